"""The cluster gateway's HTTP front end without Ray: a real node (an in-process server whose
fast path listens on loopback) behind a ``GatewayCore``, called over HTTP with the splitserve
client (binary tensors) and with raw v2 JSON. Every call goes through the gateway's ledger."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import numpy as np

from splitserve.client.fastpath import connect
from splitserve.cluster.dataplane import front_ends
from splitserve.cluster.dispatch import NodeState
from splitserve.cluster.gateway import GatewayCore, NodeRoute, Routes
from splitserve.cluster.pools import Market
from splitserve.config import ClusterConfig, ServerConfig
from tests.inproc import quiet_config, run_server, until

CLUSTER_FID = 7  # the cluster's id for lenet: not the node's, so the gateway must rewrite it


def test_v2_over_http_at_the_gateway_answers_like_the_node_through_the_ledger(tmp_path):
    x = (np.arange(2 * 784) % 251).astype(np.uint8).reshape(2, 1, 28, 28)

    async def scenario(server):
        core = GatewayCore(ClusterConfig())
        await core.serve("127.0.0.1", 0)
        (http,) = front_ends(core, ServerConfig(host="127.0.0.1", http_port=0, grpc_port=None,
                                                data_dir=tmp_path / "gw"))
        port = (await http.start())["http_port"]
        try:
            route = NodeRoute("node-1", "127.0.0.1", server.ports["fast_port"], Market.ON_DEMAND, NodeState.ACTIVE,
                              frozenset({"lenet"}))
            core.update(Routes(1, (route,), (("lenet", CLUSTER_FID),)))
            await asyncio.wait_for(until(lambda: core.serves("lenet")), 60)
            want = (await server.infer("lenet", [x])).outputs[0]

            def calls() -> dict:
                out = {}
                with connect(f"http://127.0.0.1:{port}") as c:  # metadata, then a binary infer
                    out["binary"] = c.infer("lenet", x)
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as h:
                    out["json"] = h.post("/v2/models/lenet/infer", json={"inputs": [
                        {"name": "image", "datatype": "UINT8", "shape": list(x.shape), "data": x.ravel().tolist()}]})
                    out["meta"] = h.get("/v2/models/lenet").json()
                    out["ready"] = h.get("/v2/health/ready").status_code
                    out["model_ready"] = h.get("/v2/models/lenet/ready").status_code
                    out["unknown"] = h.post("/v2/models/nope/infer", json={"inputs": []})
                    out["bad"] = h.post("/v2/models/lenet/infer", json={"inputs": [
                        {"name": "image", "datatype": "UINT8", "shape": [1, 2], "data": [0, 0]}]})
                return out

            out = await asyncio.to_thread(calls)
            stats = core.stats()
        finally:
            await http.stop(1.0)
            await core.close()
        return want, out, stats

    want, out, stats = run_server(dataclasses.replace(quiet_config(tmp_path / "node", load=("lenet",)), fast_port=0), scenario)
    np.testing.assert_allclose(out["binary"], want, atol=1e-5)
    assert out["json"].status_code == 200, out["json"].text
    (logits,) = out["json"].json()["outputs"]
    np.testing.assert_allclose(np.asarray(logits["data"], np.float32).reshape(want.shape), want, atol=1e-5)
    assert out["meta"]["inputs"] == [{"name": "image", "datatype": "UINT8", "shape": [-1, 1, 28, 28]}]
    assert out["meta"]["parameters"]["func_id"] == CLUSTER_FID
    assert out["ready"] == 200 and out["model_ready"] == 200
    assert out["unknown"].status_code == 404 and "nope" in out["unknown"].json()["error"]
    assert out["bad"].status_code == 400 and "shape" in out["bad"].json()["error"]
    # both infers were held by the ledger and answered by the node, once each
    assert stats["delivered"] == 2 and stats["answers_by_node"] == {"node-1": 2} and stats["held"] == 0
