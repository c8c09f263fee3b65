"""Triton and KServe drop-in: the real ``tritonclient`` (HTTP sync and async, gRPC sync,
async and streaming) and the ``kserve`` clients against one real server.

The server runs in this process (a ``Server`` on its own loop in a thread; its models in
worker processes), so every test here also proves that splitserve's gRPC front end and
``tritonclient.grpc`` share protobuf's descriptor pools without colliding. ``kserve`` and
``tritonclient.grpc`` cannot be imported in one process (both register ``inference.*``
messages in protobuf's default pool), so the kserve clients run in a child process.

Organised by what a client does (metadata, inference, errors, streaming, system shared
memory, management), one function per client flavour where they differ.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import queue
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.utils.shared_memory as shm
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio
from tritonclient.utils import InferenceServerException

from splitserve.models.gate import Gates
from splitserve.server.app import Server
from tests.fake_cuda_ipc import FakeCudaIpc
from tests.inproc import quiet_config, server_in_thread, write_model

ROOT = Path(__file__).resolve().parents[2]
STREAM_LIMIT = 4  # the server's grpc_stream_max_in_flight: the stream test sends many more
rng = np.random.default_rng(14)


@dataclasses.dataclass
class Node:
    http: str  # host:port, as tritonclient takes it
    grpc: str
    token: str
    gates: Gates
    server: Server


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One server for the module, with lenet and vecadd1k loaded at start and ``gate``
    (INT64, holds a sample while its key is closed) in a repository."""
    base = tmp_path_factory.mktemp("triton")
    write_model(base / "repo", "gate", "gate")
    config = quiet_config(base / "data", cache_dir=base / "cache", repository=base / "repo",
                          load=("lenet", "vecadd1k"),
                          grpc_stream_max_in_flight=STREAM_LIMIT).replaced(http_port=0, grpc_port=0)
    with server_in_thread(config, "triton-compat-server") as server:
        yield Node(f"127.0.0.1:{server.ports['http_port']}", f"127.0.0.1:{server.ports['grpc_port']}",
                   (base / "data" / "token").read_text().strip(), Gates(base / "cache"), server)


@pytest.fixture(scope="module")
def http(node: Node) -> Iterator[thttp.InferenceServerClient]:
    c = thttp.InferenceServerClient(node.http)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc(node: Node) -> Iterator[tgrpc.InferenceServerClient]:
    c = tgrpc.InferenceServerClient(node.grpc)
    yield c
    c.close()


# -- what every datatype the zoo uses looks like on the wire --------------------------------

def samples(model: str, n: int) -> dict[str, np.ndarray]:
    """``n`` samples of each input of ``model``."""
    if model == "lenet":  # UINT8 in, FP32 out
        return {"image": rng.integers(0, 255, (n, 1, 28, 28), dtype=np.uint8)}
    if model == "vecadd1k":  # FP32
        return {"a": rng.standard_normal((n, 1024)).astype(np.float32),
                "b": rng.standard_normal((n, 1024)).astype(np.float32)}
    if model == "distilbert":  # INT32 in
        return {"input_ids": rng.integers(0, 1000, (n, 128), dtype=np.int32),
                "attention_mask": np.ones((n, 128), np.int32)}
    assert model == "gate"  # INT64
    return {"key": np.arange(1000, 1000 + n, dtype=np.int64).reshape(n, 1)}


OUTPUT = {"lenet": "logits", "vecadd1k": "sum", "distilbert": "logits", "gate": "key"}
DATATYPE = {np.dtype(np.uint8): "UINT8", np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32",
            np.dtype(np.int64): "INT64"}


def inputs_for(module: Any, arrays: dict[str, np.ndarray], binary: bool = True) -> list[Any]:
    out = []
    for name, arr in arrays.items():
        t = module.InferInput(name, list(arr.shape), DATATYPE[arr.dtype])
        if module in (thttp, thttp_aio):
            t.set_data_from_numpy(arr, binary_data=binary)
        else:
            t.set_data_from_numpy(arr)
        out.append(t)
    return out


def check_answer(model: str, arrays: dict[str, np.ndarray], out: np.ndarray) -> None:
    n = next(iter(arrays.values())).shape[0]
    assert out.shape[0] == n
    if model == "vecadd1k":
        np.testing.assert_allclose(out, arrays["a"] + arrays["b"], rtol=1e-6)
    elif model == "gate":
        np.testing.assert_array_equal(out, arrays["key"])
    else:
        assert out.dtype == np.float32 and np.isfinite(out).all()


