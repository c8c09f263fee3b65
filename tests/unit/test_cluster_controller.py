"""The cluster controller with fake node servers, a fake clock and no Ray: a node that joins
while a model is being registered gets every model the registry holds, whatever the order."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from splitserve.cluster.actors.controller import Controller, _Node
from splitserve.cluster.actors.node_server import NodeEndpoint, NodeSpec
from splitserve.cluster.actors.store import ControllerStore
from splitserve.cluster.gateway.core import Routes
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.pools import Market
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import InvalidInput, UnknownModel

SPEC = ModelSpec("late", 'name = "late"\n[artifact]\nkind = "zoo"\narch = "lenet"\n')


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeNodeServer:
    """A node server's control calls; ``hold`` keeps the next ensure_models call waiting
    until it is set (a slow model load)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registered: set[str] = set()
        self.warm: set[str] = set()
        self.hold: asyncio.Event | None = None
        self.ensure_models = _Method(self._ensure_models)
        self.remove_models = _Method(self._remove_models)

    async def _ensure_models(self, specs: list[ModelSpec], warm: tuple[str, ...] = ()) -> list[str]:
        if self.hold is not None:
            hold, self.hold = self.hold, None
            await hold.wait()
        self.registered |= {s.name for s in specs}
        self.warm |= set(warm)
        return sorted(self.registered)

    async def _remove_models(self, names: list[str]) -> None:
        self.registered -= set(names)


def _endpoint(node: str) -> NodeEndpoint:
    return NodeEndpoint(node, "127.0.0.1", 1, 2, 3)


async def _reachable(endpoint: NodeEndpoint) -> str | None:
    return None


def _controller(cfg: ClusterConfig, provider: Any, now: list[float], store: ControllerStore | None = None,
                servers: dict[str, Any] | None = None, reach: Any = _reachable) -> Controller:
    """A controller on a fake clock with no Ray: its store in memory unless given, its node
    servers found in ``servers`` by name, every node reachable unless ``reach`` says otherwise."""
    found = servers if servers is not None else {}
    return Controller(cfg, NodeSpec(), provider=provider, builtin_models=["lenet"], clock=lambda: now[0],
                      address="127.0.0.1:1", store=store or ControllerStore(":memory:"), find_server=found.get,
                      reach=reach)


def _running(cfg: ClusterConfig, provider: Any, now: list[float]) -> Controller:
    """A controller whose start-up is done (nothing to take back) and whose loop the test runs
    by hand (inside the test's event loop)."""
    ctl = _controller(cfg, provider, now)
    ctl._recovered.set()
    ctl._loop_task = asyncio.get_running_loop().create_future()
    return ctl


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.parametrize("slow", ["serving node", "joining node"])
def test_a_node_joining_while_a_model_registers_gets_every_model(slow: str) -> None:
    """``serving node``: the registration waits on the node already serving while the new
    node's server comes up and joins; ``joining node``: the new node's first models load
    slowly while the registration runs. Either way the new node ends with the model, and the
    routes never claim a model a node was not given."""

    async def scenario() -> None:
        now = [100.0]
        ctl = _running(ClusterConfig(), None, now)
        old, new = FakeNodeServer("old"), FakeNodeServer("new")
        ctl.nodes["old"] = _Node("old", Market.ON_DEMAND, None, old, endpoint=_endpoint("old"),
                                 state=NodeState.ACTIVE, models=frozenset({"lenet"}))
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        joining = ctl.nodes["new"] = _Node("new", Market.SPOT, None, new, starting=started)
        ctl.cost.requested("new", "spot", Market.SPOT, 1.0, now[0])
        gate = asyncio.Event()
        if slow == "serving node":
            old.hold = gate
            registering = asyncio.ensure_future(ctl.register(SPEC))
            await _settle()
            started.set_result(_endpoint("new"))
            await ctl._check_started(joining)
            gate.set()
            await registering
        else:
            new.hold = gate
            started.set_result(_endpoint("new"))
            join = asyncio.ensure_future(ctl._check_started(joining))
            await _settle()
            registering = asyncio.ensure_future(ctl.register(SPEC))
            await _settle()
            gate.set()
            await join
            await registering
        await _settle()
        assert joining.state is NodeState.ACTIVE
        assert "late" in new.registered and "late" in old.registered
        for n, server in ((joining, new), (ctl.nodes["old"], old)):
            assert n.models == {"lenet", "late"}
            assert n.models <= server.registered | server.warm | {"lenet"}

    asyncio.run(scenario())


