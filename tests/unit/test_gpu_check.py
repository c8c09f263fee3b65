"""``scripts/gpu-check``: without CUDA it says so and exits 0 (this machine); every step's
parameters are ones its scenario takes, so a device run does not fail on a name; a step
past its limit or the overall budget says so in the table."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitserve.bench.gpu_check import GPU_SCENARIOS, MARK, STEPS, Outcome, Step, _summary, run_step, table
from splitserve.bench.runner import build_params

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the check would run")
def test_the_script_without_cuda_says_so_and_exits_0():
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout


@pytest.mark.parametrize("step", [s for s in STEPS if s.scenario], ids=lambda s: s.label)
def test_every_step_names_parameters_its_scenario_takes(step):
    overrides = dict(step.overrides, **({"device": "cuda"} if step.scenario in GPU_SCENARIOS else {}))
    params = build_params(step.scenario, quick=True, overrides=overrides)
    if step.scenario in GPU_SCENARIOS:
        assert params.device == "cuda"


def test_the_steps_fit_the_nine_minutes():
    assert sum(s.limit_s for s in STEPS) <= 540


def test_a_step_past_the_budget_is_skipped_and_the_table_says_what_each_did(tmp_path):
    skipped = run_step(Step("late", 60), tmp_path, deadline=time.monotonic())
    assert skipped.status == "skipped"
    text = table([Outcome("rpc-tax", "ok", 12.0, ["tcp tax 40 µs"]), skipped])
    assert "rpc-tax" in text and "tcp tax 40 µs" in text and "skipped" in text
    assert _summary(f"progress\n{MARK}[\"a\", \"b\"]\n") == ["a", "b"]


def test_the_pinned_reload_step_reports_medians_and_the_ratio_against_its_goal(tmp_path):
    from splitserve.bench.pinned_reload import main, measure, summarize

    # its pinned arm is the server's path (a binding parked, reloaded by its first batch): it runs on the CPU too
    disk, pinned = measure("lenet", 2, 2, tmp_path, device="cpu")
    assert len(disk) == len(pinned) == 2 and min(disk + pinned) > 0

    lines = summarize("m", [0.30, 0.10, 0.20], [0.05, 0.04, 0.06])
    assert lines == ["m: reload to first answer, median of 3: disk 200.0 ms, pinned tier 50.0 ms",
                     "pinned tier 4.00x faster than disk (meets the 3x goal)"]
    assert "misses the 3x goal" in summarize("m", [0.1], [0.05])[1]
    step = next(s for s in STEPS if s.module == "splitserve.bench.pinned_reload")
    assert step.limit_s <= 30
    if not torch.cuda.is_available():
        assert main(["--rounds", "1"]) == 0  # says why it measured nothing
