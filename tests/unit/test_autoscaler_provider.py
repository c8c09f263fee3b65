"""``AutoscalerProvider``'s bookkeeping over a fake Ray (no cluster): what it asks Ray's
autoscaler for, which node a launch claims, a launch that gets none, and a terminate; on a
cluster without an autoscaler, the machines that joined by hand, and no wait for a spot node
that cannot come."""

from __future__ import annotations

import pytest

from splitserve.cluster.actors import provider as prov
from splitserve.cluster.actors import raycompat
from splitserve.cluster.pools import Market, NodeProviderKind
from splitserve.errors import Refused, ResourcesUnavailable


class FakeRay:
    """Ray's node table, the autoscaler's requests and GCS drains; a fake clock whose sleep
    runs ``on_sleep`` (what the cluster does meanwhile)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.table: dict[str, raycompat.RayNode] = {"head": raycompat.RayNode("head", True, {}, {})}
        self.requests: list[dict[str, int]] = []
        self.drains: list[str] = []
        self.busy = 0  # drains the next node refuses as not idle
        self.on_sleep = lambda: None

    def join(self, node_id: str, market: str | None) -> None:
        """A node with one ``splitserve_node`` joins, labelled with ``market`` (None: unlabelled)."""
        labels = {} if market is None else {raycompat.MARKET_LABEL: market}
        self.table[node_id] = raycompat.RayNode(node_id, True, labels, {raycompat.NODE_RESOURCE: 1.0})

    def die(self, node_id: str) -> None:
        n = self.table[node_id]
        self.table[node_id] = raycompat.RayNode(n.node_id, False, n.labels, n.resources)

    def drain_idle(self, address: str, node_id: str, message: str) -> tuple[bool, str]:
        self.drains.append(node_id)
        if self.busy:
            self.busy -= 1
            return False, "node is not idle"
        self.die(node_id)
        return True, ""

    def sleep(self, s: float) -> None:
        self.now += s
        self.on_sleep()


@pytest.fixture
def fake(monkeypatch) -> FakeRay:
    f = FakeRay()
    f.autoscaled = True
    monkeypatch.setattr(raycompat, "autoscaler_adds_nodes", lambda: f.autoscaled)
    monkeypatch.setattr(raycompat, "nodes", lambda: list(f.table.values()))
    monkeypatch.setattr(raycompat, "request_nodes", lambda wanted: f.requests.append(dict(wanted)))
    monkeypatch.setattr(raycompat, "drain_idle", f.drain_idle)
    return f


def _provider(f: FakeRay, launch_timeout_s: float = 10.0) -> prov.AutoscalerProvider:
    return prov.AutoscalerProvider("gcs", launch_timeout_s, 10.0, clock=lambda: f.now, sleep=f.sleep)


def test_each_launch_raises_the_markets_total_and_claims_a_node_no_other_launch_has(fake):
    p = _provider(fake)
    fake.on_sleep = lambda: fake.join("s1", "spot")
    assert p.launch("spot") == "s1"
    fake.on_sleep = lambda: fake.join("o1", "on-demand")
    assert p.launch("on-demand") == "o1"
    fake.on_sleep = lambda: fake.join("s2", "spot")
    assert p.launch("spot") == "s2"  # s1 is alive and labelled spot, but taken
    # request_resources replaces the last request: each one carries the whole total
    assert fake.requests == [{"spot": 1}, {"spot": 1, "on-demand": 1}, {"spot": 2, "on-demand": 1}]
    assert p.markets() == {"s1": "spot", "o1": "on-demand", "s2": "spot"}


def test_a_launch_no_node_answers_in_time_is_withdrawn_and_fails_as_resources_unavailable(fake):
    p = _provider(fake, launch_timeout_s=2.0)
    fake.join("o1", "on-demand")  # another market's node does not count
    with pytest.raises(ResourcesUnavailable, match="no spot node joined within 2 s"):
        p.launch("spot")
    assert fake.requests == [{"spot": 1}, {}]  # withdrawn, so no node turns up unclaimed later
    assert fake.now <= 2.0 + prov._POLL_S


def test_terminate_lowers_the_request_and_drains_the_node_until_ray_lets_it_go(fake):
    p = _provider(fake)
    fake.on_sleep = lambda: fake.join("s1", "spot")
    p.launch("spot")
    fake.on_sleep = lambda: fake.join("s2", "spot")
    p.launch("spot")
    fake.busy = 2  # the node server's last processes are still exiting
    p.terminate("s1")
    assert fake.requests[-1] == {"spot": 1}
    assert fake.drains == ["s1", "s1", "s1"] and not fake.table["s1"].alive
    assert p.markets() == {"s2": "spot"}


def test_a_node_that_died_is_not_asked_for_again(fake):
    p = _provider(fake)
    fake.on_sleep = lambda: fake.join("s1", "spot")
    p.launch("spot")
    fake.die("s1")  # evicted by the cloud: the controller orders its replacement itself
    fake.on_sleep = lambda: fake.join("o1", "on-demand")
    p.launch("on-demand")
    assert fake.requests[-1] == {"on-demand": 1}
    assert p.markets() == {"o1": "on-demand"}


def test_evict_is_refused_with_its_reason(fake):
    with pytest.raises(Refused, match="PREEMPTION drain"):
        _provider(fake).evict("s1")


def test_a_launch_claims_a_joined_node_at_once_and_waits_or_asks_only_where_one_can_come():
    OD, SPOT = Market.ON_DEMAND, Market.SPOT
    assert prov.launch_step(SPOT, {SPOT, OD}, autoscaled=False) is prov.LaunchStep.CLAIM
    assert prov.launch_step(OD, {OD}, autoscaled=True) is prov.LaunchStep.CLAIM
    assert prov.launch_step(SPOT, {OD}, autoscaled=True) is prov.LaunchStep.ASK
    assert prov.launch_step(SPOT, {OD}, autoscaled=False) is prov.LaunchStep.REFUSE
    assert prov.launch_step(OD, set(), autoscaled=False) is prov.LaunchStep.WAIT


def test_a_joined_nodes_market_is_its_label_and_on_demand_without_one():
    assert prov.market_of({raycompat.MARKET_LABEL: "spot"}) is Market.SPOT
    assert prov.market_of({"ray.io/node-id": "x"}) is Market.ON_DEMAND
    assert prov.market_of({raycompat.MARKET_LABEL: "preemptible"}) is None  # no market of ours: not used


def test_a_node_there_before_the_launch_is_taken_without_asking_and_released_not_drained(fake):
    p = _provider(fake)
    fake.join("m1", None)  # joined by hand, unlabelled: on-demand
    assert p.launch("on-demand") == "m1"
    assert fake.requests == [] and fake.now == 0.0
    p.terminate("m1")
    assert fake.drains == [] and fake.table["m1"].alive


def test_without_an_autoscaler_the_machines_that_joined_serve_and_no_spot_launch_waits(fake):
    fake.autoscaled = False
    p = _provider(fake, launch_timeout_s=30.0)
    fake.join("m1", None)  # `ray start --resources='{"splitserve_node": 1}'`, no label
    fake.join("x1", "preemptible")
    with pytest.raises(ResourcesUnavailable, match="no spot node can come"):
        p.launch("spot")
    assert p.launch("on-demand") == "m1"
    assert fake.now == 0.0  # neither waited
    fake.on_sleep = lambda: fake.join("m2", None)  # a second machine joins a while later
    assert p.launch("on-demand") == "m2"
    fake.join("s1", "spot")
    assert p.launch("spot") == "s1"
    assert fake.requests == []  # nothing asked of an autoscaler there is not
    p.terminate("m1")  # released: the machine stays in the Ray cluster, for the next launch
    assert fake.drains == [] and fake.table["m1"].alive
    assert p.launch("on-demand") == "m1"
    fake.die("m2")
    fake.on_sleep = lambda: None
    with pytest.raises(ResourcesUnavailable, match="no on-demand node joined within 30 s"):
        p.launch("on-demand")  # m2 is gone and x1 is no on-demand node
    assert p.markets() == {"m1": "on-demand", "s1": "spot"}


def test_auto_means_the_autoscaler_only_on_a_cluster_someone_else_runs():
    assert NodeProviderKind.AUTO.resolve(joined=True) is NodeProviderKind.AUTOSCALER
    assert NodeProviderKind.AUTO.resolve(joined=False) is NodeProviderKind.LOCAL
    assert NodeProviderKind.LOCAL.resolve(joined=True) is NodeProviderKind.LOCAL
