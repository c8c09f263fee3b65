"""The GPU batch path's logic on the CPU, behind its device seam (``worker.cuda.Device``): a fake
device whose streams are names, whose copies are real tensor copies it counts, and whose
events read a clock the test moves; the model (LeNet, 4 segments) and the double-mapped
tensor queues are real. Segments run inside inference mode, as the worker runs them. The same path on a real GPU is ``tests/gpu``."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
import torch

from splitserve.modelconfig import ModelConfig
from splitserve.models.zoo import build_zoo_model
from splitserve.protocol.header import RequestClass
from splitserve.server.model.gpu_stats import GpuStats
from splitserve.tensorqueue import TensorQueue, ring_slots
from splitserve.worker.cuda import BE_PRIORITY, RT_PRIORITY, GpuPath, _Graph, fatal_cuda_error, pin_queue
from splitserve.worker.gpu_counters import GpuCopies, read_copies, write_copies
from splitserve.worker.launch import DRAIN_BUDGET_NS, graph_size_for, graph_sizes, launch_ahead
from splitserve.worker.preempt_flag import PreemptFlag

RT, BE = RequestClass.RT, RequestClass.BE


class FakeDevice:
    """``Device`` on the CPU: ``log`` is every operation with the stream it was issued on;
    an event is the segment clock's reading (``seg_ns`` per segment run), so GPU times are
    known; ``in_flight`` is the most segments launched and not yet waited for (each launched
    segment's end event is waited for once)."""

    def __init__(self, seg_ns: int = 100_000) -> None:
        self.current: str | None = None
        self.log: list[tuple[str, str | None]] = []
        self.seg_ns = seg_ns
        self.clock = 0
        self.launched = self.waited = self.in_flight = 0

    def stream(self, cls: RequestClass) -> str:
        return {RT: "rt", BE: "be"}[RequestClass(cls)]

    @contextlib.contextmanager
    def on(self, stream: str):
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.log.append(("h2d", self.current))
        return host.clone()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", self.current))
        dst.copy_(src)

    def event(self) -> tuple[int, int]:
        self.log.append(("event", self.current))
        return (len(self.log), self.clock)

    def wait(self, event: tuple[int, int]) -> None:
        self.log.append(("wait", self.current))
        self.waited += 1

    def elapsed_ns(self, start: tuple[int, int], end: tuple[int, int]) -> int:
        return end[1] - start[1]

    def keep_on(self, t: torch.Tensor, stream: str) -> None:
        self.log.append(("record_stream", stream))


class SpyModel:
    """A real segmented model whose segments say on which stream they ran, and move the
    fake device's clock by one segment's time."""

    def __init__(self, dev: FakeDevice) -> None:
        self.model = build_zoo_model("lenet")
        self.dev = dev
        self.num_segments = self.model.num_segments

    def run_segment(self, i: int, acts: tuple) -> tuple:
        self.dev.log.append((f"segment {i}", self.dev.current))
        dev = self.dev
        dev.launched += 1
        dev.in_flight = max(dev.in_flight, dev.launched - dev.waited)
        self.dev.clock += self.dev.seg_ns
        with torch.inference_mode():
            return self.model.run_segment(i, acts)


@pytest.fixture(autouse=True)
def inference():
    with torch.inference_mode():  # as the worker runs every batch
        yield


@pytest.fixture()
def lenet_queues():
    cfg = ModelConfig.from_dict({"name": "lenet", "artifact": {"kind": "zoo", "arch": "lenet"}})
    n = ring_slots([t.nbytes for t in cfg.inputs + cfg.outputs], 8)
    ins = [TensorQueue(t.nbytes, n) for t in cfg.inputs]
    outs = [TensorQueue(t.nbytes, n) for t in cfg.outputs]
    yield cfg, n, ins, outs
    for q in ins + outs:
        q.close()


def path_for(dev: FakeDevice, capacity: int = 4) -> GpuPath:
    return GpuPath(dev, capacity, {}, 0.5)


def host_views(cfg: ModelConfig, queues: list[TensorQueue], seq: int, count: int, specs: Any) -> tuple:
    return tuple(torch.from_numpy(q.array(seq, count, t.dtype, t.shape)) for q, t in zip(queues, specs))


def test_a_batch_across_the_ring_wrap_is_one_copy_in_and_one_out_on_its_own_stream(lenet_queues):
    cfg, n, ins, outs = lenet_queues
    dev = FakeDevice()
    path, model = path_for(dev), SpyModel(dev)
    seq, count = n - 2, 4  # slots n-2, n-1, 0, 1: the double mapping makes them one view
    x = np.random.default_rng(0).integers(0, 255, (count, *cfg.inputs[0].shape), dtype=np.uint8)
    ins[0].array(seq, count, np.uint8, cfg.inputs[0].shape)[:] = x
    acts = path.inputs(BE, host_views(cfg, ins, seq, count, cfg.inputs))
    stopped, acts = path.segments(model, BE, acts, 0, count, None)
    path.outputs(BE, acts, host_views(cfg, outs, seq, count, cfg.outputs))
    assert stopped is None
    ops = [op for op, _ in dev.log]
    assert ops.count("h2d") == len(cfg.inputs) and ops.count("copy") == len(cfg.outputs)
    # the copy in, every segment and the copy out on the batch's stream, in that order
    assert {s for op, s in dev.log if op != "wait"} == {"be"}
    assert ops.index("h2d") < ops.index("segment 0") and ops.index("copy") > ops.index("segment 3")
    assert dev.log[-1] == ("wait", None)  # the host waits for the copy out before answering
    assert path.copies == GpuCopies(batches=1, h2d=1, d2h=1, h2d_bytes=x.nbytes,
                                    d2h_bytes=count * cfg.outputs[0].nbytes)
    with torch.inference_mode():
        (want,) = model.model(torch.from_numpy(x))
    np.testing.assert_array_equal(outs[0].array(seq, count, np.float32, cfg.outputs[0].shape), want.numpy())


def test_real_time_runs_on_the_high_priority_stream_with_the_whole_capacity(lenet_queues):
    cfg, n, ins, outs = lenet_queues
    dev = FakeDevice()
    path, model = path_for(dev, capacity=4), SpyModel(dev)
    acts = path.inputs(RT, host_views(cfg, ins, 0, 2, cfg.inputs))
    path.segments(model, RT, acts, 0, 2, None)
    assert {s for op, s in dev.log if op != "wait"} == {"rt"}
    assert dev.in_flight == 4  # all four segments launched before the first was waited for
    assert RT_PRIORITY < BE_PRIORITY  # lower is higher in CUDA


def test_best_effort_launches_one_segment_until_measured_then_what_the_drain_budget_allows(lenet_queues):
    cfg, n, ins, outs = lenet_queues
    dev = FakeDevice(seg_ns=DRAIN_BUDGET_NS // 3)
    path, model = path_for(dev, capacity=8), SpyModel(dev)
    acts = path.inputs(BE, host_views(cfg, ins, 0, 2, cfg.inputs))
    path.segments(model, BE, acts, 0, 2, None)
    assert dev.in_flight == 1
    assert path.times == {(i, 2): DRAIN_BUDGET_NS // 3 for i in range(4)}  # GPU-timed, per segment
    dev.in_flight = 0
    path.segments(model, BE, acts, 0, 2, None)
    assert dev.in_flight == 3
    assert dev.waited == dev.launched  # every segment launched was waited for before the return


@pytest.mark.parametrize("cls, cap, times, want", [
    (RT, 4, [None, None], 4), (BE, 4, [None, None], 1), (BE, 4, [500_000, 1_000_000], 2),
    (BE, 4, [100, 100], 4), (BE, 4, [DRAIN_BUDGET_NS * 3], 1), (BE, 1, [10], 1)])
def test_launch_ahead_bound(cls, cap, times, want):
    assert launch_ahead(cls, cap, times) == want


def test_preemption_stops_launching_drains_what_is_in_flight_and_resumes_bit_identical(lenet_queues):
    cfg, n, ins, outs = lenet_queues
    dev = FakeDevice()
    path, model = path_for(dev), SpyModel(dev)
    x = host_views(cfg, ins, 0, 3, cfg.inputs)
    ins[0].array(0, 3, np.uint8, cfg.inputs[0].shape)[:] = 7
    _, whole = path.segments(model, BE, path.inputs(BE, x), 0, 3, None)
    for k in range(1, model.num_segments):
        dev.log.clear()
        dev.launched = dev.waited = 0
        stopped, acts = path.segments(model, BE, path.inputs(BE, x), 0, 3, lambda i, k=k: i == k)
        assert stopped == k
        assert f"segment {k}" not in [op for op, _ in dev.log]  # nothing launched at or past the stop
        assert dev.waited == dev.launched == k  # what was in flight finished before the restore point was kept
        stopped, acts = path.segments(model, BE, acts, k, 3, None)
        assert stopped is None
        assert torch.equal(acts[0], whole[0])


def fake_chain(model: SpyModel, size: int, example: tuple) -> list[_Graph]:
    """A captured chain whose replays run the segment into its fixed output buffers, as a
    CUDA graph's do."""

    class Replay:
        def __init__(self, i: int, ins: tuple, outs: tuple) -> None:
            self.i, self.ins, self.outs = i, ins, outs

        def replay(self) -> None:
            for o, r in zip(self.outs, model.run_segment(self.i, self.ins)):
                o.copy_(r)

    chain, acts = [], example
    for i in range(model.num_segments):
        with torch.inference_mode():
            outs = tuple(t.clone() for t in model.model.run_segment(i, acts))
        chain.append(_Graph(Replay(i, acts, outs), acts, outs))
        acts = outs
    return chain


def test_graph_replays_copy_into_the_graph_rows_and_a_restore_point_survives_the_next_batch(lenet_queues):
    cfg, n, ins, outs = lenet_queues
    dev = FakeDevice()
    path, model = path_for(dev), SpyModel(dev)
    with torch.inference_mode():
        path.graphs[4] = fake_chain(model, 4, (torch.zeros((4, *cfg.inputs[0].shape), dtype=torch.uint8),))
    ins[0].array(0, 3, np.uint8, cfg.inputs[0].shape)[:] = 9
    ins[0].array(3, 3, np.uint8, cfg.inputs[0].shape)[:] = 200
    a, b = host_views(cfg, ins, 0, 3, cfg.inputs), host_views(cfg, ins, 3, 3, cfg.inputs)
    acts = path.inputs(BE, a)  # a batch of 3 replays the size-4 chain
    assert [op for op, _ in dev.log].count("copy") == 1 and path.copies.h2d == 1
    stopped, saved = path.segments(model, BE, acts, 0, 3, lambda i: i == 2)
    assert stopped == 2
    path.segments(model, RT, path.inputs(RT, b), 0, 3, None)  # overwrites the chain's buffers
    _, resumed = path.segments(model, BE, saved, 2, 3, None)
    # what the graph computed: the batch padded to 4 with the row the chain's buffers hold (zeros)
    (want,) = model.model(torch.cat([a[0], torch.zeros_like(a[0][:1])]))
    assert torch.equal(resumed[0][:3], want[:3])
    assert path.copies.graph_batches == 2


@pytest.mark.parametrize("mode, nbytes, max_batch, want", [
    ("off", 1, 8, ()), ("auto", 1 << 20, 8, (1, 2, 4, 8)), ("auto", 1 << 30, 8, ()), ("on", 1 << 30, 6, (1, 2, 4, 6)),
    ("auto", 1, 1, (1,))])
def test_graph_capture_policy(mode, nbytes, max_batch, want):
    assert graph_sizes(mode, nbytes, max_batch) == want


def test_a_batch_replays_the_smallest_captured_size_that_holds_it():
    assert [graph_size_for(c, (1, 2, 4, 6)) for c in (1, 3, 5, 6, 7)] == [1, 4, 6, 6, None]
    assert graph_size_for(3, ()) is None


def test_the_model_config_refuses_an_unknown_graphs_mode():
    base = {"name": "m", "artifact": {"kind": "zoo", "arch": "lenet"}}
    assert ModelConfig.from_dict({**base, "cuda_graphs": "off"}).cuda_graphs == "off"
    with pytest.raises(Exception, match="cuda_graphs"):
        ModelConfig.from_dict({**base, "cuda_graphs": "yes"})


class FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail = fail

    def cudaHostRegister(self, base: int, size: int, flags: int) -> int:
        self.calls.append((base, size, flags))
        return 1 if self.fail else 0


def test_a_queue_is_pinned_in_one_registration_covering_both_mappings():
    q = TensorQueue(4096, 4)
    try:
        cudart = FakeCudart()
        assert pin_queue(cudart, q.base, q.size)
        assert cudart.calls == [(q.base, 2 * q.size, 0)]
        # every view a batch can have, wrapped or not, lies inside that one range
        for seq in range(q.nslots):
            start = q.address(seq)
            assert q.base <= start and start + q.nslots * q.slot_bytes <= q.base + 2 * q.size
        assert not pin_queue(FakeCudart(fail=True), q.base, q.size)
    finally:
        q.close()


def test_copy_counts_travel_through_the_page_into_the_model_statistics():
    flag = PreemptFlag()
    try:
        write_copies(flag.page, GpuCopies(batches=4, h2d=4, d2h=8, h2d_bytes=40, d2h_bytes=80), 3, 2)
        copies, pinned, graphs = read_copies(flag.page)
        assert (copies.h2d, copies.d2h, pinned, graphs) == (4, 8, 3, 2)

        class Handle:
            def gpu_copies(self):
                return read_copies(flag.page)

        stats = GpuStats()
        stats.harvest(Handle())  # a worker gone
        snap = stats.snapshot([Handle()], ["GPU-a"])
        assert snap["copies"]["batches"] == 8 and snap["copies_per_batch"] == {"h2d": 1.0, "d2h": 2.0}
        assert snap["partitions"] == ["GPU-a"] and snap["pinned_queues"] == [3] and snap["graph_sizes"] == [2]
    finally:
        flag.close()


def test_sticky_cuda_errors_end_the_worker_and_model_errors_do_not():
    assert fatal_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not fatal_cuda_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not fatal_cuda_error(ValueError("CUDA error"))
