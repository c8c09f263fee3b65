"""PROTEAN's Algorithm 1 (tags, job distribution), Algorithm 2 (geometry controller) and the
CPU geometry family: hand-computed cases and a fake clock, no processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.errors import InvalidInput
from splitserve.protean.distributor import Job, JobDistributor, Placement, Slot, tag_partitions
from splitserve.protean.geometry import (
    FALLBACK_GEOMETRY,
    INITIAL_GEOMETRY,
    MIG_A100_MEM_UNITS,
    SMALL_SETS,
    Geometry,
    carve,
    cpu_unit,
)
from splitserve.protean.reconfig import (
    BEPredictor,
    GeometryController,
    ProteanSettings,
    derive_thresholds,
    reconfig_budget,
)
from splitserve.protean.slowdown import SlowdownModel

GB = 10**9

# --------------------------------------------------------------------------- Algorithm 1


def test_tags_of_5_10_20_gb_with_12_gb_of_be() -> None:
    slots = [Slot(2, 4, 20 * GB), Slot(0, 1, 5 * GB), Slot(1, 2, 10 * GB)]  # any order
    assert tag_partitions(slots, 12 * GB) == {0: 1.0, 1: 0.7, 2: 0.0}
    assert tag_partitions(slots, 0) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_tags_leave_out_memory_held_by_strict_batches() -> None:
    strict = Job("s", 8, True, 5 * GB)
    be = Job("b", 8, False, 3 * GB)
    slots = [Slot(0, 1, 5 * GB, (be,)), Slot(1, 2, 10 * GB, (strict,)), Slot(2, 4, 20 * GB)]
    # slot 1 has 5 GB for BE (its strict batch holds the rest); slot 0's BE batch is part of
    # the demand, so slot 0 keeps its whole 5 GB
    assert tag_partitions(slots, 12 * GB) == {0: 1.0, 1: 1.0, 2: pytest.approx(0.1)}


_slot_lists = st.lists(
    st.tuples(st.integers(1, 8), st.integers(1, 40)), min_size=1, max_size=6
).map(lambda xs: [Slot(i, c, m * GB) for i, (c, m) in enumerate(xs)])


@given(_slot_lists, st.integers(0, 200), st.integers(0, 200))
def test_tags_are_shares_filled_smallest_first(slots: list[Slot], a: int, b: int) -> None:
    low, high = sorted((a * GB, b * GB))
    tags = tag_partitions(slots, low)
    assert all(0.0 <= t <= 1.0 for t in tags.values())
    ordered = [tags[s.id] for s in sorted(slots, key=lambda s: (s.cores, s.mem_bytes, s.id))]
    assert ordered == sorted(ordered, reverse=True)  # 1, ..., 1, partial, 0, ..., 0
    assert sum(tags[s.id] * s.mem_bytes for s in slots) == pytest.approx(min(low, sum(s.mem_bytes for s in slots)))
    more = tag_partitions(slots, high)
    assert all(more[i] >= tags[i] for i in tags)  # more demand never lowers a tag


def _solo(model: str, cores: int, batch: int) -> float | None:
    base = {"s": 0.7, "be": 1.4, "heavy": 0.7}.get(model)
    return None if base is None else base / cores  # perfect scaling: RDF = 7 / cores


def test_be_first_fit_fills_small_then_spills_into_the_largest() -> None:
    dist = JobDistributor(SlowdownModel(_solo, {}, whole_cores=7))
    be = Job("be", 8, False, 4 * GB)
    slots = [Slot(0, 4, 20 * GB), Slot(1, 2, 10 * GB), Slot(2, 1, 5 * GB)]
    placed = []
    for _ in range(5):
        sid = dist.choose(be, slots, {}, {0, 1, 2})
        assert sid is not None
        placed.append(sid)
        slots[sid] = replace(slots[sid], running=(*slots[sid].running, be))
    # 1g holds one, 2g two, then the 4g takes the rest
    assert placed == [2, 1, 1, 0, 0]
    assert dist.choose(be, slots, {}, {1, 2}) is None  # the small ones are full: wait
    assert dist.choose(Job("be", 8, False, 30 * GB), slots, {}, {0, 1, 2}) is None


def test_eta_sends_strict_to_a_smaller_less_crowded_partition_and_back() -> None:
    """Fig. 13's point. Large slot: 4 cores (RDF 7/4 = 1.75) with two batches of FBR 0.9:
    η = 1.75 × (0.5 + 0.9 + 0.9) = 4.025. Small slot: 2 cores (RDF 3.5), empty: η = 3.5.
    The strict batch goes to the small one; once the co-runners leave, the large one has
    η = 1.75 and wins. "Strict on the largest" would have picked the large one both times."""
    model = SlowdownModel(_solo, {"s": 0.5, "heavy": 0.9}, whole_cores=7)
    dist = JobDistributor(model)
    strict = Job("s", 8, True, GB)
    heavy = Job("heavy", 8, True, GB)
    crowded = [Slot(0, 4, 20 * GB, (heavy, heavy)), Slot(1, 2, 10 * GB)]
    assert dist.strict_eta(strict, crowded[0], 0.0) == pytest.approx(4.025)
    assert dist.strict_eta(strict, crowded[1], 0.0) == pytest.approx(3.5)
    assert dist.choose(strict, crowded, {0: 0.0, 1: 0.0}, {0, 1}) == 1
    quiet = [Slot(0, 4, 20 * GB), Slot(1, 2, 10 * GB)]
    assert dist.choose(strict, quiet, {0: 0.0, 1: 0.0}, {0, 1}) == 0


def test_strict_avoids_partitions_the_tags_give_to_be() -> None:
    model = SlowdownModel(_solo, {"s": 0.5, "be": 0.6}, whole_cores=7)
    dist = JobDistributor(model, batch_mem=lambda m: 2 * GB if m == "be" else None)
    strict = Job("s", 8, True, GB)
    slots = [Slot(0, 4, 20 * GB), Slot(1, 3, 20 * GB)]
    # slot 0 wholly tagged for BE: excluded although its η (1.75) is lower than slot 1's (2.33)
    assert dist.choose(strict, slots, {0: 1.0, 1: 0.0}, {0, 1}, be_models=("be",)) == 1
    # every eligible slot wholly tagged: least η among them
    assert dist.choose(strict, slots, {0: 1.0, 1: 1.0}, {0, 1}, be_models=("be",)) == 0
    # the slot BE work has not taken has no idle instance: while a strict batch of the model
    # runs there it waits for it, rather than take the wholly tagged one (seen under a 50/50
    # stream: a second strict client's batches went to the partition BE work had taken)
    running = [slots[0], replace(slots[1], running=(Job("s", 8, True, GB),))]
    assert dist.choose(strict, running, {0: 1.0, 1: 0.0}, {0}, be_models=("be",)) is None
    # busy with anything else (a BE batch, another model's strict batch): it does not wait
    for other in (Job("be", 8, False, 2 * GB), Job("t", 8, True, GB)):
        busy_other = [slots[0], replace(slots[1], running=(other,))]
        assert dist.choose(strict, busy_other, {0: 1.0, 1: 0.0}, {0}, be_models=("be",)) == 0
    # tag 0.5 of 20 GB with 2 GB batches predicts 5 BE batches: η = 1.75 × (0.5 + 5 × 0.6) = 6.125
    assert dist.strict_eta(strict, slots[0], 0.5, ("be",)) == pytest.approx(1.75 * 3.5)
    assert dist.choose(strict, slots, {0: 0.5, 1: 0.0}, {0, 1}, be_models=("be",)) == 1
    # BE already running there is part of the prediction, counted once
    be = Job("be", 8, False, 2 * GB)
    busy = replace(slots[0], running=(be, be))
    assert dist.strict_eta(strict, busy, 0.5, ("be",)) == pytest.approx(1.75 * 3.5)
    assert dist.choose(strict, slots, {}, set()) is None


def test_strict_ties_go_to_the_larger_partition() -> None:
    model = SlowdownModel(lambda m, c, b: None, {"s": 0.2}, whole_cores=7)  # RDF 1 everywhere
    slots = [Slot(0, 1, 5 * GB), Slot(1, 4, 20 * GB), Slot(2, 2, 10 * GB)]
    assert JobDistributor(model).choose(Job("s", 8, True, GB), slots, {}, {0, 1, 2}) == 1


# --------------------------------------------------------------------------- wait-for-free
# Two 1-core partitions. The strict model "s" takes 0.1 s alone on one core (FBR 0.5, so alone
# it runs at its solo time); BE "b" (FBR 1.5) and "light" (FBR 1.0) have no solo profile, so
# nothing predicts when their batches end. Slot 0 runs a strict batch (the only instance of
# "s" there is busy); slot 1 runs BE, so "s" can run now only on slot 1, beside it.


def _waiting(fbr_b: float = 1.5, profiled: bool = True, on: bool = True) -> JobDistributor:
    solo = (lambda m, c, b: 0.1 if m == "s" else None) if profiled else (lambda m, c, b: None)
    return JobDistributor(SlowdownModel(solo, {"s": 0.5, "b": fbr_b}, whole_cores=2), wait_for_free=on)


def _node(started: float, be: str = "b") -> list[Slot]:
    return [Slot(0, 1, 10 * GB, (Job("s", 4, True, GB, started=started),)),
            Slot(1, 1, 10 * GB, (Job(be, 4, False, GB, started=9.0),))]


STRICT = Job("s", 4, True, GB)


def test_a_strict_batch_waits_for_a_partition_predicted_free_sooner_than_a_co_run_ends() -> None:
    dist = _waiting()
    # running now beside "b": 0.1 × (0.5 + 1.5) = 0.2 s; slot 0 frees at 9.92 + 0.1 = 10.02,
    # then 0.1 s alone: done at 10.12, before 10.2. Waiting pays until 10.2 - 0.1 = 10.1.
    plan = dist.place(STRICT, _node(started=9.92), {}, {1}, now=10.0)
    assert plan == Placement(None, wait_for=0, until=pytest.approx(10.1), run_now_s=pytest.approx(0.2),
                             wait_s=pytest.approx(0.12))
    # BE work keeps off the partition it waits for: first fit would have taken slot 0
    assert dist.place(Job("b", 4, False, GB), _node(started=9.92), {}, {0, 1}, now=10.01).slot == 1
    assert dist.held(10.01) == {"s": 0}
    # slot 0 is free: the strict batch runs there, alone, and BE may use it again
    freed = [Slot(0, 1, 10 * GB), _node(9.92)[1]]
    assert dist.place(STRICT, freed, {}, {0, 1}, now=10.03) == Placement(0, run_now_s=pytest.approx(0.1))
    assert dist.held(10.03) == {}
    assert dist.place(Job("b", 4, False, GB), freed, {}, {0, 1}, now=10.03).slot == 0


def test_a_strict_batch_runs_now_when_waiting_is_predicted_to_end_later() -> None:
    # beside "light" now: 0.1 × (0.5 + 1.0) = 0.15 s; slot 0's batch just started: 0.1 + 0.1 = 0.2 s
    plan = _waiting(fbr_b=1.0).place(STRICT, _node(started=10.0, be="b"), {}, {1}, now=10.0)
    assert plan.slot == 1 and plan.until is None and plan.wait_s == pytest.approx(0.2)


def test_a_strict_batch_never_waits_past_its_slo() -> None:
    dist = _waiting()
    # the wait would end at 10.12, after its SLO: it runs now, beside "b"
    assert dist.place(replace(STRICT, due=10.11), _node(9.92), {}, {1}, now=10.0).slot == 1
    assert dist.held(10.0) == {}
    # an SLO at 10.15 leaves room to wait, but only until 10.15 - 0.1 = 10.05
    plan = dist.place(replace(STRICT, due=10.15), _node(9.92), {}, {1}, now=10.0)
    assert plan.wait_for == 0 and plan.until == pytest.approx(10.05)
    # decided again then, slot 0's batch still running (0.03 s late, so 0.03 s more expected):
    # 10.08 + 0.1 is past the SLO, so it runs now
    assert dist.place(replace(STRICT, due=10.15), _node(9.92), {}, {1}, now=10.05).slot == 1


def test_a_wait_on_a_late_batch_ends_by_itself() -> None:
    dist = _waiting()
    now, waits = 10.0, 0
    while (plan := dist.place(STRICT, _node(9.92), {}, {1}, now=now)).slot is None:
        assert plan.until is not None and plan.until > now
        now, waits = plan.until, waits + 1  # the batch on slot 0 never ends; nothing else does
    assert plan.slot == 1 and waits == 2
    assert now - 10.0 <= 2 * (0.2 - 0.1) + 1e-9  # at most twice what the co-run would have cost


def test_a_strict_batch_running_alone_is_predicted_to_end_at_its_solo_time_whatever_its_fbr() -> None:
    # resnet152's fitted FBR on one core is 1.41: beside a BE batch of FBR 0.72 it is predicted
    # at 0.1 × 2.13 = 0.213 s, and the strict batch alone on slot 0 ends at its solo time, so
    # waiting (0.1 + 0.1 s) wins; max{1.41, 1} for a batch alone would have predicted 0.28 s
    dist = JobDistributor(SlowdownModel(lambda m, c, b: 0.1 if m == "s" else None, {"s": 1.41, "b": 0.72},
                                        whole_cores=2), wait_for_free=True)
    plan = dist.place(STRICT, _node(started=10.0), {}, {1}, now=10.0)
    assert plan.wait_for == 0 and plan.wait_s == pytest.approx(0.2) and plan.run_now_s == pytest.approx(0.213)


@given(st.floats(9.5, 10.0), st.floats(10.0, 11.0), st.floats(10.0, 10.5))
def test_a_waiting_strict_batch_is_predicted_to_finish_sooner_and_by_its_slo(started: float, due: float,
                                                                           now: float) -> None:
    plan = _waiting().place(replace(STRICT, due=due), _node(min(started, now)), {}, {1}, now=now)
    if plan.slot is None:
        assert plan.until is not None and now < plan.until <= due - 0.1 + 1e-9
        assert plan.wait_s is not None and plan.run_now_s is not None and plan.wait_s < plan.run_now_s
        assert now + plan.wait_s <= due + 1e-9
    else:
        assert plan.slot == 1


def test_without_a_prediction_or_with_the_setting_off_the_choice_is_todays() -> None:
    for dist in (_waiting(profiled=False), _waiting(on=False)):
        plan = dist.place(STRICT, _node(9.92), {}, {1}, now=10.0)
        assert plan.slot == dist.choose(STRICT, _node(9.92), {}, {1}) == 1
        assert plan.wait_for is None and dist.held(10.0) == {}
    # a partition whose running batch has no solo profile is never waited for
    unknown = [Slot(0, 1, 10 * GB, (Job("b", 4, False, GB, started=9.99),)), _node(9.92)[1]]
    assert _waiting().place(STRICT, unknown, {}, {1}, now=10.0) == Placement(1, run_now_s=pytest.approx(0.2))


# --------------------------------------------------------------------------- BE keeps off strict work
# Slot 0 runs a BE batch of "b" (its instance there is busy, so slot 0 is not eligible); slot 1
# runs a strict batch of "s". Algorithm 1's first fit sends the next BE batch to slot 1, beside
# the strict batch: on a CPU core that time-slices with it. The BE batch's oldest request
# arrived at 10.0; it may keep off strict work until 10.5.

BE_JOB = Job("b", 4, False, GB, arrived=10.0)


def _be_node(strict_on_1: bool = True) -> list[Slot]:
    return [Slot(0, 1, 10 * GB, (Job("b", 4, False, GB, started=9.9),)),
            Slot(1, 1, 10 * GB, (Job("s", 4, True, GB, started=9.95),) if strict_on_1 else ())]


def _be_waiting(max_wait_s: float = 0.5) -> JobDistributor:
    return JobDistributor(SlowdownModel(lambda m, c, b: None, {"s": 0.5, "b": 1.5}, whole_cores=2),
                          be_max_wait_s=max_wait_s)


def test_a_be_batch_waits_rather_than_start_beside_a_running_strict_batch_then_spills_at_its_bound() -> None:
    dist = _be_waiting()
    assert dist.place(BE_JOB, _be_node(), {}, {1}, now=10.1) == Placement(None, until=pytest.approx(10.5))
    assert dist.place(BE_JOB, _be_node(), {}, {1}, now=10.49).slot is None
    # its oldest request has waited the bound: Algorithm 1's first fit, beside the strict batch
    assert dist.place(BE_JOB, _be_node(), {}, {1}, now=10.5) == Placement(1)
    # the strict batch ended before that: slot 1 is free of strict work and the batch runs there
    assert dist.place(BE_JOB, _be_node(strict_on_1=False), {}, {1}, now=10.2) == Placement(1)
    # its own instance on slot 0 freed: first fit, as ever
    assert dist.place(BE_JOB, _be_node(), {}, {0, 1}, now=10.2) == Placement(0)


def test_a_be_batch_takes_a_partition_without_strict_work_over_first_fit_beside_strict_work() -> None:
    # slot 1 (1 core, first in ascending order) runs strict work; slot 2 (2 cores) runs none
    slots = [*_be_node(), Slot(2, 2, 20 * GB)]
    assert _be_waiting().place(BE_JOB, slots, {}, {1, 2}, now=10.1) == Placement(2)
    assert _be_waiting(0.0).place(BE_JOB, slots, {}, {1, 2}, now=10.1) == Placement(1)


def test_with_no_bound_or_no_arrival_a_be_batch_takes_algorithm_1s_first_fit() -> None:
    for dist, job in ((_be_waiting(0.0), BE_JOB), (_be_waiting(), replace(BE_JOB, arrived=None))):
        assert dist.place(job, _be_node(), {}, {1}, now=10.1) == Placement(dist.choose(job, _be_node(), {}, {1})) \
            == Placement(1)


@given(st.floats(0.0, 2.0), st.floats(0.0, 1.0), st.sets(st.integers(0, 2), max_size=3),
       st.sets(st.integers(0, 2), max_size=3))
def test_a_be_batch_joins_strict_work_only_past_its_bound_and_waits_only_for_it(
        waited: float, max_wait: float, eligible: set[int], strict_on: set[int]) -> None:
    slots = [Slot(i, 1 + i, 10 * GB, (Job("s", 4, True, GB, started=9.9),) if i in strict_on else ())
             for i in range(3)]
    now = 10.0 + waited
    plan = _be_waiting(max_wait).place(BE_JOB, slots, {}, eligible, now=now)
    apart = eligible - strict_on  # slots are in ascending order: first fit is the lowest id that fits
    if not eligible:  # no idle instance: it waits, as it always did
        assert plan == Placement(None)
    elif apart and max_wait > 0:
        assert plan == Placement(min(apart))
    elif max_wait == 0 or now >= 10.0 + max_wait:
        assert plan == Placement(min(eligible))  # Algorithm 1's first fit
    else:  # every eligible slot runs strict work and the bound has not passed: it waits until then
        assert plan.slot is None and now < plan.until == pytest.approx(10.0 + max_wait)


# --------------------------------------------------------------------------- geometries


def test_geometry_family() -> None:
    assert INITIAL_GEOMETRY.units == (4, 2, 1)
    assert FALLBACK_GEOMETRY.units == (4, 3)
    assert SMALL_SETS == ((1, 2), (3,))
    assert Geometry((1, 4, 2)) == INITIAL_GEOMETRY
    assert str(INITIAL_GEOMETRY) == "(4g,2g,1g)"
    for bad in [(4, 4), (4, 3, 1), (5,), (2, 2, 2, 2), (), (7, 1)]:
        with pytest.raises(InvalidInput):
            Geometry(bad)
    assert Geometry((3, 3, 1)).units == (3, 3, 1)


def test_cpu_unit() -> None:
    assert [cpu_unit(w) for w in (1, 2, 6, 7, 13, 14, 20, 64)] == [None, None, None, 1, 1, 2, 2, 9]


def test_carve_hands_out_units_and_the_remainder_to_the_largest() -> None:
    assert carve(INITIAL_GEOMETRY, range(14), 2) == [tuple(range(8)), (8, 9, 10, 11), (12, 13)]
    assert carve(FALLBACK_GEOMETRY, range(10, 19), 1) == [(10, 11, 12, 13, 14, 15), (16, 17, 18)]
    with pytest.raises(InvalidInput):
        carve(INITIAL_GEOMETRY, range(6), 1)
    with pytest.raises(InvalidInput):
        carve(INITIAL_GEOMETRY, range(7), 0)


_geometries = st.sampled_from([INITIAL_GEOMETRY, FALLBACK_GEOMETRY, Geometry((7,)), Geometry((3, 3, 1)),
                               Geometry((2, 2, 2, 1)), Geometry((1,) * 7), Geometry((4, 1, 1))])


@given(_geometries, st.integers(1, 4), st.integers(0, 6), st.randoms(use_true_random=False))
def test_carve_gives_disjoint_sets_of_the_right_size(geometry: Geometry, unit: int, extra: int, rnd) -> None:
    cpus = rnd.sample(range(256), 7 * unit + extra)
    parts = carve(geometry, cpus, unit)
    assert len(parts) == len(geometry.units)
    flat = [c for p in parts for c in p]
    assert len(flat) == len(set(flat))  # disjoint
    assert set(flat) <= set(cpus)
    sizes = [len(p) for p in parts]
    assert sizes[1:] == [u * unit for u in geometry.units[1:]]
    assert sizes[0] == geometry.units[0] * unit + (len(cpus) - sum(geometry.units) * unit)


# --------------------------------------------------------------------------- Algorithm 2


def test_ewma_predictor() -> None:
    p = BEPredictor(0.5)
    assert p.observe(10) == 10.0  # seeded by the first sample
    assert p.observe(20) == 15.0
    assert p.observe(-3) == 7.5  # a negative count reads as 0
    with pytest.raises(InvalidInput):
        BEPredictor(0.0)


def test_budget() -> None:
    assert [reconfig_budget(g, 0.3) for g in (1, 2, 3, 4, 7, 8, 10)] == [1, 1, 1, 1, 2, 2, 3]


def _controller(groups: int = 1, thresholds=None, **kw) -> GeometryController:
    """A100-like memory: 5 GB units (3g holds 20 GB); BE demand = the forecast in GB; the
    newest sample alone is the forecast (weight 1), so each tick reads as written."""
    settings = ProteanSettings(ewma_weight=1.0, **kw)
    return GeometryController(settings, groups, unit_mem=5 * GB, be_mem=lambda n: int(n * GB),
                              thresholds=thresholds, mem_units=MIG_A100_MEM_UNITS)


def test_candidate_order_and_fallback() -> None:
    c = _controller()
    assert c.current == [INITIAL_GEOMETRY]
    assert c.set_mem((1, 2)) == 15 * GB and c.set_mem((3,)) == 20 * GB
    assert c.target(15)[0] == INITIAL_GEOMETRY  # [1g, 2g] holds 15 GB: (4g, 2g, 1g)
    assert c.target(15)[1]["small_set"] == [1, 2]
    goal, numbers = c.target(17)  # [1g, 2g] does not, [3g] does: (4g, 3g)
    assert goal == FALLBACK_GEOMETRY and numbers["small_set"] == [3]
    goal, numbers = c.target(25)  # neither: the fallback
    assert goal == FALLBACK_GEOMETRY and numbers["small_set"] is None


def test_outside_the_thresholds_falls_back() -> None:
    seen = []

    def thresholds(candidate: Geometry, pred: float) -> tuple[float, float]:
        seen.append(candidate)
        return 5.0, 12.0

    c = _controller(thresholds=thresholds)
    assert c.target(3)[0] == FALLBACK_GEOMETRY  # below T_low
    assert c.target(13)[0] == FALLBACK_GEOMETRY  # above T_high
    goal, numbers = c.target(8)
    assert goal == INITIAL_GEOMETRY
    assert (numbers["t_low"], numbers["t_high"], numbers["threshold_source"]) == (5.0, 12.0, "derived")
    assert seen == [INITIAL_GEOMETRY] * 3  # asked about the [1g, 2g] candidate
    # settings override the derivation
    c = _controller(thresholds=thresholds, t_low=0.0, t_high=20.0)
    assert c.target(3)[0] == INITIAL_GEOMETRY


def test_reconfigures_on_exactly_the_fourth_mismatching_tick() -> None:
    c = _controller()
    t = 0.0
    for expected_wait in (1, 2, 3):
        assert c.tick(t, 25) == []  # 25 GB: (4g, 3g) wanted, (4g, 2g, 1g) in force
        assert c.wait == [expected_wait]
        t += 2.0
    assert c.tick(t, 25) == [(0, FALLBACK_GEOMETRY)]
    assert c.last["issued"] == [0] and c.last["target"] == "(4g,3g)"
    assert c.tick(t + 2, 25) == []  # in flight: not issued twice
    c.applied(0, FALLBACK_GEOMETRY)
    assert c.tick(t + 4, 25) == [] and c.wait == [0]
    assert c.current == [FALLBACK_GEOMETRY]


def test_one_matching_tick_resets_the_count() -> None:
    c = _controller()
    for _ in range(3):
        assert c.tick(0.0, 25) == []
    assert c.tick(0.0, 10) == [] and c.wait == [0]  # 10 GB fits (2g, 1g): a match
    for _ in range(3):
        assert c.tick(0.0, 25) == []
    assert c.tick(0.0, 25) == [(0, FALLBACK_GEOMETRY)]


def test_wait_limit_zero_changes_at_once() -> None:
    assert _controller(wait_limit=0).tick(0.0, 25) == [(0, FALLBACK_GEOMETRY)]


def test_never_more_than_the_budget_at_once_and_held_back_groups_go_next() -> None:
    c = _controller(groups=8)
    assert c.budget == 2
    for _ in range(3):
        assert c.tick(0.0, 25) == []
    first = c.tick(0.0, 25)
    assert first == [(0, FALLBACK_GEOMETRY), (1, FALLBACK_GEOMETRY)]
    assert c.tick(0.0, 25) == []  # two in flight: no room
    c.applied(0, FALLBACK_GEOMETRY)
    assert c.tick(0.0, 25) == [(2, FALLBACK_GEOMETRY)]  # held back: goes without waiting again
    done = {0}
    in_flight = {1, 2}
    while len(done) < 8:
        g = min(in_flight)
        c.applied(g, FALLBACK_GEOMETRY)
        in_flight.discard(g)
        done.add(g)
        issued = c.tick(0.0, 25)
        in_flight |= {gg for gg, _ in issued}
        assert len(in_flight) <= 2
        assert len(c.last["in_flight"]) <= 2
    assert c.current == [FALLBACK_GEOMETRY] * 8


def test_settings_validate_and_report() -> None:
    s = ProteanSettings()
    assert s.to_dict()["wait_limit"] == 3 and s.to_dict()["reconfig_fraction"] == 0.3
    assert s.to_dict()["keep_alive_s"] == 600.0
    for bad in ({"ewma_weight": 0.0}, {"wait_limit": -1}, {"reconfig_fraction": 0.0},
                {"t_low": 5.0, "t_high": 1.0}, {"monitor_interval_s": 0.0}):
        with pytest.raises(InvalidInput):
            ProteanSettings(**bad)


def test_thresholds_are_crossovers_of_the_eta_model() -> None:
    """A100 memory (1g 5 GB, 2g 10, 3g and 4g 20), RDF = 7 / cores, BE batches of 8 requests
    and 2 GB with FBR 1.0. Two strict batches of FBR 0.8:

    - no BE: (4g,2g,1g) puts both on the 4g (2g's RDF 3.5 > 1.75 × 1.6 = 2.8): mean η 2.275;
      (4g,3g) puts the second alone on the 3g (RDF 2.33): mean 2.04. The fallback wins.
    - one BE batch: on the 1g, resp. on the 3g, where the second strict batch would now see
      2.33 × 1.8 = 4.2 and shares the 4g instead: equal, the candidate wins: T_low = 8.
    - up to 7 BE batches the 1g and 2g hold them all; the 8th spills onto the 4g beside the
      strict batches, while (4g,3g) still holds it on the 3g: T_high = 7 × 8 = 56.
    """
    model = SlowdownModel(_solo, {"s": 0.8, "be": 1.0}, whole_cores=7)
    strict, be = Job("s", 8, True, GB), Job("be", 8, False, 2 * GB)
    kw = {"unit_cores": 1, "unit_mem": 5 * GB, "mem_units": MIG_A100_MEM_UNITS}
    assert derive_thresholds(INITIAL_GEOMETRY, model, strict, be, strict_batches=2, **kw) == (8.0, 56.0)
    assert derive_thresholds(INITIAL_GEOMETRY, model, strict, be, strict_batches=1, **kw) == (0.0, 56.0)
    # a candidate that never wins: every forecast is below T_low
    never = derive_thresholds(Geometry((1,)), model, strict, be, strict_batches=1, **kw)
    assert never == (math.inf, math.inf)
    # the controller takes them through its thresholds callable
    c = _controller(thresholds=lambda g, n: derive_thresholds(g, model, strict, be, strict_batches=2, **kw))
    assert c.target(4)[0] == FALLBACK_GEOMETRY  # below T_low = 8
    assert c.target(10)[0] == INITIAL_GEOMETRY


def test_last_tick_is_json_ready() -> None:
    c = _controller(thresholds=lambda g, n: (math.inf, math.inf))
    assert c.tick(4.0, 10) == []
    last = json.loads(json.dumps(c.last, allow_nan=False))
    assert last["t_low"] == "inf" and last["target"] == "(4g,3g)" and last["prediction"] == 10.0
    assert last["wait"] == [1] and last["small_set"] == [1, 2] and last["t"] == 4.0