def test_a_node_is_ready_when_its_models_are_warm_not_when_its_server_answered() -> None:
    """The bill's ready time and the ACTIVE state wait for the node's models: a load that
    takes 30 s shows in its boot, and the node takes no work before it."""

    async def scenario() -> None:
        now = [100.0]
        ctl = _running(ClusterConfig(), None, now)
        server = FakeNodeServer("new")
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        node = ctl.nodes["new"] = _Node("new", Market.SPOT, None, server, starting=started)
        ctl.cost.requested("new", "spot", Market.SPOT, 1.0, now[0])
        gate = server.hold = asyncio.Event()
        started.set_result(_endpoint("new"))
        joining = asyncio.ensure_future(ctl._check_started(node))
        await _settle()
        assert node.state is NodeState.STARTING  # its server answered, lenet still loads
        now[0] = 130.0
        gate.set()
        await joining
        assert node.state is NodeState.ACTIVE and server.warm == {"lenet"}
        (record,) = ctl.cost.to_list()
        assert record["ready_at"] == 130.0

    asyncio.run(scenario())


class _Provider:
    """A provider whose launches never finish (the test looks at what was ordered)."""

    def __init__(self) -> None:
        self.markets: list[str] = []
        self.launch = _Method(self._launch)

    async def _launch(self, market: str) -> str:
        self.markets.append(market)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_the_controller_orders_a_node_when_the_gateways_strict_compliance_falls_below_target() -> None:
    """Two nodes serve and the gateway holds 4 requests (a node carries 32): queue depth asks
    for no node. Strict outcomes from the gateway's stats (cumulative) are differenced per
    autoscaler round: a round where 10 of 100 strict calls missed orders a third node."""

    async def scenario() -> None:
        now = [100.0]
        provider = _Provider()
        cfg = ClusterConfig(min_nodes=2, max_nodes=4, procurement="on-demand-only", slo_target=0.99)
        ctl = _running(cfg, provider, now)
        for name in ("a", "b"):
            ctl.nodes[name] = _Node(name, Market.ON_DEMAND, None, FakeNodeServer(name), endpoint=_endpoint(name),
                                    state=NodeState.ACTIVE, models=frozenset({"lenet"}))
        await ctl.routes(-1, {"held": 4, "slo": {"met": 500, "missed": 0, "dropped": 0}})
        ctl._autoscale(now[0])
        assert ctl._target == 2 and ctl.procurement.open_orders == 0
        now[0] += 1
        await ctl.routes(-1, {"held": 4, "slo": {"met": 590, "missed": 8, "dropped": 2}})
        ctl._autoscale(now[0])
        await _settle()
        assert ctl._target == 3 and ctl.procurement.open_orders == 1 and provider.markets == ["on-demand"]
        assert (await ctl.status())["slo_window"] == {"met": 90, "total": 100, "scale_ups": 1}
        for task in list(ctl._tasks):
            task.cancel()

    asyncio.run(scenario())


class _HeldProvider:
    """A provider whose launches finish when the test says, per market; records terminations."""

    def __init__(self) -> None:
        self.pending: dict[str, asyncio.Future] = {}
        self.terminated: list[str] = []
        self.launch = _Method(self._launch)
        self.terminate = _Method(self._terminate)

    async def _launch(self, market: str) -> str:
        self.pending[market] = asyncio.get_running_loop().create_future()
        return await self.pending[market]

    async def _terminate(self, node_id: str) -> None:
        self.terminated.append(node_id)


