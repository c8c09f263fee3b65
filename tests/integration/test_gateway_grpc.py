"""The cluster gateway's gRPC front end without Ray: a real node (an in-process server whose
fast path listens on loopback) behind a ``GatewayCore``, called over gRPC with the splitserve
client, with ``tritonclient.grpc`` and with raw ``ModelInfer`` and ``ModelStreamInfer``
messages. Every infer goes through the gateway's ledger."""

from __future__ import annotations

import grpc
import numpy as np
import tritonclient.grpc as tgrpc

from splitserve.client import connect
from splitserve.protocol import grpc_api as pb
from tests.gateway_front import CLUSTER_FID, through_gateway


def _raw(model: str, x: np.ndarray, call_id: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id=call_id)
    req.inputs.add(name="image", datatype="UINT8", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


def test_v2_over_grpc_at_the_gateway_answers_like_the_node_through_the_ledger(tmp_path):
    x = (np.arange(2 * 784) % 251).astype(np.uint8).reshape(2, 1, 28, 28)

    def calls(port: int) -> dict:
        out = {}
        with connect(f"grpc://127.0.0.1:{port}") as c:  # ModelMetadata, then ModelInfer
            out["client"] = c.infer("lenet", x)
        triton = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            t = tgrpc.InferInput("image", list(x.shape), "UINT8")
            t.set_data_from_numpy(x)
            out["triton"] = triton.infer("lenet", [t]).as_numpy("logits")
            out["live"], out["ready"] = triton.is_server_live(), triton.is_server_ready()
            out["model_ready"] = triton.is_model_ready("lenet")
        finally:
            triton.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb.Stub(channel)
            out["meta"] = stub.ModelMetadata(pb.ModelMetadataRequest(name="lenet"))
            streamed = list(stub.ModelStreamInfer(iter([_raw("lenet", x[:1], "s1"), _raw("nope", x, "s2")])))
            out["stream"] = {r.infer_response.id: r for r in streamed}
            out["unknown"] = _code(lambda: stub.ModelInfer(_raw("nope", x)))
            out["bad"] = _code(lambda: stub.ModelInfer(_raw("lenet", x.reshape(2, 784))))
            out["management"] = _code(lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest()))
        return out

    want, out, stats = through_gateway(tmp_path, "grpc", x, calls)
    np.testing.assert_allclose(out["client"], want, atol=1e-5)
    np.testing.assert_allclose(out["triton"], want, atol=1e-5)
    assert out["live"] and out["ready"] and out["model_ready"]
    assert [(t.name, t.datatype, list(t.shape)) for t in out["meta"].inputs] == [("image", "UINT8", [-1, 1, 28, 28])]
    assert out["meta"].parameters["func_id"].int64_param == CLUSTER_FID  # the cluster's id, not the node's
    ok, missing = out["stream"]["s1"], out["stream"]["s2"]
    assert ok.error_message == ""
    np.testing.assert_allclose(np.frombuffer(ok.infer_response.raw_output_contents[0], np.float32), want[0], atol=1e-5)
    assert "nope" in missing.error_message  # a stream answers a bad call in place and goes on
    assert out["unknown"][0] == grpc.StatusCode.NOT_FOUND and "nope" in out["unknown"][1]
    assert out["bad"][0] == grpc.StatusCode.INVALID_ARGUMENT and "shape" in out["bad"][1]
    assert out["management"][0] == grpc.StatusCode.UNIMPLEMENTED  # the gateway serves the inference half only
    # the client's, tritonclient's and the streamed infer were held by the ledger and answered by the node, once each
    assert stats["delivered"] == 3 and stats["answers_by_node"] == {"node-1": 3} and stats["held"] == 0
