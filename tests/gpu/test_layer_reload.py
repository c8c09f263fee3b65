"""The pipelined reload on CUDA streams: resnet50's weights page-locked, freed from the
device (the allocator's bytes fall by them), then brought back layer by layer while the
first batch runs; the answer is the one before. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from splitserve.models.zoo import build_zoo_model
from splitserve.worker.layer_reload import CudaLanes, drop_device, pin_weights, reload_and_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_pipelined_reload_from_pinned_memory_answers_as_before() -> None:
    model = build_zoo_model("resnet50").cuda()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        want = model(x)[0]
        weights = pin_weights(model, lambda t: t.pin_memory())
        assert all(h.is_pinned() for seg in weights.segments for _, h in seg)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        drop_device(weights)
        assert before - torch.cuda.memory_allocated() >= 0.99 * weights.nbytes
        compute = torch.cuda.Stream()
        compute.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
        got = reload_and_run(model, weights, CudaLanes(torch.device("cuda"), compute), (x,))[0]
        compute.synchronize()
    torch.testing.assert_close(got, want)
    assert torch.cuda.memory_allocated() >= before - x.numel() * 4