class _StartingServer(FakeNodeServer):
    """A node server just placed: its endpoint never comes in this test; it can be stopped."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.endpoint = _Method(lambda: asyncio.Event().wait())
        self.stop = _Method(self._stop)

    async def _stop(self) -> None:
        return None


class _ServerActor:
    """Stands in for ``NodeServerActor``: ``.options(...).remote(spec)`` places a fake server."""

    def options(self, **kw: Any) -> Any:
        return _Method(lambda spec: _StartingServer(kw["name"]))


def test_protean_keeps_the_on_demand_fallback_that_arrives_before_the_withdrawn_spot_node(monkeypatch) -> None:
    """A spot request pending past ``spot_retry_timeout_s`` is withdrawn and the same order asks
    on-demand. Withdrawals were kept by order only, so an on-demand node that joined first was
    retired as withdrawn, and the late spot node kept. Now only the spot node goes."""
    from splitserve.cluster.actors import controller as controller_module

    monkeypatch.setattr(controller_module, "NodeServerActor", _ServerActor())
    monkeypatch.setattr(controller_module.ray, "kill", lambda *a, **kw: None)

    async def scenario() -> None:
        now = [100.0]
        provider = _HeldProvider()
        cfg = ClusterConfig(min_nodes=1, max_nodes=1, procurement="protean", p_rev=0.0, spot_retry_timeout_s=10.0)
        ctl = _running(cfg, provider, now)
        ctl._autoscale(now[0])
        await _settle()
        assert list(provider.pending) == ["spot"]
        now[0] += 11.0
        ctl._autoscale(now[0])  # the spot request timed out: protean asks on-demand for the same order
        await _settle()
        assert list(provider.pending) == ["spot", "on-demand"]
        provider.pending["on-demand"].set_result("od")
        await _settle()
        assert "od" in ctl.nodes and ctl.nodes["od"].order is not None and provider.terminated == []
        provider.pending["spot"].set_result("sp")
        await _settle()
        assert "sp" not in ctl.nodes and provider.terminated == ["sp"] and "od" in ctl.nodes
        assert not ctl._cancelled  # each withdrawal is forgotten once its launch came back
        for task in list(ctl._tasks):
            task.cancel()

    asyncio.run(scenario())


class _Server(FakeNodeServer):
    """A serving node's server as a restarted controller finds it: endpoint, models, stats."""

    def __init__(self, node_id: str, registered: set[str] = frozenset(), alive: bool = True) -> None:
        super().__init__(node_id)
        self.registered = set(registered)
        self.alive = alive
        self.stopped = False
        self.endpoint = _Method(self._endpoint)
        self.stats = _Method(self._stats)
        self.stop = _Method(self._stop)

    async def _endpoint(self) -> NodeEndpoint:
        return _endpoint(self.node_id)

    async def _stats(self) -> dict:
        return {"node_id": self.node_id, "pid": 3, "alive": self.alive}

    async def _stop(self) -> None:
        self.stopped = True


class _MarketsProvider(_HeldProvider):
    """The provider's view of its nodes (``markets``), held until ``release`` is set."""

    def __init__(self, markets: dict[str, str]) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.release.set()
        self.markets = _Method(self._markets)
        self._known = markets

    async def _markets(self) -> dict[str, str]:
        await self.release.wait()
        return dict(self._known)


