"""What a cluster gateway tells a direct client about a node's workers, without Ray: a real
node (an in-process server, lenet loaded, its workers' direct endpoints on) behind a
``GatewayCore``. The workers a node runs for a model change when the model is moved off the
node and back, or unloaded and loaded there: the gateway offers the node's workers as the
node itself describes them now, never endpoints of workers that are gone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.gateway.core import GatewayCore, NodeRoute, Routes
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.pools import Market
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header
from tests.inproc import quiet_config, run_server, until

CLUSTER_FID = 7


async def _lookup(port: int, name: str = "lenet") -> tuple[Kind, dict[str, Any] | str]:
    """One LOOKUP on a fast-path port: the reply's kind and its JSON (an error's message)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(Header(Kind.LOOKUP, req_id=1, payload_len=len(name)).pack() + name.encode())
        h = unpack_header(await reader.readexactly(HEADER_SIZE))
        body = await reader.readexactly(h.payload_len)
    finally:
        writer.close()
    return h.kind, (json.loads(body) if h.kind == Kind.LOOKUP_REPLY else body.decode())


def _ports(urls: list[str]) -> list[int]:
    return sorted(int(u.rsplit(":", 1)[1]) for u in urls)


def test_a_node_reloading_a_model_is_offered_with_its_new_workers_and_not_while_the_model_is_off_it(tmp_path: Path):
    async def scenario(server: Any) -> None:
        node_port = server.ports["fast_port"]
        core = GatewayCore(ClusterConfig())
        port = await core.serve("127.0.0.1", 0)
        versions = iter(range(1, 100))

        def route(models: frozenset[str]) -> None:
            node = NodeRoute("node-1", "127.0.0.1", node_port, Market.ON_DEMAND, NodeState.ACTIVE, models)
            core.update(Routes(next(versions), (node,), (("lenet", CLUSTER_FID),)))

        async def offered() -> list[int]:
            """The workers the gateway offers (none: no node entry, the calls go through it)."""
            kind, reply = await _lookup(port)
            assert kind == Kind.LOOKUP_REPLY, reply
            return [p for entry in reply["nodes"] for p in _ports(entry["direct_tcp"])]

        async def the_nodes_own() -> list[int]:
            """The node's workers as it describes them, once it lists some (a model's workers
            take their direct endpoints a moment after its load returns)."""
            while True:
                kind, reply = await _lookup(node_port)
                assert kind == Kind.LOOKUP_REPLY, reply
                if reply.get("direct_tcp"):
                    return _ports(reply["direct_tcp"])
                await asyncio.sleep(0.05)

        async def offered_as_the_node_says() -> list[int]:
            want = await asyncio.wait_for(the_nodes_own(), 30)
            while await offered() != want:
                await asyncio.sleep(0.05)
            return want

        try:
            route(frozenset({"lenet"}))
            await asyncio.wait_for(until(lambda: core.serves("lenet")), 60)
            first = await asyncio.wait_for(offered_as_the_node_says(), 30)

            # placement moves lenet off the node: not offered there, not even from what the gateway knew
            route(frozenset())
            kind, reply = await _lookup(port)
            assert kind == Kind.ERROR and "no node serves it" in reply
            # and back, on new workers: offered as the node describes them now
            await server.management.unload("lenet")
            await server.management.load("lenet")
            route(frozenset({"lenet"}))
            await asyncio.wait_for(until(lambda: core.serves("lenet")), 60)
            second = await asyncio.wait_for(offered_as_the_node_says(), 30)

            # reloaded on the node with no change of route: a lookup asks the node afresh for the
            # next one, so a client that looks up again (as a direct client does while it holds
            # fewer connections than offered) is given the new workers
            await server.management.unload("lenet")
            await server.management.load("lenet")
            third = await asyncio.wait_for(offered_as_the_node_says(), 30)
            assert first != second != third  # each time new workers, on new ports
        finally:
            await core.close()

    run_server(quiet_config(tmp_path / "node", load=("lenet",)).replaced(fast_port=0), scenario)
