"""PROTEAN on MIG devices: latency profiles and FBRs measured, stored and read per MIG
profile, and Algorithm 1 ranking MIG slots by each profile's own numbers, from a fake NVML
listing of an H100 split 3g.40gb + 2 × 1g.10gb and a real SQLite registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.placement.devices import partitions_of
from splitserve.placement.gpus import read_gpus
from splitserve.placement.mig_profiler import VISIBLE, devices_by_profile, profile_mig
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import (
    ColocationProfile, ColocationRun, ModelProfile, fit_stored_fbr, load_fbr, save_colocation, save_profile,
)
from splitserve.protean.distributor import Job, JobDistributor
from splitserve.protean.mig_slots import mig_slots, mig_slowdown_model
from splitserve.protean.profiles import ProteanProfiles
from splitserve.protean.slowdown import FbrFit
from splitserve.registry import Registry
from tests.fake_nvml import GIB, H100, FakeGpu, FakeInstance, FakeNvml

M = "test-machine"
BIG, SMALL = "3g.40gb", "1g.10gb"


@pytest.fixture
def registry(tmp_path: Path) -> Any:
    reg = Registry(tmp_path)
    yield reg
    reg.close()


@pytest.fixture
def parts() -> Any:
    """An H100 with MIG on: a 3g.40gb and two 1g.10gb devices, as NVML lists them."""
    gpu = FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, (1, 1), H100,
                  [FakeInstance(1, 9, (0, 4), {0: 3}), FakeInstance(2, 19, (4, 1), {0: 1}),
                   FakeInstance(3, 19, (5, 1), {0: 1})], "GPU-h")
    return partitions_of(read_gpus(FakeNvml([gpu])))


def _store(registry: Any) -> None:
    """What ``splitserve profile --mig`` stores: per MIG profile, L[1, b] of the strict model
    ``s`` and co-location runs (s and the BE model ``be``) fitted into FBRs. The CPU profile
    and FBRs are stored too, with numbers no MIG decision may use."""
    lat = {BIG: {(1, 1): 0.006, (1, 4): 0.012}, SMALL: {(1, 1): 0.009, (1, 4): 0.018}}
    for name, table in lat.items():
        save_profile(registry, ModelProfile(LatencyProfile("s", table), {}, M), mig=name)
    save_profile(registry, ModelProfile(LatencyProfile("s", {(1, 4): 0.001}), {}, M))  # the CPUs': never read here
    for m in ("s", "be"):
        registry.save_profile(m, M, "fbr", FbrFit({"s@4": 0.2, "be@4": 0.2}).to_dict())
    # FBRs on 3g: s 0.8, be 2.0 (a bandwidth-heavy BE job); on 1g: s 0.6, be 0.7
    for name, cores, fs, fb in ((BIG, 3, 0.8, 2.0), (SMALL, 1, 0.6, 0.7)):
        runs = [ColocationRun(cores, ("s@4", "be@4"), (fs + fb,) * 2, (0.01, 0.01), (0.01, 0.01)),
                ColocationRun(cores, ("s@4", "s@4"), (2 * fs,) * 2, (0.01, 0.01), (0.01, 0.01)),
                ColocationRun(cores, ("be@4", "be@4"), (2 * fb,) * 2, (0.01, 0.01), (0.01, 0.01))]
        save_colocation(registry, ColocationProfile(cores, (0,), {}, runs, M), mig=name)
        fit_stored_fbr(registry, ["s", "be"], cores, M, mig=name)


def test_profiles_are_stored_and_read_per_mig_profile_and_never_mixed_with_the_cpus(registry: Any, parts: Any):
    _store(registry)
    assert load_fbr(registry, "s", M, mig=BIG) == pytest.approx(0.8)
    assert load_fbr(registry, "be", M, mig=SMALL) == pytest.approx(0.7)
    assert load_fbr(registry, "s", M) == pytest.approx(0.2)  # the core sets' own
    p = ProteanProfiles(registry, M)
    assert p.solo("s", BIG, 4) == pytest.approx(0.012) and p.solo("s", SMALL, 4) == pytest.approx(0.018)
    assert p.solo("s", 1, 4) == pytest.approx(0.001)  # the core set's own
    assert p.solo("s", "2g.20gb", 4) is None and p.fbr("s", "2g.20gb") is None  # never measured there
    assert p.fbr("be", BIG) == pytest.approx(2.0) and p.fbr("be") == pytest.approx(0.2)


def test_the_strict_batch_goes_where_its_own_profiles_rank_it_best(registry: Any, parts: Any):
    _store(registry)
    model = mig_slowdown_model(ProteanProfiles(registry, M), ["s", "be"], parts)
    dist = JobDistributor(model)
    strict = Job("s", 4, True, GIB)
    be = Job("be", 4, False, GIB)
    idle = mig_slots(parts)
    assert [(s.id, s.profile, s.cores) for s in idle] == [(0, BIG, 3), (1, SMALL, 1), (2, SMALL, 1)]
    # RDF against the fastest profile of the node: 3g 1.0, 1g 0.018 / 0.012
    assert model.rdf("s", 4, SMALL) == pytest.approx(1.5) and model.rdf("s", 4, BIG) == 1.0
    assert dist.choose(strict, idle, {}, {0, 1, 2}) == 0  # alone, the 3g is the fastest
    # a BE batch on the 3g: η there is 1.0 × (0.8 + 2.0) = 2.8 with the 3g's FBRs, against
    # 1.5 × max(0.6, 1) on a 1g; the 1g's FBRs (Σ 1.3) or the CPUs' (Σ 0.4) would keep it on the 3g
    busy = mig_slots(parts, {parts[0].uuid: [be]})
    assert dist.strict_eta(strict, busy[0], 0.0) == pytest.approx(2.8)
    assert dist.strict_eta(strict, busy[1], 0.0) == pytest.approx(1.5)
    assert busy[dist.choose(strict, busy, {}, {0, 1, 2})].profile == SMALL  # either 1g
    assert model.predict("s", 4, BIG, ["be"]) == pytest.approx(0.012 * 2.8)
    # a pair never fitted on a profile is assumed to take its bandwidth (unknown_fbr), not the CPU's number
    assert mig_slowdown_model(ProteanProfiles(registry, M), ["s", "new"], parts, 0.9).fbr_of("new", BIG) == 0.9


def test_each_mig_profile_is_measured_once_on_its_first_device_alone(parts: Any, tmp_path: Path):
    assert {k: v.uuid for k, v in devices_by_profile(parts).items()} == {BIG: parts[0].uuid, SMALL: parts[1].uuid}
    config = ModelConfig.from_dict({"name": "s", "artifact": {"kind": "zoo", "arch": "lenet"}, "max_batch_size": 8})
    seen: list[tuple[str, int, dict[str, str]]] = []

    def sweep(cfg: ModelConfig, model_dir: Any, cache: Path, sweeps: Any, batches: Any, **kw: Any) -> ModelProfile:
        ((threads, _cpus, env),) = sweeps
        seen.append((cfg.device, threads, dict(env)))
        for b in batches:
            kw["on_point"](threads, b, 0.01)
        return ModelProfile(LatencyProfile(cfg.name, {(threads, b): 0.01 for b in batches}), {}, M)

    points: list[tuple[str, int]] = []
    out = profile_mig(config, None, tmp_path, parts, [1, 4], sweep=sweep,
                      on_point=lambda p, b, s: points.append((p, b)))
    assert list(out) == [BIG, SMALL]
    assert seen == [("cuda:0", 1, {VISIBLE: parts[0].uuid}), ("cuda:0", 1, {VISIBLE: parts[1].uuid})]
    assert points == [(BIG, 1), (BIG, 4), (SMALL, 1), (SMALL, 4)]
    with pytest.raises(InvalidInput, match="no MIG devices"):
        profile_mig(config, None, tmp_path, [p for p in parts if p.profile is None], [1], sweep=sweep)


def test_profile_mig_refuses_cpu_options_and_a_node_without_mig_devices_before_measuring(tmp_path: Path):
    from splitserve.cli import app
    from splitserve.placement.gpus import PynvmlNvml

    result = CliRunner().invoke(app, ["profile", "lenet", "--mig", "--threads", "1"])
    assert result.exit_code != 0 and "--mig measures on MIG devices" in result.output
    if devices_by_profile(partitions_of(read_gpus(PynvmlNvml()))):
        return  # a MIG node would measure (tests/gpu does)
    result = CliRunner().invoke(app, ["profile", "lenet", "--mig", "--data-dir", str(tmp_path)])
    assert result.exit_code != 0 and "this node has no MIG devices" in result.output


def test_the_node_places_a_gpu_models_strict_batch_on_the_mig_device_its_profiles_pick(registry: Any):
    """The coordinator asks the partition manager, which hands a model whose instances hold
    MIG devices (a real ``DeviceAssigner`` over the fake NVML) to the MIG chooser: ``s`` has
    an instance on the 3g and one on a 1g, ``be`` one on the 3g."""
    from splitserve.placement.devices import DeviceAssigner
    from splitserve.protean.mig_slots import MigBatchChooser
    from tests.unit.test_node_partitions import BE, RT, Model, manager

    gpu = FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, (1, 1), H100,
                  [FakeInstance(1, 9, (0, 4), {0: 3}), FakeInstance(2, 19, (4, 1), {0: 1})], "GPU-h")
    listing = read_gpus(FakeNvml([gpu]))
    devices = DeviceAssigner(lambda: listing)
    _store(registry)
    models: dict[str, Model] = {}
    pm, coord = manager(models)
    pm.mig = MigBatchChooser(devices, lambda: partitions_of(listing), ProteanProfiles(registry, M))
    p1, p2 = (p.id for p in pm.current())
    # on the CPU partitions alone (ties to the higher id) s would go to its instance 0 both times
    models["s"], models["be"] = Model("s", [p2, p1]), Model("be", [p1])
    for owner, instance, device in (("s", 0, "cuda:0"), ("s", 1, "cuda:1"), ("be", 0, "cuda:0")):
        devices.assign(owner, instance, device)
    models["s"].enqueue(RT, 0)
    (alone,) = coord.schedule(models["s"], 0.0)
    assert alone.instance == 0  # nothing else runs: the 3g (RDF 1.0 against 1.5)
    models["s"].sched.complete(alone.instance, alone.batch_id)
    coord.finished(models["s"], alone.instance, alone, ok=True)
    models["be"].enqueue(BE, 0)
    (be,) = coord.schedule(models["be"], 0.0)
    coord.started(models["be"], be)
    models["s"].enqueue(RT, 1)
    (beside,) = coord.schedule(models["s"], 0.0)
    assert beside.instance == 1  # the BE batch's bandwidth on the 3g (its FBR there) sends it to the 1g
