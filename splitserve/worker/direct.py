"""A worker's direct endpoint: SplitRPC's split on a host without a programmable NIC.

With ``ServerConfig.transports.fast_direct`` every bound worker also listens on a Unix socket of its
own (in the node's private run directory, mode 0600) and, when the node's fast path listens
on TCP, on a TCP port of its own at the fast path's address (``DirectSpec.tcp_host``; the
port its OS picks goes back in LOADED), both named in the model's LOOKUP reply. Both kinds
of connection are served alike, under one ``max_connections``.
A client that follows it sends its frames straight to the process that runs the model:
client -> worker -> client, two hand-offs instead of four, and no front-end Python on the
way. The front end keeps the control path: LOOKUP, LOAD/UNLOAD (which open and close the
endpoint), the preemption page, and the counters and admission limit in that page
(``worker/counters.py``).

The worker serves its direct connections in the loop that serves its control socket, one
batch at a time (``Worker.serve``). Frames are checked by the rules the front end applies
(``protocol/requests.py``); a request's payload lands in the next free rows of a per-class
batch buffer (a small frame comes whole in one read into the connection's staging buffer
and its payload is copied there; the rest of a longer one is received straight into
them), so calls from many connections form one contiguous batch with no gather copy, up
to the model's ``max_batch_size``. A batch's outputs are copied into the class's answer
rows and each connection's answers of the batch leave from there in one ``sendmsg``. Where
it was built, the compiled lane (``_directlane.Lane``) takes a read that is one plain call,
copies the outputs and packs and sends the answers; the Python code here does the same
where it was not, and everything the lane declines. A connection's frame state machine and
its calls are ``worker/direct_conn.py``'s; this module holds the endpoint and its batches.

A request whose payload is still arriving when its batch starts is moved aside (one copy
of what came so far), finishes arriving there and takes rows in the next batch (a second
copy); its rows in the batch that runs are a hole, computed and ignored (samples are
independent): that batch's size counts them, and only the batch that answers the call
counts its samples (Triton's inference_count counts a call's samples once). A misbehaving peer costs only its own connection: a frame incomplete
``frame_timeout_s`` after its first byte closes it; reading pauses at a frame boundary
while it has ``max_in_flight`` calls unanswered or ``out_high_water`` bytes unsent, or
while the worker holds the front end's admission limit of calls; past ``max_pending_out``
unsent bytes it is closed. A connection past ``max_connections`` is told why and closed.

When the endpoint closes (UNLOAD, eviction, the worker's exit or death), calls not yet
answered are not answered here: the client re-sends them through the front end, which
has its own answer for every state of the model (inference has no side effects).
"""

from __future__ import annotations

import functools
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from splitserve.errors import (DeadlineMissed, DuplicateRequest, InternalError, Refused, SplitServeError,
                               UnknownModel, WorkerFailed)
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestClass, pack_response_into
from splitserve.protocol.requests import call_class, stream_samples
from splitserve.protocol.sockets import tcp_listener, unix_listener
from splitserve.slo import slo_outcome
from splitserve.worker.counters import SLO_WORDS, WorkerCounters, Word
from splitserve.worker.direct_batching import BatchGate, direct_policy, max_calls
from splitserve.worker.direct_conn import _BE, _RT, _WAIT, _Call, _Conn
from splitserve.worker.poller import Poller
from splitserve.worker.spec import DirectSpec

try:  # compiled where the install found a C compiler (pyproject's optional ext-module)
    from splitserve import _directlane
except ImportError:  # the frame state machine takes every read
    _directlane = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_CLASSES = (_RT, _BE)  # in the order of their values: a class's value is its index (the lane's rows)
_IN_FLIGHT = {_RT: Word.IN_FLIGHT_RT, _BE: Word.IN_FLIGHT_BE}
# Buffers one sendmsg takes at most (Linux's IOV_MAX; past it the call fails)
_IOV_MAX = 1024

# Runs a batch's segments from ``first``: (class, activations, first segment, samples) ->
# (the segment it stopped before, or None when it ran to the end; the activations there).
SegmentRunner = Callable[[RequestClass, tuple, int, int], "tuple[int | None, tuple]"]


