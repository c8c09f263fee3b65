"""``splitserve profile`` measures what PROTEAN reads, for real: the memory one batch adds
(kind ``footprint``, from the latency sweep's own process) and a co-location of two tiny
models on one core (kind ``colocation``: each member's slowdown against its solo latency), with the FBRs fitted
from it or reported unidentified, never invented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from splitserve.placement.profiler import load_colocations, load_fbr, load_footprint
from splitserve.registry import Registry

ROOT = Path(__file__).resolve().parents[2]


def _profile(data: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "splitserve", "profile", *args, "--data-dir", str(data)],
                         capture_output=True, text=True, cwd=ROOT, timeout=240, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_profile_stores_footprints_and_colocation_slowdowns(tmp_path: Path) -> None:
    _profile(tmp_path, "lenet", "--threads", "1", "--batches", "1,8", "--budget-s", "0.2")
    text = _profile(tmp_path, "lenet", "--colocate", "vecadd1k", "--cores", "1", "--batch", "8", "--budget-s", "0.2")
    reg = Registry(tmp_path)
    try:
        assert (load_footprint(reg, "lenet", 8) or 0) > 0
        runs = load_colocations(reg, "lenet")
        assert sorted(r.members for r in runs) == [("lenet@8", "lenet@8"), ("lenet@8", "vecadd1k@8")]
        assert load_colocations(reg, "vecadd1k") == [r for r in runs if "vecadd1k@8" in r.members]
        # each member's slowdown is its co-located latency over its solo one on the same core (Eq. 1's
        # T_k/Solo_k); how much it is slowed depends on the host's load, so no magnitude is asserted
        for r in runs:
            assert len(r.slowdowns) == len(r.solo_s) == len(r.mean_s) == 2, r
            assert all(m > 0 and s > 0 and abs(x - m / s) <= 1e-6 * x for x, m, s in zip(r.slowdowns, r.mean_s,
                                                                                      r.solo_s)), r
        assert "FBRs fitted from" in text
        for model in ("lenet", "vecadd1k"):  # a number, or said to be unidentified: never invented
            assert load_fbr(reg, model) is not None or f"{model}@8" in text.split("unidentified", 1)[-1]
    finally:
        reg.close()
