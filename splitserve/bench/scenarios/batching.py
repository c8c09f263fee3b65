"""batching: throughput and latency against concurrency under each batching policy
(SplitRPC Fig. 10, Rafiqi Fig. 5).

Each model is served once per policy from a generated model repository: ``<arch>_b<N>``
batches with the work-conserving policy (SplitRPC §6.4: when the instance frees up, run
everything waiting, up to the maximum batch size N), ``<arch>_b<N>_nobatch`` runs one
request at a time (policy ``none``, Rafiqi's GRE baseline), ``_timeout`` waits for a fuller
batch (what Triton, TorchServe and Ray do), and ``_adaptive`` / ``_aimd`` use Rafiqi's
adaptive threshold (§3.3) with its final EWMA rule and the AIMD rule it rejected.
Closed-loop clients (a sweep of concurrencies, one connection each) send back to back from
separate generator processes; throughput and latency at each concurrency are compared, as
ratios from the same run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.bench.scenarios.base import (
    COLOURS,
    Context,
    ScenarioOutput,
    fmt,
    md_table,
    note_generator_bottleneck,
    report_intro,
    write_repository,
)
from splitserve.bench.scenarios.base import (
    Params as BaseParams,
)
from splitserve.bench.timing import bottleneck, closed_loop_run, workload
from splitserve.bench.transports import LABEL, SERVER_TRANSPORTS
from splitserve.bench.validate import Expected

NAME = "batching"
SUMMARY = "Closed loop, 1-256 clients, each batching policy (none ... adaptive): SplitRPC Fig. 10, Rafiqi Fig. 5."
MODELS: tuple[str, ...] = ("resnet18", "resnet50", "lenet", "lstm", "vecadd1k", "matmul8k")
TRANSPORTS: tuple[str, ...] = SERVER_TRANSPORTS
# Each benchmark policy: (served-name suffix, [batching] keys beyond the quantum and cap, label).
POLICIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "work_conserving": ("", {"policy": "work_conserving"}, "batching on"),
    "none": ("_nobatch", {"policy": "none"}, "batching off"),
    "timeout": ("_timeout", {"policy": "timeout"}, "timeout batching"),
    "adaptive": ("_adaptive", {"policy": "adaptive", "rule": "ewma"}, "adaptive (ewma)"),
    "adaptive_aimd": ("_aimd", {"policy": "adaptive", "rule": "aimd"}, "adaptive (aimd)"),
}
STYLE = {"work_conserving": ("-", "o"), "none": ("--", "x"), "timeout": (":", "s"), "adaptive": ("-", "^"),
         "adaptive_aimd": ("-.", "v")}


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet",)
    transports: tuple[str, ...] = ("tcp",)
    clients: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # Rafiqi Fig. 5's sweep
    policies: tuple[str, ...] = ("none", "timeout", "work_conserving", "adaptive", "adaptive_aimd")
    max_batch: int = 128  # Rafiqi Fig. 5
    quantum_ms: float = 10.0  # adaptive policies' quantum (Rafiqi Fig. 5)
    threshold_cap: int = 128  # adaptive policies' cap (Rafiqi §3.3)
    duration_s: float = 5.0  # per client count
    warmup_s: float = 1.0  # left out of each point
    generators: int = 1  # generator processes at least ...
    clients_per_generator: int = 128  # ... and one more per this many clients

    @classmethod
    def quick(cls) -> Params:
        return cls(clients=(1, 16, 256), duration_s=1.5, warmup_s=0.3)

    def check(self) -> None:
        for policy in self.policies:
            variant_name("x", self.max_batch, policy)
        if not self.clients or min(self.clients) < 1:
            raise ValueError("clients must be counts >= 1")
        if self.clients_per_generator < 1:
            raise ValueError("clients_per_generator must be >= 1")

    def generators_for(self, clients: int) -> int:
        """Generator processes for ``clients`` connections (one asyncio process tops out)."""
        return max(self.generators, math.ceil(clients / self.clients_per_generator))


def variant_name(arch: str, max_batch: int, policy: str) -> str:
    """The served name of ``arch`` with this batching policy, e.g. ``resnet18_b8``."""
    try:
        return f"{arch}_b{max_batch}{POLICIES[policy][0]}"
    except KeyError:
        raise ValueError(f"unknown batching policy {policy!r}; use one of {', '.join(POLICIES)}") from None


def variants(models: Sequence[str], max_batch: int, policies: Sequence[str], quantum_ms: float = 10.0,
             threshold_cap: int = 128) -> dict[str, dict[str, Any]]:
    """Model-repository configs: one per model and batching policy."""
    return {
        variant_name(arch, max_batch, policy): {
            "max_batch_size": max_batch,
            "artifact": {"kind": "zoo", "arch": arch},
            "batching": {**POLICIES[policy][1],
                         **({"quantum_ms": quantum_ms, "threshold_cap": threshold_cap}
                            if POLICIES[policy][1]["policy"] == "adaptive" else {})},
        }
        for arch in models
        for policy in policies
    }


def prepare_repository(ctx: Context, models: Sequence[str], max_batch: int, policies: Sequence[str],
                       quantum_ms: float = 10.0, threshold_cap: int = 128) -> Path:
    """Write the variants' repository into the results folder; note how to serve it for --url."""
    repo = write_repository(ctx.results.path / "repository",
                            variants(models, max_batch, policies, quantum_ms, threshold_cap), ctx.params.device)
    if ctx.urls:
        ctx.notes.append(f"measured a running server: it must serve the variants in {repo} "
                         f"(start it with `splitserve serve --repository {repo}`)")
    return repo


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    names = variants(p.models, p.max_batch, p.policies, p.quantum_ms, p.threshold_cap)
    repo = prepare_repository(ctx, p.models, p.max_batch, p.policies, p.quantum_ms, p.threshold_cap)
    target = ctx.target(load=list(names), repository=repo)
    expected = {name: Expected(cfg["artifact"]["arch"]) for name, cfg in names.items()}
    transports = [t for t in ctx.validate(target, expected, p.transports) if t in SERVER_TRANSPORTS]
    results: dict[str, Any] = {}
    total = len(p.models) * len(transports) * len(p.policies) * len(p.clients)
    with ctx.task("closed-loop runs", total) as advance:
        for arch in p.models:
            per_transport: dict[str, Any] = {}
            for t in transports:
                per_policy: dict[str, Any] = {}
                for policy in p.policies:
                    name = variant_name(arch, p.max_batch, policy)
                    points = []
                    for n in p.clients:
                        res = closed_loop_run(workload(t, target.url(t), name, arch, p.seed), n, p.duration_s,
                                              p.generators_for(n), p.warmup_s)
                        s = res.summary(warmup_s=p.warmup_s)
                        points.append({"clients": n, "throughput_rps": s["throughput_rps"],
                                       "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"],
                                       "ok": s["ok"], "errors": s["errors"], "server": s.get("server", {}),
                                       "error_kinds": s.get("error_kinds", {}),
                                       "generator_bottleneck": bottleneck(s)})
                        advance(1)
                    per_policy[policy] = {"model": name, "points": points}
                per_transport[t] = per_policy
            results[arch] = per_transport
    return _output(p, results)


