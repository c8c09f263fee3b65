"""Packrat's batch-size estimator, driven by a fake clock and seeded queue-depth traces."""

from __future__ import annotations

import random
from typing import Any

import pytest

from splitserve.errors import InvalidInput
from splitserve.placement.estimator import BatchSizeEstimator

STEP_S = 0.1  # one queue-depth observation every 100 ms of fake time


def drive(
    est: BatchSizeEstimator,
    phases: list[tuple[float, float, int]],
    current: int,
    seed: int,
    start: float = 0.0,
) -> tuple[list[tuple[float, int]], int]:
    """Feed (mean, sd, count) phases of Gaussian queue depths, acting on every proposal as the
    scheduler would; returns the (time, new batch) reconfigurations and the final batch."""
    rng = random.Random(seed)
    changes: list[tuple[float, int]] = []
    i = 0
    for mean, sd, count in phases:
        for _ in range(count):
            now = start + i * STEP_S
            i += 1
            est.observe(max(0, round(rng.gauss(mean, sd))), now)
            proposal = est.should_reconfigure(current, now)
            if proposal is not None:
                changes.append((now, proposal))
                current = proposal
                est.mark_reconfigured(now)
    return changes, current


@pytest.mark.parametrize("seed", range(5))
def test_noisy_constant_load_settles_once_without_flip_flop(seed: int) -> None:
    # Depth 8 ± 2 sits on the 4/8 boundary: the paper's bare mode flips here (see module doc).
    est = BatchSizeEstimator(reconfig_timeout_s=5.0)
    changes, final = drive(est, [(8.0, 2.0, 1000)], current=1, seed=seed)
    assert len(changes) == 1, changes
    assert final in (4, 8)
    assert changes[0][0] >= 5.0  # even the first change waits a timeout from start-up


@pytest.mark.parametrize("seed", range(3))
def test_load_step_gives_one_reconfiguration_to_16(seed: int) -> None:
    est = BatchSizeEstimator(reconfig_timeout_s=10.0)
    est.observe(5, 0.0)
    est.mark_reconfigured(0.0)
    # 20 s at depth ~5 (batch 4 is right), then the load jumps to ~20 (batch 16).
    changes, final = drive(est, [(5.0, 1.0, 200), (20.0, 3.0, 800)], current=4, seed=seed)
    assert [batch for _, batch in changes] == [16]
    step_time = 200 * STEP_S
    assert step_time <= changes[0][0] <= step_time + 5.0
    assert final == 16


def test_reconfiguration_waits_for_the_timeout() -> None:
    est = BatchSizeEstimator(reconfig_timeout_s=10.0, window=8)
    proposals = []
    for i in range(150):  # constant depth 32 from t = 0 to 14.9 s
        now = i * STEP_S
        est.observe(32, now)
        proposals.append((now, est.should_reconfigure(4, now)))
    # Nothing before the timeout (counted from the first observation), 32 right after it.
    assert all(p is None for now, p in proposals if now < 10.0)
    assert all(p == 32 for now, p in proposals if now >= 10.0)
    est.mark_reconfigured(15.0)
    for i in range(150):  # the load collapses to depth 2
        now = 15.0 + i * STEP_S
        est.observe(2, now)
        proposal = est.should_reconfigure(32, now)
        if now < 25.0:
            assert proposal is None, now
    assert est.should_reconfigure(32, 25.0) == 2


def test_hysteresis_band_keeps_the_current_batch() -> None:
    # alpha = 1: the EWMA is the last depth, so the band is easy to place.
    est = BatchSizeEstimator(alpha=1.0, window=4, reconfig_timeout_s=0.0)
    for i in range(4):
        est.observe(7, float(i))
    assert est.smoothed() == 4
    assert est.should_reconfigure(8, 4.0) is None  # 7 >= 8 * 2**-0.4 ≈ 6.06: stay at 8
    for i in range(4):
        est.observe(5, 4.0 + i)
    assert est.should_reconfigure(8, 8.0) == 4
    paper = BatchSizeEstimator(alpha=1.0, window=4, reconfig_timeout_s=0.0, hysteresis=0.0)
    for i in range(4):
        paper.observe(7, float(i))
    assert paper.should_reconfigure(8, 4.0) == 4


def test_a_minority_mode_does_not_reconfigure() -> None:
    est = BatchSizeEstimator(alpha=1.0, window=4, reconfig_timeout_s=0.0)
    for depth in (16, 1, 2, 16):  # mode 16 holds 2 of 4: a majority of the window
        est.observe(depth, 0.0)
    assert est.should_reconfigure(4, 1.0) == 16
    est = BatchSizeEstimator(alpha=1.0, window=5, reconfig_timeout_s=0.0)
    for depth in (16, 1, 2, 16, 64):  # mode 16 holds 2 of 5: wait
        est.observe(depth, 0.0)
    assert est.smoothed() == 16
    assert est.should_reconfigure(128, 1.0) is None


def test_estimates_are_powers_of_two_within_bounds() -> None:
    est = BatchSizeEstimator(alpha=1.0, window=1, max_batch=64)
    assert est.smoothed() is None and est.ewma is None
    est.observe(0, 0.0)
    assert est.smoothed() == 1
    est.observe(13, 1.0)
    assert est.smoothed() == 8
    est.observe(5000, 2.0)
    assert est.smoothed() == 64


def test_first_observation_seeds_the_ewma() -> None:
    est = BatchSizeEstimator(alpha=0.1)
    est.observe(20, 0.0)
    assert est.ewma == 20.0
    est.observe(10, 0.1)
    assert est.ewma == pytest.approx(19.0)


def test_mode_ties_go_to_the_larger_batch() -> None:
    est = BatchSizeEstimator(alpha=1.0, window=4)
    for depth in (4, 4, 8, 8):
        est.observe(depth, 0.0)
    assert est.smoothed() == 8


def test_no_proposal_until_the_window_is_full() -> None:
    est = BatchSizeEstimator(alpha=1.0, window=4, reconfig_timeout_s=0.0)
    for i in range(3):
        est.observe(64, float(i))
        assert est.should_reconfigure(1, float(i)) is None
    est.observe(64, 3.0)
    assert est.should_reconfigure(1, 3.0) == 64


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"window": 0},
        {"reconfig_timeout_s": -1.0},
        {"max_batch": 0},
        {"hysteresis": -0.1},
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        BatchSizeEstimator(**kwargs)


def test_invalid_observations_are_refused() -> None:
    est = BatchSizeEstimator()
    with pytest.raises(InvalidInput):
        est.observe(-1, 0.0)
    with pytest.raises(InvalidInput):
        est.should_reconfigure(0, 0.0)
