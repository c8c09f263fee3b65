"""One class model for REEF and PROTEAN: class order, the soft SLO beside the
hard deadline, and where SLO outcomes are counted. Pure parts and fakes, a fake clock."""

from __future__ import annotations

import pytest

from splitserve.config import ServerConfig
from splitserve.errors import DeadlineMissed, InvalidInput
from splitserve.modelconfig import ModelConfig, SloConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ClassOrder, ModelScheduler, Residency, RtPolicy
from splitserve.scheduler.policy import NoBatching, WorkConserving
from splitserve.scheduler.priority import PriorityMode
from splitserve.scheduler.request import QueuedRequest
from splitserve.server.metrics import Metrics, SloOutcome
from splitserve.server.monitor import Call, InferenceMonitor, slo_outcome

RT, BE = RequestClass.RT, RequestClass.BE


def sched(order: ClassOrder, policy=None, rt_policy=RtPolicy.FIFO) -> ModelScheduler:
    s = ModelScheduler("m", policy or WorkConserving(), 8, 64, rt_policy=rt_policy, class_order=order)
    s.set_residency(s.add_instance(), Residency.RESIDENT)
    return s


# -- class order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("order, first", [(ClassOrder.PRIORITY, RT), (ClassOrder.ARRIVAL, BE)])
def test_an_earlier_best_effort_request_goes_first_only_under_arrival(order, first):
    s = sched(order)
    s.enqueue(QueuedRequest(0, 1, BE, arrival=1.0))
    s.enqueue(QueuedRequest(0, 1, RT, arrival=2.0))
    (b,) = s.schedule(3.0)
    assert b.cls == first
    s.complete(0)
    (b,) = s.schedule(3.0)
    assert b.cls != first  # the other class is next, not starved


def test_arrival_order_serves_an_earlier_real_time_request_first_too():
    s = sched(ClassOrder.ARRIVAL)
    s.enqueue(QueuedRequest(0, 1, RT, arrival=1.0))
    s.enqueue(QueuedRequest(0, 1, BE, arrival=2.0))
    assert [b.cls for b in s.schedule(3.0)] == [RT]


def test_under_arrival_a_class_the_node_holds_back_leaves_the_instance_to_the_next():
    s = sched(ClassOrder.ARRIVAL)
    s.enqueue(QueuedRequest(0, 1, BE, arrival=1.0))
    s.enqueue(QueuedRequest(0, 1, RT, arrival=2.0))
    (b,) = s.schedule(3.0, may_start=lambda i, cls: cls == RT)
    assert b.cls == RT and s.waiting(BE) == 1


def test_oldest_waiting_is_the_earliest_head_of_any_class():
    s = sched(ClassOrder.ARRIVAL)
    assert s.oldest_waiting() is None
    s.enqueue(QueuedRequest(0, 1, RT, arrival=5.0))
    s.enqueue(QueuedRequest(0, 1, BE, arrival=4.0))
    assert s.oldest_waiting() == 4.0


def test_edf_takes_the_earlier_of_slo_and_deadline():
    s = sched(ClassOrder.PRIORITY, NoBatching(), RtPolicy.EDF)
    s.enqueue(QueuedRequest(0, 1, RT, 0.0, deadline=10.0))
    s.enqueue(QueuedRequest(1, 1, RT, 0.0, deadline=None, slo=3.0))  # most urgent: its SLO
    s.enqueue(QueuedRequest(2, 1, RT, 0.0, deadline=5.0, slo=8.0))
    order = []
    for _ in range(3):
        (b,) = s.schedule(0.0)
        order.append(b.seq)
        s.complete(0)
    assert order == [1, 2, 0]


def test_a_soft_slo_never_expires_a_request():
    s = sched(ClassOrder.PRIORITY)
    s.enqueue(QueuedRequest(0, 1, RT, 0.0, slo=1.0))
    s.enqueue(QueuedRequest(1, 1, RT, 0.0, deadline=1.0))
    assert [r.seq for r in s.expire(2.0)] == [1]
    assert s.waiting(RT) == 1


# -- config ----------------------------------------------------------------------------------------


def test_class_order_parses_from_config_and_environment(monkeypatch):
    assert ServerConfig().reef.class_order is ClassOrder.PRIORITY
    assert ServerConfig.of(class_order="arrival").reef.class_order is ClassOrder.ARRIVAL
    monkeypatch.setenv("SPLITSERVE_CLASS_ORDER", "arrival")
    monkeypatch.setenv("SPLITSERVE_PREEMPTION", "concurrent")
    assert ServerConfig.from_env().reef.class_order is ClassOrder.ARRIVAL
    with pytest.raises(InvalidInput, match="class_order.*'fifo'.*priority, arrival"):
        ServerConfig.of(class_order="fifo")


