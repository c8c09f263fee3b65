"""The disb and packrat benchmark scenarios without processes or sockets: refusing bad input at
start-up, rate scaling, and the numbers drawn from samples and scheduler events."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from splitserve.bench.cli import _extras, bench_app
from splitserve.bench.disb import workload
from splitserve.bench.disb.run import (
    be_batches,
    busy_share,
    compute_waits,
    normalised,
    preemptions,
    restore_overhead,
    run_metrics,
)
from splitserve.bench.disb.scenario import Params, choose_scale, resolve_workloads, scaled
from splitserve.bench.loadgen import RunResult, Sample
from splitserve.bench.runner import build_params
from splitserve.bench.scenarios.base import write_repository
from splitserve.registry import read_model_dir


def test_a_workload_file_with_a_bad_field_is_refused_naming_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"time": 5, "tasks": [
        {"id": "rt", "load": {"type": "periodic", "frequency": 10}, "client": {"model_name": "vgg19"}},
        {"id": "be", "load": {"type": "continuous", "rate": 3}, "client": {"model_name": "resnet152"}},
    ]}))
    with pytest.raises(ValueError, match=r"bad\.json: tasks\[1\]\.load\.rate: unknown field"):
        build_params("disb", quick=True, overrides={"workload_file": str(bad)})
    # the command line says so and stops before making a results folder or starting a server
    out = tmp_path / "results"
    res = CliRunner().invoke(bench_app, ["disb", "--quick", "--workload-file", str(bad), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "tasks[1].load.rate" in " ".join(res.output.split())
    assert not out.exists()


def test_workload_selection_and_bad_parameters():
    assert [w.label for w in resolve_workloads(Params(), quick=True)] == ["A", "C"]
    assert [w.label for w in resolve_workloads(Params())] == list(workload.BUILTIN)
    with pytest.raises(ValueError, match="unknown DISB workloads Z"):
        build_params("disb", overrides={"workloads": "A,Z"})
    with pytest.raises(ValueError, match="unknown schemes"):
        build_params("disb", overrides={"schemes": "reef,fifo"})
    with pytest.raises(ValueError, match="pair 'vgg19'"):
        build_params("disb", overrides={"pairs": "vgg19"})


def test_cli_takes_bare_models_and_parameters_as_options():
    assert _extras(["resnet18", "--threads", "1,2", "--rate-scale=0.3", "--timeline"]) == \
        (("resnet18",), {"threads": "1,2", "rate-scale": "0.3", "timeline": "true"})


def test_rates_are_scaled_to_the_wanted_share_of_a_core():
    compute = {m: 0.01 for m in workload.MODELS}  # 10 ms per sample
    p = Params(duration_s=10.0, rt_load=0.4)
    # A: vgg19 at 100 req/s x 10 ms = one core at scale 1, so 0.4
    assert choose_scale(workload.WorkloadSpec("A", builtin="A"), p, compute) == pytest.approx(0.4)
    # D: five models at 20 req/s each
    assert choose_scale(workload.WorkloadSpec("D", builtin="D"), p, compute) == pytest.approx(0.4)
    assert choose_scale(workload.WorkloadSpec("B", builtin="B"), p, compute) == 1.0  # closed-loop RT: nothing to scale
    assert choose_scale(workload.WorkloadSpec("A", builtin="A"), Params(rate_scale=0.25), compute) == 0.25
    w = workload.parse_workload({"time": 60, "tasks": [
        {"id": "p", "load": {"type": "poisson", "frequency": 40}, "client": {"model_name": "vgg19"}},
        {"id": "t", "load": {"type": "trace", "trace": [0, 100, 200]}, "client": {"model_name": "vgg19"}}]})
    spec = workload.WorkloadSpec("f", workload=w)
    # the trace needs 3% of a core and is replayed as written; the poisson task makes up the rest
    scale = choose_scale(spec, Params(duration_s=1.0, warmup_s=0.2), compute)
    assert scale == pytest.approx((0.4 - 0.03) / 0.4)
    run = scaled(spec, scale, 1.0)
    assert run.time == 1.0 and run.tasks[0].load.frequency == pytest.approx(40 * scale)
    assert run.tasks[1].load.trace == (0.0, 100.0, 200.0)


def _ev(t, kind, model, batch, cls="be", latency_ns=0):
    return {"t": t, "kind": kind, "model": model, "instance": 0, "batch": batch, "cls": cls, "segment": 0,
            "latency_ns": latency_ns}


def test_preemptions_and_restore_overhead_from_events():
    events = [
        _ev(0.000, "start", "r", 1), _ev(0.010, "done", "r", 1),  # clean: ran 10 ms
        _ev(0.020, "start", "r", 2), _ev(0.024, "preempt", "r", 2),
        _ev(0.026, "preempted", "r", 2, latency_ns=2_000_000), _ev(0.040, "resume", "r", 2),
        _ev(0.048, "done", "r", 2),  # stopped once: ran 6 + 8 = 14 ms, suspended 14 ms
        _ev(0.050, "start", "r", 3), _ev(0.052, "preempted", "r", 3), _ev(0.0521, "resume", "r", 3),
        _ev(0.060, "done", "r", 3),  # a padding stop: no flag
        _ev(0.030, "start", "v", 1, cls="rt"), _ev(0.035, "done", "v", 1, cls="rt"),
        _ev(0.070, "resume", "r", 9), _ev(0.075, "done", "r", 9),  # started before the log: left out
    ]
    p = preemptions(events)
    assert p["preemptions"] == 1 and p["latency_ms"] == [2.0] and p["padding_stops"] == 1
    assert p["padding_resume_ms"]["p50"] == pytest.approx(0.1)
    batches = be_batches(events)
    assert sorted((b["stops"], round(b["ran_ms"], 3)) for b in batches) == [(0, 10.0), (1, 9.9), (1, 14.0)]
    r = restore_overhead(batches)["r"]
    assert r["clean_n"] == 1 and r["preempted_n"] == 2
    assert r["ratio"] == pytest.approx(11.95 / 10.0) and r["per_stop_ms"] == pytest.approx(1.95)
    # RT ran 30-35 ms of a 75 ms log; overlapping RT batches are counted once
    assert busy_share(events, "rt") == pytest.approx(5 / 75)
    assert busy_share(events + [_ev(0.031, "start", "w", 1, cls="rt"), _ev(0.037, "done", "w", 1, cls="rt")],
                      "rt") == pytest.approx(7 / 75)
    # arrival -> compute start: the RT requests of done events with the worker's stamp only
    stamped = [{**_ev(0.035, "done", "v", 2, cls="rt"), "waits_us": [120, 80]},
               {**_ev(0.036, "done", "r", 4), "waits_us": [5000]}, _ev(0.037, "failed", "v", 3, cls="rt")]
    assert compute_waits(events + stamped, "rt") == [120.0, 80.0]


def _sample(t, lat, cls, ok=True, queue=0.001, compute=0.01):
    return Sample(t, t, t + lat, ok, "m", cls, tag=cls, server_queue_s=queue, server_compute_s=compute)


def test_run_metrics_and_normalisation():
    rt = [_sample(0.1 * i, 0.02, "rt") for i in range(1, 20)]
    be = [_sample(0.05 * i, 0.05, "be") for i in range(1, 38)]
    m = run_metrics(RunResult(rt + be + [_sample(1.0, 0.0, "be", ok=False)]), duration=2.0, warmup=0.5)
    assert m["rt"]["mean_ms"] == pytest.approx(20.0) and m["rt"]["errors"] == 0 and m["be"]["errors"] == 1
    assert m["rt"]["throughput_rps"] == pytest.approx(15 / 1.5)  # answers between 0.5 s and 2 s
    base = run_metrics(RunResult(rt), duration=2.0, warmup=0.5)
    n = normalised({"rt-only": base, "reef": m})
    assert n["rt-only"]["rt_p99"] == pytest.approx(1.0)
    assert n["reef"]["overall"] == pytest.approx(m["overall_rps"] / base["overall_rps"])
    assert normalised({"reef": m})["reef"]["rt_mean"] is None  # no rt-only to compare with


def test_repository_with_pinned_cpus_is_readable(tmp_path):
    write_repository(tmp_path, {"vgg19_pad": {"cpus": [1], "threads": 1, "default_class": "rt",
                                           "artifact": {"kind": "zoo", "arch": "vgg19"},
                                           "placement": {"kind": "packrat", "threads": 2, "batch": 4,
                                                         "adaptive": False}}})
    cfg = read_model_dir(tmp_path / "vgg19_pad")
    assert cfg.cpus == (1,) and cfg.default_class == "rt" and cfg.placement["adaptive"] is False
