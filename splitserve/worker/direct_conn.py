"""A worker's direct connections (``DirectServer``'s, ``worker/direct.py``): each one's frame
state machine (``_Conn``), reading frames into its staging buffer and its calls' batch rows,
pausing and closing at its bounds, and its calls from header to answer (``_Call``).

A connection reaches its endpoint only through ``DirectHost``: the calls it accepts and
the rows they take are the endpoint's to give, and its answers leave from there.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from typing import Any, Protocol

from splitserve.errors import BadFrame, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestClass, unpack_header
from splitserve.protocol.sockets import close_drained
from splitserve.protocol.stream import DISCARD, FIRST_OWN_STATE, HEADER, PAYLOAD, FrameStream
from splitserve.worker.counters import WorkerCounters, Word
from splitserve.worker.poller import READABLE, WRITABLE, Poller
from splitserve.worker.spec import DirectSpec

log = logging.getLogger(__name__)

_WAIT = FIRST_OWN_STATE  # a call's header is read; it waits for rows in its class's batch
_RT, _BE = RequestClass.RT, RequestClass.BE  # looked up per call: an enum's attribute costs more than a global


class DirectHost(Protocol):
    """What a direct connection needs of the endpoint that accepted it (``DirectServer``)."""

    spec: DirectSpec
    counters: WorkerCounters
    poller: Poller
    lane: Any  # the compiled lane (``_directlane.Lane``), or None where it is not built or not asked for
    suspended: tuple[list[_Call], int, int, tuple] | None  # a best-effort batch stopped for real-time work
    paused: set[_Conn]  # connections paused by their bounds
    stage_bytes: int

    def accept_call(self, conn: _Conn, h: Header) -> _Call:
        """The call of an accepted header, with rows in its class's batch when there are some."""
        ...

    def arrived(self, call: _Call) -> None:
        """``call``'s payload is all in."""
        ...

    def gone(self, conn: _Conn) -> None:
        """``conn`` closed: forget it and the calls no batch holds."""
        ...


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

    def __init__(self, server: DirectHost, sock: socket.socket) -> None:
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
