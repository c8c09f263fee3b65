"""A cluster gateway's front end without Ray, for the gateway's HTTP and gRPC tests: a real
node (an in-process server whose fast path listens on loopback, lenet loaded) behind a
``GatewayCore`` that routes lenet to it under the cluster's id ``CLUSTER_FID``.

``with_registry`` adds what the gateway's management needs: its ``GatewayRegistrar`` and the
upcall channel, whose actor's end is ``upcall.serve`` in a thread over ``NodeRegistry``,
which stands in for the controller by registering on the real node through its HTTP API
(as the node servers do) and publishing the routes that name the model."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from splitserve.cluster.gateway import upcall
from splitserve.cluster.gateway.core import GatewayCore, NodeRoute, Routes
from splitserve.cluster.gateway.dataplane import GatewayRegistrar, front_ends
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.pools import Market
from splitserve.cluster.config import ClusterConfig
from splitserve.config import ServerConfig
from tests.inproc import quiet_config, run_server, until

CLUSTER_FID = 7  # the cluster's id for lenet: not the node's, so the gateway must rewrite it
TOKEN = "gateway-test-token"  # the cluster's management token, the node's too
UPLOAD_LIMIT = 1 << 20  # the gateway's max_upload_bytes and its upcall channel's bound


def through_gateway(tmp_path: Path, kind: str, x: np.ndarray, calls: Callable[[int], dict[str, Any]],
                    node_http: bool = False, others: tuple[NodeRoute, ...] = (),
                    cluster: ClusterConfig = ClusterConfig()) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
    """Run ``calls(port)`` (in a thread) against the gateway's ``kind`` front end ("http" or
    "grpc"); return the node's own answer for ``x``, what ``calls`` returned and the
    gateway's statistics after them. ``node_http``: the node serves HTTP too, and its route
    says where; ``others``: more routes, beside the node's; ``cluster``: the gateway's settings."""

    async def scenario(server: Any) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
        core = GatewayCore(cluster)
        await core.serve("127.0.0.1", 0)
        ports: dict[str, int | None] = {"http_port": None, "grpc_port": None, f"{kind}_port": 0}
        (front,) = front_ends(core, ServerConfig.of(host="127.0.0.1", data_dir=tmp_path / "gw", **ports))
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

    node = quiet_config(tmp_path / "node", load=("lenet",)).replaced(fast_port=0,
                                                                     http_port=0 if node_http else None)
    return run_server(node, scenario)


class NodeRegistry:
    """``upcall.ClusterRegistry`` standing in for the controller: registers on one real node
    over its HTTP API, then publishes routes naming the model (on the gateway's loop)."""

    def __init__(self, node_url: str, fast_port: int, core: GatewayCore, loop: asyncio.AbstractEventLoop) -> None:
        self.node_url = node_url
        self.fast_port = fast_port
        self.core = core
        self.loop = loop
        self.models = {"lenet": CLUSTER_FID}
        self.ids = itertools.count(CLUSTER_FID + 1)
        self.version = itertools.count(1)
        self.publish()

    def publish(self) -> None:
        route = NodeRoute("node-1", "127.0.0.1", self.fast_port, Market.ON_DEMAND, NodeState.ACTIVE,
                          frozenset(self.models))
        self.loop.call_soon_threadsafe(self.core.update, Routes(next(self.version), (route,),
                                                                tuple(sorted(self.models.items()))))

    def _node(self) -> httpx.Client:
        return httpx.Client(base_url=self.node_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    def register(self, call: ModelSpec) -> int:
        files = {"config": ("config.toml", call.config_toml.encode())}
        if call.artifact is not None:
            files["artifact"] = ("artifact", call.artifact)
        with self._node() as http:
            r = http.post(f"/v2/repository/models/{call.name}/register", files=files)
        r.raise_for_status()
        self.models[call.name] = next(self.ids)
        self.publish()
        return self.models[call.name]

    def unregister(self, name: str) -> None:
        with self._node() as http:
            http.delete(f"/v2/repository/models/{name}").raise_for_status()
        del self.models[name]
        self.publish()


def with_registry(tmp_path: Path, calls: Callable[[dict[str, int]], Any], grpc: bool = False) -> Any:
    """Run ``calls(ports)`` (in a thread) against a gateway whose management reaches a
    ``NodeRegistry`` over the upcall channel, in front of a real node with the cluster's
    ``TOKEN``; ``ports``: the gateway's "http" (and "grpc" when asked for) and the node's
    "node_http". Returns what ``calls`` returned."""

    async def scenario(server: Any) -> Any:
        core = GatewayCore(ClusterConfig())
        await core.serve("127.0.0.1", 0)
        ours, theirs = socket.socketpair()
        upcalls = upcall.UpcallClient(theirs, UPLOAD_LIMIT, 120)
        gw = ServerConfig.of(host="127.0.0.1", data_dir=tmp_path / "gw", http_port=0, grpc_port=0 if grpc else None,
                          max_upload_bytes=UPLOAD_LIMIT)
        fronts = front_ends(core, gw, GatewayRegistrar(core, upcalls, TOKEN, 120))
        ports = {"node_http": server.ports["http_port"]}
        started = []
        registry = NodeRegistry(f"http://127.0.0.1:{ports['node_http']}", server.ports["fast_port"], core,
                                asyncio.get_running_loop())
        actor = threading.Thread(target=upcall.serve, args=(ours, registry, UPLOAD_LIMIT), name="test-upcalls")
        actor.start()
        try:
            for front in fronts:
                bound = await front.start()
                started.append(front)
                ports.update({k.removesuffix("_port"): v for k, v in bound.items()})
            await asyncio.wait_for(until(lambda: core.serves("lenet")), 60)
            return await asyncio.to_thread(calls, ports)
        finally:
            for front in started:
                await front.stop(1.0)
            upcalls.close()  # the actor's end sees EOF and its thread ends
            await asyncio.to_thread(actor.join, 30)
            await core.close()

    node_dir = tmp_path / "node"
    node_dir.mkdir()
    (node_dir / "token").write_text(TOKEN + "\n")
    (node_dir / "token").chmod(0o600)
    node = quiet_config(node_dir, load=("lenet",)).replaced(fast_port=0, http_port=0)
    return run_server(node, scenario)
