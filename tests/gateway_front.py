"""A cluster gateway's front end without Ray, for the gateway's HTTP and gRPC tests: a real
node (an in-process server whose fast path listens on loopback, lenet loaded) behind a
``GatewayCore`` that routes lenet to it under the cluster's id ``CLUSTER_FID``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.cluster.dataplane import front_ends
from splitserve.cluster.dispatch import NodeState
from splitserve.cluster.gateway import GatewayCore, NodeRoute, Routes
from splitserve.cluster.pools import Market
from splitserve.config import ClusterConfig, ServerConfig
from tests.inproc import quiet_config, run_server, until

CLUSTER_FID = 7  # the cluster's id for lenet: not the node's, so the gateway must rewrite it


def through_gateway(tmp_path: Path, kind: str, x: np.ndarray, calls: Callable[[int], dict[str, Any]],
                    node_http: bool = False, others: tuple[NodeRoute, ...] = ()
                    ) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
    """Run ``calls(port)`` (in a thread) against the gateway's ``kind`` front end ("http" or
    "grpc"); return the node's own answer for ``x``, what ``calls`` returned and the
    gateway's statistics after them. ``node_http``: the node serves HTTP too, and its route
    says where; ``others``: more routes, beside the node's."""

    async def scenario(server: Any) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
        core = GatewayCore(ClusterConfig())
        await core.serve("127.0.0.1", 0)
        ports: dict[str, int | None] = {"http_port": None, "grpc_port": None, f"{kind}_port": 0}
        (front,) = front_ends(core, ServerConfig(host="127.0.0.1", data_dir=tmp_path / "gw", **ports))
        port = (await front.start())[f"{kind}_port"]
        try:
            route = NodeRoute("node-1", "127.0.0.1", server.ports["fast_port"], Market.ON_DEMAND, NodeState.ACTIVE,
                              frozenset({"lenet"}), server.ports.get("http_port"))
            core.update(Routes(1, (route, *others), (("lenet", CLUSTER_FID),)))
            await asyncio.wait_for(until(lambda: core.serves("lenet")), 60)
            want = (await server.infer("lenet", [x])).outputs[0]
            out = await asyncio.to_thread(calls, port)
            return want, out, core.stats()
        finally:
            await front.stop(1.0)
            await core.close()

    node = dataclasses.replace(quiet_config(tmp_path / "node", load=("lenet",)), fast_port=0,
                               http_port=0 if node_http else None)
    return run_server(node, scenario)