# -- metadata, configuration, readiness, repository index -----------------------------------

def test_http_metadata_config_readiness_and_index(http: thttp.InferenceServerClient) -> None:
    assert http.is_server_live() and http.is_server_ready()
    assert http.is_model_ready("lenet")
    assert "model_configuration" in http.get_server_metadata()["extensions"]
    meta = http.get_model_metadata("lenet")
    assert meta["inputs"] == [{"name": "image", "datatype": "UINT8", "shape": [-1, 1, 28, 28]}]
    config = http.get_model_config("lenet")
    assert config["name"] == "lenet" and config["backend"] == "pytorch" and config["platform"] == "pytorch_libtorch"
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "image", "data_type": "TYPE_UINT8", "dims": [1, 28, 28]}]
    assert config["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]
    assert config["instance_group"] == [{"name": "lenet", "count": 1, "kind": "KIND_CPU"}]
    assert config["dynamic_batching"] == {}  # work-conserving: Triton's batcher with no delay
    assert config["parameters"]["batching"] == {"string_value": "work_conserving"}
    assert config["parameters"]["residency"] == {"string_value": "ready"}
    assert http.get_model_config("vecadd1k", "1")["input"][1] == {"name": "b", "data_type": "TYPE_FP32",
                                                                   "dims": [1024]}
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["lenet"]["state"] == "READY" and index["lenet"]["version"] == "1"
    assert {"gate", "distilbert", "vecadd1k"} <= set(index)


def test_grpc_metadata_config_readiness_and_index(grpc: tgrpc.InferenceServerClient,
                                                   http: thttp.InferenceServerClient) -> None:
    assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready("vecadd1k")
    assert grpc.get_model_metadata("gate").inputs[0].datatype == "INT64"
    config = grpc.get_model_config("gate").config
    assert config.input[0].data_type == tgrpc.model_config_pb2.TYPE_INT64 and list(config.input[0].dims) == [1]
    assert config.instance_group[0].kind == tgrpc.model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert config.parameters["default_class"].string_value == "be"
    # the same configuration over both protocols
    as_json = grpc.get_model_config("lenet", as_json=True)["config"]
    http_config = http.get_model_config("lenet")
    assert as_json["input"][0]["data_type"] == "TYPE_UINT8" and as_json["max_batch_size"] == 32
    assert [int(d) for d in as_json["input"][0]["dims"]] == http_config["input"][0]["dims"]
    assert as_json["parameters"] == http_config["parameters"]
    index = {m.name: m for m in grpc.get_model_repository_index().models}
    assert index["vecadd1k"].state == "READY"


# -- inference in every datatype the zoo uses, batches of several samples -----------------

@pytest.mark.parametrize("model", ["lenet", "vecadd1k", "distilbert", "gate"])
def test_http_and_grpc_inference_agree(model: str, http: thttp.InferenceServerClient,
                                       grpc: tgrpc.InferenceServerClient) -> None:
    arrays = samples(model, 3)
    by_http = http.infer(model, inputs_for(thttp, arrays), outputs=[thttp.InferRequestedOutput(OUTPUT[model])])
    by_json = http.infer(model, inputs_for(thttp, arrays, binary=False))
    by_grpc = grpc.infer(model, inputs_for(tgrpc, arrays), request_id="call-1")
    assert by_grpc.get_response().id == "call-1"
    out = by_http.as_numpy(OUTPUT[model])
    check_answer(model, arrays, out)
    np.testing.assert_allclose(by_json.as_numpy(OUTPUT[model]), out, rtol=1e-5)
    np.testing.assert_allclose(by_grpc.as_numpy(OUTPUT[model]), out, rtol=1e-5)


def test_async_clients(node: Node) -> None:
    async def scenario() -> None:
        arrays = samples("vecadd1k", 2)
        hc = thttp_aio.InferenceServerClient(node.http)
        gc = tgrpc_aio.InferenceServerClient(node.grpc)
        try:
            assert await hc.is_model_ready("vecadd1k") and await gc.is_model_ready("vecadd1k")
            assert (await hc.get_model_config("vecadd1k"))["max_batch_size"] == 32
            assert (await gc.get_model_config("vecadd1k")).config.name == "vecadd1k"
            answers = await asyncio.gather(*(hc.infer("vecadd1k", inputs_for(thttp_aio, arrays)) for _ in range(3)),
                                           *(gc.infer("vecadd1k", inputs_for(tgrpc_aio, arrays)) for _ in range(3)))
            for r in answers:
                check_answer("vecadd1k", arrays, r.as_numpy("sum"))
        finally:
            await hc.close()
            await gc.close()

    asyncio.run(scenario())


# -- errors, each with its status -------------------------------------------------------------

def _error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


def test_errors_carry_their_status(http: thttp.InferenceServerClient, grpc: tgrpc.InferenceServerClient) -> None:
    good = samples("lenet", 1)["image"]
    wrong_shape = {"image": good.reshape(1, 28, 28)}
    wrong_type = {"image": good.astype(np.float32)}
    for client, module, codes in ((http, thttp, ("404", "400")),
                                  (grpc, tgrpc, ("StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT"))):
        e = _error(lambda: client.infer("nope", inputs_for(module, {"image": good})))
        assert e.status() == codes[0] and "unknown model 'nope'" in e.message()
        e = _error(lambda: client.infer("lenet", inputs_for(module, wrong_shape)))
        assert e.status() == codes[1] and "shape" in e.message()
        e = _error(lambda: client.infer("lenet", inputs_for(module, wrong_type)))
        assert e.status() == codes[1] and "UINT8" in e.message()
        assert _error(lambda: client.get_model_config("nope")).status() == codes[0]
    assert not http.is_model_ready("lenet", "7")


# -- gRPC streaming ------------------------------------------------------------------------------

def test_stream_many_in_flight_out_of_order_and_an_error_that_does_not_close_it(
        node: Node, grpc: tgrpc.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    held = {"key": np.array([[7]], np.int64)}
    node.gates.close(7)
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        grpc.async_stream_infer("gate", inputs_for(tgrpc, held), request_id="held")
        sent = {}
        for i in range(4 * STREAM_LIMIT):  # far more than the stream's in-flight limit
            arrays = samples("vecadd1k", 1 + i % 3)
            sent[f"v{i}"] = arrays
            grpc.async_stream_infer("vecadd1k", inputs_for(tgrpc, arrays), request_id=f"v{i}")
            if i == STREAM_LIMIT:
                grpc.async_stream_infer("nope", inputs_for(tgrpc, arrays), request_id="bad")
        errors, seen = [], set()
        while len(seen) < len(sent) or not errors:  # everything but the held call is answered
            result, error = answers.get(timeout=120)
            if error is not None:
                errors.append(error)
                continue
            call_id = result.get_response().id
            assert call_id in sent and call_id not in seen
            seen.add(call_id)
            check_answer("vecadd1k", sent[call_id], result.as_numpy("sum"))
        assert len(errors) == 1 and "unknown model 'nope'" in errors[0].message()
        node.gates.open(7)
        result, error = answers.get(timeout=120)
        assert error is None and result.get_response().id == "held"
        np.testing.assert_array_equal(result.as_numpy("key"), held["key"])
    finally:
        node.gates.open_all()
        grpc.stop_stream()
    assert answers.empty()  # exactly one answer per request


def test_async_stream(node: Node) -> None:
    async def scenario() -> list[str]:
        c = tgrpc_aio.InferenceServerClient(node.grpc)

        async def requests() -> Any:
            for i in range(6):
                yield {"model_name": "lenet", "inputs": inputs_for(tgrpc_aio, samples("lenet", 1)),
                       "request_id": f"a{i}"}

        try:
            ids = []
            async for result, error in c.stream_infer(requests()):
                assert error is None
                ids.append(result.get_response().id)
                if len(ids) == 6:
                    break
            return ids
        finally:
            await c.close()

    assert sorted(asyncio.run(scenario())) == [f"a{i}" for i in range(6)]


# -- system shared memory ------------------------------------------------------------------------

@pytest.fixture
def regions(http: thttp.InferenceServerClient) -> Iterator[Any]:
    """``make(name, byte_size)`` creates a POSIX shared-memory object (key ``/<name>-<pid>``)
    and registers it with the server under ``name``; every one is unregistered and destroyed after."""
    made = []

    def make(name: str, byte_size: int, register: bool = True) -> Any:
        key = f"/splitserve-test-{name}-{os.getpid()}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        if register:
            http.register_system_shared_memory(name, key, byte_size)
        return handle

    yield make
    http.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("module", [thttp, tgrpc], ids=["http", "grpc"])
def test_shared_memory_inference_equals_the_normal_path(module: Any, regions: Any, http: thttp.InferenceServerClient,
                                                        grpc: tgrpc.InferenceServerClient) -> None:
    client = http if module is thttp else grpc
    arrays = samples("vecadd1k", 3)
    a, b = arrays["a"], arrays["b"]
    inp = regions("in", a.nbytes + b.nbytes + 64)  # b lies at an offset
    out = regions("out", a.nbytes)
    shm.set_shared_memory_region(inp, [a])
    shm.set_shared_memory_region(inp, [b], offset=a.nbytes)
    inputs = [module.InferInput("a", list(a.shape), "FP32"), module.InferInput("b", list(b.shape), "FP32")]
    inputs[0].set_shared_memory("in", a.nbytes)
    inputs[1].set_shared_memory("in", b.nbytes, offset=a.nbytes)
    wanted = module.InferRequestedOutput("sum")
    wanted.set_shared_memory("out", a.nbytes)
    result = client.infer("vecadd1k", inputs, outputs=[wanted])
    if module is thttp:  # the answer carries no data: it is in the region
        assert result.get_output("sum")["parameters"]["shared_memory_region"] == "out"
        assert "data" not in result.get_output("sum") and result.get_response().get("parameters") is not None
    else:
        assert result.get_output("sum").parameters["shared_memory_region"].string_param == "out"
        assert not result.get_response().raw_output_contents
    normal = client.infer("vecadd1k", inputs_for(module, arrays)).as_numpy("sum")
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [3, 1024]), normal)
    # the input may be in shared memory and the output on the wire, too
    inputs[0].set_shared_memory("in", a.nbytes)
    np.testing.assert_array_equal(client.infer("vecadd1k", inputs).as_numpy("sum"), normal)
    listed = client.get_system_shared_memory_status()
    if module is tgrpc:
        listed = [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                  for r in listed.regions.values()]
    assert sorted((r["name"], int(r["byte_size"])) for r in listed) == [("in", a.nbytes + b.nbytes + 64),
                                                                       ("out", a.nbytes)]
    client.unregister_system_shared_memory()
    assert len(http.get_system_shared_memory_status()) == 0 and not grpc.get_system_shared_memory_status().regions


