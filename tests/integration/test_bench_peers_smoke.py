"""``splitserve bench peers`` with splitserve alone: the peers cannot be built here (their
interpreter is missing), so the run says why for each and measures splitserve's fast path,
HTTP and gRPC front ends (the last two through ``tritonclient``) on its own server."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from splitserve.bench.runner import EXIT_OK, run_scenario

pytestmark = pytest.mark.usefixtures("shared_weights")


def test_peers_smoke_with_splitserve_alone(tmp_path):
    summary = run_scenario(
        "peers", quick=True, out=tmp_path / "out", models=("lenet",),
        transports=("splitserve/fast-path", "splitserve/http", "splitserve/grpc", "triton/grpc", "ray/http"),
        overrides={"python": str(tmp_path / "no-python3.11"), "cache_dir": str(tmp_path / "cache"),
                   "requests": "20", "warmup": "2", "clients": "2", "duration_s": "0.6", "warmup_s": "0.1"},
        console=Console(file=io.StringIO()))
    report = (summary.path / "report.md").read_text()
    assert summary.exit_code == EXIT_OK, (summary.lines, report[-3000:])
    doc = json.loads((summary.path / "result.json").read_text())
    for peer in ("triton/grpc", "ray/http"):  # never a number for a peer that did not run: a reason
        assert "no Python at" in doc["unavailable"][peer]
        assert peer not in doc["models"]["lenet"]
    cells = doc["models"]["lenet"]
    assert set(cells) == {"splitserve/fast-path", "splitserve/http", "splitserve/grpc"}
    for cell in cells.values():
        single = cell["single_us"]  # a lenet round trip over a socket: tens of µs to a second, in µs
        assert 10 < single["min"] <= single["p50"] <= single["p99"] <= single["max"] < 1e6, single
        closed = cell["closed"]["2"]
        assert closed["ok"] > 0 and closed["errors"] == 0 and closed["throughput_rps"] > 0, closed
        assert 0 < closed["p50_ms"] <= closed["p99_ms"] < 1e3, closed
    assert cells["splitserve/http"]["client"] == "tritonclient-http"
    assert all(c["ok"] for c in doc["validation"]) and len(doc["validation"]) == 3
    assert "Unavailable" in report and (summary.path / "peers_throughput.png").is_file()
