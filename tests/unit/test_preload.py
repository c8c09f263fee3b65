"""Start-up models are preloaded only as far as they fit together: host bytes, device bytes on
each GPU partition (the smaller of the device budget and the partition's memory), and the
count of resident models, in the operator's order, each skipped one with its reason."""

from __future__ import annotations

import asyncio

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


def test_a_gpu_model_never_measured_on_its_device_is_planned_at_its_weights_per_instance(tmp_path):
    """What the node hands the plan: a GPU model's device bytes before any load measured them
    are its weights once per instance (a lower bound), on the partitions its instances would
    get; the memory manager itself still charges nothing until LOADED says."""
    from dataclasses import replace

    from splitserve.memory.footprints import MemoryFootprint
    from splitserve.modelconfig import ModelConfig
    from splitserve.placement.devices import DeviceAssigner
    from splitserve.placement.gpus import read_gpus
    from splitserve.registry import ModelRecord
    from splitserve.server.model.runtime import ModelRuntime
    from tests.fake_nvml import GIB, FakeGpu, FakeNvml
    from tests.unit.test_node_placement import Node
    from tests.unit.test_runtime_seams import FakeLoop, NoFootprints

    class Weights(NoFootprints):
        def footprint(self, record: ModelRecord) -> MemoryFootprint:
            return MemoryFootprint(100 * MIB)

    listing = read_gpus(FakeNvml([FakeGpu("NVIDIA H200", 141 * GIB, None, (), [], "GPU-a"),
                                  FakeGpu("NVIDIA H200", 141 * GIB, None, (), [], "GPU-b")]))
    node = Node(tmp_path, 2, FakeLoop())
    env = replace(node.env, devices=DeviceAssigner(lambda: listing), footprints=Weights())
    cfg = ModelConfig.from_dict({"name": "g", "device": "cuda", "instances": 3,
                                 "artifact": {"kind": "zoo", "arch": "lenet"}})
    rt = ModelRuntime(env, ModelRecord("g", 1, 1, "test", None, cfg), None)
    assert asyncio.run(rt.residency.read_footprint()) == MemoryFootprint(100 * MIB)  # before any load
    assert rt.residency.charge() == 100 * MIB and rt.residency.device_charge() == {}
    charge = rt.residency.device_charge(at_least_weights=True)
    assert sum(charge.values()) == 3 * 100 * MIB and set(charge) <= {"GPU-a", "GPU-b"}
    cpu = ModelRuntime(env, ModelRecord("c", 2, 1, "test", None, replace(cfg, name="c", device="cpu")), None)
    assert cpu.residency.device_charge(at_least_weights=True) == {}
