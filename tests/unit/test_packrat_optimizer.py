"""Packrat's optimizer: the dynamic program against exhaustive search, plan invariants, the
shape of the paper's Table 2 on a synthetic profile, and the latency profile itself."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.errors import InvalidInput
from splitserve.placement.optimizer import (
    InstanceShape,
    LatencyProfile,
    Plan,
    brute_force,
    optimize,
)

POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def synthetic(T: int, batches: tuple[int, ...] = POW2) -> LatencyProfile:
    """BERT-like profile: Amdahl thread scaling (serial fraction 0.3) of a per-batch cost.

    Each batch costs 200 ms of parallelizable fixed work (think weights streamed through the
    caches, the same for any batch size) plus 10 ms per input, all scaled by Amdahl's law,
    plus 2 ms of serial overhead. Fixed work makes many tiny instances wasteful while the
    sub-linear thread scaling makes one fat instance wasteful, which is what gives Packrat's
    Table 2 its shape.
    """
    serial = 0.3
    return LatencyProfile(
        "synthetic-bert",
        {(t, b): 0.002 + (0.2 + 0.01 * b) * (serial + (1 - serial) / t) for t in range(1, T + 1) for b in batches},
    )


def random_profile(rng: random.Random, T: int, B: int, kind: str) -> LatencyProfile:
    if kind == "monotone":
        # Decreasing in threads with diminishing returns, increasing in batch, with noise;
        # only powers of two measured so the interpolation is exercised.
        serial = rng.uniform(0.05, 0.6)
        fixed, per_item = rng.uniform(0.0, 0.3), rng.uniform(0.005, 0.05)
        batches = [b for b in POW2 if b <= B]
        table = {
            (t, b): (fixed + per_item * b) * (serial + (1 - serial) / t) * rng.uniform(0.9, 1.1) + 1e-3
            for t in range(1, T + 1)
            for b in batches
        }
    elif kind == "adversarial":
        # Every (t, b) measured and unrelated to its neighbours: more threads or a smaller
        # batch may well be slower.
        table = {(t, b): rng.uniform(0.1, 1.0) for t in range(1, T + 1) for b in range(1, B + 1)}
    else:
        # Few distinct values: many configurations tie at the optimum.
        table = {(t, b): float(rng.choice((1, 2, 3))) for t in range(1, T + 1) for b in range(1, B + 1)}
    return LatencyProfile(f"random-{kind}", table)


def check_invariants(plan: Plan, profile: LatencyProfile, T: int, B: int) -> None:
    assert plan.total_batch == B
    assert plan.total_threads <= T
    assert all(s.threads >= 1 and s.batch >= 1 and s.count >= 1 for s in plan.shapes)
    assert len({(s.threads, s.batch) for s in plan.shapes}) == len(plan.shapes), "merged"
    assert plan.latency == max(profile.latency(s.threads, s.batch) for s in plan.shapes)
    assert plan.latency <= plan.fat_latency
    assert plan.speedup >= 1.0


def test_optimizer_matches_brute_force_on_random_profiles() -> None:
    rng = random.Random(20240611)
    kinds = ("monotone", "adversarial", "ties")
    for case in range(54):
        kind = kinds[case % 3]
        T, B = rng.randint(1, 8), rng.randint(1, 32)
        profile = random_profile(rng, T, B, kind)
        plan = optimize(profile, T, B)
        expected = brute_force(profile, T, B)
        assert plan.latency == pytest.approx(expected, rel=1e-9), (kind, T, B)
        check_invariants(plan, profile, T, B)


def test_largest_brute_force_sizes_agree() -> None:
    profile = synthetic(8, batches=(1, 2, 4, 8, 16, 32))
    for B in (24, 31, 32):
        assert optimize(profile, 8, B).latency == pytest.approx(brute_force(profile, 8, B))


def test_invariants_hold_for_larger_random_inputs() -> None:
    rng = random.Random(7)
    for case in range(12):
        kind = ("monotone", "adversarial", "ties")[case % 3]
        T, B = rng.randint(1, 24), rng.randint(1, 96)
        profile = random_profile(rng, T, B, kind)
        check_invariants(optimize(profile, T, B), profile, T, B)
    profile = synthetic(64)
    check_invariants(optimize(profile, 64, 256), profile, 64, 256)


def test_reproduces_table2_shape_on_synthetic_profile() -> None:
    profile = synthetic(16)
    single = optimize(profile, 16, 1)
    assert single.shapes == (InstanceShape(threads=16, batch=1, count=1),)
    assert single.speedup == 1.0
    # Packrat's Table 2, T = 16 column (BERT): the synthetic profile lands on the same plans.
    table2 = {8: (2, 8, 4), 32: (4, 4, 8), 256: (8, 2, 32)}
    for B, (i, t, b) in table2.items():
        assert optimize(profile, 16, B).shapes == (InstanceShape(threads=t, batch=b, count=i),)
    for B in POW2:
        plan = optimize(profile, 16, B)
        check_invariants(plan, profile, 16, B)
        if B >= 8:
            # Several thin instances beat the fat one on large batches.
            assert plan.instances > 1
            assert max(s.threads for s in plan.shapes) < 16
            assert plan.latency < plan.fat_latency
    # Thinner instances as the batch grows, as in the table.
    widths = [max(s.threads for s in optimize(profile, 16, B).shapes) for B in POW2]
    assert widths == sorted(widths, reverse=True)


def test_mixed_shapes_when_threads_do_not_divide_evenly() -> None:
    # Appendix B: with T = 14 the best configurations mix instance shapes.
    profile = synthetic(14)
    plans = [optimize(profile, 14, B) for B in (32, 64, 128, 256)]
    for B, plan in zip((32, 64, 128, 256), plans, strict=True):
        check_invariants(plan, profile, 14, B)
    assert any(len(plan.shapes) > 1 for plan in plans)


def test_ties_prefer_fewest_instances_then_fewest_threads() -> None:
    flat = LatencyProfile("flat", {(t, b): 1.0 for t in range(1, 5) for b in (1, 2, 4, 8)})
    assert optimize(flat, 4, 8).shapes == (InstanceShape(threads=1, batch=8, count=1),)
    # Two instances tie with one fat one on latency; the single instance wins.
    profile = LatencyProfile("tie", {(1, 1): 1.0, (1, 2): 2.0, (2, 1): 1.0, (2, 2): 1.0})
    assert optimize(profile, 2, 2).shapes == (InstanceShape(threads=2, batch=2, count=1),)


def test_plans_are_cached_per_profile_and_deterministic() -> None:
    first = optimize(synthetic(16), 16, 64)
    again = optimize(synthetic(16), 16, 64)  # an equal profile built anew hits the cache
    assert again is first
    assert hash(synthetic(8)) == hash(synthetic(8))


def test_threads_beyond_the_profile_are_never_given_to_one_instance() -> None:
    profile = synthetic(4)
    plan = optimize(profile, 8, 4)
    assert max(s.threads for s in plan.shapes) <= 4
    assert plan.fat_latency == profile.latency(4, 4)
    check_invariants(plan, profile, 8, 4)


def test_optimize_rejects_empty_budgets() -> None:
    with pytest.raises(InvalidInput):
        optimize(synthetic(2), 0, 4)
    with pytest.raises(InvalidInput):
        optimize(synthetic(2), 2, 0)


def test_plan_to_dict_is_json_safe() -> None:
    plan = optimize(synthetic(16), 16, 32)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["shapes"] == [{"threads": 4, "batch": 8, "count": 4}]
    assert data["speedup"] == pytest.approx(plan.fat_latency / plan.latency)


def test_latency_interpolates_clamps_and_extrapolates() -> None:
    profile = LatencyProfile("p", {(1, 2): 2.0, (1, 4): 3.0, (1, 8): 7.0, (2, 4): 5.0})
    assert profile.latency(1, 4) == 3.0
    assert profile.latency(1, 3) == pytest.approx(2.5)
    assert profile.latency(1, 6) == pytest.approx(5.0)
    assert profile.latency(1, 1) == 2.0  # clamped below the smallest measured batch
    assert profile.latency(1, 10) == pytest.approx(9.0)  # last segment's slope, 1 s/input
    assert profile.latency(2, 8) == pytest.approx(10.0)  # one point: proportional to b
    assert profile.latency(2, 1) == 5.0
    assert profile.max_threads == 2
    assert profile.batches == (2, 4, 8)
    falling = LatencyProfile("noisy", {(1, 1): 2.0, (1, 2): 1.0})
    assert falling.latency(1, 50) == 1.0  # a falling last segment is not extrapolated down
    with pytest.raises(InvalidInput):
        profile.latency(3, 1)
    with pytest.raises(InvalidInput):
        profile.latency(1, 0)


def test_profile_validation() -> None:
    with pytest.raises(InvalidInput, match=r"threads \[2\]"):
        LatencyProfile("gap", {(1, 1): 1.0, (3, 1): 1.0})
    with pytest.raises(InvalidInput):
        LatencyProfile("empty", {})
    with pytest.raises(InvalidInput):
        LatencyProfile("zero", {(1, 1): 0.0})
    with pytest.raises(InvalidInput):
        LatencyProfile("nan", {(1, 1): float("nan")})
    with pytest.raises(InvalidInput):
        LatencyProfile("key", {(0, 1): 1.0})


def test_profile_copies_its_table() -> None:
    table = {(1, 1): 1.0, (1, 2): 2.0}
    profile = LatencyProfile("copy", table)
    table[(1, 1)] = 100.0
    assert profile.latency(1, 1) == 1.0


def test_profile_round_trips_through_json() -> None:
    profile = synthetic(4, batches=(1, 2, 4))
    data = json.loads(json.dumps(profile.to_dict()))
    assert data["table"]["2,4"] == profile.latency(2, 4)
    assert LatencyProfile.from_dict(data) == profile
    for bad in ({"model": "m"}, {"model": "m", "table": {"1-1": 1.0}}, {"model": 3, "table": {}}):
        with pytest.raises(InvalidInput):
            LatencyProfile.from_dict(bad)
