"""The worker on a CUDA device: pinned tensor queues, segments on a stream with a bounded
number in flight (REEF-N's device-queue capacity), preemption and restore (bit for bit
against the uninterrupted run, eager and replaying CUDA graphs). Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.modelconfig import ModelConfig
from splitserve.models.zoo import build_zoo_model
from splitserve.protocol.header import RequestClass
from splitserve.worker.messages import Msg, RunMsg
from tests.inproc import inproc_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("capacity, graphs", [(1, "off"), (4, "off"), (4, "on")])
def test_cuda_batch_preempted_at_every_segment_matches_an_uninterrupted_run(tmp_path, capacity, graphs):
    cfg = ModelConfig.from_dict({"name": "resnet152", "device": "cuda", "segment_capacity": capacity,
                                 "max_batch_size": 4, "cuda_graphs": graphs,
                                 "artifact": {"kind": "zoo", "arch": "resnet152"}})
    with inproc_worker(cfg, tmp_path, threads=2) as (w, flag, ins, outs):
        x = np.random.default_rng(0).standard_normal((4, *cfg.inputs[0].shape)).astype(np.float32)
        ins[0].array(0, 4, np.float32, cfg.inputs[0].shape)[:] = x
        msg = RunMsg(int(RequestClass.BE), 1, 0, 4, 0)
        assert w.run(msg).kind == Msg.DONE
        want = outs[0].array(0, 4, np.float32, cfg.outputs[0].shape).copy()
        flag.raise_for(2)
        msg = RunMsg(int(RequestClass.BE), 2, 0, 4, 0)
        stops = 0
        while (done := w.run(msg)).kind == Msg.PREEMPTED:
            stops += 1
            msg = RunMsg(int(RequestClass.BE), 2, 0, 4, done.first_segment + done.segments_run)
        assert stops == w.model.num_segments - 1
        np.testing.assert_array_equal(outs[0].array(0, 4, np.float32, cfg.outputs[0].shape), want)
        cpu = build_zoo_model("resnet152")
        with torch.inference_mode():
            (ref,) = cpu(torch.from_numpy(x))
        np.testing.assert_allclose(want, ref.numpy(), rtol=1e-3, atol=1e-3)