def refuse(sock: socket.socket, error: SplitServeError) -> None:
    """Tell a client why its connection is not served (an ERROR frame, if the socket takes it
    now), then close it."""
    msg = error.message.encode()
    try:
        sock.send(Header(Kind.ERROR, status=int(error.status), payload_len=len(msg)).pack() + msg, socket.MSG_DONTWAIT)
    except OSError:
        pass
    sock.close()


class DirectServer:
    """A bound worker's endpoint and its direct calls (see the module's docstring)."""

    def __init__(self, spec: DirectSpec, cfg: ModelConfig, counters: WorkerCounters,
                 poller: Poller, ring: Callable[[], None], stops: Callable[[int, int], bool]) -> None:
        self.spec = spec
        self.ring = ring  # tells the front end that a direct real-time batch began or ended
        self.stops = stops  # (segment, count): a suspended best-effort batch would stop again there now
        self.cfg = cfg
        self.counters = counters
        self.poller = poller
        # the instance's batch: Packrat's b where it places the model, else max_batch_size
        self.max_batch = min(spec.batch, cfg.max_batch_size) if spec.batch else cfg.max_batch_size
        # when a batch starts (the model's batching policy; None: at once, work-conserving)
        policy = direct_policy(cfg, self.max_batch, spec.aggregate_s)
        self.gate = BatchGate(policy, self.max_batch) if policy is not None else None
        self.max_calls = max_calls(cfg, spec.aggregate_s)  # a batch's calls at most (0: its rows' limit)
        self.wake_at_s: float | None = None  # the gate's next look, while it holds a batch back
        self.default_cls = RequestClass.RT if cfg.default_class == "rt" else RequestClass.BE
        self.class_of: dict[int, RequestClass] = {}  # a header's class -> the class its call runs in
        self.sizes = [t.nbytes for t in cfg.inputs]
        # Per class: the batch buffer (one array per input), its bytes, the next free row,
        # the calls holding rows (row order), calls finished aside and connections waiting for rows.
        self.inputs = {c: [np.empty((self.max_batch, *t.shape), t.dtype) for t in cfg.inputs] for c in _CLASSES}
        self.flat = {c: [memoryview(a).cast("B") for a in arrays] for c, arrays in self.inputs.items()}
        self.tensors = {c: [torch.from_numpy(a) for a in arrays] for c, arrays in self.inputs.items()}
        # A batch of n rows is these views of the buffers, made once per (class, n)
        self.batch_views: dict[RequestClass, dict[int, tuple[torch.Tensor, ...]]] = {c: {} for c in _CLASSES}
        # (lists indexed by the class: the compiled lane records the calls it takes in them)
        self.next_row = [0 for _ in _CLASSES]
        self.placed: list[list[_Call]] = [[] for _ in _CLASSES]
        self.complete = [0 for _ in _CLASSES]  # placed calls whose payload is whole (a batch could run)
        self.out_bytes = sum(t.nbytes for t in cfg.outputs)  # one sample's answer payload
        # Per class, the answer rows (one array per output): a batch's outputs are copied
        # there (by the lane when they are already CPU memory of the declared dtype, else by
        # ``copy_``, which also converts dtype and device and checks the shape) and its
        # answers are sent from them. Checking and viewing the model's own tensors as bytes
        # instead costs more Python right after the model, where every step runs cold
        # (benchmarks/cold_python.py), than the copy of a small model's outputs.
        self.out_rows = {c: [np.empty((self.max_batch, *t.shape), t.dtype) for t in cfg.outputs] for c in _CLASSES}
        self.out_flat = {c: [memoryview(a).cast("B") for a in arrays] for c, arrays in self.out_rows.items()}
        self.out_tensors = {c: [torch.from_numpy(a) for a in arrays] for c, arrays in self.out_rows.items()}
        self.out_views: dict[RequestClass, dict[int, tuple[torch.Tensor, ...]]] = {c: {} for c in _CLASSES}
        self.out_sizes = [t.nbytes for t in cfg.outputs]
        # The answers' headers of one batch (a call holds at least one row), written in place
        self.headers = memoryview(bytearray(self.max_batch * HEADER_SIZE))
        self.aside_done: dict[RequestClass, deque[_Call]] = {c: deque() for c in _CLASSES}
        self.waiting: dict[RequestClass, deque[_Conn]] = {c: deque() for c in _CLASSES}
        # A best-effort batch stopped at a segment boundary (padding deadline): its calls,
        # samples, the segment to resume at and the activations there.
        self.suspended: tuple[list[_Call], int, int, tuple] | None = None
        self.expire_ns = 0  # the suspended batch's calls are answered INTERNAL from here (the watchdog)
        self.conns: set[_Conn] = set()  # from every listener: one limit covers both kinds
        self.paused: set[_Conn] = set()  # connections paused by their bounds: a batch's end looks at them again
        self.stage_bytes = spec.stage_bytes
        # The compiled lane (``_directlane``, where it was built and the spec allows it): a read
        # that is one plain call, a batch's outputs and answers; None: the Python code does all
        self.lane = self._lane() if spec.compiled and _directlane is not None else None
        # No frame can be past its timeout before this (see ``sweep``): the loop looks at
        # its connections' frames then, not on every turn.
        self.sweep_at_ns = time.monotonic_ns() + int(spec.frame_timeout_s * 1e9)
        self.path = Path(spec.path)
        counters.reset()
        self.listeners: list[socket.socket] = []
        try:
            self.listeners.append(unix_listener(self.path))
            if spec.tcp_host is not None:
                self.listeners.append(tcp_listener(spec.tcp_host, 0))
            for listener in self.listeners:
                listener.setblocking(False)
                poller.register(listener.fileno(), select.EPOLLIN, functools.partial(self._on_accept, listener))
        except BaseException:
            if self.listeners:  # the Unix socket is this endpoint's (a live server's is never taken over)
                self.close()
            raise

    def _lane(self) -> "_directlane.Lane":
        table = bytearray([255] * 256)  # a header's class -> the index in _CLASSES it runs in; 255: the Python path's
        for value in range(256):
            try:
                table[value] = _CLASSES.index(call_class(value, self.default_cls, self.spec.rt_only))
            except SplitServeError:
                pass
        spec, flat = self.spec, [self.flat[c] for c in _CLASSES]
        lane = _directlane.Lane(spec.func_id, self.sizes, self.max_batch, bytes(table), flat, self.out_sizes,
                                [self.out_rows[c] for c in _CLASSES], *self.counters.lane_counts())
        lane.bind(_Call, _CLASSES, self.placed, self.next_row, self.complete, flat, self.sizes, spec.slo_us,
                  spec.max_in_flight, spec.out_high_water, self.max_calls)
        return lane

    @property
    def tcp_port(self) -> int | None:
        """The TCP endpoint's port, which the OS picked (None: a Unix endpoint only)."""
        return self.listeners[1].getsockname()[1] if len(self.listeners) > 1 else None

    # -- connections -----------------------------------------------------------------

    def _on_accept(self, listener: socket.socket, _mask: int) -> None:
        for _ in range(64):
            try:
                sock, _peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("direct endpoint: accept failed: %s", e)
                return
            self._serve(sock)

    def adopt(self, sock: socket.socket, req_id: int) -> None:
        """Serve a client's connection that the front end handed over (its HANDOFF frame of
        ``req_id``): acknowledged with an empty HANDOFF of that id before anything else on it,
        so the client knows that its next frame reaches this worker."""
        conn = self._serve(sock)
        if conn is not None:
            conn.send([Header(Kind.HANDOFF, req_id=req_id).pack()])

    def _serve(self, sock: socket.socket) -> _Conn | None:
        """A new connection (accepted, or handed over): served, or past ``max_connections``
        told why and closed (the client sends its calls through the front end)."""
        if len(self.conns) >= self.spec.max_connections:
            refuse(sock, Refused(f"this worker takes at most {self.spec.max_connections} direct connections; "
                                 "use the front end"))
            return None
        conn = _Conn(self, sock)
        self.conns.add(conn)
        self.counters.add(Word.CONNECTIONS)
        return conn

    def gone(self, conn: _Conn) -> None:
        """A connection closed: its calls will not be answered here (dropped at their batch)."""
        if conn in self.conns:
            self.conns.discard(conn)
            self.counters.sub(Word.CONNECTIONS)
        self.paused.discard(conn)
        call = conn.call
        if call is not None and (conn.state == _WAIT or call.row < 0):  # no batch holds it: drop it now
            self._drop(call)
            conn.call = None

    def accept_call(self, conn: _Conn, h: Header) -> _Call:
        """Check a REQUEST header as the front end would; the call, with rows if its class
        has room now (else it waits for them and its connection is not read meanwhile)."""
        if h.func_id != self.spec.func_id:
            raise UnknownModel(f"this endpoint serves {self.cfg.name!r} (func_id {self.spec.func_id}), "
                               f"not func_id {h.func_id}; look the model up at the front end")
        if h.req_id in conn.ids:
            raise DuplicateRequest(f"req_id {h.req_id} is already in flight on this connection")
        count = stream_samples(h, self.cfg)
        cls = self.class_of.get(h.cls)
        if cls is None:  # raises for a class no call may have, so this holds at most three
            cls = self.class_of[h.cls] = call_class(h.cls, self.default_cls, self.spec.rt_only)
        call = _Call(conn, h.req_id, cls, count, h.payload_len, h.deadline_us, conn.frame_t0_ns,
                     h.slo_us or self.spec.slo_us)
        conn.ids.add(h.req_id)
        self.counters.accepted(_IN_FLIGHT[cls])
        if not self._give_rows(call):
            self.waiting[cls].append(conn)
        return call

    def _give_rows(self, call: _Call) -> bool:
        cls = call.cls
        row = self.next_row[cls]
        if row + call.count > self.max_batch or (cls == _BE and self.suspended is not None) or \
                (self.max_calls and len(self.placed[cls]) >= self.max_calls):
            return False
        call.place(row, self.flat[cls], self.sizes)
        self.next_row[cls] = row + call.count
        self.placed[cls].append(call)
        return True

    def arrived(self, call: _Call) -> None:
        """A payload is complete: in its rows, it runs with the next batch of its class;
        aside, it takes rows then."""
        if call.row < 0:
            self.aside_done[call.cls].append(call)
        else:
            self.complete[call.cls] += 1

    def _drop(self, call: _Call) -> None:
        call.conn.ids.discard(call.req_id)
        self.counters.sub(_IN_FLIGHT[call.cls])

    def _answer_error(self, call: _Call, error: SplitServeError) -> None:
        self._drop(call)
        self.counters.add(Word.FAILED)
        self.counters.call_failed(call.cls, error.status, time.monotonic_ns() - call.t_rx_ns)
        self._count_slo(call, 0, error)
        self.counters.flush()
        call.conn.send_error(call.req_id, self.spec.func_id, error)

    def _count_slo(self, call: _Call, answered_ns: int, error: SplitServeError | None) -> None:
        """An answered call's SLO outcome, by the front end's rule, in the page (the front
        end adds it to its SLO metric and statistics)."""
        if call.slo_ns:
            self.counters.add(SLO_WORDS[slo_outcome(call.slo_ns, answered_ns, error)])

    # -- the worker's loop -----------------------------------------------------------

    def timeout(self) -> float | None:
        """How long the worker's loop may block: until the next sweep while connections are
        open, or a short poll while a batch is suspended (its padding deadline moves
        without a message)."""
        if self.suspended is not None:
            return self.spec.suspend_poll_s
        if not self.conns:
            return None
        now_ns = time.monotonic_ns()
        wait = max(0.0, (self.sweep_at_ns - now_ns) / 1e9) + 1e-3
        if self.wake_at_s is not None:  # the batching policy looks again then
            wait = min(wait, max(0.0, self.wake_at_s - now_ns / 1e9))
        return wait

    def sweep(self, now_ns: int) -> None:
        """Close connections whose frame has been incomplete too long. It looks at them only
        from ``sweep_at_ns`` on, the earliest time any frame could be too old: every frame
        begun since the last look expires a whole timeout after it (so per turn of the
        loop the cost is one comparison, not one per connection)."""
        if now_ns < self.sweep_at_ns:
            return
        if self.suspended is not None and now_ns >= self.expire_ns:
            self._expire_suspended(now_ns)
        limit_ns = int(self.spec.frame_timeout_s * 1e9)
        for conn in [c for c in self.conns if c.frame_t0_ns]:
            conn.expire(now_ns)
        self.sweep_at_ns = min((c.frame_t0_ns for c in self.conns if c.frame_t0_ns and not c.closed),
                               default=now_ns) + limit_ns
        if self.suspended is not None:
            self.sweep_at_ns = min(self.sweep_at_ns, self.expire_ns)

    def _expire_suspended(self, now_ns: int) -> None:
        """The watchdog (``max_call_age_s``): a best-effort batch held at a boundary since
        its oldest call arrived that long ago is not resumed; each of its calls is answered
        INTERNAL once, as the front end's watchdog answers a call nothing answered, and its
        rows are free for the calls waiting for them."""
        calls, _, _, _ = self.suspended  # type: ignore[misc]
        self.suspended = None
        age_s = (now_ns - min(c.t_rx_ns for c in calls)) / 1e9
        error = InternalError(f"no answer after {age_s:.0f} s (the server's max_call_age_s): its best-effort "
                              "batch was held that long for real-time work")
        for c in calls:
            if c.conn.closed:
                self._drop(c)
            else:
                self._answer_error(c, error)
        self._rows_free(_BE)

    def _has_ready(self, cls: RequestClass) -> bool:
        return self.complete[cls] > 0 or bool(self.aside_done[cls])

    def ready(self) -> bool:
        """A batch could run (or resume) now. A suspended batch that would stop again at once
        is not ready: the loop then waits ``suspend_poll_s`` instead of spinning on the CPUs
        the real-time work claimed."""
        if self.suspended is not None:
            _, n, stopped, _ = self.suspended
            if self.gate is not None:
                self.wake_at_s = None
            return self._has_due(_RT) or not self.stops(stopped, n)
        complete, aside = self.complete, self.aside_done
        if self.gate is None:
            return bool(complete[_RT] or complete[_BE] or aside[_RT] or aside[_BE])
        self.wake_at_s = None  # each look sets its own (the loop asks ``timeout`` after this)
        return self._due(_RT) or self._due(_BE)

    def _has_due(self, cls: RequestClass) -> bool:
        return self._has_ready(cls) if self.gate is None else self._due(cls)

    def _due(self, cls: RequestClass) -> bool:
        """The batching policy starts ``cls``'s batch now (calls finished aside waited a
        whole batch already: they start it at once). Else ``wake_at_s`` is its next look."""
        if self.aside_done[cls]:
            return True
        if not self.complete[cls]:
            return False
        gate, now_s = self.gate, time.monotonic_ns() / 1e9
        placed = self.placed[cls]
        gate.arrivals(cls, placed, now_s)  # type: ignore[union-attr]
        due, wake = gate.due(cls, [c for c in placed if c.got == c.total], now_s)  # type: ignore[union-attr]
        if not due and wake is not None:
            self.wake_at_s = wake if self.wake_at_s is None else min(self.wake_at_s, wake)
        return due

    def run_one(self, run: SegmentRunner) -> None:
        """Run one batch: a suspended best-effort batch's next segments, else the oldest
        class with calls ready, real-time first."""
        if self.suspended is not None:
            calls, n, first, acts = self.suspended
            if self._has_due(_RT):
                self._run(_RT, run)
                return
            self.suspended = None
            self._finish(_BE, calls, n, first, acts, run, resuming=True)
            return
        for cls in _CLASSES:
            if self._has_due(cls):
                self._run(cls, run)
                return

    def _run(self, cls: RequestClass, run: SegmentRunner) -> None:
        now = time.monotonic_ns()
        calls: list[_Call] = []
        for c in self.placed[cls]:
            if c.conn.closed:
                self._drop(c)
            elif c.got != c.total:
                c.move_aside()
            elif not (c.deadline_ns and self._late(c, now)):
                calls.append(c)
        row = self.next_row[cls]
        aside = self.aside_done[cls]
        cap = self.max_calls or self.max_batch
        while aside and row + aside[0].count <= self.max_batch and len(calls) < cap:
            c = aside.popleft()
            if c.conn.closed:
                self._drop(c)
                continue
            if c.deadline_ns and self._late(c, now):
                continue
            c.place_from_aside(row, self.flat[cls], self.sizes)
            calls.append(c)
            row += c.count
        if not calls:
            self._rows_free(cls)
            return
        n = calls[-1].row + calls[-1].count  # calls are in row order
        xs = self.batch_views[cls].get(n)
        if xs is None:
            xs = self.batch_views[cls][n] = tuple(t[:n] for t in self.tensors[cls])
        self._finish(cls, calls, n, 0, xs, run)

    def _late(self, c: _Call, now: int) -> bool:
        """``c``'s deadline passed before its batch started: answered DEADLINE_MISSED here."""
        if not (c.deadline_ns and now > c.deadline_ns):
            return False
        self._answer_error(c, DeadlineMissed(
            f"deadline passed after {(now - c.t_rx_ns) / 1e6:.1f} ms before its batch started"))
        return True

    def _finish(self, cls: RequestClass, calls: list[_Call], n: int, first: int, acts: tuple,
                run: SegmentRunner, resuming: bool = False) -> None:
        rt = cls == _RT
        # the front end sees the calls in flight while they run (a batch may run long: its
        # REEF view and statistics must not wait for the loop's next turn)
        self.counters.flush()
        if rt:  # REEF: the instance's CPUs are claimed while it runs (the front end's view, and its bell)
            self._claim(1)
        t0 = time.monotonic_ns()
        try:
            stopped, acts = run(cls, acts, first, n)
            t1 = time.monotonic_ns()
            if stopped is None and (self.lane is None or not self.lane.outputs(cls, n, acts)):
                self._to_rows(cls, n, acts)
        except Exception as e:  # a model error, or outputs that do not fit them, fails this batch, not the worker
            log.exception("direct batch of %d failed", n)
            self.counters.add(Word.BUSY_NS, time.monotonic_ns() - t0)
            for c in calls:
                self._answer_error(c, WorkerFailed(f"model {self.cfg.name!r} raised: {type(e).__name__}: {e}"))
            self._rows_free(cls)
            return
        finally:
            if rt:
                self._claim(0)
        if stopped is not None:  # best-effort, at a boundary: it resumes once it may
            self.counters.add(Word.BUSY_NS, t1 - t0)
            if not resuming or stopped > first:
                self.counters.add(Word.PREEMPTED)
            self.suspended = (calls, n, stopped, acts)
            self.expire_ns = min(c.t_rx_ns for c in calls) + int(self.spec.max_call_age_s * 1e9)
            self.sweep_at_ns = min(self.sweep_at_ns, self.expire_ns)
            return
        t2 = time.monotonic_ns()
        if self.lane is not None:
            self._answer_compiled(cls, calls, n, t0, t1, t2)
        else:
            self._answer(cls, calls, n, t0, t1, t2)
        self._rows_free(cls)

    def _to_rows(self, cls: RequestClass, n: int, acts: tuple) -> None:
        """A batch's outputs into its class's answer rows ``0..n`` (converted as needed)."""
        dsts = self.out_views[cls].get(n)
        if dsts is None:
            dsts = self.out_views[cls][n] = tuple(t[:n] for t in self.out_tensors[cls])
        if len(acts) != len(dsts):
            raise ValueError(f"it returned {len(acts)} outputs; its config declares {len(dsts)}")
        for y, dst in zip(acts, dsts):
            dst.copy_(y.reshape(dst.shape))

    def _answer_compiled(self, cls: RequestClass, calls: list[_Call], n: int, t0: int, t1: int, t2: int) -> None:
        """``_answer`` in one call of the lane (packed, counted, sent); what a socket did not
        take waits on its connection."""
        for conn, rest in self.lane.finish(calls, cls, n, t0, t1, t2):  # type: ignore[union-attr]
            conn.send([rest])

    def _answer(self, cls: RequestClass, calls: list[_Call], n: int, t0: int, t1: int, t2: int) -> None:
        """Answer a batch's calls from its answer rows: each connection's answers, in the
        batch's order, in one gather write (calls of a closed connection are dropped)."""
        compute_us = (t1 - t0) // 1000
        func_id, headers, out_bytes = self.spec.func_id, self.headers, self.out_bytes
        outs = list(zip(self.out_flat[cls], self.out_sizes))
        answers: dict[_Conn, list] = {}
        answered = samples = rx_ns = 0
        request_ns: list[int] = []
        queue_ns: list[int] = []
        for c in calls:
            conn = c.conn
            if conn.closed:
                self._drop(c)
                continue
            off = answered * HEADER_SIZE
            pack_response_into(headers, off, c.req_id, func_id, cls, c.count * out_bytes,
                               max(0, t0 - c.t_rx_ns) // 1000, compute_us, (t2 - c.t_rx_ns) // 1000)
            parts = answers.get(conn)
            if parts is None:
                parts = answers[conn] = []
            parts.append(headers[off : off + HEADER_SIZE])
            a, b = c.row, c.row + c.count
            for mv, nb in outs:
                parts.append(mv[a * nb : b * nb])
            conn.ids.discard(c.req_id)
            if c.slo_ns:
                self._count_slo(c, t2, None)
            answered += 1
            samples += c.count
            rx_ns += c.t_rx_ns
            request_ns.append(t2 - c.t_rx_ns)
            queue_ns.append(max(0, t0 - c.t_rx_ns))
        # each call's duration and queue wait from its header in (before its batch began)
        self.counters.calls_answered(cls, answered, samples, answered * t2 - rx_ns, answered * t0 - rx_ns, t1 - t0,
                                     t2 - t1)
        self.counters.durations_answered(cls, request_ns, queue_ns, t2 - t0)
        self.counters.answered(_IN_FLIGHT[cls], answered, n, t1 - t0)
        step = _IOV_MAX // (1 + len(outs)) * (1 + len(outs))  # whole answers per write
        for conn, parts in answers.items():
            if len(parts) <= step:
                conn.send(parts)
                continue
            for i in range(0, len(parts), step):
                conn.send(parts[i : i + step])

    def _claim(self, running: int) -> None:
        self.counters.set(Word.RT_RUNNING, running)
        if self.counters.bell():
            self.ring()

    def _rows_free(self, cls: RequestClass) -> None:
        """The class's batch ran: its rows are free; connections that waited get theirs,
        paused ones look at their bounds again."""
        if self.gate is not None:
            self.gate.rows_freed(cls, self.next_row[cls])
        self.next_row[cls] = 0
        self.placed[cls] = []
        self.complete[cls] = 0
        waiting = self.waiting[cls]
        while waiting:
            conn = waiting[0]
            call = conn.call
            if conn.closed or call is None or conn.state != _WAIT:
                waiting.popleft()
                continue
            if not self._give_rows(call):
                break
            waiting.popleft()
            conn.rows_granted()
        if self.paused:
            for conn in list(self.paused):
                conn.resume()

    def close(self) -> None:
        """Close the endpoint and every connection (UNLOAD, STOP): calls not answered are
        the client's to re-send through the front end."""
        for listener in self.listeners:
            self.poller.unregister(listener.fileno())
            listener.close()
        self.listeners = []
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        for conn in list(self.conns):
            conn.close()
        self.suspended = None
        # Nothing is held or open any more; the totals stay for the front end to read.
        for word in (Word.IN_FLIGHT_RT, Word.IN_FLIGHT_BE, Word.CONNECTIONS):
            self.counters.set(word, 0)
