"""The inference monitor's watchdog and its exactly-once answer, on a fake clock."""

from __future__ import annotations

from splitserve.errors import ModelNotReady, Status
from splitserve.protocol.header import RequestClass
from splitserve.server.metrics import Metrics
from splitserve.server.monitor import Call, CallState, InferenceMonitor


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeRuntime:
    name = "m"

    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, call: Call) -> None:
        self.released.append(call.req_id)


class FakeSink:
    def __init__(self) -> None:
        self.answers: list[tuple[int, object]] = []

    def deliver(self, call: Call) -> None:
        self.answers.append((call.req_id, "ok"))

    def fail(self, call: Call, error) -> None:
        self.answers.append((call.req_id, error))


def setup():
    clock, metrics = FakeClock(), Metrics()
    return clock, metrics, InferenceMonitor(metrics, clock), FakeRuntime(), FakeSink()


def call(mon, rt, sink, req_id):
    return Call(mon, rt, req_id, RequestClass.BE, req_id, 1, sink, None)


def test_the_watchdog_answers_only_calls_older_than_the_limit_and_each_once():
    clock, metrics, mon, rt, sink = setup()
    old = call(mon, rt, sink, 1)
    old.rx_complete()
    clock.t += 5
    receiving = call(mon, rt, sink, 2)  # still READY: payload arriving
    clock.t += 5
    call(mon, rt, sink, 3)
    clock.t += 2  # ages now: 12, 7, 2

    expired = mon.sweep(clock(), max_age=6)

    assert [c.req_id for c in expired] == [1, 2]
    assert [(i, e.status) for i, e in sink.answers] == [(1, Status.INTERNAL), (2, Status.INTERNAL)]
    assert "no answer after 12 s" in sink.answers[0][1].message
    assert rt.released == []  # a worker may still write them: the slots wait for the runtime
    assert mon.sweep(clock(), max_age=6) == []  # answered once, never again
    value = metrics.registry.get_sample_value
    assert value("splitserve_watchdog_expired_total", {"model": "m", "state": "RX_COMPLETE"}) == 1
    assert value("splitserve_watchdog_expired_total", {"model": "m", "state": "READY"}) == 1
    assert mon.outcomes["expired"] == 2

    old.answer(None)  # the real answer arrives late: dropped, counted, slots back once
    receiving.abandon()  # the peer gave up: its slots come back too
    assert len(sink.answers) == 2
    assert rt.released == [1, 2]
    assert value("splitserve_dropped_answers_total", {"model": "m", "reason": "late"}) == 1
    assert mon.in_flight == 1 and old.state is CallState.TX_COMPLETE


def test_a_second_answer_is_a_counted_no_op():
    clock, metrics, mon, rt, sink = setup()
    c = call(mon, rt, sink, 7)
    c.rx_complete()
    c.answer(None)
    c.answer(ModelNotReady("again"))
    assert sink.answers == [(7, "ok")]
    assert rt.released == [7]
    assert mon.outcomes["dropped:duplicate"] == 1 and mon.outcomes["ok"] == 1
    assert metrics.registry.get_sample_value("splitserve_dropped_answers_total",
                                             {"model": "m", "reason": "duplicate"}) == 1
    assert mon.in_flight == 0


def test_stage_trace_keeps_the_newest_successful_calls_only_and_is_bounded():
    clock, metrics = FakeClock(), Metrics()
    mon, rt, sink = InferenceMonitor(metrics, clock, stage_trace=2), FakeRuntime(), FakeSink()
    for req_id in (1, 2, 3, 4, 5):
        c = call(mon, rt, sink, req_id)
        c.rx_complete()
        clock.t += 1
        c.t_tx = 0.0 if req_id == 5 else clock.t  # 5: a transport that does not stamp its write (UDP, HTTP)
        c.answer(ModelNotReady("x") if req_id == 3 else None)  # a failed call is not a stage sample

    kept = mon.stages.snapshot()

    assert [r["req_id"] for r in kept] == [2, 4]
    assert kept[1]["model"] == "m" and kept[1]["t_first"] == kept[1]["t_ready"] == 103.0
    assert kept[1]["t_rx"] == 103.0 and kept[1]["t_work"] == kept[1]["t_tx"] == 104.0
    assert InferenceMonitor(metrics, clock).stages is None  # off by default: nothing is kept
