"""``splitserve bench disb`` and ``splitserve bench packrat``: narrowed quick runs end to end.

Each scenario starts its own servers (one per preemption scheme; a static and an adaptive
Packrat server) and its generators in their own processes; these runs are cut to a few seconds
of load each, so they check the plumbing and the results folder, not the numbers.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from splitserve.bench.runner import EXIT_OK, run_scenario

pytestmark = pytest.mark.usefixtures("shared_weights")


def _run(tmp_path: Path, name: str, models: tuple[str, ...], **overrides: object) -> dict:
    summary = run_scenario(name, quick=True, out=tmp_path, models=models,
                           overrides={k: str(v) for k, v in overrides.items()}, console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK, (summary.lines, (summary.path / "report.md").read_text()[-3000:])
    doc = json.loads((summary.path / "result.json").read_text())
    assert doc["status"] == "ok" and doc["params"]["quick"] is True
    assert list(summary.path.glob("*.png")), sorted(p.name for p in summary.path.iterdir())
    assert (summary.path / "report.md").read_text().startswith(f"# splitserve bench {name}")
    doc["_lines"] = summary.lines
    return doc


def test_disb_workload_a_reef_against_rt_only(tmp_path):
    # no warm-up: A's BE client is closed-loop, and on a loaded host its first ResNet-152 call
    # (sent at 0) can outlast a short run; counted from 0, it is answered in the drain at the latest
    doc = _run(tmp_path, "disb", ("vgg19", "resnet152"), workloads="A", schemes="rt-only,reef", duration_s=1.2,
               warmup_s=0.0, probe_requests=2, pair_duration_s=0.8)
    runs = doc["runs"]["A"]
    assert set(runs) == {"rt-only", "reef"}
    for scheme, m in runs.items():
        assert m["rt"]["ok"] > 0 and m["rt"]["errors"] == 0, (scheme, m.get("error_kinds"))
    assert runs["rt-only"]["be"]["requests"] == 0  # rt-only refuses BE, so none is sent
    assert runs["reef"]["be"]["ok"] > 0 and runs["reef"]["be"]["errors"] == 0
    assert doc["normalised"]["A"]["rt-only"]["rt_p99"] == 1.0
    assert 0 < doc["workloads"]["A"]["scale"] < 1  # the CPU cannot take 100 VGG-19 req/s
    assert set(doc["pairs"]["vgg19:resnet152"]) >= {"alone", "shared"}
    assert any(line.startswith("A: RT p99 / rt-only") for line in doc["_lines"])


def test_packrat_lenet_static_and_timeline(tmp_path):
    doc = _run(tmp_path, "packrat", ("lenet",), threads="2", batches="1,2", reps=3, warmup=1, closed_s=0.3,
               budget_s=0.3, step_s=1.0, reconfig_timeout_s=1, profile_dir=tmp_path / "profiles")
    r = doc["models"]["lenet"]
    assert r["T"] == 2 and set(r["batches"]) == {"1", "2"}
    for b, row in r["batches"].items():
        assert row["expected"]["packrat_ms"] <= row["expected"]["fat_ms"] * (1 + 1e-9)
        assert row["fat"]["e2e_ms"]["p50"] > 0 and row["packrat"]["e2e_ms"]["p50"] > 0
        assert sum(i["batch"] for i in row["served"]["instances"]) >= int(b)
    tl = r["timeline"]
    assert tl["requests"] > 0 and tl["lost"] == 0
    assert r["profile"]["measured_now"] is True
