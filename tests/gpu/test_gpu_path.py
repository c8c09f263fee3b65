"""The GPU batch path on a real device: the input copy ordered before segment 0 even with the
default stream held back, one copy each way across a ring wrap from page-locked memory,
priorities between the class streams, CUDA graphs replaying the eager outputs, and a worker
whose CUDA context failed replaced by a fresh one. Skipped without CUDA (``scripts/gpu-check``
runs them)."""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest
import torch

from splitserve.errors import SplitServeError
from splitserve.modelconfig import ModelConfig
from splitserve.models.zoo import build_zoo_model
from splitserve.protocol.header import RequestClass
from splitserve.worker.cuda import CudaDevice
from splitserve.worker.messages import Msg, RunMsg
from tests.inproc import inproc_worker, quiet_config, run_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BE, RT = RequestClass.BE, RequestClass.RT
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a GPU's clock: far longer than any copy or segment here
BOUND_S = 120.0


def lenet(**kw) -> ModelConfig:
    return ModelConfig.from_dict({"name": "lenet", "device": "cuda", "max_batch_size": 4,
                                  "artifact": {"kind": "zoo", "arch": "lenet"}, **kw})


def images(seed: int, n: int, cfg: ModelConfig) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, *cfg.inputs[0].shape), dtype=np.uint8)


def run_batch(w, ins, outs, cfg, x: np.ndarray, seq: int = 0, cls: RequestClass = BE, batch_id: int = 1):
    n = len(x)
    ins[0].array(seq, n, np.uint8, cfg.inputs[0].shape)[:] = x
    assert w.run(RunMsg(int(cls), batch_id, seq, n, 0)).kind == Msg.DONE
    return outs[0].array(seq, n, np.float32, cfg.outputs[0].shape).copy()


def cpu_reference(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        (y,) = build_zoo_model("lenet")(torch.from_numpy(x))
    return y.numpy()


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_segment_0_reads_the_batch_it_was_given_with_every_other_stream_held_back(tmp_path, graphs):
    """The race the input copy had: copied on the default stream, read on another. Both the
    default stream and the batch's own are held back before the copy: a copy not ordered
    before segment 0 on the batch's stream would let it read the previous batch's rows."""
    cfg = lenet(cuda_graphs=graphs)
    with inproc_worker(cfg, tmp_path) as (w, flag, ins, outs):
        a, b = images(1, 4, cfg), images(2, 4, cfg)
        out_a = run_batch(w, ins, outs, cfg, a)
        torch.cuda._sleep(SLEEP_CYCLES)  # the legacy default stream
        with torch.cuda.stream(w.bound.gpu.device.stream(BE)):
            torch.cuda._sleep(SLEEP_CYCLES)  # the batch's own, before its copy
        out_b = run_batch(w, ins, outs, cfg, b, batch_id=2)
        np.testing.assert_allclose(out_b, cpu_reference(b), rtol=1e-3, atol=1e-4)
        assert not np.allclose(out_b, out_a)


def _pinned(address: int) -> bool:
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * 8).from_address(address))).is_pinned()


def test_a_batch_across_the_ring_wrap_is_one_copy_each_way_from_pinned_memory(tmp_path):
    cfg = lenet(cuda_graphs="off")
    with inproc_worker(cfg, tmp_path) as (w, flag, ins, outs):
        gpu = w.bound.gpu
        assert w.bound.pinned_queues == len(ins) + len(outs)
        for q in ins + outs:  # both mappings of the ring: a wrapped view's every byte is page-locked
            assert _pinned(q.base) and _pinned(q.base + q.size) and _pinned(q.base + 2 * q.size - 8)
        n = ins[0].nslots
        x = images(3, 4, cfg)
        before = (gpu.copies.h2d, gpu.copies.d2h)
        out = run_batch(w, ins, outs, cfg, x, seq=n - 2)  # slots n-2, n-1, 0, 1
        assert (gpu.copies.h2d - before[0], gpu.copies.d2h - before[1]) == (len(ins), len(outs))
        np.testing.assert_allclose(out, cpu_reference(x), rtol=1e-3, atol=1e-4)


