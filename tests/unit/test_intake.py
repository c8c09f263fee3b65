"""The intake moves requests that hold a ring's tail aside; pure, no sockets or processes."""

from __future__ import annotations

import pytest

from splitserve.config import TransportSection
from splitserve.errors import QueueFull, SplitServeError
from splitserve.modelconfig import BatchingConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ModelScheduler, Residency
from splitserve.scheduler.policy import make_policy
from splitserve.scheduler.request import QueuedRequest
from splitserve.server.intake import Arrival, Intake
from splitserve.server.monitor import Call, CallState, InferenceMonitor
from splitserve.tensorqueue import SlotRing

RT = RequestClass.RT
SLOT = 4  # bytes per slot of the one input tensor


class FakeRuntime:
    """The slice of ModelRuntime the intake and Call use: a ring and its input memory."""

    name = "fake"

    def __init__(self, nslots: int) -> None:
        self.rings = {RT: SlotRing(nslots)}
        self.memory = bytearray(nslots * SLOT)

    def alloc(self, cls: RequestClass, count: int) -> int:
        return self.rings[cls].alloc(count)

    def input_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        start = (seq % self.rings[cls].nslots) * SLOT
        return [memoryview(self.memory)[start : start + count * SLOT]]

    def plan_room(self, cls: RequestClass, count: int, movable: dict[int, int]) -> list[int] | None:
        return self.rings[cls].plan_room(count, movable)

    def release(self, call: Call) -> None:
        self.rings[call.cls].release(call.seq, call.count)


class Owner:
    """A transport: records what the intake gave up, and abandons those calls."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self.dropped: list[tuple[Arrival, SplitServeError]] = []

    def drop_arrival(self, arrival: Arrival, error: SplitServeError) -> None:
        self.dropped.append((arrival, error))
        self.intake.dropped(arrival)
        arrival.call.abandon()

    def expire(self, now: float, limit: float) -> None:
        raise AssertionError("no sweep in these tests")


class Sink:
    def __init__(self) -> None:
        self.errors: list[SplitServeError] = []
        self.delivered: list[Call] = []

    def deliver(self, call: Call) -> None:
        self.delivered.append(call)

    def fail(self, call: Call, error: SplitServeError) -> None:
        self.errors.append(error)


def setup(nslots: int = 4, side: int = 1 << 20):
    intake = Intake(TransportSection(side_buffer_bytes=side))
    return intake, FakeRuntime(nslots), Owner(intake), InferenceMonitor(), Sink()


def start(intake, rt, owner, monitor, sink, count, t0=0.0):
    seq = intake.alloc(rt, RT, count)
    call = Call(monitor, rt, seq, RT, seq, count, sink, None)
    return intake.arriving(call, rt.input_views(RT, seq, count), owner, t0)


def finish(intake, arrival):
    """Receive the whole payload as a stream would (zeros) and complete it; the call is queued."""
    while True:
        target = arrival.target()
        target[:] = bytes(len(target))
        if arrival.advance(len(target)):
            break
    intake.arrived(arrival)
    arrival.call.rx_complete()
    return arrival.call


def test_a_stalled_request_at_the_tail_is_moved_aside_and_completes_later():
    intake, rt, owner, monitor, sink = setup(nslots=4)
    stalled = start(intake, rt, owner, monitor, sink, 1)
    half = stalled.target()[:2]
    half[:] = b"ab"
    stalled.advance(2)
    for _ in range(12):  # three laps of the ring behind the stalled request
        finish(intake, start(intake, rt, owner, monitor, sink, 1)).answer()
    assert len(sink.delivered) == 12
    assert stalled.call.aside and intake.side_bytes == SLOT and intake.moved_aside == 1
    stalled.target()[:] = b"cd"
    assert stalled.advance(2)
    intake.arrived(stalled)
    call = stalled.call
    assert not call.aside and intake.side_bytes == 0
    assert bytes(rt.input_views(RT, call.seq, 1)[0]) == b"abcd"  # copied once into fresh slots


def test_a_queued_request_at_the_tail_is_real_backpressure():
    intake, rt, owner, monitor, sink = setup(nslots=2)
    queued = finish(intake, start(intake, rt, owner, monitor, sink, 2))
    with pytest.raises(QueueFull):
        intake.alloc(rt, RT, 1)
    assert not queued.aside and intake.moved_aside == 0


def test_past_the_side_buffer_bound_the_oldest_request_aside_is_dropped():
    intake, rt, owner, monitor, sink = setup(nslots=2, side=2 * SLOT)
    first = start(intake, rt, owner, monitor, sink, 2, t0=1.0)
    second = start(intake, rt, owner, monitor, sink, 2, t0=2.0)  # moves `first` aside (8 B)
    assert first.call.aside and intake.side_bytes == 2 * SLOT
    start(intake, rt, owner, monitor, sink, 1, t0=3.0)  # `second` must go aside: `first` is dropped
    assert [a for a, _ in owner.dropped] == [first] and isinstance(owner.dropped[0][1], QueueFull)
    assert first.call.state == CallState.TX_COMPLETE and second.call.aside
    assert intake.side_bytes == 2 * SLOT and monitor.outcomes["abandoned"] == 1


def test_a_request_larger_than_the_side_buffers_is_dropped_instead():
    intake, rt, owner, monitor, sink = setup(nslots=2, side=SLOT)
    big = start(intake, rt, owner, monitor, sink, 2)
    start(intake, rt, owner, monitor, sink, 1)
    assert [a for a, _ in owner.dropped] == [big] and intake.side_bytes == 0


def test_a_request_aside_that_finds_no_room_is_answered_queue_full():
    intake, rt, owner, monitor, sink = setup(nslots=2)
    stalled = start(intake, rt, owner, monitor, sink, 1)
    finish(intake, start(intake, rt, owner, monitor, sink, 1))
    finish(intake, start(intake, rt, owner, monitor, sink, 1))  # ring full: `stalled` goes aside
    stalled.target()[:] = bytes(SLOT)
    assert stalled.advance(SLOT)
    with pytest.raises(QueueFull):  # the two later requests, queued, hold both slots
        intake.arrived(stalled)
    stalled.call.answer(QueueFull("no room"))  # what a transport does; holds no slots to free
    assert [e.status.name for e in sink.errors] == ["QUEUE_FULL"] and intake.side_bytes == 0


@pytest.mark.parametrize("policy", ["work_conserving", "timeout"])
def test_a_gap_left_by_a_request_moved_aside_never_holds_a_batch(policy):
    """Slots freed by moving a request aside are never enqueued: the runs on either side of
    the gap are dispatched on their own, the later one at most one batching delay late."""
    s = ModelScheduler("m", make_policy(BatchingConfig(policy=policy, max_delay_ms=10, preferred_batch=8)), 8, 64)
    s.set_residency(s.add_instance(), Residency.RESIDENT)
    s.enqueue(QueuedRequest(0, 1, RT, 0.0))
    s.enqueue(QueuedRequest(2, 1, RT, 0.0))  # seq 1 went aside and will come back as a new seq
    now = 0.0 if policy == "work_conserving" else s.next_wakeup(0.0)
    assert now is not None and now <= 0.010
    (first,) = s.schedule(now)
    s.complete(first.instance)
    (second,) = s.schedule(now)
    assert [(b.seq, b.count) for b in (first, second)] == [(0, 1), (2, 1)]
