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
where it was not, and everything the lane declines.

A request whose payload is still arriving when its batch starts is moved aside (one copy
of what came so far), finishes arriving there and takes rows in the next batch (a second
copy); its rows in the batch that runs are a hole, computed and ignored (samples are
independent). A misbehaving peer costs only its own connection: a frame incomplete
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

from splitserve.errors import (BadFrame, DeadlineMissed, DuplicateRequest, Refused, SplitServeError,
                               UnknownModel, WorkerFailed)
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestClass, pack_response_into, unpack_header
from splitserve.protocol.requests import call_class, stream_samples
from splitserve.protocol.sockets import close_drained, tcp_listener, unix_listener
from splitserve.protocol.stream import DISCARD, FIRST_OWN_STATE, HEADER, PAYLOAD, FrameStream
from splitserve.slo import slo_outcome
from splitserve.worker.counters import SLO_WORDS, WorkerCounters, Word
from splitserve.worker.poller import READABLE, WRITABLE, Poller
from splitserve.worker.spec import DirectSpec

try:  # compiled where the install found a C compiler (pyproject's optional ext-module)
    from splitserve import _directlane
except ImportError:  # the frame state machine takes every read
    _directlane = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_WAIT = FIRST_OWN_STATE  # a call's header is read; it waits for rows in its class's batch
_RT, _BE = RequestClass.RT, RequestClass.BE  # looked up per call: an enum's attribute costs more than a global
_CLASSES = (_RT, _BE)  # in the order of their values: a class's value is its index (the lane's rows)
_IN_FLIGHT = {_RT: Word.IN_FLIGHT_RT, _BE: Word.IN_FLIGHT_BE}
# Buffers one sendmsg takes at most (Linux's IOV_MAX; past it the call fails)
_IOV_MAX = 1024

# Runs a batch's segments from ``first``: (class, activations, first segment, samples) ->
# (the segment it stopped before, or None when it ran to the end; the activations there).
SegmentRunner = Callable[[RequestClass, tuple, int, int], "tuple[int | None, tuple]"]


class _Call:
    """One direct call from its accepted header to its answer. The compiled lane records the
    calls it takes as these too (``Lane.bind``: this constructor, then the fields ``place``
    sets and ``got``) and reads their fields to answer them (``Lane.finish``)."""

    __slots__ = ("conn", "req_id", "cls", "count", "total", "got", "row", "flat", "sizes", "views", "vi", "target",
                 "aside", "deadline_ns", "slo_ns", "t_rx_ns")

    def __init__(self, conn: "_Conn", req_id: int, cls: RequestClass, count: int, total: int, deadline_us: int,
                 t_rx_ns: int, slo_us: int = 0) -> None:
        self.conn = conn
        self.req_id = req_id
        self.cls = cls
        self.count = count
        self.total = total  # payload bytes
        self.got = 0
        self.row = -1  # its first row in the class's batch buffer (-1: none, e.g. moved aside)
        self.flat: list[memoryview] = []
        self.sizes: list[int] = []
        # Where the rest of the payload goes (made on first need: a payload that comes whole
        # with its header is copied into the rows without them)
        self.views: list[memoryview] | None = None
        self.vi = 0
        self.target: memoryview = memoryview(b"")
        self.aside: bytearray | None = None
        self.deadline_ns = t_rx_ns + deadline_us * 1000 if deadline_us else 0
        # Soft, real-time calls only: its own SLO, else its model's (``slo_us``); 0: none
        self.slo_ns = t_rx_ns + slo_us * 1000 if slo_us and cls == _RT else 0
        self.t_rx_ns = t_rx_ns

    def place(self, row: int, flat: list[memoryview], sizes: list[int]) -> None:
        """Its payload goes into rows ``row..row+count`` of each input (inputs one after the
        other, as the payload lays them out)."""
        self.row, self.flat, self.sizes = row, flat, sizes

    def _views(self) -> None:
        row, count = self.row, self.count
        self.views = [mv[row * nb : (row + count) * nb] for mv, nb in zip(self.flat, self.sizes)]
        self.vi = 0
        self.target = self.views[0]  # nothing came yet: a partial payload made them

    def fill(self, src: memoryview) -> bool:
        """Copy the next ``len(src)`` bytes of the payload (no more than it lacks) into place;
        True once it is complete. A whole payload in its rows is one copy per input."""
        if self.got == 0 and len(src) == self.total and self.row >= 0:
            self._copy_rows(self.row, src)
            self.got = self.total
            return True
        if self.views is None:
            self._views()
        off, n = 0, len(src)
        while off < n:
            k = min(len(self.target), n - off)
            self.target[:k] = src[off : off + k]
            off += k
            if self.advance(k):
                return True
        return False

    def _copy_rows(self, row: int, src: "memoryview | bytearray") -> None:
        off, count = 0, self.count
        for mv, nb in zip(self.flat, self.sizes):
            k = nb * count
            mv[row * nb : row * nb + k] = src[off : off + k]
            off += k

    def advance(self, n: int) -> bool:
        """``n`` bytes landed in ``target`` and the views after it; True once the payload is complete."""
        self.got += n
        if self.got == self.total:
            return True
        while n >= len(self.target):
            n -= len(self.target)
            self.vi += 1
            self.target = self.views[self.vi]  # type: ignore[index]
        self.target = self.target[n:]
        return False

    def targets(self) -> list[memoryview]:
        """Where the rest of the payload goes, in order (one scatter read fills them)."""
        if self.views is None:
            self._views()
        return [self.target, *self.views[self.vi + 1 :]]  # type: ignore[index]

    def move_aside(self) -> None:
        """Its batch starts without it: keep what came in a buffer of its own, receive the
        rest there, give the rows back."""
        buf = bytearray(self.total)
        off = 0
        for v in self.views or ():
            k = min(len(v), self.got - off)
            if k <= 0:
                break
            buf[off : off + k] = v[:k]
            off += k
        self.aside, self.row, self.vi = buf, -1, 0
        self.views = [memoryview(buf)]
        self.target = self.views[0][self.got :]

    def place_from_aside(self, row: int, flat: list[memoryview], sizes: list[int]) -> None:
        """A call that finished arriving aside takes rows ``row..``: one copy back."""
        assert self.aside is not None
        self.flat, self.sizes = flat, sizes
        self._copy_rows(row, self.aside)
        self.row, self.aside = row, None


