"""CUDA shared memory on a real GPU: this process is the client (a handle cannot be opened
in the process that exported it), allocating with ``cudaMalloc`` and exporting with
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


class DeviceBuffer:
    """A client's own ``cudaMalloc`` allocation (not torch's caching allocator, whose tensors
    lie at offsets inside larger allocations, which an IPC handle does not carry)."""

    def __init__(self, nbytes: int) -> None:
        torch.cuda.init()  # torch loads the runtime library and makes the context
        self.rt = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
        self.ptr, self.nbytes = ctypes.c_void_p(), nbytes
        assert self.rt.cudaMalloc(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes)) == 0

    def handle(self) -> str:
        """The base64 CUDA IPC handle, as tritonclient's ``get_raw_handle`` gives it."""
        raw = ctypes.create_string_buffer(64)
        assert self.rt.cudaIpcGetMemHandle(raw, self.ptr) == 0
        return base64.b64encode(raw.raw).decode()

    def write(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        assert self.rt.cudaMemcpy(self.ptr, ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes), 1) == 0

    def read(self, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, dtype)
        assert self.rt.cudaMemcpy(ctypes.c_void_p(out.ctypes.data), self.ptr, ctypes.c_size_t(out.nbytes), 2) == 0
        return out

    def free(self) -> None:
        assert self.rt.cudaFree(self.ptr) == 0


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
    dev_in, dev_out = DeviceBuffer(x.nbytes), DeviceBuffer(want.nbytes)
    dev_in.write(x)
    client.register_cuda_shared_memory(f"{model}-in", dev_in.handle(), 0, x.nbytes)
    client.register_cuda_shared_memory(f"{model}-out", dev_out.handle(), 0, want.nbytes)
    try:
        t = module.InferInput(name, list(x.shape), datatype)
        t.set_shared_memory(f"{model}-in", x.nbytes)
        o = module.InferRequestedOutput(out)
        o.set_shared_memory(f"{model}-out", want.nbytes)
        client.infer(model, [t], outputs=[o])
        np.testing.assert_allclose(dev_out.read(np.float32, want.shape), want, rtol=1e-5, atol=1e-5)
        assert {r["name"] for r in plain_client.get_cuda_shared_memory_status()} == {f"{model}-in", f"{model}-out"}
    finally:
        client.unregister_cuda_shared_memory()
        dev_in.free()
        dev_out.free()
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
