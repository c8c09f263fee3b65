"""The worker process: one per model instance (``python -m splitserve.worker SPEC``).

A worker is a process with a control socket and a preemption flag. It starts bound to
nothing (a spare, on one thread); a model is *bound* to it by a LOAD
(``worker/binding.py``), which also pins it to the instance's CPUs and threads, until an
UNLOAD releases it, so one process can serve model A, then model B. PARK keeps the binding
with its weights only in page-locked host memory (the pinned host tier: its device memory
goes back) and RELOAD serves it again, the next batch copying the weights back segment by
segment as it runs (``worker/layer_reload.py``). While bound it
serves RUN messages: the batch is a contiguous view of the input queue (no gather), the
model runs segment by segment with a preemption check between segments, and outputs are
written into the output queue at the same slots. Only small structs cross the control
socket; a LOAD's queue memfds ride beside it as SCM_RIGHTS and are mapped once per
binding.
"""

from __future__ import annotations

import array
import gc
import logging
import os
import select
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch

from splitserve.errors import InvalidInput, ModelNotReady, Refused, SplitServeError
from splitserve.models.segmented import SegmentedModel
from splitserve.protocol.header import RequestClass
from splitserve.spin import BUSY_READS_AFTER_RUN, HostLoad, SpinPolicy
from splitserve.worker.binding import Binding, Restore, rss_anon
from splitserve.worker.counters import WorkerCounters
from splitserve.worker.direct import DirectServer, refuse
from splitserve.worker.cuda import fatal_cuda_error
from splitserve.worker.gpu_counters import write_copies
from splitserve.worker.gpu_env import claim_visible
from splitserve.worker.launch import ewma
from splitserve.worker.poller import Poller
from splitserve.worker.messages import (ADOPT, HEAD, MAX_LOAD_FDS, MAX_MESSAGE_BYTES, RUN, START_BINDING,
                                        DoneMsg, FailedMsg, LoadedMsg, LoadMsg, Msg, RunMsg, UnloadedMsg, pack_ready)
from splitserve.worker.sched_class import set_idle
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.spec import DirectSpec, WorkerSpec

log = logging.getLogger("splitserve.worker")

_FD_BYTES = array.array("i").itemsize
_CUT = socket.MSG_TRUNC | socket.MSG_CTRUNC  # the message or its fds did not fit and were cut


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _received_fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of SCM_RIGHTS ancillary data (they are open in this process now)."""
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _place(cpus: list[int], threads: int) -> None:
    """Pin every thread of this process to ``cpus`` (none: leave them) and run torch on
    ``threads``. Every thread, not only this one: a process reused from another model
    keeps the pool threads that model's placement started, pinned where it was."""
    if cpus:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:
                pass  # the thread ended meanwhile
    torch.set_num_threads(threads)