def gains(p: Params, results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Throughput with batching on over off, at the largest client count, per model and transport."""
    out: dict[str, dict[str, float | None]] = {}
    if "work_conserving" not in p.policies or "none" not in p.policies:
        return out
    for arch, per_t in results.items():
        out[arch] = {}
        for t, per_p in per_t.items():
            on = per_p["work_conserving"]["points"][-1]["throughput_rps"]
            off = per_p["none"]["points"][-1]["throughput_rps"]
            out[arch][t] = on / off if on and off else None
    return out


def _point(curve: dict[str, Any] | None, clients: int) -> dict[str, Any] | None:
    """The point of ``curve`` measured at ``clients`` (None if that policy or count was not run)."""
    if curve is None:
        return None
    return next((q for q in curve["points"] if q["clients"] == clients), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fig5(p: Params, results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Rafiqi Fig. 5's claims as ratios from this run, per model and transport (None where a
    policy they compare was not run): adaptive over none at the highest concurrency (goal
    >= 1.5), adaptive p50 over none's at the lowest in quanta (goal <= 2), ewma's p50 over
    aimd's at each concurrency (goal <= 1), adaptive against work_conserving, and how flat
    none's throughput stays."""
    top, low = max(p.clients), min(p.clients)

    def get(curve: dict[str, Any] | None, clients: int, key: str) -> float | None:
        q = _point(curve, clients)
        return None if q is None else q[key]

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arch, per_t in results.items():
        out[arch] = {}
        for t, per_p in per_t.items():
            ada, none, wc, aimd = (per_p.get(k) for k in ("adaptive", "none", "work_conserving", "adaptive_aimd"))
            a50, n50 = get(ada, low, "p50_ms"), get(none, low, "p50_ms")
            none_rps = [q["throughput_rps"] for q in none["points"] if q["throughput_rps"]] if none else []
            out[arch][t] = {
                "clients_high": top, "clients_low": low,
                "adaptive_over_none_throughput": _ratio(get(ada, top, "throughput_rps"),
                                                        get(none, top, "throughput_rps")),
                "adaptive_minus_none_p50_quanta": (a50 - n50) / p.quantum_ms if a50 is not None and n50 is not None
                else None,
                "ewma_over_aimd_p50": {n: _ratio(get(ada, n, "p50_ms"), get(aimd, n, "p50_ms")) for n in p.clients}
                if ada and aimd else {},
                "adaptive_over_work_conserving_throughput": _ratio(get(ada, top, "throughput_rps"),
                                                                   get(wc, top, "throughput_rps")),
                "adaptive_over_work_conserving_p50_low": _ratio(a50, get(wc, low, "p50_ms")),
                "none_throughput_max_over_min": max(none_rps) / min(none_rps) if none_rps else None,
            }
    return out


def fig5_lines(p: Params, arch: str, transport: str, r: dict[str, Any]) -> list[str]:
    """The report's sentences for one model and transport's ``fig5`` ratios."""
    head = f"{arch} over {LABEL[transport]}:"
    x = r["adaptive_over_none_throughput"]
    q = r["adaptive_minus_none_p50_quanta"]
    lines = [
        f"{head} at {r['clients_high']} clients adaptive/none throughput = {fmt(x, 2)}x (goal >= 1.5)",
        f"{head} at {r['clients_low']} client(s) adaptive p50 - none p50 = {fmt(q, 2)} quanta of "
        f"{p.quantum_ms:g} ms (goal <= 2)",
    ]
    if r["ewma_over_aimd_p50"]:
        per = ", ".join(f"{fmt(v, 2)} ({n})" for n, v in r["ewma_over_aimd_p50"].items())
        lines.append(f"{head} ewma p50 / aimd p50 per client count = {per} (goal <= 1)")
    wc_rps, wc_p50 = r["adaptive_over_work_conserving_throughput"], r["adaptive_over_work_conserving_p50_low"]
    lines.append(f"{head} adaptive/work_conserving: throughput {fmt(wc_rps, 2)}x "
                 f"at {r['clients_high']} clients, p50 {fmt(wc_p50, 2)}x at "
                 f"{r['clients_low']}")
    lines.append(f"{head} none's throughput max/min over the sweep = {fmt(r['none_throughput_max_over_min'], 2)} "
                 "(flat: about 1)")
    return lines


def _plot(p: Params, results: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 3.4 * len(results) + 0.4))
    axes = fig.subplots(len(results), 3, squeeze=False)
    for row, (arch, per_t) in zip(axes, results.items()):
        for t, per_p in per_t.items():
            for policy, curve in per_p.items():
                xs = [q["clients"] for q in curve["points"]]
                style, marker = STYLE[policy]
                label = f"{LABEL[t]}, {POLICIES[policy][2]}"
                for ax, key in zip(row, ("throughput_rps", "p50_ms", "p99_ms")):
                    ax.plot(xs, [q[key] or 0 for q in curve["points"]], style, marker=marker, ms=3,
                            color=COLOURS.get(t), label=label)
        for ax, ylabel in zip(row, ("throughput (req/s)", "p50 latency (ms)", "p99 latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(p.clients), [str(c) for c in p.clients])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        row[0].set_title(f"{arch}: throughput (max batch {p.max_batch}, quantum {p.quantum_ms:g} ms)", fontsize=9)
        row[1].set_title(f"{arch}: p50 latency", fontsize=9)
        row[2].set_title(f"{arch}: p99 latency", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    gen_notes: list[str] = []
    g = gains(p, results)
    f5 = fig5(p, results)
    for arch, per_t in results.items():
        rows = []
        for t, per_p in per_t.items():
            for policy, curve in per_p.items():
                for q in curve["points"]:
                    rows.append((LABEL[t], POLICIES[policy][2], q["clients"], fmt(q["throughput_rps"], 0),
                                 fmt(q["p50_ms"], 2), fmt(q["p99_ms"], 2), q["errors"],
                                 "yes" if q["generator_bottleneck"] else ""))
                    if q["generator_bottleneck"]:
                        gen_notes.append(f"{curve['model']} over {LABEL[t]} with {q['clients']} clients: "
                                         f"{q['generator_bottleneck']}")
        report += [f"## {arch}", "", md_table(("transport", "policy", "clients", "req/s", "p50 ms", "p99 ms",
                                               "errors", "generator-bound"), rows), ""]
        for t, gain in g.get(arch, {}).items():
            text = f"{arch} over {LABEL[t]}: batching's throughput gain at {p.clients[-1]} clients = " + \
                (f"{gain:.2f}x" if gain is not None else "n/a")
            report += [text + ".", ""]
            lines.append(text)
        for t, r in f5.get(arch, {}).items():
            if "adaptive" in per_t[t]:
                found = fig5_lines(p, arch, t, r)
                report += [f"- {line}" for line in found] + [""]
                lines += found
    note_generator_bottleneck(report, lines, gen_notes)
    return ScenarioOutput({"models": results, "gain_at_max_clients": g, "fig5": f5}, "\n".join(report),
                          {"batching": _plot(p, results)} if results else {}, lines)
