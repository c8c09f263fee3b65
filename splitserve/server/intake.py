"""Requests still arriving on the fast path: where their bytes go, how long they may take,
and what happens when one of them holds its ring's tail.

Slots are handed out in ring order and the tail only moves in order, which is what keeps a
batch one contiguous view; it also means that one request whose sender goes quiet halfway
would pin its ring, and once the head laps it every other client of that model and class
is refused ``QUEUE_FULL``. Two mechanisms close that hole:

* **Moving aside** (zero cost while the ring has room). When an allocation finds the ring
  full and the allocations at its tail belong to requests still arriving, their bytes so
  far are copied into a side buffer, their slots are freed at once, and they go on
  receiving into the side buffer. When such a request completes it gets fresh slots and
  is copied in once (``QUEUE_FULL`` if there is no room then). Side buffers are bounded
  server-wide (``ServerConfig.transports.side_buffer_bytes``); past the bound the oldest request
  already aside is given up (its stream connection is closed, a UDP peer gets an error).
* **A frame timeout.** A partial frame (stream or UDP) that is not complete
  ``frame_timeout_s`` after its first byte is abandoned; trickling bytes does not extend
  it. One periodic sweep over the watched transports does this, never a timer per frame.

Why not per-connection slot quotas or a second ring generation: a quota still lets a few
stalled connections per model pin the tail, and a second generation doubles the shared
memory of every ring to serve a rare case; moving aside costs nothing on the happy path
and a bounded copy on the unhappy one. The freed slots leave a gap in the ring's sequence
numbers that is never filled; the scheduler's contiguous runs simply end at a gap
(``ClassQueue.contiguous_run``), so a batch never waits for one.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from typing import TYPE_CHECKING, Protocol, cast

from splitserve.errors import QueueFull, SplitServeError
from splitserve.server.monitor import Call, CallTarget

if TYPE_CHECKING:
    from splitserve.config import TransportSection
    from splitserve.protocol.header import RequestClass

log = logging.getLogger(__name__)


class Receiver(Protocol):
    """A transport that receives requests (a stream connection, the UDP endpoint)."""

    def drop_arrival(self, arrival: "Arrival", error: SplitServeError) -> None:
        """Give up on ``arrival``: abandon or answer its call (``error`` says why), and call
        ``Intake.dropped``. A stream connection closes itself."""

    def expire(self, now: float, limit: float) -> None:
        """Abandon every partial frame whose first byte came before ``now - limit``."""


class RingPort(CallTarget, Protocol):
    """What the intake needs of a model: its slots (``server.ports.ModelPort`` extends it)."""

    def alloc(self, cls: "RequestClass", count: int) -> int:
        """``count`` consecutive slots of ring ``cls``; raises why the model refuses the call
        (QueueFull when the ring is full)."""

    def input_views(self, cls: "RequestClass", seq: int, count: int) -> list[memoryview]:
        """Where the payload of slots ``seq .. seq + count`` goes, one view per input tensor."""

    def plan_room(self, cls: "RequestClass", count: int, movable: dict[int, int]) -> list[int] | None:
        """Which of the ``movable`` allocations (first seq -> slot count, requests still
        arriving) to move aside so that ``count`` slots fit; None if that is not enough."""


def _port(call: Call) -> RingPort:
    """The model of a call that arrives through the intake: its slots came from ``alloc``."""
    return cast(RingPort, call.runtime)


class Arrival:
    """Where the payload of one request still arriving goes: its slots, or a side buffer.

    The payload is the concatenation of ``views`` (one per input tensor). A stream fills it
    in order through ``target``/``advance``; UDP places segments with ``buffers``. Neither
    may keep a view across a call into the intake, since moving aside replaces them.
    """

    __slots__ = ("call", "owner", "t0", "total", "got", "side", "_views", "_starts", "_vi", "_target")

    def __init__(self, call: Call, views: list[memoryview], owner: Receiver, t0: float) -> None:
        self.call = call
        self.owner = owner
        self.t0 = t0  # when the frame's first byte came (time.monotonic)
        self.got = 0  # stream: payload bytes received so far
        self.side: bytearray | None = None
        self._place(views)

    def _place(self, views: list[memoryview]) -> None:
        self._views = vs = [v for v in views if len(v)]
        self._starts = list(itertools.accumulate(map(len, vs), initial=0))
        self.total = self._starts[-1]
        if self.got == 0 and vs:  # a new request (the usual case): its first view, no search
            self._vi, self._target = 0, vs[0]
        elif self.got < self.total:
            self._vi = bisect.bisect_right(self._starts, self.got) - 1
            self._target = vs[self._vi][self.got - self._starts[self._vi]:]

    def target(self) -> memoryview:
        """Stream: where the next payload bytes go."""
        return self._target

    def advance(self, n: int) -> bool:
        """Stream: ``n`` bytes landed in ``target()``; True once the payload is complete."""
        self.got += n
        if self.got == self.total:
            return True
        if n == len(self._target):
            self._vi += 1
            self._target = self._views[self._vi]
        else:
            self._target = self._target[n:]
        return False

    def buffers(self, offset: int, length: int) -> list[memoryview]:
        """UDP: the memory that payload bytes ``[offset, offset + length)`` belong in."""
        out = []
        for start, v in zip(self._starts, self._views):
            lo, hi = max(offset, start), min(offset + length, start + len(v))
            if lo < hi:
                out.append(v[lo - start : hi - start])
        return out

    def move_aside(self) -> None:
        """Copy the payload so far into a side buffer and receive the rest there."""
        side = bytearray(self.total)
        off = 0
        for v in self._views:
            side[off : off + len(v)] = v
            off += len(v)
        self.side = side
        self._place([memoryview(side)])

    def copy_into(self, views: list[memoryview]) -> None:
        """Copy the side buffer into fresh slots (the payload is complete)."""
        assert self.side is not None
        off = 0
        for v in views:
            v[:] = self.side[off : off + len(v)]
            off += len(v)
        self.side = None


class Intake:
    """Server-wide bookkeeping of requests still arriving (event-loop thread only).

    Transports allocate through ``alloc``, register a request with ``arriving`` once its
    call exists, and report ``arrived`` (payload complete) or ``dropped`` (abandoned or
    answered before completion). Each transport that can hold a partial frame ``watch``-es
    itself so the periodic sweep can expire old frames.
    """

    def __init__(self, config: "TransportSection") -> None:
        self.timeout = config.frame_timeout_s
        self.side_limit = config.side_buffer_bytes
        self.side_bytes = 0  # bytes of side buffers in use
        self.moved_aside = 0  # requests moved aside so far (a count for tests and logs)
        # Requests receiving into their slots, per ring, by first sequence number. Slots
        # are allocated in order and registered right after, so each dict is in seq order.
        self._arriving: dict[tuple[RingPort, "RequestClass"], dict[int, Arrival]] = {}
        self._aside: dict[Arrival, None] = {}  # receiving into side buffers (insertion order)
        self._sources: set[Receiver] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    # -- slots --------------------------------------------------------------------------

    def alloc(self, rt: RingPort, cls: "RequestClass", count: int) -> int:
        """``rt.alloc``, moving requests that hold the ring's tail aside when it is full."""
        try:
            return rt.alloc(cls, count)
        except QueueFull:
            if not self._make_room(rt, cls, count):
                raise
        return rt.alloc(cls, count)

    def arriving(self, call: Call, views: list[memoryview], owner: Receiver, t0: float) -> Arrival:
        """Register ``call`` (its slots just allocated) as receiving into ``views``."""
        arrival = Arrival(call, views, owner, t0)
        key = (_port(call), call.cls)
        waiting = self._arriving.get(key)
        if waiting is None:  # one dict per model and class, kept: no allocation per request
            waiting = self._arriving[key] = {}
        waiting[call.seq] = arrival
        return arrival

    def arrived(self, arrival: Arrival) -> None:
        """The payload is complete. A request that was aside gets fresh slots and is copied
        in; raises the allocation's error (e.g. QueueFull) if it cannot have them."""
        self._forget(arrival)
        call = arrival.call
        if call.aside:
            port = _port(call)
            seq = self.alloc(port, call.cls, call.count)
            arrival.copy_into(port.input_views(call.cls, seq, call.count))
            call.move_back(seq)

    def dropped(self, arrival: Arrival) -> None:
        """``arrival`` will never complete (idempotent); its owner frees or answers the call."""
        self._forget(arrival)

    def _forget(self, arrival: Arrival) -> None:
        if arrival in self._aside:
            del self._aside[arrival]
            self.side_bytes -= arrival.total
            return
        key = (_port(arrival.call), arrival.call.cls)
        waiting = self._arriving.get(key)
        if waiting is not None and waiting.get(arrival.call.seq) is arrival:
            del waiting[arrival.call.seq]

    def _make_room(self, rt: RingPort, cls: "RequestClass", count: int) -> bool:
        waiting = self._arriving.get((rt, cls))
        if not waiting:
            return False
        plan = rt.plan_room(cls, count, {seq: a.call.count for seq, a in waiting.items()})
        if plan is None:
            return False
        for seq in plan:
            self._move_aside(waiting[seq])
        return True

    def _move_aside(self, arrival: Arrival) -> None:
        need = arrival.total
        while self.side_bytes + need > self.side_limit and self._aside:
            oldest = min(self._aside, key=lambda a: a.t0)
            log.warning("side buffers full (%d B): giving up the oldest request still arriving (%s, %d B)",
                        self.side_bytes, oldest.call.runtime.name, oldest.total)
            self._drop(oldest, QueueFull("the server's side buffers for slow requests are full, "
                                         "and this was the oldest request still arriving"))
        if self.side_bytes + need > self.side_limit:
            self._drop(arrival, QueueFull(f"request of {need} B arrives too slowly and does not fit "
                                          f"the server's side buffers ({self.side_limit} B)"))
            return
        self._forget(arrival)
        arrival.move_aside()
        arrival.call.move_aside()
        self._aside[arrival] = None
        self.side_bytes += need
        self.moved_aside += 1
        log.info("model %s: a request still arriving (%d B) held its ring's tail; moved it aside",
                 arrival.call.runtime.name, need)

    def _drop(self, arrival: Arrival, error: SplitServeError) -> None:
        arrival.owner.drop_arrival(arrival, error)
        self._forget(arrival)  # whatever the owner did, the intake lets go

    # -- the frame-timeout sweep ------------------------------------------------------------

    def watch(self, source: Receiver, loop: asyncio.AbstractEventLoop) -> None:
        """Sweep ``source`` for old partial frames until ``unwatch``."""
        self._sources.add(source)
        self._loop = loop
        self._arm()

    def unwatch(self, source: Receiver) -> None:
        """Stop sweeping ``source`` (it closed)."""
        self._sources.discard(source)

    def _arm(self) -> None:
        if self._timer is None and not self._closed and self._sources and self._loop is not None:
            # a quarter of the timeout: a frame is expired at most 25 % late
            self._timer = self._loop.call_later(self.timeout / 4, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now = time.monotonic()
        for source in list(self._sources):
            try:
                source.expire(now, self.timeout)
            except Exception:  # one broken transport must not stop the sweep for the others
                log.exception("frame-timeout sweep of %r failed", source)
        self._arm()

    def close(self) -> None:
        """Stop sweeping (server shutdown)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
