"""``splitserve bench``: every scenario's quick run, narrowed, against one shared server.

One server serves the module: vecadd1k, the batching variants of resnet18, and a model named
``lenet`` whose weights come from seed 1 (not the zoo's seed 0) so that validation must refuse
it. Each scenario runs in this process through ``runner.run_scenario`` with ``--url`` pointing
at the server's ``server.json``; its load generators still run in their own processes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from splitserve.bench.cli import bench_app
from splitserve.bench.runner import EXIT_OK, EXIT_REFUSED, run_scenario
from splitserve.bench.scenarios import SCENARIOS
from splitserve.bench.scenarios.base import write_repository
from splitserve.bench.scenarios.batching import variants

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("shared_weights")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers import start_server

    base = tmp_path_factory.mktemp("bench")
    repo = write_repository(base / "repository", {
        **variants(("resnet18",), 8, ("work_conserving", "none", "adaptive")),
        "lenet": {"artifact": {"kind": "zoo", "arch": "lenet", "seed": 1}},  # wrong weights on purpose
    })
    s = start_server(base / "data", "--repository", str(repo), "--load", "vecadd1k",
                     "--load", "resnet18_b8", "--load", "resnet18_b8_nobatch")
    yield s
    assert s.stop() == 0


def _run(server, tmp_path: Path, name: str, models: tuple[str, ...], transports: tuple[str, ...],
         **overrides: object) -> tuple[int, Path, list[str]]:
    summary = run_scenario(name, quick=True, out=tmp_path, urls=[str(server.info_file)], models=models,
                           transports=transports, overrides={k: str(v) for k, v in overrides.items()},
                           console=Console(file=io.StringIO()))
    return summary.exit_code, summary.path, summary.lines


def _result(path: Path) -> dict:
    doc = json.loads((path / "result.json").read_text())
    for key in ("machine", "commit", "params", "scenario"):
        assert key in doc
    assert doc["params"]["quick"] is True
    assert list(path.glob("*.png")), f"no plot in {sorted(p.name for p in path.iterdir())}"
    assert (path / "report.md").read_text().startswith("# splitserve bench")
    return doc


def test_bench_help_lists_every_scenario():
    out = subprocess.run([sys.executable, "-m", "splitserve", "bench", "--help"], capture_output=True, text=True, check=False,
                         cwd=ROOT, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    for name in SCENARIOS:
        assert name in out.stdout


def test_rpc_tax(server, tmp_path):
    code, path, lines = _run(server, tmp_path, "rpc-tax", ("vecadd1k",), ("tcp", "udp", "http-json", "local", "echo"),
                             requests=30, warmup=5, codec_reps=10)
    assert code == EXIT_OK
    doc = _result(path)
    cells = doc["models"]["vecadd1k"]
    assert set(cells) == {"tcp", "udp", "local", "echo", "echo+poll"}  # the echo by a polling client too
    assert "http-json" in doc["unavailable"]  # this server has no HTTP front end
    tcp = cells["tcp"]
    parts = tcp["components"]
    assert parts["compute_us"] > 0 and parts["client_us"] > 0
    # the parts are medians and add up to the median E2E, unless they overshoot it (then transport is 0)
    assert parts["transport_us"] == 0 or sum(parts.values()) == pytest.approx(tcp["e2e_us"]["p50"], rel=1e-6)
    assert doc["ratios"]["vecadd1k"]["vs_echo"] > 0
    assert any("fast-path tax" in line for line in lines)


def test_load(server, tmp_path):
    code, path, _ = _run(server, tmp_path, "load", ("vecadd1k",), ("tcp",), rates="100,300", duration_s=0.6,
                         warmup_s=0.1)
    assert code == EXIT_OK
    curve = _result(path)["models"]["vecadd1k"]["transports"]["tcp"]
    assert [p["rate"] for p in curve["points"]] == [100.0, 300.0]
    assert all(p["ok"] > 0 for p in curve["points"])


def test_batching(server, tmp_path):
    code, path, lines = _run(server, tmp_path, "batching", ("resnet18",), ("tcp",), clients="1,4", duration_s=0.5,
                             warmup_s=0.1, max_batch=8, policies="work_conserving,none,adaptive")
    assert code == EXIT_OK
    doc = _result(path)
    per_policy = doc["models"]["resnet18"]["tcp"]
    assert set(per_policy) == {"work_conserving", "none", "adaptive"}
    assert all(q["throughput_rps"] > 0 for c in per_policy.values() for q in c["points"])
    assert doc["gain_at_max_clients"]["resnet18"]["tcp"] > 0
    assert doc["fig5"]["resnet18"]["tcp"]["adaptive_over_none_throughput"] > 0
    assert (path / "repository" / "resnet18_b8" / "config.toml").is_file()
    assert any("throughput gain at 4 clients" in line for line in lines)
    assert any("at 4 clients adaptive/none throughput" in line for line in lines)


def test_trace(server, tmp_path):
    code, path, _ = _run(server, tmp_path, "trace", ("resnet18",), ("tcp",), duration_s=1.5, windows=3,
                         mean_rate=10)
    assert code == EXIT_OK
    traces = _result(path)["models"]["resnet18"]["traces"]
    assert set(traces) == {"diurnal", "bursty"}
    assert all(len(t["transports"]["tcp"]["windows"]) == 3 for t in traces.values())


def test_micro(server, tmp_path):
    code, path, _ = _run(server, tmp_path, "micro", ("vecadd1k",), ("tcp", "echo"), requests=30, warmup=5,
                         clients=4, duration_s=0.6, warmup_s=0.1)
    assert code == EXIT_OK
    cells = _result(path)["models"]["vecadd1k"]
    assert cells["tcp"]["throughput_rps"] > 0 and cells["echo"]["throughput_rps"] > 0


def test_fastpath_latency(server, tmp_path):
    code, path, lines = _run(server, tmp_path, "fastpath-latency", ("vecadd1k",), ("tcp",), requests=60, warmup=5,
                             connections=4, duration_s=0.6, warmup_s=0.1)
    assert code == EXIT_OK
    r = _result(path)["models"]["vecadd1k"]
    assert r["latency_ratio"] > 0 and r["throughput_ratio"] > 0
    assert any("echo p50" in line for line in lines)


def test_fastpath_latency_direct_with_a_polling_client(tmp_path):
    """On a server of its own with the direct path: the path measured by a blocking client
    and by one that polls for its answers, the latter set against an echo client that polls
    too, with no throughput figure of its own (the generator does not poll); and the same
    direct path over connections the front end handed over (``direct-front``). Each direct
    path is also set against an echo whose server polls as long as the workers do."""
    summary = run_scenario("fastpath-latency", quick=True, out=tmp_path, models=("vecadd1k",),
                           transports=("direct", "direct-front"),
                           overrides={"requests": "60", "warmup": "5", "connections": "4", "duration_s": "0.6",
                                      "warmup_s": "0.1", "client_poll_us": "500", "worker_spin_us": "50"},
                           console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK
    doc = _result(summary.path)
    assert doc["server"]["direct_spin_us"] == "50"  # its workers poll as long as asked
    paths = doc["models"]["vecadd1k"]["transports"]
    assert set(paths) == {"direct", "direct+poll", "direct-front", "direct-front+poll"}
    assert paths["direct"]["throughput_ratio"] > 0 and paths["direct+poll"]["throughput_ratio"] is None
    assert paths["direct-front"]["throughput_ratio"] > 0
    assert all(p["latency_ratio"] > 0 and p["compute_us"]["p50"] > 0 for p in paths.values())
    assert all(p["floor_ratio"] > 0 and p["floor_echo_us"]["p50"] > 0 for p in paths.values())
    assert any("direct, client polls" in line and "the echo client polls too" in line for line in summary.lines)
    assert any("an echo whose server polls too" in line for line in summary.lines)
    assert "vecadd1k (direct, client polls)" in (summary.path / "report.md").read_text()


def test_polling_on_and_off_side_by_side_on_a_quiet_and_a_busy_host(tmp_path):
    """Its own two servers, one polling and one not: both hosts' figures each way, and each
    side's polling alone, from the same minutes, and the busy host's goal reported; a --url
    is refused."""
    summary = run_scenario("polling", quick=True, out=tmp_path, models=("vecadd1k",),
                           overrides={"requests": "60", "warmup": "5", "connections": "4", "duration_s": "0.4",
                                      "warmup_s": "0.1", "busy_cores": "1"},
                           console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK
    doc = _result(summary.path)
    assert doc["server"]["direct_spin_us"] == {"on": None, "off": "0"} and len(doc["server"]["on"]) == 1
    for phase in ("quiet", "busy"):
        c = doc["phases"][phase]["vecadd1k"]["direct"]
        assert c["one_client_rps"]["on"] > 0 and c["one_client_rps"]["off"] > 0
        assert c["one_client_ratio"] == pytest.approx(c["one_client_rps"]["on"] / c["one_client_rps"]["off"])
        for side in ("worker", "client"):  # each half of polling alone, against neither
            assert c["one_side_ratio"][side] == pytest.approx(c["one_client_rps"][side] / c["one_client_rps"]["off"])
            assert c["one_client_us"][side]["p50"] > 0
        assert len(c["connections_runs"]["on"]) == len(c["connections_runs"]["off"]) == 1
    assert doc["busy_processes"] == 1
    assert any(line.startswith("busy, vecadd1k") and "goal >= 0.95x" in line and "the worker alone" in line
               for line in summary.lines)
    code = run_scenario("polling", quick=True, out=tmp_path, urls=["tcp://127.0.0.1:1"], models=("vecadd1k",),
                        console=Console(file=io.StringIO())).exit_code
    assert code != EXIT_OK


def test_rpc_tax_direct_with_a_polling_client(tmp_path):
    """On a server of its own with the direct path: the path and the echo each timed by a
    sleeping client and by one that polls, each polled row broken down like the others."""
    summary = run_scenario("rpc-tax", quick=True, out=tmp_path, models=("vecadd1k",), transports=("direct", "echo"),
                           overrides={"requests": "30", "warmup": "5", "codec_reps": "5", "client_poll_us": "500"},
                           console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK
    doc = _result(summary.path)
    assert doc["server"]["direct_spin_us"] is None  # the server's own default: its workers poll
    cells = doc["models"]["vecadd1k"]
    assert set(cells) == {"direct", "direct+poll", "echo", "echo+poll"}
    assert cells["direct+poll"]["tax_us"] > 0 and cells["direct+poll"]["components"]["compute_us"] > 0
    assert doc["ratios"]["vecadd1k"]["direct_polled_tax_us"] == cells["direct+poll"]["tax_us"]
    assert "fast path direct (to the worker, Unix), client polls" in (summary.path / "report.md").read_text()


def test_validation_refuses_a_wrong_model(server, tmp_path):
    result = CliRunner().invoke(bench_app, ["rpc-tax", "--quick", "--models", "lenet", "--transports", "tcp,echo",
                                            "--url", str(server.info_file), "--out", str(tmp_path),
                                            "-p", "requests=5"])
    assert result.exit_code == EXIT_REFUSED, result.output
    (path,) = tmp_path.iterdir()
    doc = json.loads((path / "result.json").read_text())
    assert doc["status"] == "refused" and "models" not in doc
    assert [c["ok"] for c in doc["validation"]] == [False]
    report = (path / "report.md").read_text()
    assert "## Refused" in report and "lenet" in report


def test_chaos_smoke(tmp_path):
    """The chaos run end to end on a server of its own (it kills workers and unloads models, so
    never on the module's shared one): every fault kind fires, the ledger adds up, and the exit
    code follows the ledger's verdict. Whether this server keeps every promise is the
    benchmark's question, not this test's."""
    from splitserve.bench.chaos_faults import FAULT_KINDS
    from splitserve.bench.runner import EXIT_BROKEN

    summary = run_scenario("chaos", quick=True, out=tmp_path, models=("vecadd1k",),
                           transports=("tcp", "unix", "udp", "http-binary", "grpc"),
                           overrides={"capacity_s": "0.5", "baseline_s": "1", "duration_s": "4.5",
                                      "fault_interval_s": "0.5", "hold_s": "1.5", "nonreader_mib": "2",
                                      "answer_timeout_s": "20", "call_timeout_s": "10", "capacity_clients": "4"},
                           console=Console(file=io.StringIO()))
    doc = _result(summary.path)
    assert summary.exit_code == (EXIT_BROKEN if doc["broken"] else EXIT_OK), summary.lines
    assert set(doc["faults_injected"]) == set(FAULT_KINDS)
    assert doc["phases"]["no-fault"]["requests"] > 0 and doc["phases"]["chaos"]["requests"] > 0
    answered = sum(doc["answers"].values())
    assert answered == doc["requests"]  # every request has an outcome, lost included
    assert doc["rss"]["server_peak_mib"] > 0 and (summary.path / "timeline.png").is_file()


def test_multimodel_smoke(tmp_path):
    """Three distinct-seed LeNet copies with room for two, on the scenario's own servers, cut to a
    few requests per sequence: every answer is checked against its copy, the no-limit server
    never loads during a sequence, loading on every request loads once per request, and the
    memory manager's loads equal the reference LRU's misses in every sequence."""
    summary = run_scenario("multimodel", quick=True, out=tmp_path, models=("lenet",),
                           overrides={"copies": "3", "cache": "2", "accessed": "3", "fig2_models": "3",
                                      "requests": "8", "every_requests": "3", "overlap_requests": "4",
                                      "clients": "4", "concurrent_models": "3", "concurrent_s": "0.5",
                                      "variants": "no-limit,load-every-request,lru"},
                           console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK, (summary.lines, (summary.path / "report.md").read_text()[-3000:])
    doc = _result(summary.path)
    assert all(c["ok"] for c in doc["validation"]) and len(doc["validation"]) == 6
    grid = {f"{p}/3" for p in ("sequential", "uniform", "zipf")}
    assert set(doc["no-limit"]) == set(doc["lru"]) == grid
    assert all(c["loads"] == 0 for c in doc["no-limit"].values())
    assert all(c["loads"] == c["requests"] == 3 for c in doc["load-every-request"].values())
    assert all(c["loads_equal_reference"] for c in doc["lru"].values())
    assert doc["lru"]["sequential/3"]["reference_misses"] == 8 - 2  # primed with two, then every request swaps
    assert doc["overlap"]["loading"]["loads"] > 0 == doc["overlap"]["quiet"]["loads"]
    assert doc["concurrent"]["ok"] == doc["concurrent"]["sent"] > 0
    assert doc["memory"]["max_resident_models"] == 2 and (summary.path / "latency_cdf.png").is_file()


def test_fastpath_breakdown_joins_the_clients_and_the_servers_stamps(tmp_path):
    summary = run_scenario("fastpath-breakdown", quick=True, out=tmp_path, models=("vecadd1k",), transports=("unix",),
                           overrides={"requests": "40", "warmup": "5", "profile": "false"},
                           console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_OK
    run = _result(summary.path)["runs"]["vecadd1k unix"]
    assert run["joined"] == 40  # every call found its server record
    means = [s["mean"] for s in run["stages_us"].values()]
    assert all(m is not None for m in means) and abs(sum(means) - run["e2e_us"]["mean"]) < 1e-6 * run["e2e_us"]["mean"]