def test_shared_memory_errors(regions: Any, http: thttp.InferenceServerClient,
                              grpc: tgrpc.InferenceServerClient) -> None:
    image = samples("lenet", 1)["image"]
    handle = regions("img", image.nbytes)
    shm.set_shared_memory_region(handle, [image])
    cases = [("img", image.nbytes, 1, "runs past the end of region 'img'"),  # offset out of bounds
             ("img", image.nbytes - 1, 0, "shared_memory_byte_size 783"),  # not the tensor's bytes
             ("nope", image.nbytes, 0, "no system shared-memory region 'nope'")]
    for client, module, code in ((http, thttp, "400"), (grpc, tgrpc, "StatusCode.INVALID_ARGUMENT")):
        for region, size, offset, message in cases:
            t = module.InferInput("image", list(image.shape), "UINT8")
            t.set_shared_memory(region, size, offset=offset)
            e = _error(lambda: client.infer("lenet", [t]))
            assert e.status() == code and message in e.message(), e.message()
    for client, code in ((http, "404"), (grpc, "StatusCode.NOT_FOUND")):
        e = _error(lambda: client.get_system_shared_memory_status("nope"))
        assert e.status() == code and "no system shared-memory region 'nope'" in e.message()
        e = _error(lambda: client.get_cuda_shared_memory_status("nope"))
        assert e.status() == code and "Unable to find cuda shared memory region: 'nope'" in e.message()
    e = _error(lambda: http.register_system_shared_memory("evil", "/../etc/passwd", 8))
    assert e.status() == "400" and "'..'" in e.message()
    key = f"/splitserve-test-small-{os.getpid()}"
    small = shm.create_shared_memory_region("small", key, 16)
    try:
        e = _error(lambda: grpc.register_system_shared_memory("small", key, 32))
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and "runs past the end" in e.message()
    finally:
        shm.destroy_shared_memory_region(small)