class _Conn(FrameStream):
    """One direct connection: frames in, answers out, its own flow control. Its frame
    states, the refused frame's discard, the bad frame's answer and the writes are
    ``protocol/stream.py``'s, shared with the front end's connections; its reads are its
    own: into a staging buffer, so a small frame (header and payload) is one ``recv``
    and its payload one copy into its rows, while the rest of a payload longer than what
    came with its header is received straight into the rows."""

    def __init__(self, server: "DirectServer", sock: socket.socket) -> None:
        super().__init__(sock, "direct peer")
        self.server = server
        self.spec = server.spec
        self.call: _Call | None = None  # the call whose payload is being read, or waits for rows
        self.ids: set[int] = set()  # req_ids accepted and not answered
        self.paused = False  # reading stopped by flow control (at a frame boundary)
        self.events = 0
        # Bytes read and not yet taken by the frame state machine: stage[lo:hi]. Past a
        # frame boundary they wait there while the connection is paused or waits for rows,
        # as unread bytes would in the socket (what is staged is bounded by its size).
        self.stage = bytearray(server.stage_bytes)
        self.stage_mv = memoryview(self.stage)
        self.lo = self.hi = 0
        self._update()

    @property
    def max_pending_out(self) -> int:
        return self.spec.max_pending_out

    # -- events ----------------------------------------------------------------------

    def _wants_read(self) -> bool:
        return not (self.paused or self.closing or self.closed or self.state == _WAIT)

    def _update(self) -> None:
        """Keep the epoll interest in step with what this connection can do now."""
        if self.closed:
            return
        want = (select.EPOLLIN if self._wants_read() else 0) | (select.EPOLLOUT if self.out else 0)
        if want == self.events:
            return
        poller = self.server.poller
        if not self.events:
            poller.register(self.fd, want, self.on_event)
        elif not want:
            poller.unregister(self.fd)
        else:
            poller.modify(self.fd, want)
        self.events = want

    def on_event(self, mask: int) -> None:
        try:
            if mask & WRITABLE:
                self.write_some()
                if not self.closed:
                    self.resume()
            if mask & READABLE:
                if self.lo < self.hi:
                    self._take()
                for _ in range(self.spec.reads_per_wakeup):
                    if not self._wants_read() or not self._read_some():
                        break
        except Exception:  # a bug costs this connection, never the worker
            log.exception("direct peer: unexpected error; closing the connection")
            self.close()

    def want_write(self) -> None:
        self._update()

    # -- reading ---------------------------------------------------------------------

    def _read_some(self) -> bool:
        """One read; False when the socket has nothing more now."""
        if self.state == PAYLOAD:
            return self._read_payload()
        if self.state == HEADER:
            return self._read_stage()
        return self.read_discard()

    def _read_stage(self) -> bool:
        """One read into the staging buffer after the part of a header it may hold (a
        header, its payload and the next frames, as far as they fit), then take them. Into
        an empty stage, the compiled lane reads, and takes a read that is one plain call
        whole: its frame is done and the next not begun, as ``frame_done`` leaves it."""
        if self.lo:
            self.stage[: self.hi - self.lo] = self.stage_mv[self.lo : self.hi]
            self.lo, self.hi = 0, self.hi - self.lo
        want = len(self.stage) - self.hi
        lane = self.server.lane
        if not self.hi and lane is not None:
            got = lane.intake(self, self.server.suspended is None)
            if type(got) is tuple:  # one call, recorded: reading went on, so it was not paused
                n, over = got
                if over:
                    self.maybe_pause()
                return n == want
            if got <= 0:
                if got < 0:  # the peer closed, or the read failed
                    self.close()
                return False
            n = got
        else:
            n = self.receive(self.stage_mv[self.hi :])
            if not n:
                return False
        self.hi += n
        self._take()
        return n == want

    def _read_payload(self) -> bool:
        """One scatter read of the rest of the payload (every input's rows) and what follows
        it into the staging buffer, when the connection will read on after this frame.
        False when the socket has nothing more now."""
        call = self.call
        assert call is not None and self.lo == self.hi
        bufs = call.targets()
        room = 0
        if not self._over_bounds():  # it will not pause after this frame: read on into the stage
            bufs.append(self.stage_mv)
            room = len(self.stage)
        want = call.total - call.got
        n = self.receive(bufs)
        if n < want:
            if n:
                call.advance(n)
            return False
        call.advance(want)
        self.lo, self.hi = 0, n - want
        self._arrived()
        self._take()
        return n == want + room

    def _arrived(self) -> None:
        call = self.call
        assert call is not None
        self.call = None
        self.server.arrived(call)
        self.frame_done()

    def _take(self) -> None:
        """Run the frame state machine over the staged bytes as far as the connection may
        read now: headers parsed, payloads copied into their rows, refused ones skipped."""
        stage = self.stage_mv
        while self.lo < self.hi and not (self.closed or self.closing):
            state = self.state
            if state == HEADER:
                if self.paused:
                    break
                if not self.frame_t0_ns:  # the frame's first byte is here (or reading resumed at it)
                    self.frame_t0_ns = time.monotonic_ns()
                if self.hi - self.lo < HEADER_SIZE:
                    break
                at = self.lo
                self.lo += HEADER_SIZE
                try:
                    h = unpack_header(stage, at)
                except BadFrame as e:  # framing is lost: say why, then close; other connections are unaffected
                    self.send_error(int.from_bytes(stage[at + 8 : at + 16], "little"), 0, e)
                    self.close(flush=True)
                    break
                self.header = h
                self.on_header(h)
            elif state == PAYLOAD:
                call = self.call
                assert call is not None
                k = min(self.hi - self.lo, call.total - call.got)
                self.lo += k
                if call.fill(stage[self.lo - k : self.lo]):
                    self._arrived()
            elif state == DISCARD:
                k = min(self.hi - self.lo, self.discard_left)
                self.lo += k
                self.discard_left -= k
                if not self.discard_left:
                    self._after_discard()
            else:  # waits for rows: the rest stays staged
                break
        if self.lo == self.hi:
            self.lo = self.hi = 0

    def on_header(self, h: Header) -> None:
        if h.kind == Kind.REQUEST:
            try:
                call = self.server.accept_call(self, h)
            except SplitServeError as e:
                self.discard(h.payload_len, e)
                return
            self.call = call
            if call.row < 0:  # waiting for rows is the worker's doing: no frame timeout meanwhile
                self.state, self.frame_t0_ns = _WAIT, 0
                self._update()
            else:  # reading on, as between frames: the epoll interest stays as it is
                self.state = PAYLOAD
        elif h.kind == Kind.PING:
            self.discard(h.payload_len, None)
            self.send([Header(Kind.PONG, req_id=h.req_id).pack()])
        else:
            self.discard(h.payload_len, BadFrame(
                f"a client may not send {Kind(h.kind).name} frames to a direct endpoint (it takes REQUEST and "
                "PING; look models up at the front end)"))

    def rows_granted(self) -> None:
        """The call that waited for rows has them: take its staged payload and read the rest."""
        self.state = PAYLOAD
        self.frame_t0_ns = time.monotonic_ns()
        self._update()
        self.on_event(select.EPOLLIN)

    def refused(self, h: Header, error: SplitServeError) -> None:
        self.server.counters.add(Word.FAILED)
        self.server.counters.flush()
        super().refused(h, error)

    def between_frames(self) -> None:
        self.maybe_pause()

    def maybe_pause(self) -> None:
        """Pause or resume reading (only between frames: the next one not begun) by the
        connection's own bounds and the worker's admission limit."""
        if self.state == HEADER and not self.frame_t0_ns and not self.closed:
            self.paused = self._over_bounds()
            if self.paused:
                self.server.paused.add(self)
            else:
                self.server.paused.discard(self)
        self._update()

    def resume(self) -> None:
        """Look at the bounds again and, reading on, take what waited in the stage (the
        epoll says nothing of bytes already read)."""
        self.maybe_pause()
        if not self.paused and self.lo < self.hi:
            self._take()

    def _over_bounds(self) -> bool:
        spec = self.spec
        return (len(self.ids) >= spec.max_in_flight or len(self.out) > spec.out_high_water
                or (self.paused and len(self.out) > spec.out_low_water)
                or self.server.counters.in_flight() >= self.server.counters.admit())

    def expire(self, now_ns: int) -> None:
        """Close the connection if its current frame began more than frame_timeout_s ago."""
        if self.expired(now_ns, self.spec.frame_timeout_s):
            self.close()

    def close(self, flush: bool = False) -> None:
        """Close the connection; its calls are dropped (the client re-sends them elsewhere)."""
        if self.closed:
            return
        if flush and self.out:
            self.closing = True
            self._update()
            return
        if self.events:
            self.server.poller.unregister(self.fd)
            self.events = 0
        self.closed = True
        self.out = bytearray()
        close_drained(self.sock)
        self.server.gone(self)


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
        self.max_batch = cfg.max_batch_size
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
                  spec.max_in_flight, spec.out_high_water)
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
            if len(self.conns) >= self.spec.max_connections:
                # Said, then closed: the client sends these calls through the front end.
                err = Refused(f"this worker takes at most {self.spec.max_connections} direct connections; "
                              "use the front end")
                msg = err.message.encode()
                try:
                    sock.send(Header(Kind.ERROR, status=int(err.status), payload_len=len(msg)).pack() + msg,
                              socket.MSG_DONTWAIT)
                except OSError:
                    pass
                sock.close()
                continue
            self.conns.add(_Conn(self, sock))
            self.counters.add(Word.CONNECTIONS)

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
        if row + call.count > self.max_batch or (cls == _BE and self.suspended is not None):
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
        return max(0.0, (self.sweep_at_ns - time.monotonic_ns()) / 1e9) + 1e-3

    def sweep(self, now_ns: int) -> None:
        """Close connections whose frame has been incomplete too long. It looks at them only
        from ``sweep_at_ns`` on, the earliest time any frame could be too old: every frame
        begun since the last look expires a whole timeout after it (so per turn of the
        loop the cost is one comparison, not one per connection)."""
        if now_ns < self.sweep_at_ns:
            return
        limit_ns = int(self.spec.frame_timeout_s * 1e9)
        for conn in [c for c in self.conns if c.frame_t0_ns]:
            conn.expire(now_ns)
        self.sweep_at_ns = min((c.frame_t0_ns for c in self.conns if c.frame_t0_ns and not c.closed),
                               default=now_ns) + limit_ns

    def _has_ready(self, cls: RequestClass) -> bool:
        return self.complete[cls] > 0 or bool(self.aside_done[cls])

    def ready(self) -> bool:
        """A batch could run (or resume) now. A suspended batch that would stop again at once
        is not ready: the loop then waits ``suspend_poll_s`` instead of spinning on the CPUs
        the real-time work claimed."""
        if self.suspended is not None:
            _, n, stopped, _ = self.suspended
            return self._has_ready(_RT) or not self.stops(stopped, n)
        complete, aside = self.complete, self.aside_done
        return bool(complete[_RT] or complete[_BE] or aside[_RT] or aside[_BE])

    def run_one(self, run: SegmentRunner) -> None:
        """Run one batch: a suspended best-effort batch's next segments, else the oldest
        class with calls ready, real-time first."""
        if self.suspended is not None:
            calls, n, first, acts = self.suspended
            if self._has_ready(_RT):
                self._run(_RT, run)
                return
            self.suspended = None
            self._finish(_BE, calls, n, first, acts, run, resuming=True)
            return
        for cls in _CLASSES:
            if self._has_ready(cls):
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
        while aside and row + aside[0].count <= self.max_batch:
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
        answered = 0
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
