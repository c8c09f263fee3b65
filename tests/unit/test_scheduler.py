import pytest

from splitserve.errors import InvalidInput, QueueFull
from splitserve.modelconfig import BatchingConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ModelScheduler, Residency
from splitserve.scheduler.policy import NoBatching, Timeout, WorkConserving, make_policy
from splitserve.scheduler.request import QueuedRequest

BE, RT = RequestClass.BE, RequestClass.RT


def req(seq, t=0.0, count=1, cls=BE, deadline=None):
    return QueuedRequest(seq, count, cls, t, deadline)


def sched(policy=None, instances=1, max_batch=8, limit=64):
    s = ModelScheduler("m", policy or WorkConserving(), max_batch, limit)
    for _ in range(instances):
        s.set_residency(s.add_instance(), Residency.RESIDENT)
    return s


def test_work_conserving_takes_everything_waiting_up_to_max_batch():
    s = sched(max_batch=4)
    for i in range(6):
        s.enqueue(req(i))
    (b,) = s.schedule(0.0)
    assert (b.seq, b.count) == (0, 4)
    assert s.schedule(0.0) == []  # the only instance is busy
    s.complete(0)
    (b2,) = s.schedule(0.1)
    assert (b2.seq, b2.count) == (4, 2)


def test_batches_are_contiguous_runs_of_slots():
    s = sched()
    s.enqueue(req(0))
    s.enqueue(req(2))  # slot 1 is still receiving
    (b,) = s.schedule(0.0)
    assert (b.seq, b.count) == (0, 1)
    s.complete(0)
    s.enqueue(req(1))  # arrives late: goes before 2 and joins it
    (b,) = s.schedule(0.0)
    assert (b.seq, b.count, [r.seq for r in b.requests]) == (1, 2, [1, 2])


def test_multi_sample_requests_count_samples_against_max_batch():
    s = sched(max_batch=4)
    s.enqueue(req(0, count=3))
    s.enqueue(req(3, count=3))
    (b,) = s.schedule(0.0)
    assert b.count == 3 and len(b.requests) == 1


def test_real_time_is_never_behind_best_effort():
    s = sched()
    s.enqueue(req(0, cls=BE))
    s.enqueue(req(0, cls=RT))
    (b,) = s.schedule(0.0)
    assert b.cls is RT


def test_timeout_policy_waits_for_preferred_or_delay():
    s = sched(Timeout(0.010, 4))
    s.enqueue(req(0, t=0.0))
    assert s.schedule(0.001) == []
    assert s.next_wakeup(0.001) == pytest.approx(0.010)
    (b,) = s.schedule(0.011)
    assert b.count == 1
    s.complete(0)
    for i in range(1, 5):
        s.enqueue(req(i, t=0.02))
    (b,) = s.schedule(0.02)
    assert b.count == 4


def test_no_batching_runs_one_request_per_dispatch():
    s = sched(NoBatching(), instances=2)
    for i in range(3):
        s.enqueue(req(i))
    bs = s.schedule(0.0)
    assert [(b.instance, b.count) for b in bs] == [(0, 1), (1, 1)]


def test_deadlines_expire_waiting_requests():
    s = sched()
    s.instances[0].residency = Residency.ABSENT
    s.enqueue(req(0, deadline=1.0))
    s.enqueue(req(1))
    assert [r.seq for r in s.expire(2.0)] == [0]
    assert s.waiting() == 1


def test_bounded_queue_refuses():
    s = sched(limit=2)
    s.enqueue(req(0))
    s.enqueue(req(1))
    with pytest.raises(QueueFull):
        s.enqueue(req(2))


def test_a_worker_that_goes_down_returns_its_batch():
    s = sched()
    s.enqueue(req(0))
    (b,) = s.schedule(0.0)
    assert s.set_residency(0, Residency.ABSENT) == [b]
    assert s.schedule(0.0) == []