def test_unregistering_a_region_in_use_keeps_the_call_safe(node: Node, regions: Any,
                                                           grpc: tgrpc.InferenceServerClient) -> None:
    key = np.array([[11]], np.int64)
    inp, out = regions("held-in", key.nbytes), regions("held-out", key.nbytes)
    shm.set_shared_memory_region(inp, [key])
    t = tgrpc.InferInput("key", [1, 1], "INT64")
    t.set_shared_memory("held-in", key.nbytes)
    wanted = tgrpc.InferRequestedOutput("key")
    wanted.set_shared_memory("held-out", key.nbytes)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    node.gates.close(11)
    try:
        grpc.async_infer("gate", [t], lambda result, error: answers.put((result, error)), outputs=[wanted])
        end = time.monotonic() + 120
        while not node.gates.held(11):  # then the call is past decoding, holding views of both regions
            assert time.monotonic() < end, "the gate never held the call"
            time.sleep(0.01)
        grpc.unregister_system_shared_memory()
        assert not grpc.get_system_shared_memory_status().regions
    finally:
        node.gates.open_all()
    result, error = answers.get(timeout=120)
    assert error is None, error
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int64, [1, 1]), key)


# -- CUDA shared memory (the device behind its seam: tests/fake_cuda_ipc.py; tests/gpu has a real one) --

