import pytest

from splitserve.errors import InvalidInput
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.packrat import PackratConfig, PackratController
from splitserve.placement.topology import Core
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ModelScheduler, Residency
from splitserve.scheduler.policy import PackratAggregate
from splitserve.scheduler.request import QueuedRequest


def packrat_sched(bs, total, timeout=0.01):
    s = ModelScheduler("m", PackratAggregate(total, timeout), 32, 256)
    ids = [s.add_instance(max_batch=b) for b in bs]
    for i in ids:
        s.set_residency(i, Residency.RESIDENT)
    return s, ids


def push(s, n, t=0.0, start=0):
    for k in range(start, start + n):
        s.enqueue(QueuedRequest(k, 1, RequestClass.BE, t))


def test_aggregates_b_then_partitions_one_contiguous_run_by_instance_batch():
    s, (a, b) = packrat_sched([4, 4], total=8)
    push(s, 5)
    assert s.schedule(0.001) == []  # 5 < B=8 and the timeout has not passed
    push(s, 4, start=5)
    bs = s.schedule(0.002)
    assert [(x.instance, x.seq, x.count) for x in bs] == [(a, 0, 4), (b, 4, 4)]
    assert s.waiting() == 1  # the ninth request waits for the next aggregate


def test_timeout_releases_a_partial_batch_across_instances():
    s, (a, b) = packrat_sched([4, 4], total=8, timeout=0.01)
    push(s, 6)
    bs = s.schedule(0.02)
    assert [(x.instance, x.count) for x in bs] == [(a, 4), (b, 2)]


def test_controller_plans_and_pins():
    table = {(t, b): 1e-3 + b * 1e-4 * (0.5 + 0.5 / t) for t in (1, 2) for b in (1, 2, 4, 8, 16)}
    cores = [Core(0, 0, 0), Core(1, 1, 0)]
    pc = PackratController(PackratConfig(threads=2, batch=16), LatencyProfile("m", table), 16, cores)
    placements = pc.placements(pc.plan())
    assert [(p.threads, p.batch) for p in placements] == [(1, 8), (1, 8)]
    assert sorted(c for p in placements for c in p.cpus) == [0, 1]


def test_placement_config_is_checked():
    assert PackratConfig.parse({}, 8) is None
    assert PackratConfig.parse({"kind": "packrat", "threads": 2}, 8).batch == 8
    with pytest.raises(InvalidInput, match="placement.kind"):
        PackratConfig.parse({"kind": "magic"}, 8)
    with pytest.raises(InvalidInput, match="placement"):
        PackratConfig.parse({"kind": "packrat", "cores": 2}, 8)
