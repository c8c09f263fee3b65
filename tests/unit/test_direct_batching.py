"""When a worker's direct batch starts (worker/direct_batching.py): the model's batching
policy asked over the calls the endpoint holds, on a clock passed in."""

from __future__ import annotations

from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.policy import Adaptive, Timeout
from splitserve.worker.direct_batching import BatchGate, direct_policy
from splitserve.worker.direct_conn import _Call

RT = RequestClass.RT
MS = 1_000_000


def call(row: int, count: int, t_rx_ns: int) -> _Call:
    c = _Call(None, row, RT, count, 0, 0, t_rx_ns)  # type: ignore[arg-type]  # no connection: a decision only
    c.row = row
    return c


def config(batching: dict) -> ModelConfig:
    return ModelConfig.from_dict({"name": "m", "max_batch_size": 8, "batching": batching,
                                  "artifact": {"kind": "zoo", "arch": "vecadd1k"},
                                  "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
                                  "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}]})


def test_work_conserving_and_none_start_at_once_and_packrat_waits_for_b_or_its_timeout():
    assert direct_policy(config({}), 8, None) is None
    assert direct_policy(config({"policy": "none"}), 8, None) is None
    packrat = direct_policy(config({}), 4, 0.002)
    assert isinstance(packrat, Timeout) and packrat.preferred == 4 and packrat.max_delay_s == 0.002


def test_timeout_holds_the_batch_until_preferred_samples_or_the_delay():
    gate = BatchGate(direct_policy(config({"policy": "timeout", "max_delay_ms": 2.0, "preferred_batch": 4}), 8,
                                   None), 8)  # type: ignore[arg-type]
    calls = [call(0, 1, 10 * MS), call(1, 2, 10 * MS)]
    assert gate.due(RT, calls, 0.0105) == (False, 0.012)  # 3 samples, 0.5 ms waited: ask again at 2 ms
    assert gate.due(RT, calls, 0.012)[0]  # the delay passed
    assert gate.due(RT, [*calls, call(3, 1, 11 * MS)], 0.0105)[0]  # 4 samples
    assert gate.due(RT, [], 1.0) == (False, None)


def test_adaptive_releases_at_a_boundary_and_numbers_keep_growing_across_batches():
    policy = direct_policy(config({"policy": "adaptive", "quantum_ms": 5.0, "rule": "fixed",
                                   "threshold_cap": 1}), 8, None)
    assert isinstance(policy, Adaptive)
    gate = BatchGate(policy, 8)
    first = [call(0, 1, 0), call(1, 1, 0)]
    gate.arrivals(RT, first, 0.0)
    due, wake = gate.due(RT, first, 0.001)
    assert not due and wake == 0.005  # before the quantum's boundary
    assert gate.due(RT, first, 0.006)[0]  # two samples before it, above the threshold of one
    gate.rows_freed(RT, 2)
    second = [call(0, 1, 7 * MS), call(1, 1, 7 * MS)]  # rows 0 and 1 again, later numbers than the released run's
    gate.arrivals(RT, second, 0.007)
    assert not gate.due(RT, second, 0.008)[0]  # not taken for the first run's release: they wait for their boundary
    assert gate.due(RT, second, 0.011)[0]
