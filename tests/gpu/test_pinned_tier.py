"""The pinned host tier on a real GPU. In the worker: PARK keeps the binding with its weights
only in page-locked host memory, and the device memory they held goes back to the GPU (the
allocator's reserved bytes and NVML's used bytes fall); RELOAD then the next batch copies
them back segment by segment while it runs, answers as before the park, and after its
answer the host copy goes and the CUDA graphs are captured again. In a server: the model
the memory manager evicts parks, and the next call reloads it in the same worker process.
Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pynvml
import pytest
import torch

from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.worker.messages import Msg, RunMsg
from tests.gpu.test_device_memory import _nvml_used
from tests.inproc import inproc_worker
from tests.pinned_story import assert_parked_then_reloaded_in_place, park_and_reload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCH = 4


@pytest.mark.parametrize("arch", ["lenet", "resnet50"])
def test_park_returns_the_device_memory_and_the_reload_batch_answers_as_before(tmp_path, arch):
    pynvml.nvmlInit()
    try:
        cfg = ModelConfig.from_dict({"name": arch, "device": "cuda", "max_batch_size": 8,
                                     "artifact": {"kind": "zoo", "arch": arch}})
        with inproc_worker(cfg, tmp_path) as (w, _flag, ins, outs):
            b = w.bound
            assert b is not None and b.gpu is not None
            spec, out_spec = cfg.inputs[0], cfg.outputs[0]
            rng = np.random.default_rng(0)
            x = (rng.integers(0, 256, (BATCH, *spec.shape), dtype=np.uint8) if spec.dtype == np.uint8
                 else rng.standard_normal((BATCH, *spec.shape)).astype(spec.dtype))
            ins[0].array(0, BATCH, spec.dtype, spec.shape)[:] = x

            def answer(batch_id: int) -> np.ndarray:
                out = outs[0].array(0, BATCH, out_spec.dtype, out_spec.shape)
                out[:] = 0
                assert w.run(RunMsg(int(RequestClass.BE), batch_id, 0, BATCH)).kind == Msg.DONE
                return out.copy()

            want = answer(1)
            graphs = sorted(b.gpu.graphs)
            torch.cuda.synchronize()
            reserved0, used0 = torch.cuda.memory_reserved(0), _nvml_used()
            parked = w.park()
            assert parked.binding == b.ident and parked.parked_bytes == b.nbytes
            assert b.parked is not None and all(h.is_pinned() for seg in b.parked.segments for _, h in seg)
            assert not b.gpu.graphs  # they read the weights' old addresses
            # the weights' device bytes (and the graph pools) went back to the driver
            assert reserved0 - torch.cuda.memory_reserved(0) >= 0.9 * b.nbytes
            assert used0 - _nvml_used() >= 0.9 * b.nbytes, "a park must give the device memory back"
            w.reload()
            got = answer(2)  # the batch that copies the weights back as it runs
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            assert b.reloaded
            b.settle()  # what the worker's loop does after the answer
            assert b.parked is None and sorted(b.gpu.graphs) == graphs
            np.testing.assert_allclose(answer(3), want, rtol=1e-4, atol=1e-5)
    finally:
        pynvml.nvmlShutdown()


def test_a_server_parks_the_model_it_evicts_and_the_next_call_reloads_it_in_the_same_worker(tmp_path):
    # two small GPU models, one resident at a time
    story = park_and_reload(tmp_path, 'device = "cuda"\nmax_batch_size = 4', calls=1)
    assert_parked_then_reloaded_in_place(story, rtol=1e-4, atol=1e-5)
