"""Padding under preemption idle: best-effort work beside real-time work only within the
slowdown Eq. 1 predicts from measured FBRs."""

from __future__ import annotations

import pytest

from splitserve.protocol.header import RequestClass
from splitserve.scheduler.padding import Padding, apply, pad
from splitserve.scheduler.priority import PriorityMode, decide
from splitserve.scheduler.priority import InstanceView as V

RT, BE = RequestClass.RT, RequestClass.BE
FBR = {"rt": 0.5, "light": 0.3, "heavy": 0.8, "mid": 0.4}


def rt_running(**kw) -> V:
    return V("rt", 0, frozenset({0}), True, running_cls=RT, running_batch=1, **kw)


def be(model: str, running: bool = False, instance: int = 0, be_waiting: int = 1, **kw) -> V:
    return V(model, instance, frozenset({0}), True, running_cls=BE if running else None,
             running_batch=7 if running else 0, be_waiting=be_waiting, **kw)


def test_without_active_real_time_work_nothing_is_held() -> None:
    assert pad([V("rt", 0, frozenset({0}), True), be("heavy", running=True)], FBR.get, 1.0) == Padding()


def test_idle_best_effort_instances_are_admitted_while_the_predicted_slowdown_stays_in_the_limit() -> None:
    p = pad([rt_running(), be("light"), be("mid")], FBR.get, 1.0)
    # rt + light = 0.8 (floor 1: no slowdown); + mid = 1.2 > 1.05
    assert p.hold == {("mid", 0)} and p.stop == ()
    assert p.rt_slowdown == (("rt", 1.0),)


def test_an_idle_instance_with_no_best_effort_work_waiting_takes_none_of_the_room() -> None:
    # heavy has nothing queued: it starts no batch now, so light (which has) is not held for it
    p = pad([rt_running(), be("heavy", be_waiting=0), be("light")], FBR.get, 1.0)
    assert p.hold == frozenset() and p.rt_slowdown == (("rt", 1.0),)
    # once heavy's work arrives, the next pass holds it: light came first in the node's order
    p = pad([rt_running(), be("light"), be("heavy")], FBR.get, 1.0)
    assert p.hold == {("heavy", 0)}
    # a preempted batch it holds is work to resume, queue or not
    p = pad([rt_running(), be("light"), be("heavy", be_waiting=0, suspended=True)], FBR.get, 1.0)
    assert p.hold == {("heavy", 0)}


def test_a_waiting_real_time_model_counts_as_active() -> None:
    p = pad([V("rt", 0, frozenset({0}), True, rt_waiting=1), be("heavy")], FBR.get, 1.0)
    assert p.hold == {("heavy", 0)}


def test_running_best_effort_batches_that_break_the_limit_are_stopped_unless_about_to_end() -> None:
    node = [rt_running(), be("light", running=True, started=0.1),
            be("heavy", running=True, instance=1, started=0.2, expected_end=2.0),
            be("heavy", running=True, instance=2, started=0.3, expected_end=0.9)]
    p = pad(node, FBR.get, 1.0)
    assert p.stop == (("heavy", 1, 7),)  # instance 2 was expected to end by now: left to end
    assert p.rt_slowdown == (("rt", pytest.approx(0.5 + 0.3 + 0.8)),)


def test_unmeasured_models_co_run_as_the_kernel_has_it() -> None:
    assert pad([rt_running(), be("unknown"), be("light")], FBR.get, 1.0) == Padding(rt_slowdown=(("rt", 1.0),))
    assert pad([V("x", 0, frozenset({0}), True, running_cls=RT), be("heavy")], FBR.get, 1.0) == Padding()


def test_the_slowdown_is_against_the_real_time_model_alone() -> None:
    # a fitted FBR above 1 (a core's time-slicing) is its floor: a light neighbour adds 0.3/1.2
    fbr = {"rt": 1.2, "tiny": 0.05, "light": 0.3}
    p = pad([rt_running(), be("tiny"), be("light")], fbr.get, 1.0)
    assert p.hold == {("light", 0)}
    assert p.rt_slowdown == (("rt", pytest.approx(1.25 / 1.2)),)


def test_a_model_running_real_time_work_is_not_padded_against() -> None:
    node = [rt_running(), V("rt", 1, frozenset({1}), True, running_cls=BE, running_batch=3)]
    assert pad(node, {"rt": 2.0}.get, 1.0).stop == ()


def test_apply_holds_instances_and_adds_each_stop_once() -> None:
    node = [rt_running(), be("light", running=True, started=0.0), be("heavy", running=True, instance=1, started=0.1),
            be("mid", instance=2)]
    d = decide(PriorityMode.IDLE, node)
    p = pad(node, FBR.get, 1.0)
    d = apply(d, p)
    assert d.may_start[("mid", 2)] == {RT} and d.may_start[("light", 0)] == {RT, BE}
    assert d.preempt == [("heavy", 1, 7)]
    assert apply(d, p).preempt == [("heavy", 1, 7)]
