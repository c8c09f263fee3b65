"""batching: peak throughput and tail latency with dynamic batching on and off (SplitRPC Fig. 10).

Each model is served twice from a generated model repository: ``<arch>_b<N>`` batches with the
work-conserving policy (SplitRPC §6.4: when the instance frees up, run everything waiting, up
to the maximum batch size N) and ``<arch>_b<N>_nobatch`` runs one request at a time (policy
``none``). Closed-loop clients (1 to 32, one connection each) send back to back from a
separate generator process; the throughput and p99 latency at each client count are compared.
"""

from __future__ import annotations

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
    write_repository,
)
from splitserve.bench.scenarios.base import (
    Params as BaseParams,
)
from splitserve.bench.timing import bottleneck, closed_loop_run, workload
from splitserve.bench.transports import LABEL, SERVER_TRANSPORTS
from splitserve.bench.validate import Expected

NAME = "batching"
SUMMARY = "Closed loop with 1-32 clients, dynamic batching on vs off: throughput and p99 (Fig. 10)."
MODELS: tuple[str, ...] = ("resnet18", "resnet50", "lenet", "lstm", "vecadd1k", "matmul8k")
TRANSPORTS: tuple[str, ...] = SERVER_TRANSPORTS
POLICY_SUFFIX = {"work_conserving": "", "none": "_nobatch", "timeout": "_timeout"}
POLICY_LABEL = {"work_conserving": "batching on", "none": "batching off", "timeout": "timeout batching"}


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("resnet18", "resnet50")
    transports: tuple[str, ...] = ("tcp", "grpc")
    clients: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    policies: tuple[str, ...] = ("work_conserving", "none")
    max_batch: int = 8
    duration_s: float = 5.0  # per client count
    warmup_s: float = 1.0  # left out of each point
    generators: int = 1  # generator processes

    @classmethod
    def quick(cls) -> Params:
        return cls(models=("resnet18",), clients=(1, 8, 32), duration_s=1.5, warmup_s=0.3)

    def check(self) -> None:
        for policy in self.policies:
            variant_name("x", self.max_batch, policy)
        if not self.clients or min(self.clients) < 1:
            raise ValueError("clients must be counts >= 1")


def variant_name(arch: str, max_batch: int, policy: str) -> str:
    """The served name of ``arch`` with this batching policy, e.g. ``resnet18_b8``."""
    try:
        return f"{arch}_b{max_batch}{POLICY_SUFFIX[policy]}"
    except KeyError:
        raise ValueError(f"unknown batching policy {policy!r}; use one of {', '.join(POLICY_SUFFIX)}") from None


def variants(models: Sequence[str], max_batch: int, policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Model-repository configs: one per model and batching policy."""
    return {
        variant_name(arch, max_batch, policy): {
            "max_batch_size": max_batch,
            "artifact": {"kind": "zoo", "arch": arch},
            "batching": {"policy": policy},
        }
        for arch in models
        for policy in policies
    }


def prepare_repository(ctx: Context, models: Sequence[str], max_batch: int, policies: Sequence[str]) -> Path:
    """Write the variants' repository into the results folder; note how to serve it for --url."""
    repo = write_repository(ctx.results.path / "repository", variants(models, max_batch, policies))
    if ctx.urls:
        ctx.notes.append(f"measured a running server: it must serve the variants in {repo} "
                         f"(start it with `splitserve serve --repository {repo}`)")
    return repo


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    names = variants(p.models, p.max_batch, p.policies)
    repo = prepare_repository(ctx, p.models, p.max_batch, p.policies)
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
                                              p.generators)
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


def _plot(p: Params, results: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4 * len(results) + 0.4))
    axes = fig.subplots(len(results), 2, squeeze=False)
    for row, (arch, per_t) in zip(axes, results.items()):
        for t, per_p in per_t.items():
            for policy, curve in per_p.items():
                xs = [q["clients"] for q in curve["points"]]
                style = "-" if policy == "work_conserving" else "--"
                label = f"{LABEL[t]}, {POLICY_LABEL[policy]}"
                row[0].plot(xs, [q["throughput_rps"] or 0 for q in curve["points"]], style, marker="o", ms=3,
                            color=COLOURS.get(t), label=label)
                row[1].plot(xs, [q["p99_ms"] for q in curve["points"]], style, marker="o", ms=3,
                            color=COLOURS.get(t), label=label)
        for ax, ylabel in zip(row, ("throughput (req/s)", "p99 latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(p.clients), [str(c) for c in p.clients])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        row[0].set_title(f"{arch}: throughput (max batch {p.max_batch})", fontsize=9)
        row[1].set_title(f"{arch}: p99 latency", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [__doc__.split("\n\n", 1)[1].strip(), ""]
    lines: list[str] = []
    gen_notes: list[str] = []
    g = gains(p, results)
    for arch, per_t in results.items():
        rows = []
        for t, per_p in per_t.items():
            for policy, curve in per_p.items():
                for q in curve["points"]:
                    rows.append((LABEL[t], POLICY_LABEL[policy], q["clients"], fmt(q["throughput_rps"], 0),
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
    if gen_notes:
        report += ["## The generator was the bottleneck", ""] + [f"- {n}" for n in gen_notes] + [""]
        lines.append(f"the load generator was the bottleneck at {len(gen_notes)} point(s); see report.md")
    return ScenarioOutput({"models": results, "gain_at_max_clients": g}, "\n".join(report),
                          {"batching": _plot(p, results)} if results else {}, lines)
