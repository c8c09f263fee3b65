"""Registering a model at the cluster gateway, without Ray: the gateway's data plane (its HTTP
front end, ``GatewayRegistrar`` and the upcall channel) in front of a real node; the actor's
end of the channel is ``upcall.serve`` in a thread, over a registry that stands in for the
controller by registering on that real node through its HTTP API (as the node servers do)
and publishing the routes that name the model. ``HttpClient.register`` and
``splitserve models register`` go through the gateway, and the model answers there."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.client.http import HttpClient
from splitserve.cluster import upcall
from splitserve.cluster.dataplane import GatewayRegistrar, front_ends
from splitserve.cluster.dispatch import NodeState
from splitserve.cluster.gateway import GatewayCore, NodeRoute, Routes
from splitserve.cluster.pools import Market
from splitserve.config import ClusterConfig, ServerConfig
from splitserve.errors import UnknownModel
from tests.gateway_front import CLUSTER_FID
from tests.inproc import quiet_config, run_server, until, write_model

TOKEN = "gateway-test-token"
LIMIT = 1 << 20


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

    def register(self, call: upcall.RegisterCall) -> int:
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


def test_a_model_registered_at_the_gateway_answers_there_and_management_needs_the_clusters_token(
        tmp_path: Path) -> None:
    x = (np.arange(784) % 251).astype(np.uint8).reshape(1, 1, 28, 28)
    mine = write_model(tmp_path / "models", "lenet_gw", "lenet")
    by_cli = write_model(tmp_path / "models", "lenet_cli", "lenet")

    def calls(port: int, node_port: int) -> dict[str, Any]:
        url = f"http://127.0.0.1:{port}"
        out: dict[str, Any] = {}
        with httpx.Client(base_url=url, timeout=60) as http:
            out["no_token"] = http.delete("/v2/repository/models/lenet_gw")
            out["bad_token"] = http.post("/v2/repository/models/lenet_gw/register",
                                         files={"config": ("config.toml", (mine / "config.toml").read_bytes())},
                                         headers={"Authorization": "Bearer wrong"})
        with HttpClient(url, token=TOKEN) as c, HttpClient(f"http://127.0.0.1:{node_port}") as node:
            out["registered"] = c.register(mine)
            out["answer"] = c.infer("lenet_gw", x)  # the model answers through the gateway at once
            out["want"] = node.infer("lenet_gw", x)
            out["index"] = c.index()
        with httpx.Client(base_url=url, timeout=60) as http:
            out["duplicate"] = http.post("/v2/repository/models/lenet_gw/register",
                                         files={"config": ("config.toml", (mine / "config.toml").read_bytes())},
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        out["cli"] = CliRunner().invoke(app, ["models", "register", str(by_cli), "--url", url, "--token", TOKEN])
        with HttpClient(url, token=TOKEN) as c:
            out["cli_answer"] = c.infer("lenet_cli", x)
            c.unregister("lenet_gw")
            try:
                c.infer("lenet_gw", x)
            except UnknownModel as e:
                out["after_unregister"] = e.message
            out["index_after"] = c.index()
        return out

    async def scenario(server: Any) -> dict[str, Any]:
        core = GatewayCore(ClusterConfig())
        await core.serve("127.0.0.1", 0)
        ours, theirs = socket.socketpair()
        upcalls = upcall.UpcallClient(theirs, LIMIT, 120)
        gw = ServerConfig(host="127.0.0.1", data_dir=tmp_path / "gw", http_port=0, grpc_port=None,
                          max_upload_bytes=LIMIT)
        (front,) = front_ends(core, gw, GatewayRegistrar(core, upcalls, TOKEN, 120))
        port = (await front.start())["http_port"]
        registry = NodeRegistry(f"http://127.0.0.1:{server.ports['http_port']}", server.ports["fast_port"], core,
                                asyncio.get_running_loop())
        actor = threading.Thread(target=upcall.serve, args=(ours, registry, LIMIT), name="test-upcalls")
        actor.start()
        try:
            await asyncio.wait_for(until(lambda: core.serves("lenet")), 60)
            return await asyncio.to_thread(calls, port, server.ports["http_port"])
        finally:
            await front.stop(1.0)
            upcalls.close()  # the actor's end sees EOF and its thread ends
            await asyncio.to_thread(actor.join, 30)
            await core.close()

    node_dir = tmp_path / "node"
    node_dir.mkdir()
    (node_dir / "token").write_text(TOKEN + "\n")
    (node_dir / "token").chmod(0o600)
    node = dataclasses.replace(quiet_config(node_dir, load=("lenet",)), fast_port=0, http_port=0)
    out = run_server(node, scenario)

    assert out["no_token"].status_code == 401
    assert out["bad_token"].status_code == 401 and "wrong management token" in out["bad_token"].json()["error"]
    reg = out["registered"]
    assert reg["name"] == "lenet_gw" and reg["func_id"] > CLUSTER_FID and reg["state"] == "READY"
    np.testing.assert_allclose(out["answer"], out["want"], atol=1e-5)
    assert {"name": "lenet_gw", "version": "1", "state": "READY", "reason": "serving on 1 node(s)"} in out["index"]
    assert out["duplicate"].status_code == 400 and "lenet_gw" in out["duplicate"].json()["error"]
    assert out["cli"].exit_code == 0, out["cli"].output
    assert "registered lenet_cli" in out["cli"].output
    np.testing.assert_allclose(out["cli_answer"], out["want"], atol=1e-5)
    assert "lenet_gw" in out["after_unregister"]
    assert [m["name"] for m in out["index_after"]] == ["lenet", "lenet_cli"]
