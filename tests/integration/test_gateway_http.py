"""The cluster gateway's HTTP front end without Ray: a real node (an in-process server whose
fast path listens on loopback) behind a ``GatewayCore``, called over HTTP with the splitserve
client (binary tensors) and with raw v2 JSON. Every call goes through the gateway's ledger."""

from __future__ import annotations

import httpx
import numpy as np

from splitserve.client import connect
from tests.gateway_front import CLUSTER_FID, through_gateway


def test_v2_over_http_at_the_gateway_answers_like_the_node_through_the_ledger(tmp_path):
    x = (np.arange(2 * 784) % 251).astype(np.uint8).reshape(2, 1, 28, 28)

    def calls(port: int) -> dict:
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

    want, out, stats = through_gateway(tmp_path, "http", x, calls)
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
