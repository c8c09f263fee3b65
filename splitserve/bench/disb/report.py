"""The DISB report: tables, headline lines and figures (REEF Fig. 11, 12, 15b, 16)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from splitserve.bench.disb.run import ratio
from splitserve.bench.disb.workload import WorkloadSpec
from splitserve.bench.scenarios.base import fmt, md_table

SCHEMES: tuple[str, ...] = ("rt-only", "seq", "concurrent", "reef", "idle")
COLOURS = {"rt-only": "#7f7f7f", "seq": "#ff7f0e", "concurrent": "#2ca02c", "reef": "#2b7bba", "idle": "#9467bd"}


class Setup(Protocol):
    """What ``markdown`` reads of the scenario's parameters (``scenario.Params`` is one), so the
    report does not import the scenario that imports it."""

    cpus: tuple[int, ...]
    rate_scale: float
    rt_load: float


def pool(runs: Mapping[str, Mapping[str, Any]], scheme: str, get: Callable[[Mapping[str, Any]], list]) -> list:
    return [v for per in runs.values() if scheme in per for v in get(per[scheme])]


def _x(v: float | None, digits: int = 2) -> str:
    return fmt(v, digits, "x")


def markdown(doc: str, p: Setup, specs: Sequence[WorkloadSpec], runs: Mapping[str, Any], norm: Mapping[str, Any],
             pair_runs: Mapping[str, Any], scales: Mapping[str, float], compute_s: Mapping[str, float],
             fig12: Mapping[str, Any], restore: Mapping[str, Any], gen_cpus: Sequence[int]) -> tuple[list[str], str]:
    """The markdown report (``doc`` first) and the headline lines the CLI prints."""
    out = [doc, "", "## Setup", "",
           f"Every model runs one instance with one thread pinned to CPU(s) {list(p.cpus)}, so RT and BE work "
           f"contend for the same core(s); the generator processes are pinned to "
           f"{list(gen_cpus) or 'any CPU (no other CPU was free)'}, the server's front end is not pinned. "
           + (f"RT rates are DISB's times rate_scale = {p.rate_scale:g}." if p.rate_scale > 0 else
              f"RT rates are scaled per workload so the RT stream needs {p.rt_load:.0%} of one core "
              "(rate_scale 0): DISB's published rates are several cores' worth of CPU time."),
           "", "Compute time of one sample per model (median of sequential RT requests on the first server): "
           + ", ".join(f"{m} {v * 1e3:.1f} ms" for m, v in compute_s.items()) + ".", "",
           "RT core share: the share of the run during which some RT batch was running, from the rt-only "
           "run's scheduler events.", "",
           md_table(("workload", "rate scale", "RT scheduled", "RT core share (rt-only, measured)"),
                    [(s.label, fmt(scales.get(s.label), 3),
                      next((m.get("rt_requests_scheduled") or "closed loop" for m in runs[s.label].values()), "-"),
                      fmt(100 * (runs[s.label].get("rt-only", {}).get("rt_core_share") or math.nan), 0, "%")
                      if "rt-only" in runs[s.label] else "-") for s in specs]), ""]
    lines: list[str] = []
    gen_notes = []
    for s in specs:
        per, nm = runs[s.label], norm[s.label]
        rows = []
        for scheme, m in per.items():
            n = nm[scheme]
            rows.append((scheme, m["rt"]["ok"], m["rt"]["errors"] + m["be"]["errors"], fmt(m["rt"]["mean_ms"], 1),
                         fmt(m["rt"]["p99_ms"], 1), fmt(m["rt"]["queue_ms"]["p50"], 2),
                         fmt(m["rt"]["compute_ms"]["mean"], 1), _x(n["rt_mean"]), _x(n["rt_p99"]),
                         fmt(m["rt"]["throughput_rps"], 1), fmt(m["be"]["throughput_rps"], 1),
                         fmt(m["overall_rps"], 1), _x(n["overall"]), _x(n["be"]), m["preemption"]["preemptions"],
                         m["preemption"]["padding_stops"], fmt(m["rt_send_lag_p99_ms"], 2),
                         "yes" if m["generator_bottleneck"] else "",
                         "/".join(f"{v:.1f}" for v in m.get("loadavg_1min", ()))))
            if m["generator_bottleneck"]:
                gen_notes.append(f"{s.label} under {scheme}: {m['generator_bottleneck']}")
        out += [f"## Workload {s.label}", "", md_table(
            ("scheme", "RT ok", "errors", "RT mean ms", "RT p99 ms", "RT queue p50 ms", "RT compute ms",
             "RT mean / rt-only", "RT p99 / rt-only", "RT req/s", "BE req/s", "overall req/s", "overall / rt-only",
             "BE / rt-only", "preemptions", "padding stops", "RT send lag p99 ms", "generator-bound",
             "load avg before/after"), rows), ""]
        if nm:
            lines.append(f"{s.label}: RT p99 / rt-only: " + ", ".join(f"{sc} {_x(v['rt_p99'])}" for sc, v in nm.items()
                                                                       if sc != "rt-only")
                         + "; overall throughput / rt-only: "
                         + ", ".join(f"{sc} {_x(v['overall'])}" for sc, v in nm.items() if sc != "rt-only"))
    out += ["## Goals (reported, not asserted)", "",
            "One short run per cell on a small machine is noisy: before reading a ratio, compare the RT compute "
            "column (the server's own timing of the RT work) and the load average across schemes; a reference "
            "(rt-only) run that was slowed by other work on the machine makes every ratio look better.", ""]
    goal_rows = []
    for s in specs:
        n = norm[s.label].get("reef")
        if n is None or n["rt_mean"] is None:
            continue
        goal_rows.append((s.label, _x(n["rt_mean"]), _x(n["rt_p99"]),
                          "met" if n["rt_mean"] <= 1.05 else "missed", _x(n["overall"]),
                          ("met" if (n["overall"] or 0) >= 2.0 else "missed") if s.label in ("C", "D", "E") else "-"))
    out += ["Reef's RT latency within 5% of rt-only (judged on the mean; p99 shown); reef's overall throughput "
            ">= 2x rt-only on C, D and E.", "",
            md_table(("workload", "reef RT mean / rt-only", "reef RT p99 / rt-only", "RT within 5%",
                      "reef overall / rt-only", ">= 2x (C, D, E)"), goal_rows) if goal_rows else
            "No workload ran both reef and rt-only.", ""]
    reef = fig12["reef_preemption_latency_ms"]
    out += ["## Preemption latency vs waiting (Fig. 12)", "",
            "reef: from the preemption flag being raised to the BE worker stopping at a segment boundary "
            "(scheduler events). seq: how long RT requests waited in the server's queue (the running batch is "
            "never interrupted). reef's RT queue wait is shown too; padding stops (a padded BE segment that "
            "would overrun the RT work, no flag) are counted apart.", "",
            md_table(("what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms"),
                     [(f"reef preemption latency, {w}", d["n"], fmt(d["p50"], 2), fmt(d["p90"], 2), fmt(d["p99"], 2),
                       fmt(d["max"], 2)) for w, d in fig12["reef_preemption_latency_by_workload_ms"].items()] +
                     [("reef preemption latency, all workloads", reef["n"], fmt(reef["p50"], 2), fmt(reef["p90"], 2),
                       fmt(reef["p99"], 2), fmt(reef["max"], 2))] +
                     [(f"reef RT queue wait, {w}", d["n"], fmt(d["p50"], 2), fmt(d["p90"], 2), fmt(d["p99"], 2),
                       fmt(d["max"], 2)) for w, d in fig12["reef_rt_queue_ms"].items()] +
                     [(f"seq RT queue wait, {w}", d["n"], fmt(d["p50"], 2), fmt(d["p90"], 2), fmt(d["p99"], 2),
                       fmt(d["max"], 2)) for w, d in fig12["seq_rt_queue_ms"].items()]),
            "", f"reef padding stops: {fig12['reef_padding_stops']}.", ""]
    by_w = fig12["reef_preemption_latency_by_workload_ms"]
    seq_w = fig12["seq_rt_queue_ms"]
    parts = [f"{w} {fmt((by_w.get(w) or {}).get('p50'), 2)} vs {fmt((seq_w.get(w) or {}).get('p50'), 2)} ms"
             for w in dict.fromkeys([*by_w, *seq_w])]
    lines.append("median reef preemption latency (flag -> stopped) vs seq RT queue wait: " + "; ".join(parts)
                 + f" (reef, all workloads: {fmt(reef['p50'], 2)} ms over {reef['n']} preemptions)")
    out += ["### Preemption latency: RT arrival -> its compute start", "",
            "From each RT request's arrival at the server to its worker starting to compute its batch (the "
            "worker's own stamp, reported in the scheduler's done events): queueing, dispatch and the worker's "
            "wake-up on a core best-effort work was using, together. The ratio is seq's p50 over the scheme's "
            "(REEF's goal: >= 10x).", "",
            md_table(("workload", "scheme", "n", "p50 us", "p99 us", "seq p50 / this p50"),
                     [(w, s, d["n"], fmt(d["p50"], 0), fmt(d["p99"], 0),
                       _x(ratio((per.get("seq") or {}).get("p50"), d["p50"]), 1))
                      for w, per in fig12["rt_start_us"].items() for s, d in per.items()]), ""]
    for w, per in fig12["rt_start_us"].items():
        lines.append(f"{w}: RT arrival -> compute start p50/p99 us: "
                     + ", ".join(f"{s} {fmt(d['p50'], 0)}/{fmt(d['p99'], 0)}" for s, d in per.items()))
    out += ["Several BE workers flagged at once finish their current segments while sharing the core with "
            "each other and the RT work, so the latency grows with the number of BE models on the core.", ""]
    out += ["## Restore overhead (Fig. 15b)", "",
            "Per model, in reef mode: the mean time BE batches actually ran (start or resume -> preempted or "
            "done, summed) when they were stopped at least once, over the same for batches never stopped (ratio; "
            "1.00x: resuming costs nothing), and the extra running time per stop. The extra covers the resume's "
            "IPC round trip, the caches the RT model cooled, and the segment a stopped batch finishes while it "
            "shares the core with the RT work (the preemption latency): an upper bound on the restore cost. "
            "Suspended time (waiting for the RT work) is not part of it. In the DISB workloads several BE models "
            "share the core, so their running times include each other; the pairs' shared runs (one BE model "
            "beside the RT one) are the cleaner measurement. Idle: one sample on an idle server.", "",
            md_table(("source", "model", "idle ms", "clean batches", "clean ms", "preempted batches", "preempted ms",
                      "stops each", "ratio", "extra ms per stop", "suspended ms"),
                     [(src, m, fmt(compute_s.get(m, math.nan) * 1e3, 2), r["clean_n"], fmt(r["clean_ms"], 2),
                       r["preempted_n"], fmt(r["preempted_ms"], 2), fmt(r["stops_per_preempted"], 2),
                       _x(r["ratio"]), fmt(r["per_stop_ms"], 2), fmt(r["suspended_ms"], 1))
                      for src, per in restore.items() for m, r in per.items()]) if restore else "No reef run.", ""]
    if pair_runs:
        rows = []
        for name, pr in pair_runs.items():
            for layout in ("alone", "shared", "padded"):
                if layout in pr:
                    m = pr[layout]
                    rows.append((name, layout, fmt(pr["rate_rps"], 1), fmt(m["rt"]["mean_ms"], 1),
                                 fmt(m["rt"]["p99_ms"], 1), _x(m.get("rt_mean_vs_alone")),
                                 _x(m.get("rt_p99_vs_alone")), fmt(m["rt"]["throughput_rps"], 1),
                                 fmt(m["be"]["throughput_rps"], 1), fmt(m["overall_rps"], 1),
                                 m["preemption"]["preemptions"], m["preemption"]["padding_stops"],
                                 fmt(m["preemption"]["padding_resume_ms"]["p50"], 2)))
        out += ["## One-to-one pairs with padding (Fig. 16, reef)", "",
                f"RT model periodic; BE model one closed-loop client. shared: the BE model on the RT model's CPU "
                f"{list(p.cpus)} (preempted); padded: the BE model on CPU {p.pair_cpu}, where it runs beside RT work "
                "while each of its segments ends before the RT work is expected to (REEF's padding rule); the "
                "generators run on the same CPU(s) in every layout, the server's front end is not pinned. "
                "A padding stop resumed within a fraction of a millisecond means the BE batch was not held "
                "back until the RT work ended: it went on one segment per stop.", "",
                md_table(("pair RT:BE", "layout", "RT req/s offered", "RT mean ms", "RT p99 ms", "mean / alone",
                          "p99 / alone", "RT req/s", "BE req/s", "overall req/s", "preemptions", "padding stops",
                          "padding stop -> resume p50 ms"),
                         rows), ""]
        for name, pr in pair_runs.items():
            if "padded" in pr:
                lines.append(f"pair {name}: RT p99 / alone shared {_x(pr['shared'].get('rt_p99_vs_alone'))}, padded "
                             f"{_x(pr['padded'].get('rt_p99_vs_alone'))}; BE req/s shared "
                             f"{fmt(pr['shared']['be']['throughput_rps'], 1)}, padded "
                             f"{fmt(pr['padded']['be']['throughput_rps'], 1)}")
    if gen_notes:
        out += ["## The generator was the bottleneck", "", "The RT stream may not have been sent on schedule:", ""]
        out += [f"- {n}" for n in gen_notes] + [""]
        worst = max((m["rt_send_lag_p99_ms"] or 0.0) for per in runs.values() for m in per.values())
        lines.append(f"the RT generator was flagged late in {len(gen_notes)} run(s) (p99 send lag up to "
                     f"{worst:.1f} ms; latency counts from the scheduled time, so lateness is included); see report.md")
    return lines, "\n".join(out)


def _plot_fig11(runs: Mapping[str, Any], norm: Mapping[str, Any]) -> Any:
    from matplotlib.figure import Figure

    labels = list(runs)
    schemes = [s for s in SCHEMES if any(s in per for per in runs.values())]
    fig = Figure(figsize=(max(6.0, 1.6 * len(labels) + 2), 6.4))
    top, bottom = fig.subplots(2, 1, sharex=True)
    width = 0.8 / max(1, len(schemes))
    for j, scheme in enumerate(schemes):
        xs = [i + (j - (len(schemes) - 1) / 2) * width for i in range(len(labels))]
        p99 = [(norm[w].get(scheme) or {}).get("rt_p99") or 0.0 for w in labels]
        mean = [(norm[w].get(scheme) or {}).get("rt_mean") or 0.0 for w in labels]
        tput = [(norm[w].get(scheme) or {}).get("overall") or 0.0 for w in labels]
        top.bar(xs, p99, width, color=COLOURS[scheme], label=scheme)
        top.plot(xs, mean, ls="", marker="_", ms=12, color="black")
        bottom.bar(xs, tput, width, color=COLOURS[scheme], label=scheme)
    top.axhline(1.0, color="grey", lw=0.8)
    top.axhline(1.05, color="grey", lw=0.8, ls=":")
    bottom.axhline(1.0, color="grey", lw=0.8)
    bottom.axhline(2.0, color="grey", lw=0.8, ls=":")
    top.set_yscale("log")
    top.set_ylabel("RT latency / rt-only\n(bars p99, ticks mean)")
    bottom.set_ylabel("overall throughput / rt-only")
    bottom.set_xticks(range(len(labels)), labels)
    top.legend(fontsize=8, ncol=len(schemes))
    top.set_title("DISB: RT latency and throughput normalised to rt-only (REEF Fig. 11)", fontsize=10)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _cdf(ax: Any, values: Sequence[float], **kw: Any) -> None:
    if len(values):
        v = np.sort(np.asarray(values))
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), **kw)


def _plot_fig12(runs: Mapping[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    _cdf(ax, pool(runs, "reef", lambda m: m["preemption"]["latency_ms"]), color=COLOURS["reef"], lw=2,
         label="reef: preemption latency (flag -> stopped)")
    _cdf(ax, pool(runs, "reef", lambda m: m["rt_queue_samples_ms"]), color=COLOURS["reef"], ls="--",
         label="reef: RT queue wait")
    _cdf(ax, pool(runs, "seq", lambda m: m["rt_queue_samples_ms"]), color=COLOURS["seq"], lw=2,
         label="seq: RT queue wait")
    for scheme in ("seq", "reef", "idle"):  # REEF's own measure, from the workers' stamps
        _cdf(ax, [us / 1e3 for us in pool(runs, scheme, lambda m: m.get("rt_start_samples_us", []))],
             color=COLOURS[scheme], ls=":", lw=2, label=f"{scheme}: RT arrival -> compute start")
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("ms (all workloads)")
    ax.set_ylabel("fraction")
    ax.set_title("Preemption latency vs RT waiting (REEF Fig. 12)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_fig15b(restore: Mapping[str, Any]) -> Any:
    from matplotlib.figure import Figure

    bars = [(src, m, r) for src, per in restore.items() for m, r in per.items()]
    fig = Figure(figsize=(max(5.0, 1.1 * len(bars) + 1.5), 4.2))
    ax = fig.subplots()
    xs = np.arange(len(bars))
    ax.bar(xs - 0.2, [r["clean_ms"] or 0 for _, _, r in bars], 0.4, color="#9ecae1", label="never stopped")
    ax.bar(xs + 0.2, [r["preempted_ms"] or 0 for _, _, r in bars], 0.4, color="#2b7bba",
           label="stopped and resumed")
    for x, (_, _, r) in zip(xs, bars):
        if r["ratio"] is not None:
            ax.text(x + 0.2, r["preempted_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"{m}\n{src}" for src, m, _ in bars], fontsize=7)
    ax.set_ylabel("BE batch running time (ms, mean)")
    ax.set_title("Restore overhead: BE running time with and without preemption (REEF Fig. 15b)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _plot_fig16(pairs: Mapping[str, Any]) -> Any:
    from matplotlib.figure import Figure

    names = list(pairs)
    fig = Figure(figsize=(max(6.0, 1.5 * len(names) + 2), 6.0))
    top, bottom = fig.subplots(2, 1, sharex=True)
    xs = np.arange(len(names))
    for k, (layout, colour) in enumerate((("shared", "#ff7f0e"), ("padded", "#2b7bba"))):
        p99 = [(pairs[n].get(layout) or {}).get("rt_p99_vs_alone") or 0 for n in names]
        be = [((pairs[n].get(layout) or {}).get("be") or {}).get("throughput_rps") or 0 for n in names]
        top.bar(xs + (k - 0.5) * 0.4, p99, 0.4, color=colour, label=layout)
        bottom.bar(xs + (k - 0.5) * 0.4, be, 0.4, color=colour, label=layout)
    top.axhline(1.0, color="grey", lw=0.8)
    top.set_ylabel("RT p99 / RT alone")
    bottom.set_ylabel("BE throughput (req/s)")
    bottom.set_xticks(xs, names, fontsize=8)
    top.legend(fontsize=8)
    top.set_title("One-to-one pairs in reef mode: BE on the RT CPU vs padded on another (REEF Fig. 16)", fontsize=10)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def figures(runs: Mapping[str, Any], norm: Mapping[str, Any], restore: Mapping[str, Any],
            pairs: Mapping[str, Any]) -> dict[str, Any]:
    """The PNG figures of a run, by file stem; a figure with nothing to show is left out."""
    out: dict[str, Any] = {}
    if any(runs.values()):
        out["disb_fig11"] = _plot_fig11(runs, norm)
    if any(pool(runs, s, lambda m: m["rt_queue_samples_ms"]) for s in ("reef", "seq")) or \
            any(pool(runs, s, lambda m: m.get("rt_start_samples_us", [])) for s in ("reef", "seq", "idle")) or \
            pool(runs, "reef", lambda m: m["preemption"]["latency_ms"]):
        out["disb_fig12"] = _plot_fig12(runs)
    if restore:
        out["disb_fig15b"] = _plot_fig15b(restore)
    if pairs:
        out["disb_fig16"] = _plot_fig16(pairs)
    return out
