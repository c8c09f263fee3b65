"""Algorithm 2's geometry on the node's MIG GPUs (``server.mig_geometry.MigGeometry``): the
plan from a fake NVML listing, logged and never run without the administrator's flag, run in
order with it, and a failing command stops the plan and says which."""

from __future__ import annotations

import subprocess

from splitserve.placement.gpus import MigDriver
from splitserve.server.mig_geometry import MigGeometry
from tests.fake_nvml import A100, GIB, FakeGpu, FakeInstance, FakeNvml


def node() -> FakeNvml:
    """An A100 in PROTEAN's initial geometry (4g, 2g, 1g) and an H200 without MIG."""
    a100 = FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GIB, (1, 1), A100,
                   [FakeInstance(1, 5, (0, 4), {0: 4}), FakeInstance(5, 14, (4, 2), {0: 2}),
                    FakeInstance(13, 19, (6, 1), {0: 1})], "GPU-a")
    return FakeNvml([a100, FakeGpu("NVIDIA H200", 141 * GIB, None, (), [], "GPU-h")])


class Recorder:
    """Stands where ``subprocess.run`` is: records argv, answers ``rc``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.argv: list[list[str]] = []
        self.fail_at = fail_at

    def __call__(self, argv, **_kw) -> subprocess.CompletedProcess[str]:
        self.argv.append(list(argv))
        rc = 1 if self.fail_at == len(self.argv) else 0
        return subprocess.CompletedProcess(argv, rc, "", "In use by another client" if rc else "")


def test_without_the_admin_flag_the_plan_is_made_and_nothing_runs():
    run = Recorder()
    drained: list[frozenset[str]] = []
    (applied,) = MigGeometry(MigDriver(node(), admin=False, run=run), lambda u: drained.append(u) or True)((4, 3))
    assert applied.dry_run and run.argv == [] and drained == []  # nothing is destroyed: nothing to drain
    assert [str(c) for c in applied.plan.commands][-1] == "nvidia-smi mig -i 0 -cgi 3g.20gb -C"


def test_with_the_admin_flag_the_commands_run_in_order_and_a_failure_stops_them():
    run = Recorder()
    drained: list[frozenset[str]] = []
    (applied,) = MigGeometry(MigDriver(node(), admin=True, run=run), lambda u: drained.append(u) or True)((4, 3))
    assert applied.ok and [" ".join(a) for a in run.argv] == [str(c) for c in applied.plan.commands]
    # the slices the plan destroys were drained first
    assert drained == [frozenset(applied.plan.destroys)] and applied.plan.destroys
    run = Recorder(fail_at=1)
    (applied,) = MigGeometry(MigDriver(node(), admin=True, run=run), lambda u: True)((4, 3))
    assert len(run.argv) == 1 and applied.failed is not None and "In use by another client" in applied.failed


def test_a_plan_whose_slices_cannot_be_drained_is_not_run():
    run = Recorder()
    (applied,) = MigGeometry(MigDriver(node(), admin=True, run=run), lambda u: False)((4, 3))
    assert run.argv == [] and not applied.ok and "could not be drained; nothing was run" in applied.failed