class Worker:
    """The process's side of one worker: CPUs, threads, control socket and preemption flag,
    which last as long as the process, and the model bound to it, which may change."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.ctrl = socket.socket(fileno=spec.ctrl_fd)
        self.flag = PreemptFlag(spec.flag_fd)
        self.counters = WorkerCounters(self.flag.page)
        self.cache_dir = Path(spec.cache_dir)
        # Every message is received into this one buffer: a RUN costs no allocation.
        self._buf = bytearray(MAX_MESSAGE_BYTES)
        self._bufs = [self._buf]
        self._ancsize = socket.CMSG_SPACE(MAX_LOAD_FDS * _FD_BYTES)
        self.bound: Binding | None = None
        # Entered around every front-end batch, and around the loop's turns while it serves a
        # direct endpoint (between two control messages); one instance, as building one costs
        # as much as entering it
        self.inference = torch.inference_mode()
        # The bound model's direct endpoint (``worker/direct.py``), when its LOAD asked for
        # one, and the epoll over it and the control socket (only while it is open).
        self.direct: DirectServer | None = None
        self.poller: Poller | None = None
        # How long the direct loop polls before it sleeps (set per binding) and the host's
        # load it asks first; after a front-end batch, its own (``front_end_spin_us``): the front
        # end's path brings the next RUN ≈ 400 µs later on the 2-core VM, past a direct call's
        # budget, and a worker that slept through it paid its wake-up and computed cold
        self.spin = SpinPolicy(0)
        self.host = HostLoad()
        self.run_spin = SpinPolicy(0)
        self.run_host = HostLoad(busy_reads=BUSY_READS_AFTER_RUN)
        self.after_run = False  # the last batch was a front-end RUN
        self.exiting = False  # a fatal CUDA error: answer, then exit (``cuda.fatal_cuda_error``)
        self._direct_spec: DirectSpec | None = None  # the binding's endpoint, opened again by a RELOAD

    @property
    def model(self) -> SegmentedModel:
        """The bound model; ModelNotReady if none is."""
        return self._binding(0).model  # type: ignore[return-value]

    def _binding(self, batch_id: int) -> Binding:
        if self.bound is None:
            raise ModelNotReady(f"no model is bound to worker {os.getpid()}; batch {batch_id} was not run")
        return self.bound

    def load(self, msg: LoadMsg) -> LoadedMsg:
        """Bind the model of a LOAD; its fds belong to the binding from here on (closed by
        it, also when loading fails)."""
        if self.bound is not None:
            _close_all(msg.bind.fds())
            raise InvalidInput(f"worker {os.getpid()} is bound to model {self.bound.cfg.name!r} "
                               f"(binding {self.bound.ident}); UNLOAD it first")
        try:
            set_idle(msg.bind.idle)  # before _place: pool threads it starts inherit the class
            _place(msg.bind.cpus, msg.bind.threads)
            claim_visible(msg.bind.visible_devices, torch.cuda.is_initialized)  # GPU device path
        except BaseException:
            _close_all(msg.bind.fds())
            raise
        self.bound = b = Binding(msg.binding, msg.bind, self.cache_dir, self.spec.segment_time_weight)
        if b.gpu is not None:  # the page counts this binding's copies from zero
            self._publish_gpu(b)
        self._direct_spec = msg.bind.direct
        return self._serve_binding(b)

    def _serve_binding(self, b: Binding) -> LoadedMsg:
        """Open the binding's direct endpoint (when its LOAD asked for one) and say it
        serves; on failure the binding is released and the error raised."""
        spec = self._direct_spec
        if spec is not None:
            self.spin = SpinPolicy(spec.spin_us * 1000)
            self.run_spin = SpinPolicy(spec.front_end_spin_us * 1000)
            self.poller = Poller()
            try:
                self.poller.register(self.ctrl.fileno(), select.EPOLLIN, None)
                self.direct = DirectServer(spec, b.cfg, self.counters, self.poller, self._ring, self._direct_stops)
            except BaseException:
                self._close_direct()
                self.bound = None
                b.close()
                raise
        return self._loaded(b, self.direct)

    def park(self) -> UnloadedMsg:
        """Keep the bound model with its weights in page-locked host memory only, its device
        memory returned (``Binding.park``); its direct endpoint closes until RELOAD. Nothing
        bound: as UNLOAD. A park that fails releases the binding as UNLOAD does."""
        b = self.bound
        if b is None:
            return self.unload()
        self._close_direct()
        try:
            nbytes = b.park()
        except Exception:
            log.exception("could not park model %s (binding %d); releasing it", b.cfg.name, b.ident)
            return self.unload()
        log.info("parked model %s (binding %d): %d B in page-locked host memory", b.cfg.name, b.ident, nbytes)
        return UnloadedMsg(b.ident, rss_anon(), parked_bytes=nbytes)

    def reload(self) -> LoadedMsg:
        """Serve the parked binding again: its next batch copies the weights back, segment
        by segment, while it runs. ModelNotReady if nothing is parked."""
        b = self.bound
        if b is None or b.parked is None:
            raise ModelNotReady(f"worker {os.getpid()} has no parked model to reload")
        # nothing was loaded or measured: the binding's load time and sizes stay what they were
        return replace(self._serve_binding(b), load_ns=0, private_bytes=None, device_bytes=None)

    def unload(self) -> UnloadedMsg:
        """Release the bound model, its queue mappings and its memory (nothing bound: no-op),
        and report the anonymous memory left."""
        self._close_direct()
        b, self.bound = self.bound, None
        if b is None:
            return UnloadedMsg(None, rss_anon())
        b.close()
        log.info("unloaded model %s (binding %d)", b.cfg.name, b.ident)
        return UnloadedMsg(b.ident, rss_anon())

    @staticmethod
    def _loaded(b: Binding, direct: DirectServer | None) -> LoadedMsg:
        return LoadedMsg(b.ident, b.cfg.name, b.nbytes, b.load_ns, b.model.num_segments,  # type: ignore[union-attr]
                         str(b.device), b.private_bytes, direct.tcp_port if direct is not None else None,
                         b.device_bytes)

    def _inputs(self, b: Binding, msg: RunMsg) -> tuple:
        ins, _ = b.queues[msg.cls]
        xs = tuple(
            torch.from_numpy(tq.array(msg.seq, msg.count, spec.dtype, spec.shape))
            for tq, spec in zip(ins, b.cfg.inputs)
        )
        if b.gpu is not None:  # GPU path: one copy per input on the batch's stream
            xs = b.gpu.inputs(RequestClass(msg.cls), xs)
        return xs

    def _ring(self) -> None:
        """The doorbell: the front end re-reads this worker's page (``Msg.DIRECT``)."""
        self.ctrl.send(bytes([Msg.DIRECT]))

    def _close_direct(self) -> None:
        d, self.direct = self.direct, None
        if d is not None:
            d.close()
        poller, self.poller = self.poller, None
        if poller is not None:
            poller.close()

    def _should_stop(self, b: Binding, msg: RunMsg, i: int, first: int, count: int) -> bool:
        """REEF's check between segments: an explicit preemption of this batch, or (for
        best-effort work padded beside real-time work) a segment that would overrun the
        padding deadline."""
        if i > first and self.flag.target() == msg.batch_id:
            return True  # an explicit preemption lets at least one segment run: progress
        return msg.cls == RequestClass.BE and self._past_padding(b, i, count, self.flag.padding_deadline())

    @staticmethod
    def _past_padding(b: Binding, i: int, count: int, deadline: int) -> bool:
        """Segment ``i`` of a best-effort batch of ``count`` would end after the padding
        deadline (0: none)."""
        return bool(deadline) and time.monotonic_ns() + b.segment_times.get((i, count), 0) > deadline

    def _segments(self, b: Binding, model: SegmentedModel, cls: RequestClass, acts: tuple, first: int, count: int,
                  stop: "Callable[[int], bool] | None") -> tuple[int | None, tuple]:
        """Run segments from ``first`` (inside inference mode) until the end or until ``stop(i)``
        says to stop before segment i (None: a batch that never stops): (i, or None at the
        end; the activations there).

        On the CPU every segment completes before the next check, so the restore point is
        exactly the boundary where it stopped and its time is the segment's real time. A GPU
        binding runs its own path (``worker/cuda.py``: launches ahead, GPU-timed)."""
        if b.parked is not None:  # the first batch after a RELOAD brings the weights back as it runs
            return None, b.reload_run(cls, acts)
        if b.gpu is not None:  # GPU path
            return b.gpu.segments(model, cls, acts, first, count, stop)
        for i in range(first, model.num_segments):
            if stop is not None and stop(i):
                return i, acts
            s0 = time.monotonic_ns()
            acts = model.run_segment(i, acts)
            key = (i, count)
            b.segment_times[key] = ewma(b.segment_times.get(key), time.monotonic_ns() - s0, self.spec.segment_time_weight)
        return None, acts

    def run_direct(self, cls: RequestClass, acts: tuple, first: int, count: int) -> tuple[int | None, tuple]:
        """A direct batch's segments (``direct.SegmentRunner``): a best-effort one stops at a
        boundary while the front end holds it (``PreemptFlag.direct_gate``: real-time work
        claims its CPUs) or its padding deadline leaves no room, and resumes later. Called
        from ``turn``, inside the loop's inference mode."""
        b = self._binding(0)
        model = b.model
        assert model is not None
        stop = (lambda i: self._direct_stops(i, count)) if cls == RequestClass.BE else None
        if b.gpu is None:
            return self._segments(b, model, cls, acts, first, count, stop)
        try:  # GPU path: in, run, and out to host rows the direct path writes from
            if first == 0:
                acts = b.gpu.inputs(cls, acts)
            stopped, acts = self._segments(b, model, cls, acts, first, count, stop)
            if stopped is None:
                acts = b.gpu.to_host(cls, acts, count)
        except Exception as e:
            self.exiting = fatal_cuda_error(e)  # the direct path answers the batch; the loop then ends
            raise
        self._publish_gpu(b)
        return stopped, acts

    def _direct_stops(self, i: int, count: int) -> bool:
        """A direct best-effort batch of ``count`` may not start segment ``i`` now: the front end
        holds it, or the segment would end after the padding deadline."""
        deadline, held = self.flag.direct_gate()
        return bool(held) or self._past_padding(self._binding(0), i, count, deadline)

    def run(self, msg: RunMsg) -> DoneMsg:
        """Run a batch of the bound model from its first (or restore) segment; stop at a
        boundary if preempted. ModelNotReady, and nothing run, if no model is bound."""
        b = self._binding(msg.batch_id)
        model = b.model
        assert model is not None  # a Binding has its model until it is closed
        t0 = time.perf_counter_ns()
        saved = b.restore.pop(msg.batch_id, None)
        if saved is not None and saved.segment == msg.resume_segment:
            first, acts = saved.segment, saved.acts
        else:  # segments are idempotent: without a saved point, start over from the inputs
            first, acts = 0, self._inputs(b, msg)
        input_ns = time.perf_counter_ns() - t0  # Triton's compute_input (a device copy is queued, not waited for)
        n = model.num_segments
        with self.inference:
            stopped, acts = self._segments(b, model, RequestClass(msg.cls), acts, first, msg.count,
                                           lambda i: self._should_stop(b, msg, i, first, msg.count))
            if stopped is not None:
                stop_ns = time.monotonic_ns()
                b.restore[msg.batch_id] = Restore(stopped, acts)
                raised = self.flag.raised_at_ns() if self.flag.target() == msg.batch_id else stop_ns
                return DoneMsg(Msg.PREEMPTED, msg.batch_id, time.perf_counter_ns() - t0, stopped - first, first,
                               max(0, stop_ns - raised), t0, input_ns)
            t_out = time.perf_counter_ns()
            _, outs = b.queues[msg.cls]
            dsts = tuple(torch.from_numpy(tq.array(msg.seq, msg.count, spec.dtype, spec.shape))
                         for tq, spec in zip(outs, b.cfg.outputs))
            if b.gpu is not None:  # GPU path: one copy per output into the pinned slots
                b.gpu.outputs(RequestClass(msg.cls), acts, dsts)
                self._publish_gpu(b)
            else:
                for dst, y in zip(dsts, acts):
                    dst.copy_(y.reshape(dst.shape))
        t_end = time.perf_counter_ns()
        return DoneMsg(Msg.DONE, msg.batch_id, t_end - t0, n - first, first, start_ns=t0, input_ns=input_ns,
                       output_ns=t_end - t_out)

    def _publish_gpu(self, b: Binding) -> None:
        """The GPU path's copy counts into the page, for the model's statistics."""
        assert b.gpu is not None
        write_copies(self.flag.page, b.gpu.copies, b.pinned_queues, len(b.gpu.graphs))

    def serve(self) -> None:
        """Serve the control socket and, while a model with a direct endpoint is bound, its
        direct connections. A control message that waits goes first (a front-end RUN is the
        worker's other path, and the front end keeps one in flight per worker, so direct
        batches run between them; ``turn``). Between two control messages the loop stays in inference
        mode (entering it per batch cost ≈ 5 µs a call); a control message (LOAD, UNLOAD, a
        front-end RUN) is handled outside it, as an unbound worker's are."""
        self.ctrl.send(pack_ready({"pid": os.getpid(), "rss_anon": rss_anon()}))
        try:
            while True:
                direct = self.direct
                if direct is not None:
                    with self.inference:
                        while not self.turn(direct) and not self.exiting:
                            pass
                if self.exiting or not self.step():  # with no direct endpoint, blocks on the control socket
                    return
        finally:
            self._close_direct()

    def turn(self, direct: DirectServer) -> bool:
        """One turn of the direct loop: wait for events (not at all while a batch is ready),
        handle the direct ones, look for expired frames, run one batch; True, and no batch
        run, when a control message waits (the caller handles it outside inference mode)."""
        poller = self.poller
        assert poller is not None  # open while a direct endpoint is
        handlers, ctrl_fd, ctrl = poller.handlers, self.ctrl.fileno(), False
        spin, host = (self.run_spin, self.run_host) if self.after_run else (self.spin, self.host)
        if direct.ready():
            events = poller.ep.poll(0)
        elif not spin.budget_ns or spin.skipping(t0 := time.monotonic_ns()):
            events = poller.ep.poll(direct.timeout())  # polling off, or backing off a busy host: no host read
        else:  # nothing to run: poll for a while (``splitserve/spin.py``), then sleep
            window = spin.window_ns()
            events = poller.wait(direct.timeout(), window, host.cpu_free) if window else \
                poller.ep.poll(direct.timeout())
            t1 = time.monotonic_ns()
            spin.observe(t1 - t0, poller.busy if window else None, t1)
        for fd, mask in events:
            if fd == ctrl_fd:
                ctrl = True
                continue
            handler = handlers.get(fd)
            if handler is not None:  # None: unregistered by an earlier event of this turn
                handler(mask)
        if not ctrl:
            now = time.monotonic_ns()
            if now >= direct.sweep_at_ns:
                direct.sweep(now)
            if direct.ready():
                self.after_run = False
                direct.run_one(self.run_direct)
                self._settle()
        self.counters.flush()  # what this turn counted, in the page before the loop waits
        return ctrl

    def step(self) -> bool:
        """Receive one message and answer it; False when the worker should exit (STOP, or
        the front end's end of the socket closed)."""
        n, anc, flags, _ = self.ctrl.recvmsg_into(self._bufs, self._ancsize)
        if n >= RUN.size and self._buf[0] == Msg.RUN and not anc and not flags & _CUT:  # serving: keep it short
            self.ctrl.send(self._answer_run(RunMsg.unpack(self._buf)))
            self.after_run = True
            self._settle()
            return not self.exiting
        fds = _received_fds(anc) if anc else []
        if n == 0 and not fds:
            return False
        kind = self._buf[0] if n else 0
        if kind == Msg.STOP:
            _close_all(fds)
            return False
        if kind == Msg.ADOPT and not flags & _CUT and n >= ADOPT.size:  # no answer: the client hears of it
            self._adopt(fds, ADOPT.unpack_from(self._buf)[1])
            return not self.exiting
        if flags & _CUT:
            _close_all(fds)
            reply = FailedMsg(kind, 0, f"message over {MAX_MESSAGE_BYTES} B or {MAX_LOAD_FDS} fds, "
                                       "cut short; not acted on").pack()
        elif kind == Msg.LOAD:
            reply = self._answer_load(memoryview(self._buf)[:n], fds)
        else:
            _close_all(fds)  # only a LOAD brings fds
            if kind == Msg.UNLOAD:
                reply = self.unload().pack()
            elif kind == Msg.PARK:
                reply = self.park().pack()
            elif kind == Msg.RELOAD:
                reply = self._answer_reload()
            elif kind == Msg.RUN:
                reply = (self._answer_run(RunMsg.unpack(self._buf)) if n >= RUN.size
                         else FailedMsg(Msg.RUN, 0, f"a RUN is {RUN.size} B, not {n}").pack())
            else:
                log.error("unknown control message kind %d (%d B)", kind, n)
                reply = FailedMsg(kind, 0, f"unknown control message kind {kind}").pack()
        self.ctrl.send(reply)
        self._settle()
        return not self.exiting

    def _adopt(self, fds: list[int], req_id: int) -> None:
        """A client's connection the front end handed over (a HANDOFF frame): the direct
        endpoint serves it; with none open (unbound, parked, the direct path off) the client
        is told why and the connection closed, and its calls go through the front end."""
        if len(fds) != 1:
            _close_all(fds)
            log.error("ADOPT with %d descriptors, not one: ignored", len(fds))
            return
        sock = socket.socket(fileno=fds[0])
        if self.direct is None:
            refuse(sock, Refused("this worker serves no direct endpoint now; use the front end"))
            return
        self.direct.adopt(sock, req_id)

    def _settle(self) -> None:
        """After a batch's answer: a binding that batch reloaded lets its pinned copy go (and
        captures its graphs again), off the answer's way."""
        b = self.bound
        if b is not None and b.reloaded:
            b.settle()

    def _answer_run(self, msg: RunMsg) -> bytes:
        try:
            return self.run(msg).pack()
        except SplitServeError as e:  # refused (nothing bound): nothing ran, no traceback to show
            log.error("batch %d refused: %s", msg.batch_id, e)
            return FailedMsg(Msg.RUN, msg.batch_id, _describe(e)).pack()
        except Exception as e:  # a model error fails this batch, not the worker
            log.exception("batch %d failed", msg.batch_id)
            if fatal_cuda_error(e):  # GPU path: this process's CUDA context is gone; a fresh one serves
                self.exiting = True
                log.error("a CUDA error left this worker's context unusable: it exits after answering")
            return FailedMsg(Msg.RUN, msg.batch_id, _describe(e)).pack()

    def _answer_reload(self) -> bytes:
        """LOADED, or FAILED (as a LOAD's, for the binding): a reload that fails leaves the
        worker unbound, and the front end's retry loads the model anew."""
        ident = self.bound.ident if self.bound is not None else 0
        try:
            return self.reload().pack()
        except Exception as e:
            log.exception("RELOAD of binding %d failed", ident)
            self.unload()
            return FailedMsg(Msg.LOAD, ident, _describe(e)).pack()

    def _answer_load(self, data: memoryview, fds: list[int]) -> bytes:
        """LOADED, or FAILED with the error: a bad message or artifact fails this LOAD and
        leaves the worker unbound and usable, with no fd or mapping left behind."""
        ident = HEAD.unpack_from(data)[2] if len(data) >= HEAD.size else 0
        try:
            msg = LoadMsg.unpack(data, fds)
        except Exception as e:
            _close_all(fds)
            log.error("malformed LOAD (binding %d): %s", ident, _describe(e))
            return FailedMsg(Msg.LOAD, ident, f"malformed LOAD: {_describe(e)}").pack()
        try:
            loaded = self.load(msg)
        except Exception as e:
            log.exception("LOAD of binding %d failed", ident)
            return FailedMsg(Msg.LOAD, ident, _describe(e)).pack()
        log.info("loaded model %s (binding %d): %d B in %.1f ms", loaded.model, loaded.binding, loaded.nbytes,
                 loaded.load_ns / 1e6)
        return loaded.pack()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.from_json(argv[0])
    logging.basicConfig(level=spec.log_level, format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s")
    try:
        worker = Worker(spec)
    except Exception as e:
        log.exception("worker failed to start")
        socket.socket(fileno=spec.ctrl_fd).send(FailedMsg(Msg.LOAD, START_BINDING, _describe(e)).pack())
        return 1
    # The imports' objects (~190,000 with torch) are never garbage: frozen, they are out of every
    # full collection, which took 80-200 ms over them (each UNLOAD's, PARK's and reload's own
    # gc.collect, and the collector's, in the middle of serving). A fork server froze them already.
    gc.freeze()
    worker.serve()
    return 0


def exit_after(argv: list[str]) -> NoReturn:
    """Run the worker of ``argv``, then end the process at once: everything the worker owns is
    released by the kernel (mappings, sockets, the preemption page), and an interpreter teardown
    with torch loaded costs ~1 s of CPU at every stop, unload and recycle."""
    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
