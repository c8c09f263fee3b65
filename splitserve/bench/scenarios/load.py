"""load: latency under open-loop Poisson load over a range of rates (SplitRPC Fig. 9).

For each model and transport, Poisson arrivals at each rate are sent open loop from a
separate generator process (latency counts from the scheduled send time, so a slow server
cannot hide its queueing). Unless rates are given, a short closed-loop probe measures each
transport's peak throughput and the rates are spaced geometrically from a fraction of the
lowest peak to past the highest, so every transport faces the same rates and each one's
curve has points below its own knee. The knee is the first rate whose p99 exceeds ``knee_factor`` times the
lowest rate's p99, or that saw errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.arrivals import poisson, to_arrivals
from splitserve.bench.jobs import OpenLoopJob, run_open_loop
from splitserve.bench.loadgen import run_in_processes
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
from splitserve.bench.timing import bottleneck, closed_loop_run, workload
from splitserve.bench.transports import LABEL, SERVER_TRANSPORTS
from splitserve.bench.validate import Expected

NAME = "load"
SUMMARY = "Open-loop Poisson load over a range of rates: mean and p99 latency and the knee (Fig. 9)."
MODELS: tuple[str, ...] = ("vecadd1k", "matmul8k", "lenet", "lstm", "resnet18", "resnet50", "bert_tiny")
TRANSPORTS: tuple[str, ...] = SERVER_TRANSPORTS
# Past a point this far over the knee, higher rates only measure an overloaded server: skip them.
_GIVE_UP_ERROR_SHARE = 0.2


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet", "resnet18")
    transports: tuple[str, ...] = ("tcp", "http-binary", "grpc")
    rates: tuple[float, ...] = ()  # req/s; empty: `steps` rates from the probed peaks
    steps: int = 10  # rates between low_fraction x the lowest peak and high_fraction x the highest
    low_fraction: float = 0.2
    high_fraction: float = 1.2
    duration_s: float = 10.0  # per rate
    warmup_s: float = 1.0  # left out of each rate's numbers
    probe_s: float = 3.0  # closed-loop peak probe per transport
    probe_clients: int = 16
    generators: int = 1  # generator processes
    connections: int = 4  # per generator process
    knee_factor: float = 3.0

    @classmethod
    def quick(cls) -> Params:
        return cls(models=("lenet",), steps=4, duration_s=1.5, warmup_s=0.3, probe_s=0.8)


def rate_ladder(peaks: dict[str, float], steps: int, low_fraction: float, high_fraction: float) -> list[float]:
    """``steps`` rates, geometrically spaced, from ``low_fraction`` x the lowest peak to
    ``high_fraction`` x the highest (peaks of 0 are ignored)."""
    good = [v for v in peaks.values() if v > 0]
    if not good or steps < 1:
        return []
    lo, hi = low_fraction * min(good), high_fraction * max(good)
    if steps == 1 or hi <= lo:
        return [round(hi, 1)]
    return [round(float(r), 1) for r in np.geomspace(lo, hi, steps)]


def find_knee(points: list[dict[str, Any]], factor: float = 3.0) -> float | None:
    """The first rate whose p99 exceeds ``factor`` x the lowest rate's p99 or that had errors.

    ``points`` are ``{"rate", "p99_ms", "errors"}`` in increasing rate; None without a knee.
    """
    base = next((p["p99_ms"] for p in points if p.get("p99_ms") is not None), None)
    for p in points:
        if p.get("errors", 0) > 0:
            return p["rate"]
        if base is not None and p.get("p99_ms") is not None and p["p99_ms"] > factor * base:
            return p["rate"]
    return None


def _probe(ctx: Context, target: Any, model: str, transports: list[str]) -> dict[str, float]:
    p: Params = ctx.params  # type: ignore[assignment]
    peaks: dict[str, float] = {}
    with ctx.task(f"{model}: probing peak throughput", len(transports)) as advance:
        warmup = min(0.2, p.probe_s / 4)
        for t in transports:
            res = closed_loop_run(workload(t, target.url(t), model, model, p.seed), p.probe_clients, p.probe_s,
                                  p.generators, warmup)
            peaks[t] = res.summary(warmup_s=warmup).get("throughput_rps") or 0.0
            advance(1)
    return peaks


def _point(ctx: Context, target: Any, t: str, model: str, rate: float, seed: int) -> dict[str, Any]:
    p: Params = ctx.params  # type: ignore[assignment]
    times = poisson(rate, p.duration_s, np.random.default_rng(seed))
    job = OpenLoopJob(workload(t, target.url(t), model, model, p.seed), tuple(to_arrivals(times, model)),
                      p.connections, drain_timeout_s=max(2.0, p.duration_s))
    result = run_in_processes(run_open_loop, (job,), processes=p.generators, timeout_s=4 * p.duration_s + 120)
    s = result.summary(warmup_s=p.warmup_s)
    lat = s["latency_ms"]
    return {"rate": rate, "sent": s["count"], "ok": s["ok"], "errors": s["errors"],
            "throughput_rps": s["throughput_rps"], "mean_ms": lat["mean"], "p50_ms": lat["p50"],
            "p99_ms": lat["p99"], "error_kinds": s.get("error_kinds", {}), "server": s.get("server", {}),
            "generator_bottleneck": bottleneck(s)}


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    target = ctx.target(load=p.models)
    transports = [t for t in ctx.validate(target, {m: Expected(m) for m in p.models}, p.transports)
                  if t in SERVER_TRANSPORTS]
    results: dict[str, dict[str, Any]] = {}
    for model in p.models:
        peaks = _probe(ctx, target, model, transports) if not p.rates and transports else {}
        rates = sorted(p.rates) if p.rates else rate_ladder(peaks, p.steps, p.low_fraction, p.high_fraction)
        curves: dict[str, Any] = {}
        with ctx.task(f"{model}: open-loop rates", len(rates) * len(transports)) as advance:
            for t in transports:
                points: list[dict[str, Any]] = []
                overloaded = False
                for i, rate in enumerate(rates):
                    if overloaded:
                        points.append({"rate": rate, "skipped": "a lower rate already overloaded the server"})
                    else:
                        q = _point(ctx, target, t, model, rate, p.seed + i)
                        points.append(q)
                        overloaded = q["sent"] > 0 and q["errors"] / q["sent"] > _GIVE_UP_ERROR_SHARE
                    advance(1)
                measured = [q for q in points if "skipped" not in q]
                curves[t] = {"points": points, "knee_rps": find_knee(measured, p.knee_factor),
                             "generator_bottleneck": [f"{q['rate']} req/s: {q['generator_bottleneck']}"
                                                      for q in measured if q["generator_bottleneck"]]}
        results[model] = {"peak_probe_rps": peaks, "rates": rates, "transports": curves}
    return _output(p, results)


def _plot(results: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4 * len(results) + 0.4))
    axes = fig.subplots(len(results), 2, squeeze=False)
    for row, (model, r) in zip(axes, results.items()):
        for t, curve in r["transports"].items():
            pts = [q for q in curve["points"] if "skipped" not in q and q["p99_ms"] is not None]
            for ax, key in zip(row, ("mean_ms", "p99_ms")):
                ax.plot([q["rate"] for q in pts], [q[key] for q in pts], marker="o", ms=3,
                        color=COLOURS.get(t), label=LABEL[t])
                if curve["knee_rps"] is not None:
                    ax.axvline(curve["knee_rps"], color=COLOURS.get(t), ls=":", lw=1)
        for ax, what in zip(row, ("mean", "p99")):
            ax.set_yscale("log")
            ax.set_xscale("log")
            ax.set_xlabel("offered load (req/s)")
            ax.set_ylabel(f"{what} latency (ms)")
            ax.set_title(f"{model}: {what} latency (dotted: knee)", fontsize=9)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    gen_notes: list[str] = []
    for model, r in results.items():
        report += [f"## {model}", ""]
        if r["peak_probe_rps"]:
            report += ["Closed-loop peak probe: " + ", ".join(
                f"{LABEL[t]} {v:,.0f} req/s" for t, v in r["peak_probe_rps"].items()) + ".", ""]
        rows = []
        for t, curve in r["transports"].items():
            for q in curve["points"]:
                if "skipped" in q:
                    rows.append((LABEL[t], fmt(q["rate"], 0), "skipped", "", "", "", ""))
                    continue
                rows.append((LABEL[t], fmt(q["rate"], 0), fmt(q["throughput_rps"], 0), fmt(q["mean_ms"], 2),
                             fmt(q["p99_ms"], 2), q["errors"], "yes" if q["generator_bottleneck"] else ""))
            gen_notes += [f"{model} over {LABEL[t]} at {g}" for g in curve["generator_bottleneck"]]
        report += [md_table(("transport", "offered req/s", "achieved req/s", "mean ms", "p99 ms", "errors",
                             "generator-bound"), rows), ""]
        knees = ", ".join(f"{LABEL[t]} {fmt(c['knee_rps'], 0) if c['knee_rps'] else 'none (beyond the rates tried)'}"
                          for t, c in r["transports"].items())
        report += [f"Knee (first rate with p99 > {p.knee_factor:g}x the lowest rate's p99, or errors): {knees}.", ""]
        lines.append(f"{model}: knee at {knees}")
    note_generator_bottleneck(report, lines, gen_notes,
                              explain="At these points the load generator could not send on schedule, so the server "
                                      "saw less than the offered load:")
    return ScenarioOutput({"models": results}, "\n".join(report), {"load": _plot(results)} if results else {}, lines)