@pytest.fixture
def device(node: Node) -> Iterator[FakeCudaIpc]:
    cuda = node.server.shm.cuda
    real, cuda.ipc = cuda.ipc, FakeCudaIpc()
    yield cuda.ipc
    cuda.unregister()
    cuda.ipc = real


@pytest.mark.parametrize("module", [thttp, tgrpc], ids=["http", "grpc"])
def test_cuda_shared_memory_inference_equals_the_normal_path(module: Any, device: FakeCudaIpc,
                                                             http: thttp.InferenceServerClient,
                                                             grpc: tgrpc.InferenceServerClient) -> None:
    client = http if module is thttp else grpc
    arrays = samples("vecadd1k", 2)
    a, b = arrays["a"], arrays["b"]
    inp, out = device.export(a.nbytes + b.nbytes), device.export(a.nbytes)
    device.memory[inp][:] = a.tobytes() + b.tobytes()
    client.register_cuda_shared_memory("cin", base64.b64encode(inp).decode(), 0, a.nbytes + b.nbytes)
    client.register_cuda_shared_memory("cout", base64.b64encode(out).decode(), 0, a.nbytes)
    inputs = [module.InferInput("a", list(a.shape), "FP32"), module.InferInput("b", list(b.shape), "FP32")]
    inputs[0].set_shared_memory("cin", a.nbytes)
    inputs[1].set_shared_memory("cin", b.nbytes, offset=a.nbytes)
    wanted = module.InferRequestedOutput("sum")
    wanted.set_shared_memory("cout", a.nbytes)
    client.infer("vecadd1k", inputs, outputs=[wanted])
    normal = client.infer("vecadd1k", inputs_for(module, arrays)).as_numpy("sum")
    np.testing.assert_array_equal(np.frombuffer(device.memory[out], np.float32).reshape(normal.shape), normal)
    listed = client.get_cuda_shared_memory_status()
    if module is tgrpc:
        listed = [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
                  for r in listed.regions.values()]
    assert sorted((r["name"], int(r["device_id"]), int(r["byte_size"])) for r in listed) == [
        ("cin", 0, a.nbytes + b.nbytes), ("cout", 0, a.nbytes)]
    inputs[1].set_shared_memory("cin", b.nbytes, offset=a.nbytes + 4)  # past the region's end
    e = _error(lambda: client.infer("vecadd1k", inputs))
    assert e.status() in ("400", "StatusCode.INVALID_ARGUMENT") and "Invalid offset" in e.message(), e.message()
    e = _error(lambda: client.register_cuda_shared_memory("bad", base64.b64encode(bytes(64)).decode(), 0, 8))
    assert e.status() in ("404", "StatusCode.NOT_FOUND") and "failed to open CUDA IPC handle" in e.message()
    client.unregister_cuda_shared_memory("cin")
    client.unregister_cuda_shared_memory()
    assert len(http.get_cuda_shared_memory_status()) == 0 and not device.opened


# -- management with the token ----------------------------------------------------------------------

