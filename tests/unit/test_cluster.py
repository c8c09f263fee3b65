"""The pure half of cluster mode (no Ray): dispatch choices, the health
tracker's bound, the ledger's one answer per request, procurement with the seeded
revocation emulator, the cost ledger against PROTEAN Table 3, the cluster autoscaler's
keep-alive, ClusterConfig's environment names, and a small simulation."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.cluster.policy.autoscale import ClusterAutoscaler, ClusterLoad, SloWindow
from splitserve.cluster.policy.cost import CostLedger
from splitserve.cluster.policy.dispatch import Dispatcher, NodeState, NodeView
from splitserve.cluster.policy.health import Health, HealthTracker
from splitserve.cluster.policy.ledger import Deliver, Drop, Ledger, Resend
from splitserve.cluster.policy.procurement import Cancel, Launch, Procurement
from splitserve.cluster.policy.revocation import DoomedStep, RevocationEmulator, doomed_step
from splitserve.cluster.policy.sim import ClusterSim, Workload, simulate
from splitserve.cluster.pools import TABLE3, Market, PricePreset, ProcurementPolicy
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import InvalidInput, ModelNotReady, QueueFull, ShuttingDown
from splitserve.protocol.header import RequestClass

RT, BE = RequestClass.RT, RequestClass.BE
OD, SPOT = Market.ON_DEMAND, Market.SPOT
WARM = frozenset({"m"})


def _node(name: str, market: Market, state: NodeState = NodeState.ACTIVE, models=WARM) -> NodeView:
    return NodeView(name, market, state, models)


# -- dispatch ----------------------------------------------------------------------------

def test_rt_prefers_on_demand_and_be_prefers_spot_then_the_lowest_load():
    d = Dispatcher(window=4, two_choices_above=8, rng=random.Random(0), prefer_below=4)
    nodes = [_node("od1", OD), _node("od2", OD), _node("s1", SPOT), _node("s2", SPOT)]
    load = {"od1": 3, "od2": 1, "s1": 0, "s2": 2}
    assert d.choose("m", RT, nodes, load) == "od2"  # on-demand, then the less loaded one
    assert d.choose("m", BE, nodes, load) == "s1"
    # the preferred market full: the other one takes it
    assert d.choose("m", RT, nodes, {"od1": 4, "od2": 4, "s1": 3, "s2": 1}) == "s2"


def test_strict_work_spills_from_a_busy_on_demand_node_to_an_idle_spot_node():
    """A protean cluster with one on-demand node (a fallback) and idle spot nodes: strict work
    kept to the on-demand node until its window was full, queueing a window's worth on it
    while spot nodes idled (protean's strict compliance fell to 92 % at P_rev 0.354 in
    ``bench cluster-spot``). Now the preference holds only below ``prefer_below``."""
    d = Dispatcher(window=64, two_choices_above=8, rng=random.Random(0), prefer_below=8)
    nodes = [_node("od", OD), _node("s1", SPOT), _node("s2", SPOT)]
    assert d.choose("m", RT, nodes, {"od": 7, "s1": 0, "s2": 1}) == "od"  # not busy yet: its market
    assert d.choose("m", RT, nodes, {"od": 8, "s1": 2, "s2": 1}) == "s2"  # busy: the least loaded of any
    assert d.choose("m", RT, nodes, {"od": 8, "s1": 9, "s2": 9}) == "od"  # and that may be itself
    assert d.choose("m", BE, nodes, {"od": 0, "s1": 8, "s2": 8}) == "od"  # best-effort work alike


def test_draining_dead_starting_cold_and_excluded_nodes_get_no_work():
    d = Dispatcher(window=4, two_choices_above=8, rng=random.Random(0), prefer_below=4)
    nodes = [_node("drain", OD, NodeState.DRAINING), _node("dead", OD, NodeState.DEAD),
             _node("boot", OD, NodeState.STARTING), _node("cold", OD, models=frozenset()),
             _node("refused", OD), _node("ok", SPOT)]
    assert d.choose("m", RT, nodes, {}, exclude={"refused"}) == "ok"
    with pytest.raises(ModelNotReady, match="'x'"):
        d.choose("x", RT, nodes, {})


def test_queue_full_when_every_window_is_full():
    d = Dispatcher(window=2, two_choices_above=8, rng=random.Random(0), prefer_below=2)
    nodes = [_node("a", OD), _node("b", SPOT)]
    with pytest.raises(QueueFull, match="all 2 nodes"):
        d.choose("m", BE, nodes, {"a": 2, "b": 2})


def test_power_of_two_choices_above_the_threshold_is_seeded():
    nodes = [_node(f"s{i}", SPOT) for i in range(12)]
    load = {f"s{i}": i for i in range(12)}
    picks = [Dispatcher(8, 8, random.Random(7), 8).choose("m", BE, nodes, load) for _ in range(3)]
    assert len(set(picks)) == 1  # the same seed, the same choice
    many = {Dispatcher(99, 8, random.Random(s), 99).choose("m", BE, nodes, load) for s in range(40)}
    assert len(many) > 1 and "s11" not in many  # the busiest node never wins a comparison


def test_a_silent_node_is_out_of_dispatch_and_then_dead_within_its_bound():
    h = HealthTracker(ping_interval_s=1.0, misses=3)
    h.add("a", 0.0)
    h.add("b", 0.0)
    now = 0.0
    died_at = None
    while died_at is None:  # "a" stops answering; "b" answers every ping; checks every interval
        now += 0.5
        h.heard("b", now)
        if now >= 1.0:
            assert h.state("a", now) is not Health.ALIVE and "a" not in h.serving(now)
        if "a" in h.check(now):
            died_at = now
    assert died_at <= h.dead_after_s + h.ping_interval_s
    assert h.serving(now) == {"b"} and h.state("a", now) is Health.DEAD


def test_a_node_that_answers_every_ping_stays_alive_between_its_answers():
    """The gateway's pinger sleeps ``ping_period_s`` between its rounds, each sleep a little
    late on a loaded host, and a healthy node answers a round trip after each ping: it is never
    SUSPECT. Pinged once an interval, the same node was SUSPECT for the lateness, every round."""
    h = HealthTracker(ping_interval_s=1.0, misses=3)
    late_ms, rtt_ms = 10, 5

    def states(period_s: float) -> set[Health]:
        h.add("a", 0.0)
        answers, ping = set(), 0
        while ping < 5000:
            ping += round(period_s * 1000) + late_ms
            answers.add(ping + rtt_ms)
        seen = set()
        for ms in range(1, 5000):
            if ms in answers:
                h.heard("a", ms / 1000)
            seen.add(h.state("a", ms / 1000))
        h.remove("a")
        return seen

    assert states(h.ping_period_s) == {Health.ALIVE}
    assert Health.SUSPECT in states(h.ping_interval_s)


# -- the ledger --------------------------------------------------------------------------

def test_the_ledger_resends_a_lost_nodes_work_and_drops_the_late_duplicate():
    led = Ledger(capacity=8, max_attempts=3)
    e = led.accept("m", RT, b"payload", now=0.0)
    led.sent(e.req_id, "a")
    [out] = led.node_lost("a", 1.0)
    assert isinstance(out, Resend) and out.entry.handle == b"payload"
    led.sent(e.req_id, "b")
    assert led.in_flight() == {"b": 1}
    first = led.answered(e.req_id, "b", 2.0)
    assert isinstance(first, Deliver) and first.error is None
    assert isinstance(led.answered(e.req_id, "a", 3.0), Drop)  # the lost node answers late
    assert len(led) == 0 and led.delivered == 1 and led.in_flight() == {}


def test_a_refusal_is_resent_elsewhere_and_attempts_are_bounded():
    led = Ledger(capacity=8, max_attempts=2)
    e = led.accept("m", BE, None, 0.0)
    led.sent(e.req_id, "a")
    out = led.answered(e.req_id, "a", 0.1, ShuttingDown("draining"))
    assert isinstance(out, Resend) and out.exclude == {"a"}
    led.sent(e.req_id, "b")
    last = led.answered(e.req_id, "b", 0.2, QueueFull("full"))
    assert isinstance(last, Deliver) and isinstance(last.error, QueueFull)
    with pytest.raises(QueueFull):
        full = Ledger(capacity=1, max_attempts=1)
        full.accept("m", BE, None, 0.0)
        full.accept("m", BE, None, 0.0)


class LedgerMachine(RuleBasedStateMachine):
    """Any interleaving of accepts, sends, answers (results, refusals, duplicates, answers
    from the wrong node), node deaths and re-sends: every accepted request is answered
    exactly once, and nothing else is ever answered."""

    NODES = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.led = Ledger(capacity=50, max_attempts=3)
        self.waiting: list[int] = []  # taken back or new: to be dispatched
        self.accepted: set[int] = set()
        self.answers: dict[int, int] = {}
        self.now = 0.0

    def _apply(self, out) -> None:
        if isinstance(out, Deliver):
            self.answers[out.entry.req_id] = self.answers.get(out.entry.req_id, 0) + 1
            # a late answer from a lost node can win while the request waits to be sent again
            if out.entry.req_id in self.waiting:
                self.waiting.remove(out.entry.req_id)
        elif isinstance(out, Resend):
            self.waiting.append(out.entry.req_id)

    @rule()
    def accept(self) -> None:
        if len(self.led) < self.led.capacity:
            e = self.led.accept("m", RT, None, self.now)
            self.accepted.add(e.req_id)
            self.waiting.append(e.req_id)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100), node=st.sampled_from(NODES), refuse=st.booleans())
    def send(self, i: int, node: str, refuse: bool) -> None:
        req = self.waiting.pop(i % len(self.waiting))
        if refuse:  # dispatch found no node
            self._apply(self.led.fail(req, QueueFull("no room")))
        else:
            self.led.sent(req, node)

    @rule(req=st.integers(1, 60), node=st.sampled_from(NODES), kind=st.sampled_from(["ok", "refused", "error"]))
    def answer(self, req: int, node: str, kind: str) -> None:
        self.now += 0.01
        error = {"ok": None, "refused": ShuttingDown("x"), "error": InvalidInput("bad")}[kind]
        self._apply(self.led.answered(req, node, self.now, error))

    @rule(node=st.sampled_from(NODES))
    def node_dies(self, node: str) -> None:
        for out in self.led.node_lost(node, self.now):
            self._apply(out)

    @invariant()
    def at_most_once(self) -> None:
        assert all(c == 1 for c in self.answers.values())
        assert set(self.answers) <= self.accepted
        held = {e.req_id for e in self.led}
        assert held | set(self.answers) == self.accepted and not held & set(self.answers)
        assert sum(self.led.in_flight().values()) == sum(1 for e in self.led if e.node is not None)

    def teardown(self) -> None:
        # every node answers what it holds: then every accepted request has had one answer
        while self.waiting or len(self.led):
            while self.waiting:
                self.led.sent(self.waiting.pop(), "a")
            for e in self.led:
                self._apply(self.led.answered(e.req_id, e.node, self.now))
        assert set(self.answers) == self.accepted and all(c == 1 for c in self.answers.values())


TestLedgerInterleavings = LedgerMachine.TestCase
TestLedgerInterleavings.settings = settings(max_examples=60, stateful_step_count=40, derandomize=True,
                                            database=None, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


# -- revocation and procurement ----------------------------------------------------------

def _emulator(p_rev: float, seed: int = 1) -> RevocationEmulator:
    return RevocationEmulator(p_rev, 60.0, 30.0, 120.0, random.Random(seed))


def test_p_rev_zero_never_sends_a_notice_nor_fails_a_spot_request():
    em = _emulator(0.0)
    assert em.tick(86_400.0, [f"s{i}" for i in range(64)]) == []
    assert not any(em.spot_request_fails() for _ in range(1000))


def test_notices_are_seeded_per_interval_with_lead_times_in_range():
    a, b = _emulator(0.5, seed=3), _emulator(0.5, seed=3)
    nodes = [f"s{i}" for i in range(20)]
    na, nb = a.tick(600.0, nodes), b.tick(600.0, nodes)
    assert na == nb and 0 < len(na) <= 20  # the same seed, the same schedule
    assert len({n.node for n in na}) == len(na)  # one notice per node
    assert all(n.at % 60.0 == 0 and 30.0 <= n.deadline - n.at <= 120.0 for n in na)


def test_protean_buys_spot_first_then_on_demand_after_a_failure_or_a_timeout():
    em = _emulator(1.0)  # spot capacity never there
    proc = Procurement(ProcurementPolicy.PROTEAN, 120.0, spot_launch_s=60.0, on_demand_launch_s=60.0)
    [first] = proc.open(0.0)
    assert first == Launch(1, SPOT)
    assert em.spot_request_fails()
    assert proc.failed(1, 0.0) == [Launch(1, OD)] and proc.fallbacks == 1
    assert proc.ready(1) is OD and proc.open_orders == 0
    # a spot request that is granted but does not serve in time
    [first] = proc.open(10.0)
    assert proc.tick(100.0) == []
    assert proc.tick(130.0) == [Cancel(2, SPOT), Launch(2, OD)] and proc.fallbacks == 2


def test_spot_only_waits_and_asks_spot_again_and_on_demand_only_never_asks_spot():
    proc = Procurement(ProcurementPolicy.SPOT_ONLY, 60.0, spot_launch_s=60.0, on_demand_launch_s=60.0)
    assert proc.open(0.0) == [Launch(1, SPOT)]
    assert proc.failed(1, 0.0) == []
    assert proc.tick(59.0) == [] and proc.tick(60.0) == [Launch(1, SPOT)] and proc.spot_retries == 1
    assert proc.tick(500.0) == []  # a pending spot request is waited for, however long
    od = Procurement(ProcurementPolicy.ON_DEMAND_ONLY, 60.0, spot_launch_s=60.0, on_demand_launch_s=60.0)
    assert od.open(0.0) == [Launch(1, OD)] and od.tick(1e6) == []


def test_protean_buys_a_replacement_on_demand_at_once_when_spot_would_serve_after_the_doomed_node_stops():
    """PROTEAN §4.5 orders the replacement at the notice so that it serves before the eviction:
    with a lead shorter than the spot launch, protean buys the market that comes sooner."""
    proc = Procurement(ProcurementPolicy.PROTEAN, 120.0, spot_launch_s=60.0, on_demand_launch_s=20.0)
    assert proc.open(0.0, serve_by=40.0) == [Launch(1, OD)]
    assert proc.fallbacks == proc.notice_fallbacks == 1
    assert proc.open(0.0, serve_by=60.0) == [Launch(2, SPOT)]  # a long enough notice: spot first still
    assert proc.open(0.0) == [Launch(3, SPOT)]  # no hurry (scale-out)
    assert proc.fallbacks == 1
    same = Procurement(ProcurementPolicy.PROTEAN, 120.0, spot_launch_s=60.0, on_demand_launch_s=60.0)
    assert same.open(0.0, serve_by=10.0) == [Launch(1, SPOT)]  # on-demand would not come sooner
    spot = Procurement(ProcurementPolicy.SPOT_ONLY, 120.0, spot_launch_s=60.0, on_demand_launch_s=20.0)
    assert spot.open(0.0, serve_by=10.0) == [Launch(1, SPOT)] and spot.fallbacks == 0  # spot-only unchanged
    od = Procurement(ProcurementPolicy.ON_DEMAND_ONLY, 120.0, spot_launch_s=60.0, on_demand_launch_s=20.0)
    assert od.open(0.0, serve_by=100.0) == [Launch(1, OD)]


def test_clustered_short_notices_no_longer_leave_the_cluster_a_node_short():
    """Several spot nodes noticed at one boundary with leads shorter than the spot launch plus
    the drain lead: each doomed node stopped taking work before its spot replacement served,
    and the cluster ran nodes short. Their replacements now come on-demand, in time, and the
    serving count never drops below the target once the cluster first serves."""
    cfg = ClusterConfig(min_nodes=4, max_nodes=4, p_rev=0.354, notice_min_s=30.0, notice_max_s=40.0,
                        drain_lead_s=10.0, drain_margin_s=5.0, spot_launch_s=60.0, on_demand_launch_s=20.0,
                        revocation_seed=10, dispatch_prefer_below=8)  # two batches of _work's 4

    def fewest_serving(cfg: ClusterConfig) -> tuple[int, dict]:
        sim = ClusterSim(cfg, _work(300.0), seed=0)
        res = sim.run(60.0, 600.0)
        assert max(sum(n.at == t for n in sim.notices) for t in {n.at for n in sim.notices}) > 1  # clustered
        timeline = res["nodes_over_time"]
        first = next(i for i, (_, serving, _) in enumerate(timeline) if serving >= 4)
        return min(serving for _, serving, _ in timeline[first:]), res

    # the case itself: with nothing faster to buy, the cluster runs short on these draws
    assert fewest_serving(dataclasses.replace(cfg, on_demand_launch_s=60.0))[0] < 4
    fewest, res = fewest_serving(cfg)
    assert fewest == 4
    assert res["notice_fallbacks"] > 0 and res["lost"] == 0 and res["strict"]["compliance"] == 1.0


def test_protean_asks_spot_to_replace_an_on_demand_node_that_served_spot_return_s():
    """The move back to spot: a swap is a spot request tied to one on-demand node; it adds no
    wanted node, scale-in leaves it, a refusal drops it (the node serves on) until
    ``spot_return_s`` later, and only protean makes one."""
    proc = Procurement(ProcurementPolicy.PROTEAN, 120.0, 60.0, 60.0, spot_return_s=120.0)
    assert proc.swap(100.0, {"od1": 0.0}) == []  # served 100 s of 120
    assert proc.swap(130.0, {"od1": 0.0, "od2": 20.0}) == [Launch(1, SPOT)]
    assert proc.replaces(1) == "od1" and proc.open_orders == 0 and proc.newest() is None
    assert proc.swap(140.0, {"od1": 0.0, "od2": 20.0}) == [Launch(2, SPOT)]  # od1's is pending
    assert proc.failed(1, 140.0) == [] and proc.swaps == 2 and proc.fallbacks == 0
    assert proc.tick(1e4) == []  # a pending swap never falls back
    assert proc.swap(200.0, {"od1": 0.0}) == []  # refused at 130: again from 250
    assert proc.swap(250.0, {"od1": 0.0}) == [Launch(3, SPOT)]
    assert proc.ready(2) is SPOT
    for policy in (ProcurementPolicy.SPOT_ONLY, ProcurementPolicy.ON_DEMAND_ONLY):
        assert Procurement(policy, 120.0, 60.0, 60.0, spot_return_s=120.0).swap(1e4, {"od1": 0.0}) == []
    assert Procurement(ProcurementPolicy.PROTEAN, 120.0, 60.0, 60.0).swap(1e4, {"od1": 0.0}) == []


def test_protean_moves_fallback_nodes_back_to_spot_and_costs_less_for_it():
    """Without a move back, every fallback stayed on-demand until scale-in, and protean's cost
    rose towards on-demand-only's as P_rev rose. The on-demand node a swap replaces ends
    once idle (not an eviction), nothing is lost and the node count holds."""
    base = ClusterConfig(min_nodes=4, max_nodes=4, p_rev=0.354, revocation_seed=3, dispatch_prefer_below=8)
    stay = simulate(dataclasses.replace(base, spot_return_s=0.0), _work(900.0), seed=0)
    back = ClusterSim(dataclasses.replace(base, spot_return_s=120.0), _work(900.0), seed=0)
    res = back.run(60.0, 600.0)
    assert stay["fallbacks"] > 0 and stay["swaps"] == 0 and res["swaps"] > 0
    assert res["cost"]["dollars"] < stay["cost"]["dollars"]
    assert res["lost"] == 0 and res["answered"] == res["requests"]
    assert res["strict"]["compliance"] == stay["strict"]["compliance"] == 1.0
    gone = [r for r in back.cost.records() if r.market is OD and r.ended_at is not None and r.ended_at < res["end_s"]]
    assert gone and all(r.drained_at is not None and not r.evicted for r in gone)  # retired, drained first


# -- cost --------------------------------------------------------------------------------

def test_the_cost_ledger_against_table3():
    aws = TABLE3[PricePreset.AWS]
    assert (aws.on_demand, aws.spot) == (32.7726, 9.8318)
    assert (TABLE3[PricePreset.AZURE].spot, TABLE3[PricePreset.GCP].on_demand) == (18.0235, 30.0846)

    def bill(market: Market) -> CostLedger:
        led = CostLedger()
        for i in range(8):  # 8 nodes, 1 hour each, booting included
            led.requested(f"n{i}", "8xa100", market, aws.of(market), now=0.0)
            led.ready(f"n{i}", 60.0)
            led.ended(f"n{i}", 3600.0)
        return led

    od, spot = bill(OD), bill(SPOT)
    assert od.total(3600.0) == pytest.approx(8 * 32.7726, abs=1e-9)
    assert spot.total(3600.0) == pytest.approx(8 * 9.8318, abs=1e-9)
    assert spot.total(3600.0) / od.total(3600.0) == pytest.approx(9.8318 / 32.7726, rel=1e-12)
    assert round(spot.total(3600.0) / od.total(3600.0), 3) == 0.300
    # an evicted spot node is billed to its eviction; a withdrawn request to its withdrawal
    led = CostLedger()
    led.requested("s", "8xa100", SPOT, aws.spot, 0.0)
    led.ready("s", 60.0)
    led.drained("s", 1000.0)
    led.ended("s", 1090.0, evicted=True)
    led.requested("w", "8xa100", SPOT, aws.spot, 0.0)
    led.ended("w", 36.0)
    assert led.total(99_999.0) == pytest.approx(aws.spot * (1090.0 + 36.0) / 3600.0)
    s = led.summary(99_999.0)
    assert (s["evictions"], s["boots"], s["withdrawn"]) == (1, 1, 1)
    assert s["draining_hours"] == pytest.approx(90.0 / 3600.0)


def test_a_long_running_bill_keeps_a_bounded_list_and_the_same_totals():
    """A cluster that has churned through many nodes lists the open ones and the newest
    ``keep_closed`` ended ones; every older one is folded into its market's totals, so the
    summary (what ``cluster status`` bills) is the unbounded ledger's to the cent."""
    aws = TABLE3[PricePreset.AWS]
    bounded, full = CostLedger(keep_closed=3), CostLedger()
    t = 0.0
    for i in range(200):  # 200 nodes, each for up to an hour; a few left running
        market = SPOT if i % 3 else OD
        for led in (bounded, full):
            led.requested(f"n{i}", "8xa100", market, aws.of(market), t)
            if i % 7:
                led.ready(f"n{i}", t + 60.0)
            if i % 5 == 0:
                led.drained(f"n{i}", t + 1800.0)
            if i < 195:
                led.ended(f"n{i}", t + 3600.0 - i, evicted=market is SPOT and i % 2 == 0)
        t += 30.0
    now = t + 7200.0
    assert len(bounded.records()) == 5 + 3
    assert {r.node for r in bounded.records()} == {f"n{i}" for i in range(192, 200)}
    got, want = bounded.summary(now), full.summary(now)
    assert got.keys() == want.keys()
    for key in ("boots", "withdrawn", "evictions"):
        assert got[key] == want[key]
    for key in ("dollars", "booting_hours", "draining_hours"):
        assert got[key] == pytest.approx(want[key], rel=1e-12)
    assert got["node_hours"] == pytest.approx(want["node_hours"], rel=1e-12)
    assert sum(f["nodes"] for f in bounded.folded().values()) == 192
    assert bounded.total(now) == pytest.approx(full.total(now), rel=1e-12)
    # the newest ended records can still be told they ended again (nothing changes)
    bounded.ended("n194", now)
    assert bounded.summary(now)["dollars"] == pytest.approx(want["dollars"], rel=1e-12)


