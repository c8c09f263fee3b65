"""The inference monitor: one record per call, READY → RX_COMPLETE → WORK_COMPLETE → TX_COMPLETE.

A call is answered exactly once (a result or an error); its slots go back to the ring only
when it reaches TX_COMPLETE. The monitor's counters make a lost or doubly answered call
visible (tests read them through the server's stats).
"""

from __future__ import annotations

import time
from collections import Counter
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from splitserve.errors import SplitServeError
from splitserve.protocol.header import RequestClass

if TYPE_CHECKING:
    from splitserve.server.runtime import ModelRuntime


class CallState(IntEnum):
    READY = 0  # header parsed, slots allocated, payload arriving
    RX_COMPLETE = 1  # all input bytes are in the tensor queue
    WORK_COMPLETE = 2  # outputs are in the output queue (or the call failed)
    TX_COMPLETE = 3  # the answer left; slots recycled


class Sink(Protocol):
    """Where a call's answer goes (a fast-path connection, a UDP peer, an HTTP future)."""

    def deliver(self, call: "Call") -> None:
        """Send the outputs, which are in ``call``'s output slots; they are freed on return."""

    def fail(self, call: "Call", error: SplitServeError) -> None:
        """Send ``error`` as the call's answer."""


class Call:
    """Per-request state; lives in the request, never on a shared handler."""

    __slots__ = ("req_id", "runtime", "cls", "seq", "count", "sink", "state", "deadline",
                 "t_ready", "t_rx", "t_dispatch", "t_work", "compute_ns", "monitor", "peer", "aside")

    def __init__(self, monitor: "InferenceMonitor", runtime: "ModelRuntime", req_id: int, cls: RequestClass,
                 seq: int, count: int, sink: Sink, deadline: float | None, peer: object = None) -> None:
        self.monitor = monitor
        self.runtime = runtime
        self.req_id = req_id
        self.cls = cls
        self.seq = seq
        self.count = count
        self.sink = sink
        self.deadline = deadline
        self.peer = peer
        self.state = CallState.READY
        self.t_ready = time.perf_counter()
        self.t_rx = self.t_dispatch = self.t_work = 0.0
        self.compute_ns = 0
        # True while the payload arrives in a side buffer: ``seq`` names no slots then.
        self.aside = False
        monitor.opened(self)

    def rx_complete(self) -> None:
        self._move(CallState.READY, CallState.RX_COMPLETE)
        self.t_rx = time.perf_counter()

    def answer(self, error: SplitServeError | None = None) -> None:
        """Send the one answer of this call, then recycle its slots (TX_COMPLETE)."""
        if self.state >= CallState.WORK_COMPLETE:
            raise RuntimeError(f"call {self.req_id} answered twice")
        self.state = CallState.WORK_COMPLETE
        self.t_work = time.perf_counter()
        try:
            if error is None:
                self.sink.deliver(self)
            else:
                self.sink.fail(self, error)
        finally:
            self.state = CallState.TX_COMPLETE
            self._free_slots()
            self.monitor.closed(self, error)

    def abandon(self) -> None:
        """The peer went away before the request was complete: free its slots, no answer."""
        self._move(CallState.READY, CallState.TX_COMPLETE)
        self._free_slots()
        self.monitor.closed(self, None, abandoned=True)

    def move_aside(self) -> None:
        """The payload (still arriving) now goes to a side buffer: give the slots back at once,
        so that this call no longer holds its ring's tail (``server/intake.py``)."""
        if self.state != CallState.READY or self.aside:
            raise RuntimeError(f"call {self.req_id}: only a call still receiving into its slots can move aside")
        self.runtime.release(self)
        self.aside = True

    def move_back(self, seq: int) -> None:
        """The payload was copied into fresh slots starting at ``seq``."""
        if not self.aside:
            raise RuntimeError(f"call {self.req_id} was not aside")
        self.seq = seq
        self.aside = False

    def _free_slots(self) -> None:
        if not self.aside:
            self.runtime.release(self)

    def _move(self, frm: CallState, to: CallState) -> None:
        if self.state != frm:
            raise RuntimeError(f"call {self.req_id}: {self.state.name} -> {to.name} is not allowed")
        self.state = to

    # timings reported in responses (microseconds)
    @property
    def queue_us(self) -> int:
        return int(max(0.0, self.t_dispatch - self.t_rx) * 1e6) if self.t_dispatch else 0

    @property
    def total_us(self) -> int:
        return int((time.perf_counter() - self.t_ready) * 1e6)


class InferenceMonitor:
    """Counts calls by outcome; ``in_flight`` must return to 0 when the server is idle."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.outcomes: Counter[str] = Counter()

    def opened(self, call: Call) -> None:
        self.in_flight += 1
        self.outcomes["accepted"] += 1

    def closed(self, call: Call, error: SplitServeError | None, abandoned: bool = False) -> None:
        self.in_flight -= 1
        key = "abandoned" if abandoned else ("ok" if error is None else f"error:{error.status.name}")
        self.outcomes[key] += 1
