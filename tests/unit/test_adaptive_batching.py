"""The ``adaptive`` batching policy (Rafiqi §3.3, §7.3) on a fake clock: the threshold's
exact traces, its bounds, the rules the paper rejected, and the policy driven through
``ModelScheduler`` the way the runtime drives it (enqueue, schedule, the timer at
``next_wakeup``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.errors import InvalidInput
from splitserve.modelconfig import BatchingConfig, ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ModelScheduler, Residency
from splitserve.scheduler.policy import Adaptive, AdaptiveThreshold, ThresholdRule, make_policy
from splitserve.scheduler.request import QueuedRequest

BE, RT = RequestClass.BE, RequestClass.RT
Q = 0.010  # the quantum of Rafiqi's Fig. 5


def sched(policy: Adaptive, max_batch: int = 128, limit: int = 4096) -> ModelScheduler:
    s = ModelScheduler("m", policy, max_batch, limit)
    s.set_residency(s.add_instance(), Residency.RESIDENT)
    return s


class Feeder:
    """Enqueues requests of one sample each with consecutive slots, as the intake would."""

    def __init__(self, s: ModelScheduler) -> None:
        self.s = s
        self.seq = 0

    def send(self, now: float, n: int = 1, cls: RequestClass = BE, deadline: float | None = None) -> None:
        for _ in range(n):
            self.s.enqueue(QueuedRequest(self.seq, 1, cls, now, deadline))
            self.seq += 1


def test_ewma_rises_gradually():
    th = AdaptiveThreshold(ThresholdRule.EWMA, alpha=0.5, cap=128)
    assert [th.update(10) for _ in range(3)] == [5.0, 7.5, 8.75]
    assert th.update(8.75) == 8.75  # c == t leaves it (E3)


def test_ewma_trace_through_the_policy_counts_arrivals_per_quantum():
    p = Adaptive(Q)
    s = sched(p)
    f = Feeder(s)
    p.advance(0.0)  # the quantum clock starts at the first event: boundaries at Q, 2Q, ...
    seen = []
    for k in range(3):  # 10 samples in each quantum
        f.send(k * Q + Q / 2, 10)
        p.advance((k + 1) * Q + Q / 4)
        seen.append(p.threshold(BE).t)
    assert seen == [5.0, 7.5, 8.75]


def test_from_the_cap_it_halves_to_zero_in_eight_quanta():
    th = AdaptiveThreshold(cap=128)
    assert th.update(256) == 128  # capped
    assert [th.update(0) for _ in range(8)] == [64, 32, 16, 8, 4, 2, 1, 0]
    th2 = AdaptiveThreshold(cap=128)
    th2.update(256)
    assert th2.update(0, quanta=3) == 16  # k missed boundaries: k - 1 extra halvings
    assert th2.update(0, quanta=10**9) == 0  # a long idle neither overflows nor loops


def test_missed_boundaries_are_counted_when_the_next_event_comes():
    p = Adaptive(Q)
    s = sched(p, max_batch=512)
    f = Feeder(s)
    f.send(0.0, 256)  # quantum [0, Q): 256 arrivals; full batches go at once
    while s.schedule(0.0):
        s.complete(0)
    p.advance(Q + 1e-4)  # a boundary passes: t = min(128, 128) = 128
    assert p.threshold(BE).t == 128
    p.advance(4 * Q + 1e-4)  # three more boundaries, all empty, passed at once
    assert p.threshold(BE).t == 16


@given(st.sampled_from(list(ThresholdRule)), st.integers(1, 300),
       st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 5)), max_size=40))
def test_the_threshold_stays_within_zero_and_the_cap(rule, cap, steps):
    th = AdaptiveThreshold(rule, 0.5, cap)
    for c, k in steps:
        t = th.update(c, k)
        assert t == 0 or 1 <= t <= cap


def test_aimd_rises_by_the_arrivals_and_fixed_never_moves():
    aimd = AdaptiveThreshold(ThresholdRule.AIMD, cap=128)
    assert [aimd.update(c) for c in (10, 15, 5, 200)] == [10, 25, 12.5, 128]
    fixed = AdaptiveThreshold(ThresholdRule.FIXED, cap=32)
    assert [fixed.update(c) for c in (0, 1000, 0)] == [32, 32, 32]


def test_fixed_threshold_never_dispatches_a_lone_request_only_its_deadline_ends_the_wait():
    s = sched(make_policy(BatchingConfig(policy="adaptive", rule="fixed", threshold_cap=32, quantum_ms=10)))
    f = Feeder(s)
    f.send(0.0, deadline=1.0)
    now = 0.0
    while now < 1.0:
        assert s.schedule(now) == []
        now = s.next_wakeup(now)
    assert now == 1.0  # the deadline is the last wakeup
    assert s.expire(1.0 + 1e-9) and s.waiting() == 0


def test_the_timer_wakes_at_the_quantum_boundaries():
    s = sched(Adaptive(Q))
    f = Feeder(s)
    f.send(0.003)  # the first event starts the quantum clock: boundaries at 0.013, 0.023, ...
    assert s.schedule(0.003) == []  # arrived after the latest boundary: waits for the next
    wake = s.next_wakeup(0.003)
    assert wake == pytest.approx(0.013)
    (b,) = s.schedule(wake)  # c = 1 > t = 0: t = 0.5, below 1 so 0, and 1 > 0
    assert b.count == 1
    s.complete(0)
    f.send(0.0131)
    assert s.schedule(0.0131) == [] and s.next_wakeup(0.0131) == pytest.approx(0.023)
    f.send(0.1)  # after an idle stretch the boundaries keep their phase
    wake = s.next_wakeup(0.1)
    assert wake == pytest.approx(0.103)
    assert [b.count for b in s.schedule(wake)] == [2]  # the earlier request was released with it


def test_a_boundary_with_every_instance_busy_is_tested_when_one_frees_up():
    s = sched(Adaptive(Q))
    f = Feeder(s)
    f.send(0.0)
    f.send(Q / 2)
    (b,) = s.schedule(Q)
    assert b.count == 2
    f.send(Q + 0.001, 3)
    assert s.schedule(2 * Q) == []  # busy at the boundary: no test
    s.complete(0)
    f.send(2 * Q + 0.002)  # arrived after the boundary: not part of its test
    (b,) = s.schedule(2 * Q + 0.003)  # t = 1.25 at 2Q; 3 waited then > 1.25
    assert b.count == 3


def test_a_full_batch_runs_at_once_and_a_released_run_drains_as_instances_free():
    s = sched(Adaptive(Q), max_batch=4)
    f = Feeder(s)
    f.send(0.001, 4)
    (b,) = s.schedule(0.001)  # mid-quantum, t = 0: a full batch cannot grow by waiting
    assert b.count == 4
    s.complete(0)
    f.send(0.002, 3)
    assert s.schedule(0.002) == []
    f.send(0.0112, 3)  # after the boundary (0.011): not released with the first three
    (b,) = s.schedule(0.0115)  # c = 7 at the boundary: t = 3.5 ... 3 waited is not > 3.5
    assert b.count == 4  # ... but 6 queued, so only a full batch can go; 6 >= 4
    s.complete(0)
    assert s.schedule(0.0116) == []  # 2 left, t = 3.5: they wait


def test_each_class_has_its_own_threshold():
    p = Adaptive(Q)
    s = sched(p)
    f = Feeder(s)
    f.send(0.0, 20, cls=BE)
    f.send(0.0, 1, cls=RT)
    p.advance(Q)
    assert p.threshold(BE).t == 10 and p.threshold(RT).t == 0


def test_adaptive_quantum_follows_the_batch_compute_time():
    p = make_policy(BatchingConfig(policy="adaptive", quantum_ms=10, adaptive_quantum=True, quantum_beta=0.5))
    s = sched(p)
    f = Feeder(s)
    f.send(0.0)
    s.batch_done(0.002)  # quantum 0.5*10 + 0.5*2 = 6 ms, from the boundary after this one
    assert s.next_wakeup(0.0) == pytest.approx(0.010)
    s.schedule(0.010)
    assert s.next_wakeup(0.010) is None  # nothing waits
    f.send(0.011)
    assert s.next_wakeup(0.011) == pytest.approx(0.016)
    fixed = Adaptive(Q)
    fixed.batch_time(0.002)
    assert fixed.quantum_s == Q  # off by default


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 256), max_batch=st.integers(1, 64),
       arrivals=st.lists(st.tuples(st.floats(0, 0.2), st.integers(1, 40)), min_size=1, max_size=25))
def test_after_arrivals_stop_everything_is_dispatched_within_log2_cap_plus_one_quanta(cap, max_batch, arrivals):
    """From the end of the quantum in which the last request came, the threshold halves at
    every boundary, so by ceil(log2(cap)) + 1 boundaries it is 0 and whatever waits goes."""
    p = Adaptive(Q, cap=cap)
    s = sched(p, max_batch=max_batch)
    f = Feeder(s)
    arrivals.sort()
    now, pending, bound = 0.0, list(arrivals), math.inf

    while pending or s.waiting():
        wake = s.next_wakeup(now)
        if pending and (wake is None or pending[0][0] <= wake):
            now, n = pending.pop(0)
            f.send(now, n)
            if not pending:  # the last quantum with arrivals ends here
                bound = p._q_end + (math.ceil(math.log2(cap)) + 1) * Q
        else:
            assert wake is not None and wake > now  # something waits: the timer is armed, later
            now = wake
        while batches := s.schedule(now):  # an instance that finishes at once drains what is released
            for b in batches:
                s.complete(b.instance)
        assert now <= bound + 1e-9 or not s.waiting()


def test_config_validation_and_run_time_changes():
    cfg = BatchingConfig(policy="adaptive")
    assert (cfg.quantum_ms, cfg.alpha, cfg.threshold_cap, cfg.rule, cfg.adaptive_quantum, cfg.quantum_beta) == \
        (5.0, 0.5, 128, "ewma", False, 0.5)
    for bad, match in (({"alpha": 1.0}, "alpha"), ({"alpha": 0}, "alpha"), ({"threshold_cap": 0}, "threshold_cap"),
                       ({"quantum_ms": 0}, "quantum_ms"), ({"quantum_beta": 1}, "quantum_beta"),
                       ({"rule": "tcp"}, "ewma, aimd, fixed"), ({"alpha": "x"}, "must be a number"),
                       ({"threshold_cap": 2.5}, "must be an integer"), ({"adaptive_quantum": 1}, "true or false"),
                       ({"rule": 3}, "must be a string"), ({"quantum": 5}, "unknown batching keys")):
        with pytest.raises(InvalidInput, match=match):
            cfg.changed(bad)
    new = cfg.changed({"rule": "aimd", "quantum_ms": 10, "policy": None})
    assert new.rule is ThresholdRule.AIMD and new.quantum_ms == 10.0 and new.policy == "adaptive"
    toml = ('name = "m"\nmax_batch_size = 128\n[batching]\npolicy = "adaptive"\nquantum_ms = 10\nrule = "aimd"\n'
            '[artifact]\nkind = "zoo"\narch = "lenet"\n')
    mc = ModelConfig.from_toml(toml)
    assert mc.batching == BatchingConfig(policy="adaptive", quantum_ms=10.0, rule="aimd")
    assert ModelConfig.from_dict(mc.to_dict()).batching == mc.batching  # what the registry stores comes back
    with pytest.raises(InvalidInput, match="alpha"):
        ModelConfig.from_toml(toml.replace('rule = "aimd"', "alpha = 2.0"))