# -- autoscaling -------------------------------------------------------------------------

def test_the_cluster_autoscaler_scales_up_at_once_and_down_after_the_keep_alive():
    a = ClusterAutoscaler(min_nodes=1, max_nodes=3, requests_per_node=10, slo_target=0.99, keep_alive_s=600.0)
    assert a.tick(0.0, ClusterLoad(outstanding=25, serving=1, starting=0)) == 3
    assert a.tick(1.0, ClusterLoad(outstanding=0, serving=3, starting=0)) == 3  # surplus: kept
    assert a.tick(300.0, ClusterLoad(outstanding=5, serving=3, starting=0)) == 3
    assert a.tick(600.0, ClusterLoad(outstanding=0, serving=3, starting=0)) == 3
    assert a.tick(601.0, ClusterLoad(outstanding=0, serving=3, starting=0)) == 1  # 600 s of surplus
    # a tick without surplus restarts the window
    b = ClusterAutoscaler(1, 3, 10, 0.99, keep_alive_s=600.0)
    b.tick(0.0, ClusterLoad(0, 3, 0))
    b.tick(500.0, ClusterLoad(30, 3, 0))
    assert b.tick(700.0, ClusterLoad(0, 3, 0)) == 3


def test_missed_slos_ask_for_one_more_node_once_at_a_time():
    a = ClusterAutoscaler(1, 8, requests_per_node=100, slo_target=0.99, keep_alive_s=600.0)
    assert a.tick(0.0, ClusterLoad(10, 2, 0, strict_met=90, strict_total=100)) == 3
    assert a.tick(1.0, ClusterLoad(10, 2, 1, strict_met=90, strict_total=100)) == 3  # one is starting
    assert a.tick(2.0, ClusterLoad(10, 3, 0, strict_met=100, strict_total=100)) == 3


