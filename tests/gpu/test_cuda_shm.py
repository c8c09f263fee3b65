"""CUDA shared memory on a real GPU: this process is the client (a handle cannot be opened
in the process that exported it), allocating with torch and exporting with
``cudaIpcGetMemHandle``; the server is a child process. lenet and resnet50 take their
inputs from, and write their outputs to, the client's device memory over HTTP and gRPC,
and answer as the plain HTTP path does. tritonclient's own CUDA utilities are used too
where ``cuda-python`` is installed. Skipped without CUDA."""

from __future__ import annotations

import base64
import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODELS = {"lenet": ("image", "UINT8", (1, 28, 28), "logits"), "resnet50": ("input", "FP32", (3, 32, 32), "logits")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.helpers import start_server

    s = start_server(tmp_path_factory.mktemp("cudashm"), "--load", "lenet", "--load", "resnet50",
                     http=True, grpc=True, timeout=300)
    yield s
    assert s.stop() == 0


def _export(t: torch.Tensor) -> str:
    """The base64 CUDA IPC handle of ``t``'s allocation (``t`` must start it: offset 0)."""
    rt = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    handle = ctypes.create_string_buffer(64)
    assert rt.cudaIpcGetMemHandle(handle, ctypes.c_void_p(t.data_ptr())) == 0
    return base64.b64encode(handle.raw).decode()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("front", ["http", "grpc"])
def test_inputs_and_outputs_in_device_memory_answer_as_plain_http(server: Any, model: str, front: str) -> None:
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    name, datatype, shape, out = MODELS[model]
    rng = np.random.default_rng(3)
    dtype = np.uint8 if datatype == "UINT8" else np.float32
    x = (rng.integers(0, 255, (2, *shape)) if dtype == np.uint8 else rng.standard_normal((2, *shape))).astype(dtype)
    plain_client = thttp.InferenceServerClient(server.http.removeprefix("http://"))
    plain = thttp.InferInput(name, list(x.shape), datatype)
    plain.set_data_from_numpy(x)
    want = plain_client.infer(model, [plain]).as_numpy(out)
    module = thttp if front == "http" else tgrpc
    client = plain_client if front == "http" else tgrpc.InferenceServerClient(server.grpc.removeprefix("grpc://"))
    dev_in = torch.from_numpy(x).cuda()
    dev_out = torch.zeros(want.shape, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    client.register_cuda_shared_memory(f"{model}-in", _export(dev_in), 0, x.nbytes)
    client.register_cuda_shared_memory(f"{model}-out", _export(dev_out), 0, want.nbytes)
    try:
        t = module.InferInput(name, list(x.shape), datatype)
        t.set_shared_memory(f"{model}-in", x.nbytes)
        o = module.InferRequestedOutput(out)
        o.set_shared_memory(f"{model}-out", want.nbytes)
        client.infer(model, [t], outputs=[o])
        np.testing.assert_allclose(dev_out.cpu().numpy(), want, rtol=1e-5, atol=1e-5)
        assert {r["name"] for r in plain_client.get_cuda_shared_memory_status()} == {f"{model}-in", f"{model}-out"}
    finally:
        client.unregister_cuda_shared_memory()
    assert not plain_client.get_cuda_shared_memory_status()


def test_tritonclient_cuda_shared_memory_utilities(server: Any) -> None:
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory", reason="needs cuda-python")
    import tritonclient.http as thttp

    client = thttp.InferenceServerClient(server.http.removeprefix("http://"))
    x = np.random.default_rng(4).integers(0, 255, (1, 1, 28, 28)).astype(np.uint8)
    plain = thttp.InferInput("image", list(x.shape), "UINT8")
    plain.set_data_from_numpy(x)
    want = client.infer("lenet", [plain]).as_numpy("logits")
    region_in = cudashm.create_shared_memory_region("tc-in", x.nbytes, 0)
    region_out = cudashm.create_shared_memory_region("tc-out", want.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(region_in, [x])
        for region, size in ((region_in, x.nbytes), (region_out, want.nbytes)):
            raw = cudashm.get_raw_handle(region)
            client.register_cuda_shared_memory(region._triton_shm_name, raw.decode() if isinstance(raw, bytes) else raw,
                                               0, size)
        t = thttp.InferInput("image", list(x.shape), "UINT8")
        t.set_shared_memory("tc-in", x.nbytes)
        o = thttp.InferRequestedOutput("logits")
        o.set_shared_memory("tc-out", want.nbytes)
        client.infer("lenet", [t], outputs=[o])
        np.testing.assert_allclose(cudashm.get_contents_as_numpy(region_out, np.float32, list(want.shape)), want,
                                   rtol=1e-5, atol=1e-5)
    finally:
        client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(region_in)
        cudashm.destroy_shared_memory_region(region_out)