def test_a_restarted_controller_takes_back_models_nodes_launches_in_flight_and_the_bill(tmp_path, monkeypatch) -> None:
    """The first controller registers a model on two serving nodes and bills them; a third
    node's launch is in flight (the provider has it, no node server yet) and a fourth node
    ended while no controller watched. A new controller on the same store (what Ray's restart
    gives: the constructor again, nothing in memory) keeps the model and its func id, takes
    both nodes back as ACTIVE with their bill records, starts the third node's server under
    an adopted order (so the autoscaler buys nothing more), ends the fourth's record, and
    publishes routes newer than any the first one published."""
    from splitserve.cluster.actors import controller as controller_module
    from splitserve.cluster.actors.node_server import node_server_name

    monkeypatch.setattr(controller_module, "NodeServerActor", _ServerActor())

    async def scenario() -> None:
        now = [100.0]
        store = tmp_path / "controller.sqlite3"
        cfg = ClusterConfig(min_nodes=3, max_nodes=3, procurement="protean", p_rev=0.0)
        first = _controller(cfg, None, now, ControllerStore(store))
        first._recovered.set()
        first._loop_task = asyncio.get_running_loop().create_future()
        servers = {"a": _Server("a", {"lenet"}), "b": _Server("b", {"lenet"})}
        for node, market in (("a", Market.ON_DEMAND), ("b", Market.SPOT), ("lost", Market.SPOT)):
            first.cost.requested(node, str(market), market, 1.0, 100.0)
            first.cost.ready(node, 110.0)
        for node, market in (("a", Market.ON_DEMAND), ("b", Market.SPOT)):
            first.nodes[node] = _Node(node, market, None, servers[node], endpoint=_endpoint(node),
                                      state=NodeState.ACTIVE, models=frozenset({"lenet"}), ready_at=110.0)
        fid = await first.register(SPEC)
        first._save_state()
        old_routes = first._routes
        old_bill = {r["node"]: r for r in first.cost.to_list()}

        now[0] = 200.0
        provider = _MarketsProvider({"a": "on-demand", "b": "spot", "c": "spot"})
        second = _controller(cfg, provider, now, ControllerStore(store),
                             servers={node_server_name(n): s for n, s in servers.items()})
        await second._recover()
        assert second.registry.ids == {"lenet": 1, "late": fid}
        assert second.registry.specs["late"] == SPEC
        for node in ("a", "b"):
            n = second.nodes[node]
            assert n.state is NodeState.ACTIVE and n.models == {"lenet", "late"} and n.ready_at == 110.0
            assert second.cost.to_list()[[r["node"] for r in second.cost.to_list()].index(node)] == old_bill[node]
        assert second.nodes["a"].market is Market.ON_DEMAND and second.nodes["b"].market is Market.SPOT
        c = second.nodes["c"]
        assert c.state is NodeState.STARTING and c.order is not None and second.procurement.open_orders == 1
        bill = {r["node"]: r for r in second.cost.to_list()}
        assert bill["c"]["requested_at"] == 200.0 and bill["lost"]["ended_at"] == 200.0
        assert second._routes.version > old_routes.version
        assert {r.node for r in second._routes.nodes} == {"a", "b"}
        assert dict(second._routes.models) == {"lenet": 1, "late": fid}
        second._autoscale(now[0])
        await _settle()
        assert provider.pending == {}  # a, b serving and c's adopted order: nothing more to buy
        for task in list(second._tasks) + list(first._tasks):
            task.cancel()

    asyncio.run(scenario())


def test_the_gateway_keeps_its_last_routes_while_a_restarted_controller_rebuilds_them(monkeypatch) -> None:
    """While the provider has not answered, the long poll returns None (the gateway serves
    on its table); once the view is rebuilt, the routes it returns are the new ones."""
    from splitserve.cluster.actors import controller as controller_module

    monkeypatch.setattr(controller_module, "_LONG_POLL_S", 0.01)  # the first poll's wait for the rebuild
    looped = asyncio.Event()

    async def loop(self: Controller) -> None:  # the reconcile loop needs Ray: it only says it started
        looped.set()

    monkeypatch.setattr(Controller, "_loop", loop)

    async def scenario() -> None:
        now = [100.0]
        provider = _MarketsProvider({})
        provider.release.clear()
        ctl = _controller(ClusterConfig(), provider, now)
        assert await ctl.routes(5, {"held": 0}) is None
        provider.release.set()
        doc = await ctl.routes(5, {"held": 0})
        assert doc is not None and Routes.from_json(doc).version > 5
        assert looped.is_set()  # the first call started the loop: Ray's restart calls no start()

    asyncio.run(scenario())


