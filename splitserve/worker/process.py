"""The worker process: one per model instance (``python -m splitserve.worker SPEC``).

It maps the model's tensor queues, loads the model, and then serves RUN messages: the
batch is a contiguous view of the input queue (no gather), the model runs segment by
segment with a preemption check between segments, and outputs are written into the
output queue at the same slots. Only small structs cross the control socket.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.tensorqueue import TensorQueue
from splitserve.worker.messages import DoneMsg, Msg, RunMsg, pack_text
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.spec import WorkerSpec

log = logging.getLogger("splitserve.worker")


@dataclass
class _Restore:
    """REEF restore point of a preempted batch: where to resume and the activations there."""

    segment: int
    acts: tuple


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        self.torch = torch
        self.spec = spec
        self.cfg = ModelConfig.from_dict(spec.model)
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(spec.threads)
        self.ctrl = socket.socket(fileno=spec.ctrl_fd)
        self.flag = PreemptFlag(spec.flag_fd)
        self.device = torch.device(self.cfg.device)
        self.queues: dict[int, tuple[list[TensorQueue], list[TensorQueue]]] = {}
        for cls, q in spec.queues.items():
            ins = [TensorQueue(t.nbytes, q.nslots, fd) for t, fd in zip(self.cfg.inputs, q.inputs)]
            outs = [TensorQueue(t.nbytes, q.nslots, fd) for t, fd in zip(self.cfg.outputs, q.outputs)]
            self.queues[int(cls)] = (ins, outs)
        from splitserve.models import load_artifact

        art = self.cfg.artifact
        path = Path(spec.model_dir) / art.file if (spec.model_dir and art.file) else None
        self.model = load_artifact(art.kind, path, art.arch, seed=art.seed, cache_dir=Path(spec.cache_dir))
        self.model.eval().to(self.device)
        self.restore: dict[int, _Restore] = {}
        # (segment, batch size) -> EWMA of its time in ns, measured here as batches run;
        # seeded from the stored profile when the server has one.
        self.segment_times: dict[tuple[int, int], int] = {(i, b): ns for i, b, ns in spec.segment_times_ns}
        self.stream = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(priority=0)
            self._pin_queues()

    def _pin_queues(self) -> None:
        """Register the queues' shared memory as pinned so one H2D copy moves a batch.

        Pinning is an optimisation: if the driver refuses the double mapping, the worker
        still works with pageable copies, and says so."""
        cudart = self.torch.cuda.cudart()
        for ins, outs in self.queues.values():
            for tq in ins + outs:
                err = cudart.cudaHostRegister(tq.base, 2 * tq.size, 0)
                if int(getattr(err, "value", err)) != 0:
                    log.warning("could not pin a %d B tensor queue (cuda error %s); using pageable copies",
                                tq.size, err)

    def _inputs(self, msg: RunMsg) -> tuple:
        ins, _ = self.queues[msg.cls]
        torch = self.torch
        xs = tuple(
            torch.from_numpy(tq.array(msg.seq, msg.count, spec.dtype, spec.shape))
            for tq, spec in zip(ins, self.cfg.inputs)
        )
        if self.device.type != "cpu":
            xs = tuple(x.to(self.device, non_blocking=True) for x in xs)
        return xs

    def _should_stop(self, msg: RunMsg, i: int, first: int, count: int) -> bool:
        """REEF's check between segments: an explicit preemption of this batch, or (for
        best-effort work padded beside real-time work) a segment that would overrun the
        padding deadline."""
        if i > first and self.flag.target() == msg.batch_id:
            return True  # an explicit preemption lets at least one segment run: progress
        if msg.cls == RequestClass.BE:
            deadline = self.flag.padding_deadline()
            if deadline and time.monotonic_ns() + self.segment_times.get((i, count), 0) > deadline:
                return True
        return False

    def run(self, msg: RunMsg) -> DoneMsg:
        """Run a batch from its first (or restore) segment; stop at a boundary if preempted.

        At most ``segment_capacity`` segments are launched ahead of the one known to be
        finished (REEF-N's bounded device queue). On the CPU every launch completes before
        the next check, so the restore point is exactly the boundary where it stopped; on a
        CUDA stream the launched segments finish before the restore point is taken.
        """
        torch = self.torch
        t0 = time.perf_counter_ns()
        saved = self.restore.pop(msg.batch_id, None)
        if saved is not None and saved.segment == msg.resume_segment:
            first, acts = saved.segment, saved.acts
        else:  # segments are idempotent: without a saved point, start over from the inputs
            first, acts = 0, self._inputs(msg)
        n = self.model.num_segments
        launched: list = []  # CUDA events of segments launched but maybe unfinished
        with torch.inference_mode():
            for i in range(first, n):
                if self._should_stop(msg, i, first, msg.count):
                    self._sync(launched)
                    stop_ns = time.monotonic_ns()
                    self.restore[msg.batch_id] = _Restore(i, acts)
                    raised = self.flag.raised_at_ns() if self.flag.target() == msg.batch_id else stop_ns
                    return DoneMsg(Msg.PREEMPTED, msg.batch_id, time.perf_counter_ns() - t0, i - first, first,
                                   max(0, stop_ns - raised))
                s0 = time.monotonic_ns()
                acts = self._launch(i, acts, launched)
                if self.stream is None:  # synchronous: this is the segment's real time
                    key = (i, msg.count)
                    dt = time.monotonic_ns() - s0
                    old = self.segment_times.get(key)
                    weight = self.spec.segment_time_weight
                    self.segment_times[key] = dt if old is None else old + int(weight * (dt - old))
            self._sync(launched)
            _, outs = self.queues[msg.cls]
            for tq, spec, y in zip(outs, self.cfg.outputs, acts):
                dst = torch.from_numpy(tq.array(msg.seq, msg.count, spec.dtype, spec.shape))
                dst.copy_(y.reshape(dst.shape))
        return DoneMsg(Msg.DONE, msg.batch_id, time.perf_counter_ns() - t0, n - first, first)

    def _launch(self, i: int, acts: tuple, launched: list) -> tuple:
        if self.stream is None:
            return self.model.run_segment(i, acts)
        with self.torch.cuda.stream(self.stream):
            out = self.model.run_segment(i, acts)
            ev = self.torch.cuda.Event()
            ev.record(self.stream)
        launched.append(ev)
        while len(launched) > self.spec.segment_capacity:
            launched.pop(0).synchronize()
        return out

    def _sync(self, launched: list) -> None:
        for ev in launched:
            ev.synchronize()
        launched.clear()

    def serve(self) -> None:
        info = f'{{"pid": {os.getpid()}, "segments": {self.model.num_segments}}}'
        self.ctrl.send(pack_text(Msg.READY, 0, info))
        while True:
            data = self.ctrl.recv(256)
            if not data or data[0] == Msg.STOP:
                return
            msg = RunMsg.unpack(data)
            try:
                reply = self.run(msg).pack()
            except Exception as e:  # a model error fails this batch, not the worker
                log.exception("batch %d failed", msg.batch_id)
                reply = pack_text(Msg.FAILED, msg.batch_id, f"{type(e).__name__}: {e}")
            self.ctrl.send(reply)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.from_json(argv[0])
    logging.basicConfig(level=spec.log_level, format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s")
    try:
        worker = Worker(spec)
    except Exception as e:
        log.exception("worker failed to start")
        socket.socket(fileno=spec.ctrl_fd).send(pack_text(Msg.FAILED, 0, f"{type(e).__name__}: {e}"))
        return 1
    worker.serve()
    return 0
