"""The cluster controller with fake node servers, a fake clock and no Ray: a node that joins
while a model is being registered gets every model the registry holds, whatever the order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitserve.cluster.controller import Controller, _Node
from splitserve.cluster.dispatch import NodeState
from splitserve.cluster.node_server import ModelSpec, NodeEndpoint, NodeSpec
from splitserve.cluster.pools import Market
from splitserve.config import ClusterConfig

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

    async def _ensure_models(self, specs: list[ModelSpec], warm: tuple[str, ...] = ()) -> list[str]:
        if self.hold is not None:
            hold, self.hold = self.hold, None
            await hold.wait()
        self.registered |= {s.name for s in specs}
        self.warm |= set(warm)
        return sorted(self.registered)


def _endpoint(node: str) -> NodeEndpoint:
    return NodeEndpoint(node, "127.0.0.1", 1, 2, 3)


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
        ctl = Controller(ClusterConfig(), NodeSpec(), provider=None, builtin_models=["lenet"],
                         clock=lambda: now[0], address="127.0.0.1:1")
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
        ctl = Controller(ClusterConfig(), NodeSpec(), provider=None, builtin_models=["lenet"],
                         clock=lambda: now[0], address="127.0.0.1:1")
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
        ctl = Controller(cfg, NodeSpec(), provider=provider, builtin_models=["lenet"], clock=lambda: now[0],
                         address="127.0.0.1:1")
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
    from splitserve.cluster import controller as controller_module

    monkeypatch.setattr(controller_module, "NodeServerActor", _ServerActor())
    monkeypatch.setattr(controller_module.ray, "kill", lambda *a, **kw: None)

    async def scenario() -> None:
        now = [100.0]
        provider = _HeldProvider()
        cfg = ClusterConfig(min_nodes=1, max_nodes=1, procurement="protean", p_rev=0.0, spot_retry_timeout_s=10.0)
        ctl = Controller(cfg, NodeSpec(), provider=provider, builtin_models=["lenet"], clock=lambda: now[0],
                         address="127.0.0.1:1")
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