def test_a_node_whose_splitserve_serve_died_is_retired_and_replaced(monkeypatch) -> None:
    """The node stays in Ray's table (only its server's child died), so nothing else takes it
    out: it stayed ACTIVE in the routes, its fast path closed, and the cluster served one node
    short for good. Now the controller asks each node server, retires the node (billed to
    now, not an eviction) and the autoscaler orders its replacement."""
    from splitserve.cluster.actors import controller as controller_module
    from splitserve.cluster.actors.raycompat import RayNode

    monkeypatch.setattr(controller_module.ray, "kill", lambda *a, **kw: None)
    monkeypatch.setattr(controller_module.raycompat, "nodes", lambda: [RayNode(n, True, {}, {}) for n in "ab"])
    monkeypatch.setattr(controller_module.raycompat, "draining_nodes", lambda address: {})

    async def scenario() -> None:
        now = [100.0]
        provider = _HeldProvider()
        cfg = ClusterConfig(min_nodes=2, max_nodes=2, procurement="on-demand-only")
        ctl = _running(cfg, provider, now)
        servers = {"a": _Server("a", alive=False), "b": _Server("b")}
        for node, server in servers.items():
            ctl.cost.requested(node, "on-demand", Market.ON_DEMAND, 1.0, 90.0)
            ctl.nodes[node] = _Node(node, Market.ON_DEMAND, None, server, endpoint=_endpoint(node),
                                    state=NodeState.ACTIVE, models=frozenset({"lenet"}))
        await ctl._reconcile(now[0])
        await _settle()
        assert "a" not in ctl.nodes and servers["a"].stopped and provider.terminated == ["a"]
        assert {r.node for r in ctl._routes.nodes} == {"b"}
        record = ctl.cost.record("a")
        assert record is not None and record.ended_at == 100.0 and not record.evicted
        now[0] += cfg.autoscale_interval_s
        await ctl._reconcile(now[0])
        await _settle()
        assert list(provider.pending) == ["on-demand"]  # its replacement
        for task in list(ctl._tasks):
            task.cancel()

    asyncio.run(scenario())


def test_the_bill_read_back_from_its_saved_state_is_the_same_bill() -> None:
    """What a restarted controller reads from its store: open, ended and folded records alike."""
    from splitserve.cluster.policy.cost import CostLedger

    ledger = CostLedger(keep_closed=1)
    for i, market in enumerate((Market.SPOT, Market.ON_DEMAND, Market.SPOT, Market.ON_DEMAND)):
        ledger.requested(f"n{i}", str(market), market, 9.8318 if market is Market.SPOT else 32.7726, 10.0 * i)
        ledger.ready(f"n{i}", 10.0 * i + 5)
    ledger.drained("n0", 50.0)
    for node, at in (("n0", 60.0), ("n1", 70.0), ("n2", 80.0)):
        ledger.ended(node, at, evicted=node == "n2")
    back = CostLedger.from_state(json.loads(json.dumps(ledger.to_state())))
    assert back.to_state() == ledger.to_state()
    assert back.summary(100.0) == ledger.summary(100.0)
    back.ended("n3", 90.0)  # and it goes on billing as before
    ledger.ended("n3", 90.0)
    assert back.summary(100.0) == ledger.summary(100.0) and back.folded() == ledger.folded()


