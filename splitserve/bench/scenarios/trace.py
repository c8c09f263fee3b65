"""trace: tail latency over time under real-world-shaped load (SplitRPC Fig. 11).

A Wikipedia-like diurnal day (two peaks, 10% Gaussian noise) and an on/off bursty trace are
compressed into ``duration_s`` seconds and replayed open loop, as Poisson arrivals following
the trace, against the model served with dynamic batching (``<arch>_b<N>``, work-conserving).
The mean rate is ``load_factor`` times the peak throughput a short closed-loop probe measured
over the first transport, so the same trace is replayed over every transport. The p99 latency
is computed per time window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench import traces
from splitserve.bench.arrivals import from_rate_trace, to_arrivals
from splitserve.bench.jobs import OpenLoopJob, run_open_loop
from splitserve.bench.loadgen import RunResult, run_in_processes
from splitserve.bench.results import percentiles
from splitserve.bench.scenarios.base import (
    COLOURS,
    Context,
    ScenarioOutput,
    fmt,
    md_table,
    note_generator_bottleneck,
    report_intro,
)
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.scenarios.batching import prepare_repository, variant_name
from splitserve.bench.timing import bottleneck, closed_loop_run, workload
from splitserve.bench.transports import LABEL, SERVER_TRANSPORTS
from splitserve.bench.validate import Expected

NAME = "trace"
SUMMARY = "Diurnal and bursty traces replayed open loop with dynamic batching: p99 over time (Fig. 11)."
MODELS: tuple[str, ...] = ("resnet18", "resnet50", "lenet", "lstm", "vecadd1k", "matmul8k")
TRANSPORTS: tuple[str, ...] = SERVER_TRANSPORTS
TRACES: tuple[str, ...] = ("diurnal", "bursty")


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("resnet18", "resnet50")
    transports: tuple[str, ...] = ("tcp", "grpc")
    traces: tuple[str, ...] = TRACES
    duration_s: float = 60.0  # one trace, compressed
    windows: int = 30  # p99 is computed per window of duration_s / windows
    mean_rate: float = 0.0  # req/s; 0: load_factor x the probed peak
    load_factor: float = 0.5
    noise: float = 0.1  # diurnal: Gaussian noise on each step
    peak_to_mean: float = 2.0  # bursty: burst rate over the mean
    bursts: int = 6
    max_batch: int = 8
    probe_s: float = 3.0
    probe_clients: int = 16
    generators: int = 1
    connections: int = 4

    @classmethod
    def quick(cls) -> Params:
        return cls(models=("resnet18",), duration_s=6.0, windows=12, probe_s=1.0)

    def check(self) -> None:
        unknown = [k for k in self.traces if k not in TRACES]
        if unknown:
            raise ValueError(f"unknown trace {unknown[0]!r}; use one of {', '.join(TRACES)}")
        if self.windows < 1 or self.duration_s <= 0:
            raise ValueError("windows must be >= 1 and duration_s > 0")


def rate_points(kind: str, p: Params, mean_rate: float, seed: int) -> traces.RatePoints:
    rng = np.random.default_rng(seed)
    if kind == "diurnal":
        return traces.diurnal(p.duration_s, mean_rate, rng, noise=p.noise, points=max(24, p.windows * 2))
    if kind == "bursty":
        return traces.bursty(p.duration_s, mean_rate, p.peak_to_mean, rng, bursts=p.bursts)
    raise ValueError(f"unknown trace {kind!r}; use one of {', '.join(TRACES)}")


def windowed(result: RunResult, duration_s: float, windows: int) -> list[dict[str, Any]]:
    """Per time window (by scheduled send time): requests, errors, achieved rate, p50 and p99 ms."""
    width = duration_s / windows
    out = []
    for i in range(windows):
        lo, hi = i * width, (i + 1) * width
        ss = [s for s in result.samples if lo <= s.scheduled < hi]
        lat = [s.latency * 1e3 for s in ss if s.ok]
        p50, p99 = percentiles(lat, (50.0, 99.0))
        out.append({"t0": lo, "t1": hi, "requests": len(ss), "errors": sum(1 for s in ss if not s.ok),
                    "rate_rps": len(ss) / width, "p50_ms": p50, "p99_ms": p99})
    return out


def _replay(ctx: Context, target: Any, t: str, name: str, arch: str, points: traces.RatePoints,
            seed: int) -> dict[str, Any]:
    p: Params = ctx.params  # type: ignore[assignment]
    times = from_rate_trace(points, p.duration_s, np.random.default_rng(seed))
    job = OpenLoopJob(workload(t, target.url(t), name, arch, p.seed), tuple(to_arrivals(times, name, tag=None)),
                      p.connections, drain_timeout_s=max(2.0, p.duration_s / 4))
    result = run_in_processes(run_open_loop, (job,), processes=p.generators, timeout_s=3 * p.duration_s + 120)
    s = result.summary()
    return {"requests": s["count"], "errors": s["errors"], "throughput_rps": s["throughput_rps"],
            "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"],
            "windows": windowed(result, p.duration_s, p.windows), "generator_bottleneck": bottleneck(s)}


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    names = {arch: variant_name(arch, p.max_batch, "work_conserving") for arch in p.models}
    repo = prepare_repository(ctx, p.models, p.max_batch, ("work_conserving",))
    target = ctx.target(load=list(names.values()), repository=repo)
    transports = [t for t in ctx.validate(target, {n: Expected(a) for a, n in names.items()}, p.transports)
                  if t in SERVER_TRANSPORTS]
    results: dict[str, Any] = {}
    for arch, name in names.items():
        mean_rate, peak = p.mean_rate, None
        if not mean_rate and transports:
            with ctx.task(f"{arch}: probing peak throughput", 1):
                warmup = min(0.2, p.probe_s / 4)
                res = closed_loop_run(workload(transports[0], target.url(transports[0]), name, arch, p.seed),
                                      p.probe_clients, p.probe_s, p.generators, warmup)
            peak = res.summary(warmup_s=warmup).get("throughput_rps") or 0.0
            mean_rate = p.load_factor * peak
        per_trace: dict[str, Any] = {}
        with ctx.task(f"{arch}: replaying traces", len(p.traces) * len(transports)) as advance:
            for k, kind in enumerate(p.traces):
                pts = rate_points(kind, p, mean_rate, p.seed + k)
                runs = {}
                for t in transports:
                    runs[t] = _replay(ctx, target, t, name, arch, pts, p.seed + 100 + k)
                    advance(1)
                per_trace[kind] = {"rate_points": pts, "transports": runs}
        results[arch] = {"model": name, "mean_rate_rps": mean_rate, "probe_peak_rps": peak, "traces": per_trace}
    return _output(p, results)


def _step(points: Sequence[tuple[float, float]], duration: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, (t, r) in enumerate(points):
        t1 = points[i + 1][0] if i + 1 < len(points) else duration
        xs += [t, t1]
        ys += [r, r]
    return xs, ys


def _plot(p: Params, arch: str, r: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    kinds = list(r["traces"])
    fig = Figure(figsize=(5.2 * len(kinds), 6))
    axes = fig.subplots(2, len(kinds), squeeze=False, sharex="col")
    for col, kind in enumerate(kinds):
        tr = r["traces"][kind]
        top, bottom = axes[0][col], axes[1][col]
        xs, ys = _step(tr["rate_points"], p.duration_s)
        top.plot(xs, ys, color="grey", lw=1, label="trace (rate)")
        for i, (t, run) in enumerate(tr["transports"].items()):
            mid = [(w["t0"] + w["t1"]) / 2 for w in run["windows"]]
            if i == 0:  # every transport replays the same arrivals
                top.plot(mid, [w["rate_rps"] for w in run["windows"]], marker="o", ms=3, ls="", color="black",
                         label="arrivals per window")
            bottom.plot(mid, [w["p99_ms"] for w in run["windows"]], marker="o", ms=3, color=COLOURS.get(t),
                        label=LABEL[t])
        top.set_title(f"{r['model']}: {kind} trace", fontsize=9)
        top.set_ylabel("req/s")
        bottom.set_ylabel("p99 latency per window (ms)")
        bottom.set_xlabel("time (s)")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    gen_notes: list[str] = []
    for r in results.values():
        report += [f"## {r['model']}", "",
                   f"Mean rate {fmt(r['mean_rate_rps'], 1)} req/s" +
                   (f" ({p.load_factor:g} x the probed peak of {fmt(r['probe_peak_rps'], 1)} req/s)"
                    if r["probe_peak_rps"] else "") + ".", ""]
        rows = []
        for kind, tr in r["traces"].items():
            for t, run in tr["transports"].items():
                worst = max((w["p99_ms"] for w in run["windows"] if math.isfinite(w["p99_ms"])), default=None)
                rows.append((kind, LABEL[t], run["requests"], run["errors"], fmt(run["p50_ms"], 2),
                             fmt(run["p99_ms"], 2), fmt(worst, 2), "yes" if run["generator_bottleneck"] else ""))
                lines.append(f"{r['model']} {kind} over {LABEL[t]}: p99 {fmt(run['p99_ms'], 1)} ms overall, "
                             f"worst window {fmt(worst, 1)} ms, {run['errors']} errors")
                if run["generator_bottleneck"]:
                    gen_notes.append(f"{r['model']} {kind} over {LABEL[t]}: {run['generator_bottleneck']}")
        report += [md_table(("trace", "transport", "requests", "errors", "p50 ms", "p99 ms", "worst window p99 ms",
                             "generator-bound"), rows), ""]
    note_generator_bottleneck(report, lines, gen_notes, counted="in {n} replay(s)")
    figures = {f"trace_{arch}": _plot(p, arch, r) for arch, r in results.items()}
    return ScenarioOutput({"models": results}, "\n".join(report), figures, lines)
