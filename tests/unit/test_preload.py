"""Start-up models are preloaded only as far as they fit together: host bytes, device bytes on
each GPU partition (the smaller of the device budget and the partition's memory), and the
count of resident models, in the operator's order, each skipped one with its reason."""

from __future__ import annotations

from splitserve.memory.preload import Candidate, plan_preload

MIB = 1 << 20


def test_without_budgets_everything_is_preloaded_in_order():
    plan = plan_preload([Candidate("a", 900 * MIB), Candidate("b", 900 * MIB, {"GPU-0": 1 << 40})])
    assert plan.load == ("a", "b") and plan.skipped == ()


def test_a_model_that_does_not_fit_beside_the_earlier_ones_is_skipped_and_a_later_smaller_one_still_loads():
    plan = plan_preload([Candidate("a", 60 * MIB), Candidate("big", 50 * MIB), Candidate("c", 30 * MIB)],
                        host_budget=100 * MIB)
    assert plan.load == ("a", "c")
    ((name, why),) = plan.skipped
    assert name == "big" and "needs 0.05 GiB of host memory; 0.04 GiB of the 0.10 GiB budget is left" in why


def test_device_bytes_are_budgeted_per_partition_and_capped_by_its_memory():
    mig_small, mig_big = "MIG-1g", "MIG-3g"
    memory = {mig_small: 10 * MIB, mig_big: 40 * MIB}
    plan = plan_preload([Candidate("a", MIB, {mig_small: 6 * MIB}),
                         Candidate("b", MIB, {mig_small: 6 * MIB}),  # 12 MiB on a 10 MiB device
                         Candidate("c", MIB, {mig_big: 25 * MIB}),
                         Candidate("d", MIB, {mig_big: 25 * MIB}, measured=False)],  # past the 30 MiB budget
                        device_budget=30 * MIB, device_memory=memory)
    assert plan.load == ("a", "c")
    why = dict(plan.skipped)
    assert f"on GPU partition {mig_small}" in why["b"] and "of its 0.01 GiB is left" in why["b"]
    assert f"on GPU partition {mig_big}" in why["d"]
    assert why["d"].endswith("(estimated: not loaded on this node before)")


def test_the_resident_model_count_binds_too():
    plan = plan_preload([Candidate(n, MIB) for n in "abc"], max_models=2)
    assert plan.load == ("a", "b") and plan.skipped == (("c", "max_resident_models 2 reached by a, b"),)