def test_unregistering_removes_the_model_from_every_node_the_routes_and_the_store_and_its_id_is_never_reused() -> None:
    """Unregistered: gone from each node, the routes and the store (a restarted controller
    does not bring it back), and its func id is never given again, after a restart too (a
    client still holding it must not reach another model)."""
    spec = ModelSpec("mine", 'name = "mine"\n[artifact]\nkind = "zoo"\narch = "lenet"\n')

    async def scenario() -> None:
        now = [100.0]
        store = ControllerStore(":memory:")
        ctl = _controller(ClusterConfig(), None, now, store)
        ctl._recovered.set()
        ctl._loop_task = asyncio.get_running_loop().create_future()
        servers = {n: FakeNodeServer(n) for n in ("a", "b")}
        for n, server in servers.items():
            ctl.nodes[n] = _Node(n, Market.ON_DEMAND, None, server, endpoint=_endpoint(n), state=NodeState.ACTIVE,
                                 models=frozenset({"lenet"}))
        first = await ctl.register(spec)
        assert all("mine" in s.registered for s in servers.values())
        await ctl.unregister("mine")
        assert not any("mine" in s.registered for s in servers.values())
        assert all("mine" not in n.models for n in ctl.nodes.values())
        routes = Routes.from_json(ctl._routes.to_json())
        assert "mine" not in dict(routes.models) and all("mine" not in n.models for n in routes.nodes)
        assert "mine" not in {name for name, _, _ in store.models()}
        with pytest.raises(UnknownModel, match="mine"):
            await ctl.unregister("mine")
        with pytest.raises(InvalidInput, match="built in"):
            await ctl.unregister("lenet")
        again = await ctl.register(spec)
        assert again != first
        assert all("mine" in s.registered for s in servers.values())
        await ctl.unregister("mine")
        restarted = _controller(ClusterConfig(), None, now, store)
        assert "mine" not in restarted.registry.ids
        restarted._recovered.set()
        restarted._loop_task = asyncio.get_running_loop().create_future()
        assert await restarted.register(ModelSpec("other", spec.config_toml.replace("mine", "other"))) > again

    asyncio.run(scenario())


def test_a_restarted_controller_keeps_the_settings_configure_changed_the_counters_and_placements_counts(tmp_path) -> None:
    """Ray restarts the controller with the settings the cluster started with: what
    ``configure`` changed since, procurement's and the emulator's counters and placement's
    counts (with their keep-alive) come back from the store; ``cluster down`` forgets them."""
    store = tmp_path / "controller.sqlite3"
    started = ClusterConfig(min_nodes=1, max_nodes=3, keep_alive_s=600.0)

    async def scenario() -> None:
        now = [100.0]
        first = _controller(started, None, now, ControllerStore(store))
        first._recovered.set()
        first._loop_task = asyncio.get_running_loop().create_future()
        await first.configure(dataclasses.replace(started, max_nodes=5, keep_alive_s=2.5, provider="local"))
        first.procurement.fallbacks, first.procurement.swaps, first.revocation.notices = 2, 1, 3
        held = 3 * started.requests_per_node  # demand asks for lenet on 3 nodes
        assert first.shares.placement.count(now[0], "lenet", held) == 3
        first._save_state()

        second = _controller(started, None, now, ControllerStore(store))
        assert (second.cfg.max_nodes, second.cfg.keep_alive_s, second.cfg.provider) == (5, 2.5, "local")
        assert (second.autoscaler.max_nodes, second.autoscaler.keep_alive.keep_alive_s) == (5, 2.5)
        assert (second.procurement.fallbacks, second.procurement.swaps, second.revocation.notices) == (2, 1, 3)
        # the keep-alive (2.5 s) outlives the restart: idle now, lenet stays on 3 nodes until it ends
        assert second.shares.placement.count(now[0] + 1, "lenet", held=0) == 3
        assert second.shares.placement.count(now[0] + 3, "lenet", held=0) == second.cfg.model_min_nodes
        second.store.clear()
        third = _controller(started, None, now, ControllerStore(store))
        assert third.cfg == started and third.procurement.fallbacks == 0 and third.revocation.notices == 0
        assert third.shares.placement.counts() == {}

    asyncio.run(scenario())


