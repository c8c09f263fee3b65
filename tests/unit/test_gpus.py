"""A GPU node's partitions: the NVML listing (an in-memory NVML that raises NVML's errors, and
the real pynvml on a machine without the driver), the MIG geometry planner on hand-checked
layouts, and the applier, which runs nothing without the administrator's flag."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import subprocess

import pytest
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.cli.gpus import run_gpu_plan
from splitserve.errors import InvalidInput
from splitserve.placement.gpus import MigDriver, PynvmlNvml, read_gpus
from splitserve.placement.mig import Gpu, GpuListing, plan_geometry
from splitserve.server.gpus import GpuInventory
from tests.fake_nvml import A100, GIB, H100, FakeGpu, FakeInstance, FakeNvml


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def a100(mig: tuple[int, int] | None = (1, 1), instances: list[FakeInstance] | None = None) -> FakeGpu:
    return FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GIB, mig, A100, instances or [])


def a100_421() -> FakeGpu:
    """(4g, 2g, 1g): PROTEAN's initial geometry, as nvidia-smi would place it."""
    return a100(instances=[FakeInstance(1, 5, (0, 4), {0: 4}), FakeInstance(5, 14, (4, 2), {0: 2}),
                           FakeInstance(13, 19, (6, 1), {0: 1})])


def listed(*gpus: FakeGpu) -> GpuListing:
    nvml = FakeNvml(list(gpus))
    out = read_gpus(nvml)
    assert nvml.sessions == 0  # every session it opened was shut down
    return out


def argv(plan) -> list[str]:
    return [str(c) for c in plan.commands]


# --------------------------------------------------------------------------- listing


@pytest.mark.skipif(_has_driver(), reason="the NVIDIA driver is here: NVML starts")
def test_the_real_pynvml_without_the_driver_says_there_are_no_gpus_and_why():
    listing = read_gpus(PynvmlNvml())
    assert listing.gpus == ()
    assert listing.reason is not None and listing.reason.startswith("no GPUs (NVML not available: ")
    assert listing.to_dict() == {"gpus": [], "reason": listing.reason}


def test_a_node_whose_nvml_does_not_start_lists_no_gpus_with_the_reason():
    listing = read_gpus(FakeNvml([a100()], driver=False))
    assert listing.gpus == () and listing.reason == "no GPUs (NVML not available: Driver Not Loaded)"


def test_whole_gpus_without_mig_and_with_mig_off():
    t4 = FakeGpu("Tesla T4", 16 * GIB, None)
    (g0, g1) = listed(t4, a100(mig=(0, 0))).gpus
    assert (g0.index, g0.name, g0.mem_bytes, g0.mig, g0.mig_pending, g0.slices) == (0, "Tesla T4", 16 * GIB,
                                                                                     None, None, ())
    assert g0.uuid.startswith("GPU-")
    assert (g1.mig, g1.mig_pending, g1.slices) == (False, False, ())
    # NVML lists profiles only with MIG on: an A100 40GB's come from Table 2
    assert [p.name for p in g1.profiles] == ["7g.40gb", "4g.20gb", "3g.20gb", "2g.10gb", "1g.5gb"]


def test_mig_on_lists_each_slice_as_cuda_visible_devices_takes_it():
    (g,) = listed(a100_421()).gpus
    assert g.mig is True and g.note is None
    assert [(s.gpu_instance, s.compute_instance, s.profile, s.placement, s.slices) for s in g.slices] == [
        (1, 0, "4g.20gb", (0, 4), 4), (5, 0, "2g.10gb", (4, 2), 2), (13, 0, "1g.5gb", (6, 1), 1)]
    assert all(s.uuid.startswith("MIG-") and s.whole for s in g.slices)
    assert [s.mem_bytes >> 20 for s in g.slices] == [19968, 9856, 4864]
    # the profiles NVML gave, with its memory and placements; the +me variant is named apart
    names = [p.name for p in g.profiles]
    assert names[:5] == ["7g.40gb", "4g.20gb", "3g.20gb", "2g.10gb", "1g.5gb"] and "1g.5gb+me" in names
    assert next(p for p in g.profiles if p.name == "3g.20gb").placements == ((0, 4), (4, 4))


