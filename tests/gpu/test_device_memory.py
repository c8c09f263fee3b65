"""Device memory on a real GPU: a load measures what it holds (the allocator's reserved
growth: weights, a warm-up batch, graph pools), and an unload gives it back to the GPU, as
NVML sees it (``empty_cache``), so the memory manager's device budget is honest. Skipped
without CUDA."""

from __future__ import annotations

import pynvml
import pytest
import torch

from splitserve.modelconfig import ModelConfig
from tests.inproc import inproc_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _nvml_used() -> int:
    """Bytes NVML says are used on this process's first visible GPU (a MIG device's own when MIG is on)."""
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def test_a_load_measures_its_device_bytes_and_an_unload_returns_them_to_the_gpu(tmp_path):
    pynvml.nvmlInit()
    try:
        torch.empty(1, device="cuda")  # the CUDA context exists before the baseline: it is the worker's
        torch.cuda.synchronize()
        used0, reserved0 = _nvml_used(), torch.cuda.memory_reserved(0)
        cfg = ModelConfig.from_dict({"name": "resnet50", "device": "cuda", "max_batch_size": 8, "cuda_graphs": "off",
                                     "artifact": {"kind": "zoo", "arch": "resnet50"}})
        with inproc_worker(cfg, tmp_path, measure=True) as (w, _flag, _ins, _outs):
            b = w.bound
            assert b is not None and b.device_bytes is not None
            assert b.device_bytes >= b.nbytes  # its own copy of the weights at least
            assert 0 <= b.device_slack_bytes < b.device_bytes
            used1 = _nvml_used()
            # NVML sees what the allocator reserved (kernels loaded lazily come on top)
            assert used1 - used0 >= 0.9 * b.device_bytes
            measured = b.device_bytes
        assert torch.cuda.memory_reserved(0) <= reserved0  # empty_cache returned the cached blocks
        assert used1 - _nvml_used() >= 0.9 * measured, "an unload must give its device memory back"
    finally:
        pynvml.nvmlShutdown()