def test_a_node_scaled_in_serves_on_until_the_nodes_that_stay_hold_its_models(monkeypatch) -> None:
    """Placement by demand left ``lenet`` on one node only; scaling that node in, the plan
    without it puts ``lenet`` on the node that stays, and the leaving node keeps taking work
    until that load is done: the model never has no node."""
    from splitserve.cluster.actors import controller as controller_module

    monkeypatch.setattr(controller_module.ray, "kill", lambda *a, **kw: None)

    async def scenario() -> None:
        now = [100.0]
        provider = _HeldProvider()
        cfg = ClusterConfig(min_nodes=1, max_nodes=2, model_min_nodes=1, reconcile_interval_s=0.01, spot_return_s=0)
        ctl = _running(cfg, provider, now)
        servers = {name: _StartingServer(name) for name in ("leaving", "staying")}
        for name, models in (("leaving", {"lenet"}), ("staying", set())):
            ctl.nodes[name] = _Node(name, Market.ON_DEMAND, None, servers[name], endpoint=_endpoint(name),
                                    state=NodeState.ACTIVE, models=frozenset(models))
            ctl.cost.requested(name, "on-demand", Market.ON_DEMAND, 1.0, now[0])
            ctl.cost.ready(name, now[0])
        gate = servers["staying"].hold = asyncio.Event()
        ctl._drain_out(ctl.nodes["leaving"])
        ctl._autoscale(now[0])  # the plan without the leaving node: lenet to the one that stays
        await asyncio.sleep(0.05)
        assert ctl.nodes["leaving"].state is NodeState.ACTIVE and provider.terminated == []
        gate.set()
        for _ in range(500):
            if provider.terminated:
                break
            await asyncio.sleep(0.01)
        assert provider.terminated == ["leaving"] and "leaving" not in ctl.nodes
        assert ctl.nodes["staying"].models == {"lenet"} and servers["staying"].warm == {"lenet"}
        for task in list(ctl._tasks):
            task.cancel()

    asyncio.run(scenario())


def test_a_copy_demand_no_longer_asks_for_leaves_the_routes_before_it_is_unloaded() -> None:
    """Three nodes hold ``lenet`` while its demand asked for them; with none held and no
    keep-alive, the plan keeps ``model_min_nodes`` (2) copies: the third node's copy leaves
    the routes, and only then is it unloaded there (the gateway sends it no new work)."""

    async def scenario() -> None:
        now = [100.0]
        cfg = ClusterConfig(min_nodes=3, max_nodes=3, model_min_nodes=2, keep_alive_s=0, spot_return_s=0)
        ctl = _running(cfg, None, now)
        unloads: list[tuple[str, list[str], bool]] = []
        for name in ("a", "b", "c"):
            server = FakeNodeServer(name)

            async def unload(names: list[str], name: str = name) -> None:
                routed = any(name == r.node and "lenet" in r.models for r in ctl._routes.nodes)
                unloads.append((name, names, routed))

            server.unload_models = _Method(unload)
            ctl.nodes[name] = _Node(name, Market.ON_DEMAND, None, server, endpoint=_endpoint(name),
                                    state=NodeState.ACTIVE, models=frozenset({"lenet"}))
        await ctl.routes(-1, {"held": 0, "held_by_model": {}})
        ctl._autoscale(now[0])
        await _settle()
        assert unloads == [("c", ["lenet"], False)]  # out of the routes first
        assert [n for n in ("a", "b", "c") if "lenet" in ctl.nodes[n].models] == ["a", "b"]
        for task in list(ctl._tasks):
            task.cancel()

    asyncio.run(scenario())