def test_a_compute_instance_smaller_than_its_gpu_instance_is_named_as_nvidia_smi_does():
    (g,) = listed(a100(instances=[FakeInstance(2, 9, (0, 4), {0: 1, 1: 2})])).gpus
    assert [(s.compute_instance, s.profile, s.whole) for s in g.slices] == [(0, "1c.3g.20gb", False),
                                                                           (1, "2c.3g.20gb", False)]


def test_mig_pending_is_off_until_a_reset():
    (g,) = listed(a100(mig=(0, 1))).gpus
    assert (g.mig, g.mig_pending, g.slices) == (False, True, ())


# --------------------------------------------------------------------------- planner


def test_plan_turns_mig_on_resets_and_creates_largest_first():
    (g,) = listed(a100(mig=(0, 0))).gpus
    plan = plan_geometry(g, "3g,4g")
    assert plan.target == ("4g.20gb", "3g.20gb")
    assert argv(plan) == ["nvidia-smi -i 0 -mig 1", "nvidia-smi -i 0 -r",
                          "nvidia-smi mig -i 0 -cgi 4g.20gb,3g.20gb -C"]
    assert plan.destroys == (g.uuid,)  # the reset takes the whole GPU: its workers are drained first


def test_plan_with_mig_pending_only_resets():
    (g,) = listed(a100(mig=(0, 1))).gpus
    assert argv(plan_geometry(g, "7g"))[:1] == ["nvidia-smi -i 0 -r"]


def test_plan_keeps_the_4g_and_replaces_the_small_slices_by_a_3g():
    (g,) = listed(a100_421()).gpus
    plan = plan_geometry(g, "4g.20gb,3g.20gb")
    assert plan.kept == (1,)
    by_gi = {s.gpu_instance: s.uuid for s in g.slices}
    assert plan.destroys == (by_gi[5], by_gi[13])  # the 2g and the 1g go: drained first; the 4g's work stays
    assert argv(plan) == [
        "nvidia-smi mig -i 0 -gi 5 -ci 0 -dci", "nvidia-smi mig -i 0 -gi 13 -ci 0 -dci",
        "nvidia-smi mig -i 0 -gi 5 -dgi", "nvidia-smi mig -i 0 -gi 13 -dgi",
        "nvidia-smi mig -i 0 -cgi 3g.20gb -C"]


def test_plan_recreates_everything_when_the_target_does_not_fit_beside_the_kept_slice():
    # a 3g at slices 0-3 blocks the 4g, which only sits at 0: keeping it would strand the plan
    (g,) = listed(a100(instances=[FakeInstance(1, 9, (0, 4), {0: 3}), FakeInstance(7, 19, (4, 1), {0: 1})])).gpus
    plan = plan_geometry(g, "4g,3g")
    assert plan.kept == ()
    assert argv(plan)[-1] == "nvidia-smi mig -i 0 -cgi 4g.20gb,3g.20gb -C"
    assert "nvidia-smi mig -i 0 -gi 1 -dgi" in argv(plan)


def test_plan_for_the_geometry_in_place_runs_nothing():
    (g,) = listed(a100_421()).gpus
    plan = plan_geometry(g, "1g,2g,4g")
    assert plan.commands == () and plan.kept == (1, 5, 13) and "already" in plan.notes[0]


def test_plan_replaces_split_compute_instances():
    (g,) = listed(a100(instances=[FakeInstance(2, 9, (0, 4), {0: 1, 1: 2})])).gpus
    assert argv(plan_geometry(g, "3g")) == [
        "nvidia-smi mig -i 0 -gi 2 -ci 0 -dci", "nvidia-smi mig -i 0 -gi 2 -ci 1 -dci",
        "nvidia-smi mig -i 0 -gi 2 -dgi", "nvidia-smi mig -i 0 -cgi 3g.20gb -C"]