def test_policy_factory_refuses_unknown_names():
    assert isinstance(make_policy(BatchingConfig("timeout", 1.0, 2)), Timeout)
    with pytest.raises(InvalidInput, match="batching.policy"):
        BatchingConfig("fifo")


def test_instances_with_their_own_batch_size_take_slices_of_one_run():
    s = sched(instances=0)
    a = s.add_instance(max_batch=2)
    b = s.add_instance(max_batch=3)
    s.set_residency(a, Residency.RESIDENT)
    s.set_residency(b, Residency.RESIDENT)
    for i in range(5):
        s.enqueue(req(i))
    bs = s.schedule(0.0)
    assert [(x.instance, x.seq, x.count) for x in bs] == [(a, 0, 2), (b, 2, 3)]


def test_active_passive_switch_and_scale_in_place():
    s = sched(instances=2)
    old = s.serving()
    new = [s.add_instance(standby=True) for _ in range(3)]
    for i in new:
        s.set_residency(i, Residency.RESIDENT)
    s.enqueue(req(0))
    (x,) = s.schedule(0.0)
    assert x.instance in old  # standby instances take nothing yet
    s.activate(new, old)
    s.enqueue(req(1))
    (y,) = s.schedule(0.0)
    assert y.instance in new and s.serving() == new
    s.complete(x.instance)
    for i in old:
        s.remove(i)
    added, drain = s.resize(1)
    assert added == [] and drain == new[1:]
    added, drain = s.resize(3)
    assert len(added) == 2 and drain == []


def test_edf_puts_the_most_urgent_real_time_request_first_and_keeps_batches_contiguous():
    s = ModelScheduler("m", WorkConserving(), 2, 64, rt_policy="edf")
    s.set_residency(s.add_instance(), Residency.RESIDENT)
    for seq, deadline in ((0, 9.0), (1, 5.0), (2, 7.0), (3, None)):
        s.enqueue(req(seq, cls=RT, deadline=deadline))
    (b,) = s.schedule(0.0)
    assert [r.seq for r in b.requests] == [1, 2]  # slot 1 is most urgent; slot 2 follows it
    s.complete(b.instance)
    (b,) = s.schedule(0.0)
    assert [r.seq for r in b.requests] == [0]  # slot 3 is not contiguous with slot 0
    with pytest.raises(InvalidInput, match="rt_policy"):
        ModelScheduler("m", WorkConserving(), 2, 64, rt_policy="lifo")


def _preempted_on_draining_instance():
    """The review's §1.1 set-up: a BE batch preempted on instance 0, which is then retired."""
    s = sched(instances=2)
    s.enqueue(req(0))
    (b,) = s.schedule(0.0)
    assert b.instance == 0
    s.preempted(0, restore_segment=1)
    s.instances[0].draining = True  # resize / reconfigure / repack retires it
    return s, b


def test_a_draining_instance_resumes_its_preempted_batch_so_its_drain_ends():
    s, b = _preempted_on_draining_instance()
    (resumed,) = s.schedule(0.1)
    assert resumed is b and resumed.instance == 0 and resumed.resume_segment == 1
    s.enqueue(req(1))
    (new,) = s.schedule(0.2)
    assert new.instance == 1  # the draining instance takes nothing new
    assert s.complete(0, b.batch_id) is b
    assert not s.instances[0].busy  # the drain can end


def test_a_batch_handed_back_by_a_draining_instance_reruns_from_segment_0_elsewhere():
    s, b = _preempted_on_draining_instance()
    s.requeue(s.take_suspended(0))
    assert not s.instances[0].busy
    (again,) = s.schedule(0.1)
    assert again.instance == 1 and again.resume_segment == 0 and again.requests == b.requests


def test_a_report_for_another_batch_leaves_the_running_batch_in_place():
    s = sched()
    s.enqueue(req(0))
    (b,) = s.schedule(0.0)
    assert s.complete(0, b.batch_id + 1) is None
    assert s.instances[0].running is b  # still owed its answer
    assert s.complete(0, b.batch_id) is b
