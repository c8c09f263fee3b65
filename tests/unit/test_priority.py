"""The pure REEF policy (``scheduler.priority``) over synthetic node views.

Each test builds a list of ``InstanceView`` by hand and checks one rule of ``decide`` or
``rt_claims``; the property tests at the end check the rules that must hold on any node.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.errors import InvalidInput
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import InstanceView, PriorityMode, decide, rt_claims

RT, BE = RequestClass.RT, RequestClass.BE
BOTH = {RT, BE}


def inst(model: str, i: int, cpus: set[int], *, running: RequestClass | None = None, batch: int = 0,
         raised: bool = False, end: float | None = None, suspended: bool = False, rt_waiting: int = 0,
         ready: bool = True) -> InstanceView:
    return InstanceView(model=model, instance=i, cpus=frozenset(cpus), ready=ready, running_cls=running,
                        running_batch=batch, preempt_raised=raised, expected_end=end, suspended=suspended,
                        rt_waiting=rt_waiting)


# -- modes ---------------------------------------------------------------------------------------


def test_parse_names_every_mode_and_refuses_others():
    assert [PriorityMode.parse(m.value) for m in PriorityMode] == list(PriorityMode)
    with pytest.raises(InvalidInput, match="reef"):
        PriorityMode.parse("fifo")


@pytest.mark.parametrize("mode", [PriorityMode.CONCURRENT, PriorityMode.RT_ONLY])
def test_concurrent_and_rt_only_let_everything_run_side_by_side(mode):
    node = [inst("a", 0, {0}, running=RT, batch=1, end=5.0, rt_waiting=3),
            inst("b", 0, {0}, running=BE, batch=2),
            inst("b", 1, {1}, suspended=True)]
    d = decide(mode, node)
    assert d.may_start == {("a", 0): BOTH, ("b", 0): BOTH, ("b", 1): BOTH}
    assert d.preempt == [] and d.padding_deadline == {} and not d.rt_mode


def test_seq_runs_one_batch_at_a_time_on_the_whole_node():
    busy = [inst("a", 0, {0}, running=BE, batch=1), inst("b", 0, {1}, rt_waiting=1)]
    d = decide(PriorityMode.SEQ, busy)
    assert d.may_start == {("a", 0): set(), ("b", 0): set()}
    assert d.preempt == []  # seq never interrupts, not even for RT work


def test_seq_on_an_idle_node_starts_rt_first_then_anything():
    rt_waiting = [inst("a", 0, {0}), inst("b", 0, {1}, rt_waiting=2)]
    assert decide(PriorityMode.SEQ, rt_waiting).may_start == {("a", 0): {RT}, ("b", 0): {RT}}
    quiet = [inst("a", 0, {0}), inst("b", 0, {1})]
    assert decide(PriorityMode.SEQ, quiet).may_start == {("a", 0): BOTH, ("b", 0): BOTH}


# -- rt_claims -----------------------------------------------------------------------------------


def test_no_rt_work_claims_nothing_and_reef_is_in_normal_mode():
    node = [inst("a", 0, {0}, running=BE, batch=1), inst("b", 0, {1})]
    assert rt_claims(node) == frozenset()
    d = decide(PriorityMode.REEF, node)
    assert not d.rt_mode and d.preempt == []
    assert d.may_start == {("a", 0): BOTH, ("b", 0): BOTH}
    assert d.padding_deadline == {("a", 0): 0.0}  # BE runs without a padding limit


def test_running_rt_claims_its_cpus_even_on_an_instance_not_ready_any_more():
    node = [inst("a", 0, {0, 1}, running=RT, batch=1, ready=False), inst("a", 1, {2})]
    assert rt_claims(node) == {0, 1}


def test_waiting_rt_claims_the_first_idle_instance_of_its_model():
    node = [inst("a", 0, {0}, running=BE, batch=1, rt_waiting=1), inst("a", 1, {1}, rt_waiting=1),
            inst("a", 2, {2}, rt_waiting=1)]
    assert rt_claims(node) == {1}


def test_waiting_rt_without_an_idle_instance_claims_the_be_batch_being_preempted():
    node = [inst("a", 0, {0}, running=BE, batch=1, rt_waiting=1),
            inst("a", 1, {1}, running=BE, batch=2, raised=True, rt_waiting=1)]
    assert rt_claims(node) == {1}  # not a second victim while one is already on its way out
    node[1] = inst("a", 1, {1}, running=BE, batch=2, rt_waiting=1)
    assert rt_claims(node) == {0}  # none raised yet: the first


def test_waiting_rt_behind_rt_claims_nothing_more():
    node = [inst("a", 0, {0}, running=RT, batch=1, rt_waiting=4), inst("b", 0, {1}, running=BE, batch=2)]
    assert rt_claims(node) == {0}  # RT waits for RT; BE elsewhere is not a victim


def test_instances_not_ready_are_never_claimed_for_waiting_rt():
    node = [inst("a", 0, {0}, ready=False, rt_waiting=1), inst("a", 1, {1}, running=BE, batch=3, rt_waiting=1)]
    assert rt_claims(node) == {1}


# -- REEF: preemption ----------------------------------------------------------------------------


def test_reef_preempts_be_on_cpus_that_rt_work_claims_across_models():
    node = [inst("a", 0, {0, 1}, running=RT, batch=1, end=2.0),
            inst("b", 0, {1, 2}, running=BE, batch=7),  # shares cpu 1 with the RT batch
            inst("c", 0, {3}, running=BE, batch=9)]
    d = decide(PriorityMode.REEF, node)
    assert d.rt_mode
    assert d.preempt == [("b", 0, 7)]
    assert d.may_start[("b", 0)] == {RT}
    assert d.may_start[("c", 0)] == BOTH


def test_reef_raises_each_preemption_once():
    node = [inst("a", 0, {0}, running=RT, batch=1, end=2.0), inst("b", 0, {0}, running=BE, batch=7, raised=True)]
    d = decide(PriorityMode.REEF, node)
    assert d.preempt == []
    assert ("b", 0) not in d.padding_deadline  # being preempted, not padded


def test_reef_preempts_the_victim_of_waiting_rt_on_its_own_model():
    node = [inst("a", 0, {0}, running=BE, batch=5, rt_waiting=1)]
    d = decide(PriorityMode.REEF, node)
    assert d.preempt == [("a", 0, 5)]
    assert d.may_start[("a", 0)] == {RT}


def test_reef_never_preempts_rt():
    node = [inst("a", 0, {0}, running=RT, batch=1, end=1.0), inst("b", 0, {0}, running=RT, batch=2, end=1.5)]
    assert decide(PriorityMode.REEF, node).preempt == []


# -- REEF: padding -------------------------------------------------------------------------------


def test_padding_deadline_is_the_earliest_expected_end_of_running_rt():
    node = [inst("a", 0, {0}, running=RT, batch=1, end=4.0),
            inst("a", 1, {1}, running=RT, batch=2, end=3.0),
            inst("b", 0, {2}, running=BE, batch=3),
            inst("b", 1, {3})]  # idle: nothing to pad
    d = decide(PriorityMode.REEF, node)
    assert d.padding_deadline == {("b", 0): 3.0}


def test_rt_without_a_profiled_end_gives_no_padding_limit():
    node = [inst("a", 0, {0}, running=RT, batch=1, end=None), inst("b", 0, {1}, running=BE, batch=3)]
    assert decide(PriorityMode.REEF, node).padding_deadline == {("b", 0): 0.0}


def test_rt_only_waiting_claims_cpus_but_sets_no_padding_limit_yet():
    # The limit follows the RT batch's expected end, known once it has started.
    node = [inst("a", 0, {0}, rt_waiting=1), inst("b", 0, {1}, running=BE, batch=3)]
    d = decide(PriorityMode.REEF, node)
    assert d.rt_mode and d.padding_deadline == {("b", 0): 0.0}


# -- REEF: the held rule -------------------------------------------------------------------------


def test_a_suspended_batch_is_held_while_rt_runs_anywhere():
    node = [inst("a", 0, {0}, running=RT, batch=1, end=2.0), inst("b", 0, {5}, suspended=True)]
    d = decide(PriorityMode.REEF, node)
    assert d.may_start[("b", 0)] == {RT}  # off the claimed cpus, but resuming would hit the limit again


def test_a_suspended_batch_may_resume_once_no_rt_runs():
    node = [inst("a", 0, {0}, rt_waiting=0), inst("b", 0, {5}, suspended=True)]
    assert decide(PriorityMode.REEF, node).may_start[("b", 0)] == BOTH


def test_waiting_rt_alone_does_not_hold_a_suspended_batch_elsewhere():
    node = [inst("a", 0, {0}, rt_waiting=1), inst("b", 0, {5}, suspended=True)]
    d = decide(PriorityMode.REEF, node)
    assert d.may_start[("a", 0)] == {RT}
    assert d.may_start[("b", 0)] == BOTH


# -- properties over any node --------------------------------------------------------------------


@st.composite
def nodes(draw) -> list[InstanceView]:
    models = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True))
    out: list[InstanceView] = []
    batch = 1
    for m in models:
        rt_waiting = draw(st.integers(0, 2))
        for i in range(draw(st.integers(1, 3))):
            running = draw(st.sampled_from([None, RT, BE]))
            out.append(inst(m, i, draw(st.sets(st.integers(0, 5), min_size=1, max_size=3)), running=running,
                            batch=batch if running else 0, raised=running == BE and draw(st.booleans()),
                            end=draw(st.none() | st.floats(0.5, 10.0)) if running == RT else None,
                            suspended=draw(st.booleans()), rt_waiting=rt_waiting, ready=draw(st.booleans())))
            batch += 1
    return out


@settings(max_examples=300, deadline=None)
@given(nodes())
def test_reef_keeps_be_off_every_cpu_that_rt_claims(node):
    d = decide(PriorityMode.REEF, node)
    claimed = rt_claims(node)
    rt_running = any(v.running_cls == RT for v in node)
    for v in node:
        k = (v.model, v.instance)
        assert RT in d.may_start[k]  # RT is never refused by the node
        assert (BE in d.may_start[k]) == (not (v.cpus & claimed) and not (v.suspended and rt_running))
        if v.running_cls == BE and v.cpus & claimed:
            # every BE batch on claimed cpus is stopped: now, or by a flag raised earlier
            assert v.preempt_raised or (v.model, v.instance, v.running_batch) in d.preempt
        if v.running_cls == BE and not v.cpus & claimed:
            assert k in d.padding_deadline
    assert all(m_i_b in {(v.model, v.instance, v.running_batch) for v in node
                         if v.running_cls == BE and not v.preempt_raised} for m_i_b in d.preempt)
    assert set(d.padding_deadline) <= {(v.model, v.instance) for v in node if v.running_cls == BE}
    assert d.rt_mode == bool(claimed)


@settings(max_examples=200, deadline=None)
@given(nodes())
def test_seq_allows_no_start_while_anything_runs_and_rt_before_be(node):
    d = decide(PriorityMode.SEQ, node)
    allowed = set().union(*d.may_start.values())
    if any(v.running_cls is not None for v in node):
        assert allowed == set()
    elif any(v.rt_waiting for v in node):
        assert allowed == {RT}
    assert d.preempt == [] and d.padding_deadline == {}


def test_idle_lets_everything_start_and_preempts_only_a_be_batch_blocking_rt_of_its_own_model():
    # the kernel puts rt first across instances: b's BE batch on a's CPU runs on; c's own
    # RT call waits for c's only instance, whose BE batch is stopped at a boundary, once
    node = [inst("a", 0, {0}, running=RT, batch=1, end=5.0, rt_waiting=1),
            inst("b", 0, {0}, running=BE, batch=2),
            inst("c", 0, {0}, running=BE, batch=3, rt_waiting=1)]
    d = decide(PriorityMode.IDLE, node)
    assert d.may_start == {("a", 0): BOTH, ("b", 0): BOTH, ("c", 0): BOTH}
    assert d.preempt == [("c", 0, 3)] and d.padding_deadline == {}
    node[2] = inst("c", 0, {0}, running=BE, batch=3, rt_waiting=1, raised=True)
    assert decide(PriorityMode.IDLE, node).preempt == []


def test_idle_sends_each_class_to_its_own_instance_of_a_model_with_be_instances():
    # c's instance 1 is kept for BE work: c's RT call takes instance 0, never preempting it
    node = [inst("c", 0, {0}, rt_waiting=1),
            InstanceView("c", 1, frozenset({0}), True, running_cls=BE, running_batch=3, rt_waiting=1,
                         best_effort=True),
            inst("b", 0, {0}, running=BE, batch=2)]
    d = decide(PriorityMode.IDLE, node)
    assert d.may_start == {("c", 0): {RT}, ("c", 1): {BE}, ("b", 0): BOTH}
    assert d.preempt == []
    node[0] = inst("c", 0, {0}, running=RT, batch=4, rt_waiting=1)  # busy: RT still waits for it
    assert decide(PriorityMode.IDLE, node).preempt == []


def test_idle_gives_both_classes_back_to_the_rt_instances_of_a_model_whose_be_instance_is_gone():
    # a scale-in drained c's only BE instance: its BE calls go to the RT instances again (at normal
    # priority, preempted at a segment boundary for their own model's RT work) rather than wait
    # for an instance that no longer exists
    node = [inst("c", 0, {0}, running=BE, batch=3, rt_waiting=1), inst("c", 2, {1})]
    d = decide(PriorityMode.IDLE, node)
    assert d.may_start == {("c", 0): BOTH, ("c", 2): BOTH}
    assert d.preempt == []  # c's RT call takes the idle instance 2
    node[1] = inst("c", 2, {1}, running=RT, batch=1, rt_waiting=1)
    assert decide(PriorityMode.IDLE, node).preempt == [("c", 0, 3)]