@pytest.mark.parametrize("geometry, says", [
    ("4g,4g", "2× 4g.20gb, but the GPU holds at most 1"),
    ("4g,3g,1g", "needs 8 compute slices, the GPU has 7"),
    ("2g,2g,2g,2g", "4× 2g.10gb, but the GPU holds at most 3"),
    ("3g,3g,1g", "no placement of these instances fits"),  # counts and compute allow it; memory does not
    ("5g", "'5g' is not a profile of this GPU"),
    (" , ", "names no profile"),
])
def test_impossible_geometries_are_refused_saying_why(geometry, says):
    (g,) = listed(a100_421()).gpus
    with pytest.raises(InvalidInput, match=says.replace("(", r"\(")):
        plan_geometry(g, geometry)


def test_other_gpus_are_checked_against_the_profiles_nvml_gives():
    (g,) = listed(FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, (1, 1), H100)).gpus
    plan = plan_geometry(g, "4g,1g,1g.20gb")  # "1g" is the plain 1g.10gb
    assert plan.target == ("4g.40gb", "1g.20gb", "1g.10gb")
    with pytest.raises(InvalidInput, match="5× 1g.20gb, but the GPU holds at most 4"):
        plan_geometry(g, ",".join(["1g.20gb"] * 5))


def test_gpus_without_mig_or_without_known_profiles_are_refused():
    t4, l40 = listed(FakeGpu("Tesla T4", 16 * GIB, None), FakeGpu("NVIDIA L40", 48 * GIB, (0, 0))).gpus
    with pytest.raises(InvalidInput, match="does not support MIG"):
        plan_geometry(t4, "1g")
    with pytest.raises(InvalidInput, match="knows none for this GPU; turn MIG on"):
        plan_geometry(l40, "1g")


# --------------------------------------------------------------------------- applier


def _must_not_run(*args, **kwargs):
    raise AssertionError(f"ran {args} without the admin flag")


def test_without_the_admin_flag_apply_logs_the_plan_and_runs_nothing(caplog):
    driver = MigDriver(FakeNvml([a100_421()]), run=_must_not_run)
    plan = driver.plan(0, "4g,3g")
    with caplog.at_level(logging.INFO, "splitserve.placement.gpus"):
        applied = driver.apply(plan)
    assert applied.dry_run and not applied.ok and applied.ran == ()
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == len(plan.commands) and all("dry run" in m for m in logged)
    assert "-cgi 3g.20gb -C" in logged[-1]


class Recorder:
    """``subprocess.run`` for an admin's apply: records argv, fails or hangs on one step."""

    def __init__(self, fail_at: int | None = None, hang_at: int | None = None) -> None:
        self.argvs: list[list[str]] = []
        self.fail_at, self.hang_at = fail_at, hang_at

    def __call__(self, argv, **kw):
        assert kw["timeout"] > 0 and kw["check"] is False
        self.argvs.append(argv)
        n = len(self.argvs)
        if n == self.hang_at:
            raise subprocess.TimeoutExpired(argv, kw["timeout"])
        code = 1 if n == self.fail_at else 0
        return subprocess.CompletedProcess(argv, code, "", "In use by another client" if code else "")


def test_an_admin_apply_runs_the_commands_in_order_and_stops_at_the_first_failure():
    nvml = FakeNvml([a100_421()])
    plan = MigDriver(nvml).plan(0, "4g,3g")
    ok = Recorder()
    applied = MigDriver(nvml, admin=True, run=ok).apply(plan)
    assert applied.ok and ok.argvs == [list(c.argv) for c in plan.commands]
    failing = Recorder(fail_at=3)
    applied = MigDriver(nvml, admin=True, run=failing).apply(plan)
    assert len(failing.argvs) == 3 and not applied.ok
    assert applied.failed == ("step 3 of 5 (nvidia-smi mig -i 0 -gi 5 -dgi) failed with exit status 1: "
                              "In use by another client")
    hung = MigDriver(nvml, admin=True, timeout_s=7, run=Recorder(hang_at=1)).apply(plan)
    assert hung.failed == "step 1 of 5 (nvidia-smi mig -i 0 -gi 5 -ci 0 -dci) did not finish within 7 s"


