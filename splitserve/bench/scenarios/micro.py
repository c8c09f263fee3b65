"""micro: single-kernel microbenchmarks, latency and peak throughput (SplitRPC Fig. 12).

VecAdd1K and MatMul8K do almost no work, so what is measured is the serving path itself.
Latency: one client, sequential requests (median and p99 of the end-to-end time). Peak
throughput: many closed-loop clients, one connection each, from a separate generator
process. The plain TCP echo of the same sizes (``echo``) and the in-process call
(``local``, latency only) frame the transports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.bench.echo import HEADER_SIZE
from splitserve.bench.scenarios.base import (
    Context,
    ScenarioOutput,
    fmt,
    md_table,
    note_generator_bottleneck,
    report_intro,
    time_transport,
)
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import bottleneck, closed_loop_run, lat_stats, time_echo, time_local, workload
from splitserve.bench.transports import (
    BASELINES,
    LABEL,
    SERVER_TRANSPORTS,
    SHORT,
)
from splitserve.bench.validate import Expected

NAME = "micro"
SUMMARY = "VecAdd1K and MatMul8K: single-client latency and peak throughput (Fig. 12)."
MODELS: tuple[str, ...] = ("vecadd1k", "matmul8k")
TRANSPORTS: tuple[str, ...] = SERVER_TRANSPORTS + BASELINES


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = MODELS
    transports: tuple[str, ...] = ("tcp", "unix", "grpc", "http-binary", "local", "echo")
    requests: int = 2000  # sequential, per model and transport
    warmup: int = 100
    clients: int = 32  # closed-loop clients for peak throughput
    duration_s: float = 5.0
    warmup_s: float = 0.5
    generators: int = 1

    @classmethod
    def quick(cls) -> Params:
        return cls(transports=("tcp", "grpc", "local", "echo"), requests=200, warmup=20, duration_s=1.5,
                   warmup_s=0.3)


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.bench.inputs import make_inputs
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    server_side = [t for t in p.transports if t in SERVER_TRANSPORTS]
    target = ctx.target(load=p.models) if server_side else None
    usable = ctx.validate(target, {m: Expected(m) for m in p.models}, p.transports) if target else \
        [t for t in p.transports if t in BASELINES]
    results: dict[str, Any] = {m: {} for m in p.models}
    steps = len(p.models) * (len(usable) + len([t for t in usable if t != "local"]))
    with ctx.task("latency and throughput", steps) as advance:
        for model in p.models:
            entry = zoo_entry(model)
            sample = make_inputs(entry.inputs, 1, p.seed)[0]
            req, resp = HEADER_SIZE + entry.request_bytes, HEADER_SIZE + entry.response_bytes
            for t in usable:
                cell: dict[str, Any] = {}
                if t == "local":
                    cell["latency_us"] = lat_stats(time_local(model, 0, sample, p.requests, p.warmup))
                elif t == "echo":
                    echo = ctx.echo()
                    cell["latency_us"] = lat_stats(time_echo(echo.host, echo.port, req, resp, p.requests, p.warmup))
                else:
                    assert target is not None
                    times = time_transport(ctx, t, target.url(t), model, sample, p.requests, p.warmup)
                    if times is None:
                        advance(2)
                        continue
                    cell["latency_us"] = lat_stats(times.e2e_us)
                    cell["server_compute_us_p50"] = float(lat_stats(times.compute_us)["p50"] or 0)
                advance(1)
                if t != "local":
                    url = ctx.echo().url if t == "echo" else target.url(t)  # type: ignore[union-attr]
                    res = closed_loop_run(workload(t, url, model, model, p.seed), p.clients, p.duration_s,
                                          p.generators, p.warmup_s)
                    s = res.summary(warmup_s=p.warmup_s)
                    cell["throughput_rps"] = s["throughput_rps"]
                    cell["throughput_p99_ms"] = s["latency_ms"]["p99"]
                    cell["errors"] = s["errors"]
                    cell["generator_bottleneck"] = bottleneck(s)
                    advance(1)
                results[model][t] = cell
    return _output(p, results)


def _plot(p: Params, results: dict[str, Any]) -> Any:
    import numpy as np
    from matplotlib.figure import Figure

    models = list(results)
    transports = list(dict.fromkeys(t for m in models for t in results[m]))
    fig = Figure(figsize=(11, 3.8))
    ax_lat, ax_tp = fig.subplots(1, 2)
    width = 0.8 / max(1, len(models))
    x = np.arange(len(transports))
    for i, m in enumerate(models):
        p50 = [results[m].get(t, {}).get("latency_us", {}).get("p50") or 0 for t in transports]
        p99 = [results[m].get(t, {}).get("latency_us", {}).get("p99") or 0 for t in transports]
        err = np.clip(np.array(p99) - np.array(p50), 0, None)
        ax_lat.bar(x + i * width, p50, width, yerr=[np.zeros_like(err), err], capsize=2, label=m)
        tp = [results[m].get(t, {}).get("throughput_rps") or 0 for t in transports]
        ax_tp.bar(x + i * width, tp, width, label=m)
    for ax, title, ylabel in ((ax_lat, "single-client E2E (bar p50, whisker p99)", "µs"),
                              (ax_tp, f"peak throughput, {p.clients} clients", "req/s")):
        ax.set_xticks(x + width * (len(models) - 1) / 2, [SHORT[t] for t in transports])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ax_lat.set_yscale("log")
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    gen_notes = []
    for model, cells in results.items():
        rows = []
        for t, c in cells.items():
            lat = c["latency_us"]
            rows.append((LABEL[t], fmt(lat["p50"]), fmt(lat["p99"]), fmt(c.get("throughput_rps"), 0),
                         fmt(c.get("throughput_p99_ms"), 2), c.get("errors", "-"),
                         "yes" if c.get("generator_bottleneck") else ""))
            if c.get("generator_bottleneck"):
                gen_notes.append(f"{model} over {LABEL[t]}: {c['generator_bottleneck']}")
        report += [f"## {model}", "", md_table(("transport", "E2E p50 µs", "E2E p99 µs",
                                                f"req/s ({p.clients} clients)", "p99 ms under load", "errors",
                                                "generator-bound"), rows), ""]
        lines.append(f"{model}: " + ", ".join(
            f"{SHORT[t]} p50 {fmt(c['latency_us']['p50'], 0)} µs" +
            (f" / {fmt(c['throughput_rps'], 0)} req/s" if c.get("throughput_rps") else "")
            for t, c in cells.items()))
    note_generator_bottleneck(report, lines, gen_notes)
    return ScenarioOutput({"models": results}, "\n".join(report), {"micro": _plot(p, results)} if results else {},
                          lines)
