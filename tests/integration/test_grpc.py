"""The gRPC front end (Open Inference Protocol v2) against a real server process."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from splitserve import Client
from splitserve.client.grpc import AsyncGrpcClient, GrpcClient
from splitserve.errors import InvalidInput, ModelNotReady, Unauthorized, UnknownModel
from splitserve.protocol import grpc_api as pb

MODELS = ("lenet", "vecadd1k", "bert_tiny")
rng = np.random.default_rng(7)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers import start_server

    s = start_server(tmp_path_factory.mktemp("grpc"), *sum((["--load", m] for m in MODELS), []), grpc=True)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def token(server):
    return (server.data_dir / "token").read_text().strip()


@pytest.fixture(scope="module")
def client(server):
    with GrpcClient(server.grpc) as c:
        yield c


@pytest.fixture(scope="module")
def fast(server):
    with Client(server.tcp) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.grpc.removeprefix("grpc://"))
    yield pb.Stub(channel)
    channel.close()


def lenet_input(n=None):
    return rng.integers(0, 255, (1, 28, 28) if n is None else (n, 1, 28, 28), dtype=np.uint8)


def vecadd_inputs(n=None):
    shape = (1024,) if n is None else (n, 1024)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def bert_inputs():
    ids = rng.integers(0, 1000, 512, dtype=np.int32)
    mask = np.ones(512, np.int32)
    mask[400:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros(512, np.int32)}


def raw_request(model, tensors, raw=None):
    """A ModelInferRequest of (name, datatype, shape, array) tensors, all as raw contents."""
    req = pb.ModelInferRequest(model_name=model)
    for name, datatype, shape, arr in tensors:
        req.inputs.add(name=name, datatype=datatype, shape=shape)
        req.raw_input_contents.append(np.ascontiguousarray(arr).tobytes() if raw is None else raw)
    return req


def expect_code(call, code, *words):
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, err.details()
    for w in words:
        assert w in err.details(), f"{w!r} not in {err.details()!r}"
    return err.details()


def assert_still_serving(client, fast):
    x = lenet_input()
    np.testing.assert_allclose(client.infer("lenet", x), fast.infer("lenet", x), rtol=1e-5, atol=1e-6)


# -- health and metadata --------------------------------------------------------------------


def test_health_and_server_metadata(client, stub):
    assert client.live() is True
    assert client.ready() is True
    assert all(client.model_ready(m) for m in MODELS)
    meta = client.server_metadata()
    assert meta["name"] == "splitserve" and meta["version"]
    assert {"model_repository", "statistics"} <= set(meta["extensions"])
    expect_code(lambda: stub.ModelReady(pb.ModelReadyRequest(name="nope")), grpc.StatusCode.NOT_FOUND, "nope")


def test_model_metadata(client, stub):
    resp = stub.ModelMetadata(pb.ModelMetadataRequest(name="lenet"))
    assert resp.name == "lenet" and resp.versions
    (inp,) = resp.inputs
    assert (inp.name, inp.datatype, list(inp.shape)) == ("image", "UINT8", [-1, 1, 28, 28])
    assert resp.parameters["max_batch_size"].int64_param == 32
    info = client.lookup("bert_tiny")
    assert [t.name for t in info.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(t.datatype == "INT32" and t.shape == (512,) for t in info.inputs)
    assert [t.shape for t in info.outputs] == [(512,), (512,)]
    assert info.max_batch_size == 8 and info.func_id > 0
    expect_code(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")), grpc.StatusCode.NOT_FOUND)


# -- inference ------------------------------------------------------------------------------


def test_lenet_uint8_matches_fast_path(client, fast):
    x = lenet_input()
    r = client.infer_result("lenet", x)
    want = fast.infer("lenet", x)
    assert r.outputs["logits"].shape == (10,)
    np.testing.assert_allclose(r.value(), want, rtol=1e-5, atol=1e-6)
    assert r.total_us > 0 and r.compute_us > 0 and r.total_us >= r.queue_us


def test_vecadd_fp32_two_inputs_and_batch(client, fast):
    a, b = vecadd_inputs()
    np.testing.assert_array_equal(client.infer("vecadd1k", (a, b)), a + b)
    a, b = vecadd_inputs(5)
    got = client.infer("vecadd1k", {"a": a, "b": b})
    assert got.shape == (5, 1024)
    np.testing.assert_array_equal(got, fast.infer("vecadd1k", (a, b)))


def test_lenet_batch_of_several(client, fast):
    x = lenet_input(6)
    got = client.infer("lenet", x, cls="rt", deadline_ms=30_000)
    assert got.shape == (6, 10)
    np.testing.assert_allclose(got, fast.infer("lenet", x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(client.infer("lenet", x, cls="be"), got, rtol=1e-5, atol=1e-6)


def test_bert_int32_two_outputs(client, fast):
    x = bert_inputs()
    got = client.infer("bert_tiny", x)
    want = fast.infer("bert_tiny", x)
    assert set(got) == {"start_logits", "end_logits"}
    for k in got:
        assert got[k].shape == (512,) and got[k].dtype == np.float32
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_typed_contents_and_requested_outputs(stub, fast):
    x = lenet_input(2)
    req = pb.ModelInferRequest(model_name="lenet", id="call-7")
    t = req.inputs.add(name="image", datatype="UINT8", shape=[2, 1, 28, 28])
    t.contents.uint_contents.extend(x.ravel().tolist())
    resp = stub.ModelInfer(req)
    assert resp.id == "call-7" and not resp.raw_output_contents  # typed in, typed out
    (out,) = resp.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("logits", "FP32", [2, 10])
    got = np.array(out.contents.fp32_contents, np.float32).reshape(2, 10)
    np.testing.assert_allclose(got, fast.infer("lenet", x), rtol=1e-5, atol=1e-6)
    # only the requested output of a two-output model, as raw contents
    x = bert_inputs()
    req = raw_request("bert_tiny", [(k, "INT32", [1, 512], v) for k, v in x.items()])
    req.outputs.add(name="end_logits")
    resp = stub.ModelInfer(req)
    assert [o.name for o in resp.outputs] == ["end_logits"] and len(resp.raw_output_contents) == 1
    got = np.frombuffer(resp.raw_output_contents[0], np.float32)
    np.testing.assert_allclose(got, fast.infer("bert_tiny", x)["end_logits"], rtol=1e-5, atol=1e-5)
    assert resp.parameters["total_us"].int64_param > 0


def test_async_client_many_calls(server, fast):
    xs = [lenet_input() for _ in range(16)]

    async def main():
        async with AsyncGrpcClient(server.grpc) as c:
            return await asyncio.gather(*(c.infer("lenet", x) for x in xs))

    got = asyncio.run(main())
    for x, y in zip(xs, got):
        np.testing.assert_allclose(y, fast.infer("lenet", x), rtol=1e-5, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------


def test_unknown_model_is_not_found(client, stub, fast):
    x = lenet_input(1)
    expect_code(lambda: stub.ModelInfer(raw_request("nope", [("image", "UINT8", [1, 1, 28, 28], x)])),
                grpc.StatusCode.NOT_FOUND, "nope")
    with pytest.raises(UnknownModel):
        client.infer("nope", x)
    assert_still_serving(client, fast)


def test_wrong_shape(stub, client, fast):
    x = rng.integers(0, 255, (1, 1, 28, 27), dtype=np.uint8)
    expect_code(lambda: stub.ModelInfer(raw_request("lenet", [("image", "UINT8", [1, 1, 28, 27], x)])),
                grpc.StatusCode.INVALID_ARGUMENT, "'image'", "shape", "[1, 1, 28, 27]")
    assert_still_serving(client, fast)


def test_wrong_datatype(stub, client, fast):
    x = np.zeros((1, 1, 28, 28), np.float32)
    expect_code(lambda: stub.ModelInfer(raw_request("lenet", [("image", "FP32", [1, 1, 28, 28], x)])),
                grpc.StatusCode.INVALID_ARGUMENT, "'image'", "UINT8", "FP32")
    expect_code(lambda: stub.ModelInfer(raw_request("lenet", [("image", "FLOAT", [1, 1, 28, 28], x)])),
                grpc.StatusCode.INVALID_ARGUMENT, "FLOAT")
    assert_still_serving(client, fast)


def test_wrong_raw_content_length(stub, client, fast):
    a, b = vecadd_inputs(1)
    req = raw_request("vecadd1k", [("a", "FP32", [1, 1024], a), ("b", "FP32", [1, 1024], b)])
    req.raw_input_contents[1] = b.tobytes()[:100]
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "'b'", "100 bytes", "4096")
    del req.raw_input_contents[1]
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents", "1 entries")
    assert_still_serving(client, fast)


def test_other_bad_requests(stub, client, fast):
    a, b = vecadd_inputs(1)
    expect_code(lambda: stub.ModelInfer(raw_request("vecadd1k", [("a", "FP32", [1, 1024], a)])),
                grpc.StatusCode.INVALID_ARGUMENT, "missing", "'b'")
    req = raw_request("vecadd1k", [("a", "FP32", [1, 1024], a), ("c", "FP32", [1, 1024], b)])
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "no input 'c'")
    req = raw_request("lenet", [("image", "UINT8", [1, 1, 28, 28], lenet_input(1))])
    req.outputs.add(name="probs")
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "no output 'probs'")
    req = raw_request("lenet", [("image", "UINT8", [1, 1, 28, 28], lenet_input(1))])
    req.parameters["class"].string_param = "urgent"
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "class", "urgent")
    req = pb.ModelInferRequest(model_name="lenet")
    t = req.inputs.add(name="image", datatype="UINT8", shape=[1, 1, 28, 28])
    t.contents.uint_contents.extend([300] * 784)
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "UINT8")
    x = lenet_input(33)  # more than max_batch_size 32
    with pytest.raises(Exception, match="max_batch_size"):
        client.infer("lenet", x)
    with pytest.raises(InvalidInput):
        client.infer("lenet", x.astype(np.float32))  # refused by the client before sending
    assert_still_serving(client, fast)


# -- statistics and the model repository ----------------------------------------------------


def test_statistics_after_inferring(client, stub):
    client.infer("vecadd1k", vecadd_inputs())
    stats = client.statistics("vecadd1k")
    (s,) = stats["model_stats"]
    assert s["name"] == "vecadd1k"
    assert int(s["inference_count"]) > 0 and int(s["execution_count"]) > 0
    assert int(s["inference_stats"]["success"]["count"]) > 0
    assert int(s["inference_stats"]["compute_infer"]["ns"]) > 0
    assert s["batch_stats"] and int(s["last_inference"]) > 0
    everything = stub.ModelStatistics(pb.ModelStatisticsRequest())
    assert {m.name for m in everything.model_stats} >= set(MODELS)
    expect_code(lambda: stub.ModelStatistics(pb.ModelStatisticsRequest(name="nope")), grpc.StatusCode.NOT_FOUND)


def test_repository_index_load_unload(server, client, stub, token, fast):
    index = {m["name"]: m for m in client.index()}
    assert set(MODELS) <= set(index) and "matmul8k" in index
    assert index["lenet"]["state"] == "READY"
    assert {m["name"] for m in client.index(ready_only=True, token=token)} >= set(MODELS)

    # without a token, or with a wrong one: UNAUTHENTICATED, and nothing happens
    expect_code(lambda: stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="matmul8k")),
                grpc.StatusCode.UNAUTHENTICATED)
    expect_code(lambda: stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="lenet"),
                                                   metadata=(("authorization", "Bearer wrong"),)),
                grpc.StatusCode.UNAUTHENTICATED)
    with pytest.raises(Unauthorized):
        client.unload("lenet")
    assert client.model_ready("lenet")

    client.load("matmul8k", token)
    assert client.model_ready("matmul8k")
    a, b = rng.standard_normal((2, 64, 64)).astype(np.float32)
    np.testing.assert_allclose(client.infer("matmul8k", (a, b)), a @ b, rtol=1e-4, atol=1e-4)
    client.unload("matmul8k", token)
    assert not client.model_ready("matmul8k")
    assert {m["name"]: m for m in client.index()}["matmul8k"]["state"] != "READY"
    with pytest.raises(ModelNotReady):
        client.infer("matmul8k", (a, b))
    expect_code(lambda: stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="nope"),
                                                 metadata=(("authorization", f"Bearer {token}"),)),
                grpc.StatusCode.NOT_FOUND)
    client.load("matmul8k", token)
    np.testing.assert_allclose(client.infer("matmul8k", (a, b)), a @ b, rtol=1e-4, atol=1e-4)
    assert_still_serving(client, fast)


def test_register_through_load_with_config(client, stub, token):
    config = 'name = "vecadd_grpc"\nmax_batch_size = 4\n[artifact]\nkind = "zoo"\narch = "vecadd1k"\n'
    auth = (("authorization", f"Bearer {token}"),)
    req = pb.RepositoryModelLoadRequest(model_name="other_name")
    req.parameters["config"].string_param = config
    expect_code(lambda: stub.RepositoryModelLoad(req, metadata=auth), grpc.StatusCode.INVALID_ARGUMENT,
                "'vecadd_grpc'", "'other_name'")
    assert "vecadd_grpc" not in {m["name"] for m in client.index()}

    client.load("vecadd_grpc", token, config_toml=config, instances=2)
    assert client.model_ready("vecadd_grpc")
    info = client.lookup("vecadd_grpc")
    assert info.max_batch_size == 4 and [t.name for t in info.inputs] == ["a", "b"]
    a, b = vecadd_inputs(4)
    np.testing.assert_array_equal(client.infer("vecadd_grpc", (a, b)), a + b)
    req.model_name = "vecadd_grpc"
    expect_code(lambda: stub.RepositoryModelLoad(req, metadata=auth), grpc.StatusCode.INVALID_ARGUMENT,
                "already exists")
    np.testing.assert_array_equal(client.infer("vecadd_grpc", (a, b)), a + b)


# -- limits, bad parameters, storage and bugs -------------------------------------------------


def test_oversized_and_unparsable_messages_are_refused_and_the_server_serves_on(server, stub, client, fast):
    big = raw_request("lenet", [("image", "UINT8", [2000, 1, 28, 28], np.zeros((2000, 1, 28, 28), np.uint8))])
    details = expect_code(lambda: stub.ModelInfer(big), grpc.StatusCode.RESOURCE_EXHAUSTED, "'lenet'", "limit")
    assert "max_batch_size 32" in details
    channel = grpc.insecure_channel(server.grpc.removeprefix("grpc://"))
    try:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        expect_code(lambda: raw(b"\x0a\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "does not parse")
    finally:
        channel.close()
    assert_still_serving(client, fast)


@pytest.mark.parametrize("kind, value", [("string_param", "50"), ("bool_param", True), ("double_param", 0.0),
                                         ("int64_param", -5), ("double_param", float("inf"))])
def test_deadline_ms_must_be_a_positive_number(stub, kind, value):
    req = raw_request("lenet", [("image", "UINT8", [1, 1, 28, 28], lenet_input(1))])
    setattr(req.parameters["deadline_ms"], kind, value)
    expect_code(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, "deadline_ms", "positive")


def test_a_full_disk_is_resource_exhausted_and_a_bug_is_internal_without_details(tmp_path, monkeypatch):
    import errno
    import os

    import httpx

    from splitserve.server import management
    from tests.inproc import quiet_config, run_server

    def full(fd):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    def bug(*args, **kw):
        raise KeyError("secret detail of a bug")

    monkeypatch.setattr(os, "fsync", full)  # what a full quota answers when the upload is flushed
    monkeypatch.setattr(management.ModelManager, "repository_index", bug)

    def test(server):
        token = (server.config.data_dir / "token").read_text().strip()
        channel = grpc.insecure_channel(f"127.0.0.1:{server.ports['grpc_port']}")
        s = pb.Stub(channel)
        try:
            req = pb.RepositoryModelLoadRequest(model_name="small")
            req.parameters["config"].string_param = ('name = "small"\n[artifact]\nkind = "safetensors"\n'
                                                     'arch = "lenet"\nfile = "w.safetensors"\n')
            req.parameters["file:w.safetensors"].bytes_param = b"weights"
            full_disk = expect_code(lambda: s.RepositoryModelLoad(req, metadata=(("authorization", f"Bearer {token}"),)),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, "no storage left")
            internal = expect_code(lambda: s.RepositoryIndex(pb.RepositoryIndexRequest()), grpc.StatusCode.INTERNAL,
                                   "reference")
            ready = s.ServerReady(pb.ServerReadyRequest()).ready
            http_ready = httpx.get(f"http://127.0.0.1:{server.ports['http_port']}/v2/health/ready").json()["ready"]
        finally:
            channel.close()
        return full_disk, internal, ready, http_ready

    async def scenario(server):
        return await asyncio.to_thread(test, server)

    config = quiet_config(tmp_path / "data", cache_dir=tmp_path / "cache").replaced(grpc_port=0, http_port=0)
    full_disk, internal, ready, http_ready = run_server(config, scenario)
    assert "secret" not in internal and "KeyError" not in internal
    assert ready is True and http_ready is True
    assert not (tmp_path / "data" / "repository" / "small").exists()