# --------------------------------------------------------------------------- CLI and the node's view


def test_cli_plan_prints_the_commands_and_runs_nothing(capsys):
    driver = MigDriver(FakeNvml([a100_421()]), run=_must_not_run)
    assert run_gpu_plan(driver, 0, "4g,3g", apply=False, as_json=False) == 0
    assert run_gpu_plan(driver, 0, "4g,3g", apply=True, as_json=False) == 0  # no admin: still a dry run
    out = capsys.readouterr().out
    assert "nvidia-smi mig -i 0 -cgi 3g.20gb -C" in out and "keeps GPU instances 1" in out
    assert run_gpu_plan(driver, 0, "4g,4g", apply=False, as_json=False) == 1
    assert "at most 1" in capsys.readouterr().out


def test_cli_gpus_on_this_machine_and_apply_refused_without_the_admin_flag(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_GPU_ADMIN", raising=False)
    runner = CliRunner()
    listed_ = runner.invoke(app, ["gpus", "--json"])
    assert listed_.exit_code == 0 and '"gpus"' in listed_.output
    if not _has_driver():
        assert "NVML not available" in listed_.output
    refused = runner.invoke(app, ["gpus", "plan", "4g,3g", "--apply"])
    assert refused.exit_code == 2 and "needs --gpu-admin" in refused.output


def test_the_inventory_answers_from_its_listing_and_reads_again_off_the_loop_when_stale():
    reads: list[int] = []
    now = [0.0]

    def read() -> GpuListing:
        reads.append(1)
        return GpuListing((Gpu(0, "GPU-0", "Tesla T4", 16 * GIB, None, None),))

    async def scenario() -> None:
        inv = GpuInventory(read, max_age_s=30, clock=lambda: now[0])
        assert inv.snapshot()["reason"] == "not read yet"
        inv.start()
        await inv.stop()
        assert inv.snapshot()["gpus"][0]["name"] == "Tesla T4" and len(reads) == 1
        now[0] = 31.0
        assert inv.snapshot()["age_s"] == 31.0  # the old listing at once, a re-read behind it
        inv.snapshot()  # one re-read at a time
        await inv.stop()
        assert len(reads) == 2 and inv.snapshot()["age_s"] == 0.0

    asyncio.run(scenario())


def test_algorithm_2s_geometry_is_planned_on_every_mig_gpu_and_other_gpus_say_why_not():
    from splitserve.placement.mig import plan_node_geometry

    listing = listed(a100_421(), FakeGpu("NVIDIA H200", 141 * GIB, None, (), [], "GPU-h"))
    plans, skipped = plan_node_geometry(listing, (3, 4))  # Algorithm 2's fallback (4g, 3g)
    (plan,) = plans
    assert plan.gpu == 0 and plan.target == ("4g.20gb", "3g.20gb") and plan.kept == (1,)
    assert argv(plan)[-1] == "nvidia-smi mig -i 0 -cgi 3g.20gb -C"
    assert skipped == ["GPU 1 (NVIDIA H200) does not support MIG"]
    plans, skipped = plan_node_geometry(listing, (4, 2, 1))  # what the A100 has already: nothing to run
    assert argv(plans[0]) == [] and "already has geometry" in plans[0].notes[0]


def test_a_geometry_a_gpu_cannot_place_is_skipped_with_the_reason():
    from splitserve.placement.mig import plan_node_geometry

    plans, skipped = plan_node_geometry(listed(a100()), (3, 3, 1))  # counts allow it; memory slices do not
    assert plans == [] and len(skipped) == 1 and "3g" in skipped[0]