def test_arrival_order_with_reef_preemption_is_refused_at_start_up():
    with pytest.raises(InvalidInput, match="class_order=arrival does not go with preemption=reef"):
        ServerConfig.from_env(class_order="arrival", preemption="reef")
    for mode in (PriorityMode.SEQ, PriorityMode.CONCURRENT, PriorityMode.RT_ONLY):
        assert ServerConfig.from_env(class_order="arrival", preemption=mode).reef.class_order is ClassOrder.ARRIVAL


def model(slo: object) -> ModelConfig:
    return ModelConfig.from_dict({"name": "m", "artifact": {"kind": "zoo", "arch": "lenet"}, "slo": slo})


def test_a_model_slo_is_a_target_or_a_multiplier_of_the_profiled_solo_latency():
    assert model({"target_ms": 40}).slo.seconds(None) == pytest.approx(0.04)
    assert model({"multiplier": 3}).slo.seconds(0.05) == pytest.approx(0.15)
    assert model({"multiplier": 3}).slo.seconds(None) is None  # not profiled: no SLO
    assert model({}).slo == SloConfig() and SloConfig().seconds(0.05) is None
    cfg = model({"multiplier": 2.5})
    assert ModelConfig.from_dict(cfg.to_dict()).slo == cfg.slo  # travels as JSON (registry rows)


@pytest.mark.parametrize("bad, message", [
    ({"target_ms": 10, "multiplier": 3}, "not both"), ({"target_ms": 0}, "positive"),
    ({"multiplier": -1}, "positive"), ({"multiplier": True}, "positive"), ({"target_ms": "10"}, "positive"),
    ({"target_ms": float("inf")}, "positive"), ({"k": 3}, "k"), (3, "must be a table"),
])
def test_a_bad_slo_table_is_refused(bad, message):
    with pytest.raises(InvalidInput, match=message):
        model(bad)


# -- SLO outcomes, counted where a call is answered ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Target:
    name = "m"
    func_id = 1

    def release(self, call: Call) -> None:
        pass


class Sink:
    def deliver(self, call: Call) -> None:
        pass

    def fail(self, call: Call, error: object) -> None:
        pass


def setup():
    clock, metrics = Clock(), Metrics()
    return clock, metrics, InferenceMonitor(metrics, clock)


def counted(metrics: Metrics, cls: str = "rt") -> dict[str, float]:
    return {o.value: metrics.registry.get_sample_value(
        "splitserve_slo_requests_total", {"model": "m", "class": cls, "outcome": o.value}) or 0.0
        for o in SloOutcome}


def test_slo_outcome_is_met_missed_or_dropped():
    assert slo_outcome(5.0, 5.0, None) is SloOutcome.MET
    assert slo_outcome(5.0, 5.1, None) is SloOutcome.MISSED
    assert slo_outcome(5.0, 1.0, DeadlineMissed("late")) is SloOutcome.DROPPED


def test_each_answered_real_time_call_with_an_slo_is_counted_once_by_its_outcome():
    clock, metrics, mon = setup()
    calls = [Call(mon, Target(), i, RT, i, 1, Sink(), None, slo=clock() + 1.0) for i in range(4)]
    calls[0].answer()  # in time
    clock.t += 2.0
    calls[1].answer()  # late, but served
    calls[2].answer(DeadlineMissed("deadline passed"))
    calls[2].answer()  # a second answer is dropped, not counted again
    calls[3].abandon()  # the peer left before the request was in: never answered, not counted
    assert counted(metrics) == {"met": 1, "missed": 1, "dropped": 1}
    assert metrics.slo_tally("m") == {"met": 1, "missed": 1, "dropped": 1}


def test_calls_without_an_slo_and_best_effort_calls_are_not_counted():
    clock, metrics, mon = setup()
    Call(mon, Target(), 1, RT, 0, 1, Sink(), None).answer()
    be = Call(mon, Target(), 2, BE, 0, 1, Sink(), None, slo=clock() + 1.0)
    assert be.slo is None  # only real-time calls have an SLO
    be.answer()
    assert counted(metrics) == counted(metrics, "be") == {"met": 0, "missed": 0, "dropped": 0}


def test_a_call_the_watchdog_answers_counts_dropped_once():
    clock, metrics, mon = setup()
    call = Call(mon, Target(), 1, RT, 0, 1, Sink(), None, slo=clock() + 1.0)
    call.rx_complete()
    clock.t += 700
    assert mon.sweep(clock(), max_age=600) == [call]
    call.answer()  # the runtime's late answer: only the slots come back
    assert counted(metrics) == {"met": 0, "missed": 0, "dropped": 1}