def test_misses_of_work_already_answered_ask_for_no_node():
    a = ClusterAutoscaler(1, 8, requests_per_node=100, slo_target=0.99, keep_alive_s=600.0)
    assert a.tick(0.0, ClusterLoad(0, 2, 0, strict_met=50, strict_total=100)) == 2
    assert a.slo_scale_ups == 0


def test_the_slo_window_is_the_difference_of_cumulative_counts_and_starts_afresh_when_they_fall():
    w = SloWindow()
    assert w.take(90, 100) == (90, 100)
    assert w.take(90, 100) == (0, 0)  # nothing answered since
    assert w.take(95, 110) == (5, 10)
    assert w.take(3, 4) == (3, 4)  # the gateway restarted: its counts began again at zero


# -- config and the simulator ------------------------------------------------------------

def test_cluster_config_reads_its_environment_names_and_refuses_bad_values(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CLUSTER_P_REV", "0.354")
    monkeypatch.setenv("SPLITSERVE_CLUSTER_PROCUREMENT", "spot-only")
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SPOT_PRICE_PER_HOUR", "5.5")
    cfg = ClusterConfig.from_env(keep_alive_s=30.0)
    assert (cfg.p_rev, cfg.procurement, cfg.prices.spot, cfg.prices.on_demand, cfg.keep_alive_s) == \
        (0.354, ProcurementPolicy.SPOT_ONLY, 5.5, 32.7726, 30.0)
    for bad in ({"p_rev": 1.5}, {"notice_min_s": 200.0}, {"min_nodes": 9}, {"procurement": "cheap"},
                {"spot_price_per_hour": -1.0}):
        with pytest.raises(InvalidInput):
            ClusterConfig.from_env(**bad)


def _work(duration: float, rate: float = 60.0, seed: int = 0) -> Workload:
    """Poisson arrivals at about 60 % of 4 nodes' capacity (4 x 4 / 0.14 s), half strict."""
    rng = random.Random(seed)
    times, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        times.append(t)
    return Workload(times, [rng.random() < 0.5 for _ in times], 4, [0.08, 0.1, 0.12, 0.14], 0.42)


def test_the_simulation_loses_nothing_and_protean_costs_the_spot_price_ratio_at_p_rev_zero():
    work = _work(300.0)
    base = dict(min_nodes=4, max_nodes=4)
    od = simulate(ClusterConfig(procurement="on-demand-only", **base), work, seed=0)
    pro = simulate(ClusterConfig(procurement="protean", **base), work, seed=0)
    assert pro["cost"]["dollars"] / od["cost"]["dollars"] == pytest.approx(9.8318 / 32.7726, rel=1e-9)
    assert od["lost"] == pro["lost"] == 0 and od["answered"] == od["requests"]


def test_under_revocations_protean_keeps_its_slo_and_spot_only_does_not_and_nothing_is_lost():
    work = _work(duration=900.0)
    base = dict(min_nodes=4, max_nodes=4, p_rev=0.708)
    pro = simulate(ClusterConfig(procurement="protean", **base), work, seed=1)
    spot = simulate(ClusterConfig(procurement="spot-only", **base), work, seed=1)
    assert pro["notices"] > 0 and pro["fallbacks"] > 0 and spot["spot_failures"] > 0
    assert pro["lost"] == spot["lost"] == 0
    assert pro["answered"] == spot["answered"] == pro["requests"]
    assert pro["strict"]["compliance"] > 0.97 > spot["strict"]["compliance"]


def test_the_simulator_draws_the_controllers_eviction_schedule_from_the_same_seed():
    """A simulated run is checked against a real one (bench cluster-check) only if one
    revocation seed gives both the same notices and the same failed spot requests: the
    controller draws from ``random.Random(revocation_seed)``."""
    cfg = ClusterConfig(min_nodes=1, max_nodes=1, p_rev=0.3, revocation_interval_s=30.0, notice_min_s=40.0,
                        notice_max_s=60.0, spot_launch_s=20.0, revocation_seed=7)
    work = Workload([20.0 + i for i in range(120)], [i % 2 == 0 for i in range(120)], 1, [0.01], 0.1)
    sim = simulate(cfg, work, seed=3, start=0.0)
    controller = RevocationEmulator(cfg.p_rev, cfg.revocation_interval_s, cfg.notice_min_s, cfg.notice_max_s,
                                    random.Random(cfg.revocation_seed))
    # the controller's draws for the same history: its first spot request, then one spot node live
    # from 20 s through each interval boundary until a notice (whose replacement asks for spot again)
    fails = controller.spot_request_fails()
    assert not fails
    notices = []
    for boundary in (30.0, 60.0, 90.0, 120.0):
        notices = controller.tick(boundary, ["spot-1"])
        if notices:
            break
    assert notices, "seed 7 at P_rev 0.3 must give a notice inside the run"
    assert [(n.at, n.deadline) for n in notices] == [tuple(x) for x in sim["notice_times"][:1]]
    assert sim["spot_failures"] == int(controller.spot_request_fails()) + int(fails)


def test_a_doomed_node_ends_once_replaced_and_idle_in_the_simulator_as_in_the_controller():
    """One rule (``doomed_step``) for the controller and the simulator: a doomed node whose
    replacement serves stops taking work and, holding nothing, ends at once, billed to then
    and not an eviction; only a node still busy at the margin is evicted. (The simulator used
    to keep it, idle, billed until the provider took it at the deadline.)"""
    cfg = ClusterConfig(min_nodes=1, max_nodes=1, p_rev=0.3, revocation_interval_s=30.0, notice_min_s=40.0,
                        notice_max_s=60.0, spot_launch_s=20.0, on_demand_launch_s=20.0, revocation_seed=7)
    work = Workload([20.0 + i for i in range(120)], [i % 2 == 0 for i in range(120)], 1, [0.01], 0.1)
    sim = ClusterSim(cfg, work, seed=3)
    res = sim.run(0.0, 600.0)
    notice = sim.notices[0]
    bill = {r.node: r for r in sim.cost.records()}
    doomed = bill[notice.node]
    replacement = min((r for r in bill.values() if r.requested_at >= notice.at), key=lambda r: r.requested_at)
    assert replacement.ready_at is not None and replacement.ready_at < notice.deadline - cfg.drain_lead_s
    assert doomed.ended_at == pytest.approx(replacement.ready_at, abs=0.011)  # at most one batch later
    assert not doomed.evicted and res["lost"] == 0 and res["answered"] == res["requests"]
    assert res["evictions"] == sum(r.evicted for r in bill.values())
    # the rule itself: serve on until replaced or the lead; end once drained and idle; the margin ends it
    d = 100.0
    assert doomed_step(cfg, 50.0, d, True, False, False, False) == DoomedStep(False, False, False)
    assert doomed_step(cfg, 50.0, d, True, False, True, True) == DoomedStep(True, False, False)
    assert doomed_step(cfg, 50.0, d, True, False, True, False) == DoomedStep(True, True, False)
    assert doomed_step(cfg, d - cfg.drain_lead_s, d, True, False, False, True) == DoomedStep(True, False, False)
    assert doomed_step(cfg, d - cfg.drain_margin_s, d, False, True, False, True) == DoomedStep(False, True, True)
    assert doomed_step(cfg, 50.0, d, False, False, True, False) == DoomedStep(False, False, False)  # still starting

