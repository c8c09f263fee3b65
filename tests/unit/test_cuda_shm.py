"""The CUDA shared-memory registry without a GPU: a fake CUDA IPC behind the seam stands in
for the runtime (tests/fake_cuda_ipc.py). Registration, its errors, the one namespace with
system regions, reads and writes of a call's tensors, and a region unregistered while a
call holds it."""

from __future__ import annotations

import base64
import gc
from pathlib import Path

import numpy as np
import pytest

from splitserve.errors import InvalidInput, NotFound, Refused
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.v2 import ShmRef
from splitserve.server.cuda_shm import CudaSharedMemory, CudartIpc, decode_handle, ipc_handle
from splitserve.server.shm import SystemSharedMemory, input_tensor, output_views, write_outputs
from tests.fake_cuda_ipc import FakeCudaIpc

CFG = ModelConfig.from_dict({
    "name": "m", "max_batch_size": 8, "artifact": {"kind": "zoo", "arch": "vecadd1k"},
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
})


@pytest.fixture
def ipc() -> FakeCudaIpc:
    return FakeCudaIpc(devices=2)


@pytest.fixture
def regions(tmp_path: Path, ipc: FakeCudaIpc) -> SystemSharedMemory:
    (tmp_path / "obj").write_bytes(bytes(64))
    return SystemSharedMemory(8, 1 << 20, tmp_path, cuda=CudaSharedMemory(ipc, max_regions=2))


def test_registration_and_its_errors(regions: SystemSharedMemory, ipc: FakeCudaIpc) -> None:
    handle = ipc.export(64)
    with pytest.raises(InvalidInput, match="CUDA IPC handle of 64 bytes, got 5"):
        regions.cuda_register("r", b"short", 0, 64)
    with pytest.raises(NotFound, match="failed to open CUDA IPC"):
        regions.cuda_register("r", bytes(64), 0, 64)
    with pytest.raises(NotFound, match="invalid device ordinal"):
        regions.cuda_register("r", handle, 5, 64)
    for device, size, message in ((-1, 8, "device_id must be a non-negative"), (0, 0, "byte_size must be positive"),
                                  (0, True, "byte_size must be a non-negative")):
        with pytest.raises(InvalidInput, match=message):
            regions.cuda_register("r", handle, device, size)
    with pytest.raises(InvalidInput, match="byte_size 65 runs past the end of the device allocation its handle "
                                           r"names \(64 bytes\)"):
        regions.cuda_register("r", handle, 0, 65)  # copies would run into another allocation
    assert regions.cuda_status() == [] and not ipc.opened
    regions.cuda_register("r", handle, 1, 64)
    [status] = regions.cuda_status("r")
    assert (status.name, status.device_id, status.byte_size) == ("r", 1, 64)
    with pytest.raises(InvalidInput, match="shared memory region 'r' already in manager"):
        regions.cuda_register("r", ipc.export(8), 0, 8)
    with pytest.raises(InvalidInput, match="shared memory region 'r' already in manager"):
        regions.register("r", "/obj", 0, 8)  # one namespace with system regions, as Triton's
    regions.register("sys", "/obj", 0, 8)
    with pytest.raises(InvalidInput, match="shared memory region 'sys' already in manager"):
        regions.cuda_register("sys", ipc.export(8), 0, 8)
    regions.cuda_register("s", ipc.export(8), 0, 8)
    with pytest.raises(Refused, match="cuda shared-memory regions are registered"):
        regions.cuda_register("t", ipc.export(8), 0, 8)
    with pytest.raises(NotFound, match="Unable to find cuda shared memory region: 'q'"):
        regions.cuda_status("q")
    regions.cuda_unregister("never-registered")  # no error, as Triton
    regions.cuda_unregister()
    assert regions.cuda_status() == [] and not ipc.opened and len(ipc.closed) == 3  # the too-short one's too
    assert [r.name for r in regions.status()] == ["sys"]  # the system regions are not touched


def test_handles_come_base64_in_a_json_body() -> None:
    handle = bytes(range(64))
    assert decode_handle("r", {"b64": base64.b64encode(handle).decode()}) == handle
    for bad in (None, "abc", {"b64": 3}, {"b64": "not base64!"}):
        with pytest.raises(InvalidInput, match="region 'r': raw_handle"):
            decode_handle("r", bad)


def test_inputs_are_read_from_and_outputs_written_to_device_memory(regions: SystemSharedMemory,
                                                                     ipc: FakeCudaIpc) -> None:
    handle = ipc.export(64)
    x = np.arange(4, dtype=np.float32)
    ipc.memory[handle][8:24] = x.tobytes()
    regions.cuda_register("io", handle, 0, 48)
    got = input_tensor(regions, "a", "FP32", (1, 4), ShmRef("io", 8, 16))
    np.testing.assert_array_equal(got, x[None])
    writers = output_views(regions, CFG, 1, {"y": ShmRef("io", 32, 16)})
    write_outputs(writers, {"y": got * 2})
    np.testing.assert_array_equal(np.frombuffer(ipc.memory[handle][32:48], np.float32), x * 2)
    with pytest.raises(InvalidInput, match=r"input 'a': Invalid offset \+ byte size for shared memory region: 'io'"):
        regions.view(ShmRef("io", 40, 16), "input 'a'")  # inside the allocation, past the region
    with pytest.raises(InvalidInput, match="output 'y': Invalid offset"):
        output_views(regions, CFG, 1, {"y": ShmRef("io", 40, 16)})
    with pytest.raises(InvalidInput, match="no system shared-memory region 'q'"):
        regions.view(ShmRef("q", 0, 4), "input 'a'")


def test_a_region_unregistered_while_a_call_holds_it_closes_when_the_call_ends(regions: SystemSharedMemory,
                                                                                ipc: FakeCudaIpc) -> None:
    handle = ipc.export(16)
    regions.cuda_register("out", handle, 0, 16)
    writers = output_views(regions, CFG, 1, {"y": ShmRef("out", 0, 16)})
    regions.cuda_unregister("out")
    assert regions.cuda_status() == [] and len(ipc.opened) == 1  # still open: the call writes into it
    write_outputs(writers, {"y": np.full((1, 4), 7, np.float32)})
    assert not ipc.opened and np.frombuffer(ipc.memory[handle], np.float32).tolist() == [7] * 4
    regions.cuda_register("gone", ipc.export(16), 0, 16)
    dropped = output_views(regions, CFG, 1, {"y": ShmRef("gone", 0, 16)})
    regions.cuda_unregister()
    assert len(ipc.opened) == 1
    del dropped  # the call failed before its outputs: the handle closes all the same
    gc.collect()
    assert not ipc.opened


def test_the_real_runtime_on_a_node_without_cuda_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this node has CUDA: tests/gpu/test_cuda_shm.py opens real handles")
    cuda = CudaSharedMemory(CudartIpc(), max_regions=1)
    with pytest.raises(NotFound, match="needs a CUDA device on the server; this node has none"):
        cuda.register("r", bytes(64), 0, 8)
    assert cuda.status() == []


def test_the_handle_reaches_the_runtime_byte_for_byte_zeros_included() -> None:
    raw = bytes([1, 0, 2, 0, *range(56), 0, 0, 7, 9])
    assert bytes(ipc_handle(raw)) == raw