def test_a_node_the_head_cannot_reach_is_reported_kept_out_of_the_routes_and_taken_once_it_answers() -> None:
    """A node server that came up advertising an address the head cannot reach: ``status``
    shows it unreachable with the reason and counts it nowhere as active, the gateway is
    given no route to it, and the next round's check lets it serve once it answers."""

    async def scenario() -> None:
        now = [100.0]
        answers: list[str | None] = ["TCP connect failed: No route to host"]

        async def reach(endpoint: NodeEndpoint) -> str | None:
            return answers[0]

        ctl = _controller(ClusterConfig(), None, now, reach=reach)
        ctl._recovered.set()
        ctl._loop_task = asyncio.get_running_loop().create_future()
        server = FakeNodeServer("far")
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        node = ctl.nodes["far"] = _Node("far", Market.ON_DEMAND, None, server, starting=started)
        ctl.cost.requested("far", "on-demand", Market.ON_DEMAND, 1.0, now[0])
        started.set_result(_endpoint("far"))
        await ctl._check_started(node)
        (shown,) = (await ctl.status())["nodes"]
        assert shown["state"] == "unreachable" and shown["reason"] == answers[0]
        assert node.state is NodeState.STARTING and server.warm == set()  # no models loaded on it
        assert ctl._routes.nodes == ()
        assert node.starting is not None and node.starting.done()  # checked again next round
        answers[0] = None
        await ctl._check_started(node)
        (shown,) = (await ctl.status())["nodes"]
        assert shown["state"] == "active" and shown["reason"] is None
        assert [r.node for r in ctl._routes.nodes] == ["far"]

    asyncio.run(scenario())


def test_a_node_the_head_cannot_reach_gets_no_share_of_the_models() -> None:
    """Placement plans over the nodes the head reaches: with two nodes up and one of them
    unreachable, ``model_min_nodes`` = 2 puts every model on the one that answers, none on
    the other (whose copies no route could use)."""
    from splitserve.cluster.actors.shares import ModelShares

    nodes = [_Node(name, Market.ON_DEMAND, None, FakeNodeServer(name), endpoint=_endpoint(name))
             for name in ("near", "far")]
    nodes[1].unreachable = "TCP connect failed: No route to host"
    shares = ModelShares(ClusterConfig(model_min_nodes=2), {}, lambda: (100.0, nodes, ["lenet", "mlp"], {}))
    assert shares.plan() == {"near": frozenset({"lenet", "mlp"})}
    assert shares.of(nodes[1]) == frozenset()


def test_a_model_being_loaded_on_one_node_counts_as_held_there_when_other_nodes_are_planned() -> None:
    """A restarted controller takes its nodes back one by one: the first back is given lenet
    (alone, it is all the plan has); the others, back while that load still runs, must count
    it there, or the plan puts lenet on model_min_nodes of them besides (one node too many,
    loaded to be unloaded again)."""

    async def scenario() -> None:
        now = [100.0]
        ctl = _running(ClusterConfig(model_min_nodes=2), None, now)
        servers = {name: FakeNodeServer(name) for name in ("a", "b", "c")}
        nodes = {name: _Node(name, Market.ON_DEMAND, None, s) for name, s in servers.items()}
        ctl.nodes.update(nodes)
        gate = asyncio.Event()
        servers["c"].hold = gate
        nodes["c"].endpoint = _endpoint("c")  # back first: its load of lenet waits on the gate
        first = asyncio.ensure_future(ctl._give_models(nodes["c"]))
        await _settle()
        assert nodes["c"].coming == {"lenet"}
        for name in ("a", "b"):
            nodes[name].endpoint = _endpoint(name)
            await ctl._give_models(nodes[name])
        gate.set()
        await first
        assert sorted(name for name, n in nodes.items() if "lenet" in n.models) == ["a", "c"]
        assert "lenet" not in servers["b"].warm

    asyncio.run(scenario())
