"""The inference monitor: one record per call, READY → RX_COMPLETE → WORK_COMPLETE → TX_COMPLETE.

A call is answered exactly once (a result or an error); its slots go back to the ring only
when it reaches TX_COMPLETE. The monitor knows every open call, so its watchdog can answer
a call that nothing else answered in ``max_call_age_s`` (a server bug turns into an error
and a metric, never a hung client), and its counters make a lost or doubly answered call
visible (tests read them through the server's stats).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from enum import IntEnum
from typing import Protocol

from splitserve.errors import InternalError, SplitServeError
from splitserve.protocol.header import RequestClass
from splitserve.server.metrics import Metrics
from splitserve.server.stages import StageTrace
from splitserve.slo import slo_outcome

log = logging.getLogger(__name__)


def after_us(now: float, us: int) -> float | None:
    """``us`` microseconds after ``now`` (a header's ``deadline_us`` or ``slo_us``); None for 0, which means none."""
    return now + us / 1e6 if us else None


class CallState(IntEnum):
    READY = 0  # header parsed, slots allocated, payload arriving
    RX_COMPLETE = 1  # all input bytes are in the tensor queue
    WORK_COMPLETE = 2  # outputs are in the output queue (or the call failed)
    TX_COMPLETE = 3  # the answer left; slots recycled


class CallTarget(Protocol):
    """The model a call was made to, as the call and its transport use it once the call
    exists (``server.ports.ModelPort`` extends it with what admission needs)."""

    name: str
    func_id: int

    def output_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        """The call's output bytes (valid until the call's slots are released)."""

    def submit(self, call: "Call") -> None:
        """RX_COMPLETE: the payload is in; the model answers the call exactly once."""

    def release(self, call: "Call") -> None:
        """Free the call's slots (``call.seq``, ``call.count`` in ring ``call.cls``)."""


class Sink(Protocol):
    """Where a call's answer goes (a fast-path connection, a UDP peer, an HTTP future)."""

    def deliver(self, call: "Call") -> None:
        """Send the outputs, which are in ``call``'s output slots; they are freed on return."""

    def fail(self, call: "Call", error: SplitServeError) -> None:
        """Send ``error`` as the call's answer."""


class Call:
    """Per-request state; lives in the request, never on a shared handler."""

    __slots__ = ("req_id", "runtime", "cls", "seq", "count", "sink", "state", "deadline", "slo",
                 "t_ready", "t_rx", "t_dispatch", "t_work", "compute_ns", "monitor", "peer", "aside", "replied",
                 "t_first", "t_start_w", "t_done", "t_tx", "input_ns", "output_ns")

    def __init__(self, monitor: "InferenceMonitor", runtime: CallTarget, req_id: int, cls: RequestClass,
                 seq: int, count: int, sink: Sink, deadline: float | None, peer: object = None,
                 slo: float | None = None) -> None:
        self.monitor = monitor
        self.runtime = runtime
        self.req_id = req_id
        self.cls = cls
        self.seq = seq
        self.count = count
        self.sink = sink
        self.deadline = deadline  # hard: still queued then, the call is answered DEADLINE_MISSED
        # Soft, real-time calls only: the call's own (``slo`` here), else its model's, set when
        # it is admitted (``ModelPort.submit``); its outcome is counted when it is answered.
        self.slo = slo if cls == RequestClass.RT else None
        self.peer = peer
        self.state = CallState.READY
        # The sink has its answer (from the runtime, or early from the watchdog).
        self.replied = False
        self.t_ready = monitor.clock()
        self.t_rx = self.t_dispatch = self.t_work = 0.0
        # Stage stamps for ``server/stages.py``: the frame's first byte (a transport that
        # knows it sets it), the worker's start, its DONE read here, the answer's write.
        self.t_first = self.t_ready
        self.t_start_w = self.t_done = self.t_tx = 0.0
        self.compute_ns = 0
        # The parts of ``compute_ns`` that copied the batch's inputs in and outputs out.
        self.input_ns = self.output_ns = 0
        # True while the payload arrives in a side buffer: ``seq`` names no slots then.
        self.aside = False
        monitor.opened(self)

    def rx_complete(self) -> None:
        self._move(CallState.READY, CallState.RX_COMPLETE)
        self.t_rx = self.monitor.clock()

    def answer(self, error: SplitServeError | None = None) -> None:
        """Send the one answer of this call, then recycle its slots (TX_COMPLETE).

        If the watchdog answered first, only the slots are recycled (the runtime is done
        with them only now); a second answer is a counted no-op."""
        if self.state >= CallState.WORK_COMPLETE:
            self.monitor.dropped(self, "duplicate")
            return
        self.state = CallState.WORK_COMPLETE
        self.t_work = self.monitor.clock()
        late = self.replied
        self.replied = True
        try:
            if late:
                self.monitor.dropped(self, "late")
            elif error is None:
                self.sink.deliver(self)
            else:
                self.sink.fail(self, error)
        finally:
            self.state = CallState.TX_COMPLETE
            self._free_slots()
            self.monitor.closed(self, error, late=late)

    def expire(self, error: SplitServeError) -> None:
        """The watchdog's answer: the peer hears ``error`` now. The slots stay held until the
        runtime or transport lets go of the call (a worker may still be writing them)."""
        if self.replied:
            return
        self.replied = True
        self.sink.fail(self, error)

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
        return int((self.monitor.clock() - self.t_ready) * 1e6)


# (model, call, its error or None) -> None
TraceHook = Callable[[str, Call, SplitServeError | None], None]


class InferenceMonitor:
    """Knows every open call and counts calls by outcome; ``in_flight`` returns to 0 when
    the server is idle. ``clock`` is the one the calls' times are on (perf_counter)."""

    def __init__(self, metrics: Metrics | None = None, clock: Callable[[], float] = time.perf_counter,
                 stage_trace: int = 0, traced: TraceHook | None = None) -> None:
        self.metrics = metrics
        self.clock = clock
        # Told of every answered call (its model, the call, its error): the trace extension's spans.
        self.traced = traced
        # The stages of the newest ``stage_trace`` successful calls (None: not kept).
        self.stages = StageTrace(stage_trace) if stage_trace else None
        self.outcomes: Counter[str] = Counter()
        # Insertion order is opening order, so the oldest calls come first.
        self._open: dict[Call, None] = {}

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def open_calls(self) -> list[Call]:
        """The calls not yet at TX_COMPLETE, oldest first."""
        return list(self._open)

    def opened(self, call: Call) -> None:
        self._open[call] = None
        self.outcomes["accepted"] += 1

    def closed(self, call: Call, error: SplitServeError | None, abandoned: bool = False, late: bool = False) -> None:
        self._open.pop(call, None)
        if late:  # its outcome was counted when the watchdog answered it
            return
        key = "abandoned" if abandoned else ("ok" if error is None else f"error:{error.status.name}")
        self.outcomes[key] += 1
        if self.stages is not None and key == "ok":
            self.stages.record(call.runtime.name, call)
        if not abandoned:
            self._count_slo(call, error)
            if self.traced is not None:
                try:
                    self.traced(call.runtime.name, call, error)
                except Exception:  # a span lost must not cost the call or the loop anything
                    log.exception("model %s: tracing call %d failed", call.runtime.name, call.req_id)

    def _count_slo(self, call: Call, error: SplitServeError | None) -> None:
        """The one place SLO outcomes are counted: every call is answered once, here or by the watchdog."""
        if call.slo is None:
            return
        if self.metrics is not None:
            outcome = slo_outcome(call.slo, call.t_work or self.clock(), error)
            self.metrics.count_slo(call.runtime.name, call.cls, outcome)

    def dropped(self, call: Call, why: str) -> None:
        """An answer that did not go out: ``late`` (after the watchdog's) or ``duplicate``."""
        log.error("model %s: call %d was answered again (%s); this answer is dropped", call.runtime.name,
                  call.req_id, why)
        self.outcomes[f"dropped:{why}"] += 1
        if self.metrics is not None:
            self.metrics.dropped_answers.labels(call.runtime.name, why).inc()

    def overdue(self, now: float, max_age: float) -> list[Call]:
        """Unanswered calls older than ``max_age`` at ``now``, oldest first (decides only)."""
        out = []
        for call in self._open:
            if now - call.t_ready <= max_age:
                break  # every later call is younger
            if not call.replied:
                out.append(call)
        return out

    def sweep(self, now: float, max_age: float) -> list[Call]:
        """The watchdog: answer every overdue call INTERNAL, log it and count it; returns them."""
        calls = self.overdue(now, max_age)
        for call in calls:
            age = now - call.t_ready
            log.error("watchdog: call %d to model %s unanswered after %.1f s in state %s; answering INTERNAL",
                      call.req_id, call.runtime.name, age, call.state.name)
            self.outcomes["expired"] += 1
            if self.metrics is not None:
                self.metrics.watchdog_expired.labels(call.runtime.name, call.state.name).inc()
            error = InternalError(f"no answer after {age:.0f} s (the server's max_call_age_s); "
                                  "the server lost this call: please report it")
            self._count_slo(call, error)
            try:
                call.expire(error)
            except Exception:  # a broken sink must not stop the sweep
                log.exception("watchdog: answering call %d failed", call.req_id)
        return calls
