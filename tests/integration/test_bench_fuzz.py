"""``splitserve bench fuzz --quick``, narrowed to a few inputs, writes its results folder.

The fuzz scenario starts no server (the transports run in-process against a fake node), so
it needs none of test_bench.py's shared server.
"""

from __future__ import annotations

import io
import json

from rich.console import Console

from splitserve.bench.runner import EXIT_OK, run_scenario


def test_fuzz_quick_writes_result_json(tmp_path):
    budget = {"header_inputs": 2000, "stream_inputs": 20, "udp_inputs": 20}
    summary = run_scenario("fuzz", quick=True, out=tmp_path, overrides={k: str(v) for k, v in budget.items()},
                           console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK
    doc = json.loads((summary.path / "result.json").read_text())
    for key in ("machine", "commit", "params", "scenario"):
        assert key in doc
    assert doc["params"]["quick"] is True
    targets = doc["targets"]
    assert {n: t["inputs"] for n, t in targets.items()} == {"header": 2000, "stream": 20, "udp": 20}
    assert doc["total_inputs"] == 2040
    assert targets["header"]["failures"] == 0 and targets["stream"]["failures"] == 0
    for t in targets.values():
        # the rate is the count over the time (``seconds`` is rounded to the millisecond)
        assert t["seconds"] > 0 and not t["stopped_early"]
        assert t["inputs"] / (t["seconds"] + 5e-4) - 0.1 <= t["inputs_per_s"]
        assert t["inputs_per_s"] <= t["inputs"] / max(t["seconds"] - 5e-4, 1e-9) + 0.1
        assert all("message" in ex and "input" in ex for ex in t["first_failures"])
    assert (summary.path / "report.md").read_text().startswith("# splitserve bench fuzz")
    assert list(summary.path.glob("*.png"))
    assert any("2,040 inputs" in line for line in summary.lines)