def test_load_and_unload_with_the_token(node: Node, http: thttp.InferenceServerClient,
                                        grpc: tgrpc.InferenceServerClient) -> None:
    auth = {"authorization": f"Bearer {node.token}"}
    assert _error(lambda: grpc.load_model("matmul8k")).status() == "StatusCode.UNAUTHENTICATED"
    assert _error(lambda: http.unload_model("matmul8k")).status() == "401"
    grpc.load_model("matmul8k", headers=auth)
    assert http.is_model_ready("matmul8k") and grpc.is_model_ready("matmul8k")
    http.unload_model("matmul8k", headers=auth)
    assert not grpc.is_model_ready("matmul8k")
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["matmul8k"]["state"] == "UNAVAILABLE"
    http.load_model("matmul8k", headers=auth)
    assert grpc.is_model_ready("matmul8k")
    grpc.unload_model("matmul8k", headers=auth)
    assert not http.is_model_ready("matmul8k")


# -- kserve's v2 clients (a child process: kserve and tritonclient.grpc cannot share one) -------

KSERVE = textwrap.dedent("""
    import asyncio, json, sys
    import numpy as np
    import splitserve.server.grpc_server  # splitserve's gRPC protocol next to kserve's
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

    http, grpc = sys.argv[1], sys.argv[2]
    a = np.arange(2048, dtype=np.float32).reshape(2, 1024)

    def request():
        inputs = [InferInput("a", [2, 1024], "FP32"), InferInput("b", [2, 1024], "FP32")]
        for t in inputs:
            t.set_data_from_numpy(a)
        return InferRequest(model_name="vecadd1k", infer_inputs=inputs, request_id="k1")

    async def main():
        rest = InferenceRESTClient(RESTConfig(protocol="v2"))
        base = f"http://{http}"
        out = {"rest_ready": await rest.is_server_ready(base),
               "rest_model_ready": await rest.is_model_ready(base, "vecadd1k")}
        r = await rest.infer(base, request(), model_name="vecadd1k")
        out["rest_sum"] = r.outputs[0].as_numpy().tolist() == (2 * a).tolist()
        await rest.close()
        g = InferenceGRPCClient(grpc)
        out["grpc_ready"] = await g.is_server_ready()
        out["grpc_model_ready"] = await g.is_model_ready("vecadd1k")
        r = await g.infer(request())
        out["grpc_sum"] = r.outputs[0].as_numpy().tolist() == (2 * a).tolist()
        out["grpc_id"] = r.id
        try:
            await g.is_model_ready("nope")
        except Exception as e:
            out["grpc_unknown"] = str(getattr(e, "code", lambda: e)())
        await g.close()
        print(json.dumps(out))

    asyncio.run(main())
""")


def test_kserve_clients(node: Node) -> None:
    r = subprocess.run([sys.executable, "-c", KSERVE, node.http, node.grpc], cwd=ROOT, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"rest_ready": True, "rest_model_ready": True, "rest_sum": True, "grpc_ready": True,
                   "grpc_model_ready": True, "grpc_sum": True, "grpc_id": "k1",
                   "grpc_unknown": "StatusCode.NOT_FOUND"}


# -- one environment ------------------------------------------------------------------------------------

def test_a_fresh_install_of_splitserve_and_tritonclient_resolves(tmp_path: Path) -> None:
    """pip's resolver, as a fresh ``pip install splitserve tritonclient[all]`` runs it: with
    splitserve's own requirements (read from pyproject.toml, which saves building it)."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), *requires, "tritonclient[all]"],
                       capture_output=True, text=True, timeout=480)
    if r.returncode != 0 and ("Could not fetch" in r.stderr or "NewConnectionError" in r.stderr):
        pytest.skip(f"no package index reachable: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "tritonclient" in chosen and "grpcio" in chosen
    assert int(chosen["protobuf"].split(".")[0]) < 7  # what tritonclient[all] needs, and splitserve accepts


def test_splitserve_tritonclient_and_kserve_import_next_to_each_other() -> None:
    """Each of tritonclient.grpc and kserve in one process with splitserve's gRPC server and
    client (the old generated stubs failed here with "duplicate file name")."""
    check = textwrap.dedent("""
        import sys, importlib
        importlib.import_module(sys.argv[1])
        import splitserve.server.grpc_server, splitserve.client.grpc
        from splitserve.protocol import grpc_api
        assert grpc_api.ModelInferRequest.FromString(grpc_api.ModelInferRequest(id="x").SerializeToString()).id == "x"
    """)
    for other in ("tritonclient.grpc", "kserve"):
        r = subprocess.run([sys.executable, "-W", "error::Warning", "-c", check, other], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{other}: {r.stderr[-2000:]}"
