"""The GPU check: ``tests/gpu`` and the GPU benchmarks in quick form, one summary table, in at
most nine minutes (``scripts/gpu-check``; ``docs/gpu.md`` says what each figure should show).

Each step runs in a child process under its own time limit, so one that hangs costs its
limit and no more; a step that would start after the overall deadline is skipped and says
so. Without CUDA it says there is nothing to check and exits 0.

    python -m splitserve.bench.gpu_check [--out DIR] [--budget-s 540]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# A child prints its summary lines after this marker, as JSON, when its scenario ends.
MARK = "GPU-CHECK-SUMMARY "


@dataclass(frozen=True)
class Step:
    """One step: a pytest run (``scenario`` and ``module`` None), a scenario in quick form
    with overrides, or a measuring ``module`` run with ``--mark``."""

    label: str
    limit_s: int
    scenario: str | None = None
    overrides: dict[str, str] = field(default_factory=dict)
    module: str | None = None


STEPS = (
    Step("tests/gpu", 170),
    Step("pinned-tier reload vs disk", 30, module="splitserve.bench.pinned_reload"),
    Step("rpc-tax (GPU compute)", 65, "rpc-tax",
         {"models": "resnet18_imagenet,resnet50_imagenet,bert_tiny", "transports": "tcp,direct,grpc,echo",
          "requests": "200", "warmup": "20"}),
    Step("batching resnet50 ImageNet, 32 clients", 60, "batching",
         {"models": "resnet50_imagenet", "transports": "tcp", "clients": "32", "policies": "none,work_conserving",
          "max_batch": "32", "duration_s": "4", "warmup_s": "1"}),
    Step("DISB C, graphs off", 50, "disb", {"workloads": "C", "schemes": "rt-only,reef", "cuda_graphs": "off",
                                            "pairs": "", "duration_s": "8"}),
    Step("DISB C, graphs on", 50, "disb", {"workloads": "C", "schemes": "rt-only,reef", "cuda_graphs": "on",
                                           "pairs": "", "duration_s": "8"}),
    Step("DISB C, no launch-ahead", 50, "disb", {"workloads": "C", "schemes": "reef", "cuda_graphs": "off",
                                                 "segment_capacity": "1", "pairs": "", "duration_s": "8"}),
    Step("packrat (CPUs)", 65, "packrat", {}),
)
# Steps on the GPU; packrat is measured on the machine's CPUs, as the paper's.
GPU_SCENARIOS = ("rpc-tax", "batching", "disb")


@dataclass
class Outcome:
    label: str
    status: str  # ok | failed (rc N) | timed out | skipped
    seconds: float
    lines: list[str]


def _child(step: Step, out: Path) -> list[str]:
    if step.module is not None:
        return [sys.executable, "-m", step.module, "--mark", MARK]
    if step.scenario is None:
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "tests/gpu"]
    overrides = dict(step.overrides)
    if step.scenario in GPU_SCENARIOS:
        overrides["device"] = "cuda"
    return [sys.executable, "-m", "splitserve.bench.gpu_check", "--one", step.scenario, "--out", str(out),
            "--overrides", json.dumps(overrides)]


def run_step(step: Step, out: Path, deadline: float) -> Outcome:
    """Run ``step`` within its limit and the overall deadline."""
    left = deadline - time.monotonic()
    if left < 10:
        return Outcome(step.label, "skipped", 0.0, ["the check's time budget was spent"])
    t0 = time.monotonic()
    try:
        done = subprocess.run(_child(step, out), capture_output=True, text=True, timeout=min(step.limit_s, left),
                              check=False)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-400:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return Outcome(step.label, "timed out", time.monotonic() - t0, text.strip().splitlines()[-3:])
    took = time.monotonic() - t0
    lines = _summary(done.stdout) if step.scenario or step.module else done.stdout.strip().splitlines()[-6:]
    if done.returncode != 0 and not lines:
        lines = (done.stdout + done.stderr).strip().splitlines()[-6:]
    return Outcome(step.label, "ok" if done.returncode == 0 else f"failed (rc {done.returncode})", took, lines)


def _summary(stdout: str) -> list[str]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return list(json.loads(line[len(MARK):]))
    return []


def run_one(scenario: str, out: Path, overrides: dict[str, str]) -> int:
    """Child: one scenario in quick form; prints its summary lines after ``MARK``."""
    from splitserve.bench.runner import EXIT_OK, run_scenario

    summary = run_scenario(scenario, quick=True, out=out, overrides=overrides)
    print(MARK + json.dumps(list(summary.lines) + [f"results in {summary.path}"]), flush=True)
    return 0 if summary.exit_code == EXIT_OK else summary.exit_code


def table(outcomes: list[Outcome]) -> str:
    """The summary: one block per step (status, seconds, its figures)."""
    rows = [f"{'step':<42} {'status':<14} {'s':>6}", "-" * 64]
    for o in outcomes:
        rows.append(f"{o.label:<42} {o.status:<14} {o.seconds:>6.0f}")
        rows += [f"    {line}" for line in o.lines]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/gpu-check"))
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole check's time (9 minutes)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return run_one(args.one, args.out, json.loads(args.overrides))
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, {args.budget_s:.0f} s at most", flush=True)
    outcomes = []
    for step in STEPS:
        outcomes.append(run_step(step, args.out, deadline))
        print(f"  {step.label}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s", flush=True)
    text = table(outcomes)
    print(text)
    (args.out / "summary.txt").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