def test_real_time_kernels_queued_beside_best_effort_ones_finish_first():
    """Both classes' work is queued behind one gate; when it opens, the high-priority stream's
    kernels are scheduled first as blocks free up, so its last one ends before best-effort's,
    although best-effort's were queued first and are no more work."""
    dev = CudaDevice(torch.device("cuda"))
    rt, be = dev.streams[RT], dev.streams[BE]
    assert rt.priority < be.priority  # lower is higher
    x = torch.randn(4096, 4096, device="cuda")
    gate = torch.cuda.Stream()
    opened = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(gate):
        torch.cuda._sleep(SLEEP_CYCLES)
        opened.record()
    ends = {}
    for name, s in (("be", be), ("rt", rt)):
        s.wait_event(opened)
        with torch.cuda.stream(s):
            y = x
            for _ in range(12):
                y = x @ y
            ends[name] = torch.cuda.Event(enable_timing=True)
            ends[name].record()
    torch.cuda.synchronize()
    assert opened.elapsed_time(ends["rt"]) < opened.elapsed_time(ends["be"])


def test_graphs_are_captured_per_batch_size_and_replay_the_eager_outputs(tmp_path):
    eager_cfg, graph_cfg = lenet(cuda_graphs="off"), lenet(cuda_graphs="on")
    xs = [images(10 + n, n, eager_cfg) for n in (1, 2, 3, 4, 3)]
    with inproc_worker(eager_cfg, tmp_path) as (w, flag, ins, outs):
        want = [run_batch(w, ins, outs, eager_cfg, x, batch_id=k + 1) for k, x in enumerate(xs)]
    with inproc_worker(graph_cfg, tmp_path) as (w, flag, ins, outs):
        assert sorted(w.bound.gpu.graphs) == [1, 2, 4]
        got = [run_batch(w, ins, outs, graph_cfg, x, batch_id=k + 1) for k, x in enumerate(xs)]
        assert w.bound.gpu.copies.graph_batches == len(xs)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_a_worker_whose_cuda_context_failed_answers_and_is_replaced(tmp_path):
    """An index past a table on the device is a device-side assert: CUDA's sticky kind, after
    which the process's context is unusable. The batch is answered with the error, the worker
    exits, and the next call is served by a fresh process."""
    repo = tmp_path / "repo"
    d = repo / "bad"
    d.mkdir(parents=True)
    torch.jit.save(torch.jit.script(_bad_module()), str(d / "m.pt"))
    (d / "config.toml").write_text(
        'name = "bad"\ndevice = "cuda"\n[artifact]\nkind = "torchscript"\nfile = "m.pt"\n'
        '[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [1]\n'
        '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [1]\n')
    cfg = quiet_config(tmp_path / "data", repository=repo, allow_code_artifacts=True,
                       worker_restart_backoff_s=0.01)
    ok, bad = np.zeros((1, 1), np.float32), np.full((1, 1), 99.0, np.float32)

    async def scenario(server):
        first = (await server.infer("bad", [ok])).outputs[0]
        rt = server.runtime("bad")
        pid = rt.workers[0].pid
        with pytest.raises(SplitServeError, match="CUDA error|device-side assert"):
            await server.infer("bad", [bad])
        again = (await server.infer("bad", [ok])).outputs[0]  # waits for the fresh worker
        return first, again, pid, rt.workers[0].pid

    first, again, pid, new_pid = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert first.tolist() == again.tolist() == [[1.0]]
    assert new_pid != pid


def _bad_module() -> torch.nn.Module:
    class Bad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            table = torch.ones(4, device=x.device)
            return table[x[:, 0].long()].unsqueeze(1)

    return Bad()
