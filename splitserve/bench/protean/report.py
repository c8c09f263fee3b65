"""The protean scenario's report: tables, ratios, and two plots (the strict latency CDF with the
SLO line, PROTEAN Fig. 8; the stacked p99 breakdown, Fig. 6)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitserve.bench.protean.analysis import COMPONENTS
from splitserve.bench.protean.schemes import REFERENCE
from splitserve.bench.scenarios.base import fmt, md_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLOURS = {"minimum": "#4c72b0", "deficiency": "#dd8452", "interference": "#c44e52", "queueing": "#8c8c8c"}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _bursts(by_burst: list[dict[str, int]] | None) -> str:
    """``before, burst 1, burst 2, ...`` as ``started/retired`` (each burst with the gap after
    it), ``+n`` for resizes still under way at the end."""
    return "-" if not by_burst else ", ".join(
        f"{b['started']}/{b['retired']}" + (f"+{b['pending']}" if b.get("pending") else "") for b in by_burst)


def markdown(intro: str, p: Any, r: dict[str, Any]) -> tuple[list[str], str]:
    """Summary lines for the console and the report's markdown."""
    runs = r["runs"]
    caps = r["capacity"]
    out = [intro, "",
           f"Strict model `{r['strict_model']}` at batch {p.batch}; best-effort models {', '.join(r['be_models'])} "
           f"switching every {p.switch_s:g} s; {100 * p.strict_share:.0f}% strict. SLO = {p.slo_multiplier:g} x "
           f"{r['solo_ms'][r['whole_cores']]:.1f} ms (solo on all {r['whole_cores']} cores) = **{r['slo_ms']:.1f} ms**. "
           f"Capacity of the mix {fmt(caps.get('mix_rps'))} req/s (measured on the `{caps.get('measured_on')}` "
           f"server; each round's: {', '.join(fmt(v) for v in caps.get('mix_rps_by_round', []))}); "
           f"offered {fmt(r['offered_rps'])} req/s = {p.load:g} of it, {r['requests']} requests, "
           f"trace `{r['trace'].get('kind')}` (peak:mean {fmt(r['trace'].get('peak_to_mean'), 3)}).", "",
           "FBRs the servers' eta used (fitted from co-location runs on "
           f"{r.get('fbr_cores')} core(s); unidentified ones count as `protean_unknown_fbr`): "
           + (", ".join(f"{m} " + (fmt(f['fbr'], 3) if f['fbr'] is not None else "unidentified")
                        for m, f in (r.get("fbr") or {}).items()) or "none") + ".", "",
           "## Strict requests", ""]
    rows = []
    for name, m in runs.items():
        s = m["strict"]
        srv = m.get("server_slo") or {}
        rows.append((name, _pct(s["compliance"]), s["violations"], s["errors"], fmt(s["p50_ms"]), fmt(s["p99_ms"]),
                     "never" if s["crossing_percentile"] is None else f"p{s['crossing_percentile']:.1f}",
                     ", ".join(f"{k.split('=')[-1]} {v:g}" for k, v in srv.items()) or "-"))
    out.append(md_table(("scheme", "compliance", "violations", "errors", "p50 ms", "p99 ms", "crosses SLO at",
                         "server's SLO counts"), rows))
    out += ["", "## Strict p99 breakdown (ms)", ""]
    rows = []
    for name, m in runs.items():
        bd = m.get("strict_p99_breakdown_ms") or {}
        rows.append((name, *(fmt(bd.get(k)) for k in COMPONENTS),
                     ", ".join(f"{k}: {v}" for k, v in m["strict_batches_by_partition"].items()) or "-"))
    out.append(md_table(("scheme", *COMPONENTS, "strict batches by partition"), rows))
    out += ["", f"## Ratios (against `{REFERENCE}`)", ""]
    rows = [(name, fmt(x.get("violations_vs_reference"), 2), fmt(x.get("reference_p99_over_p99"), 2),
             _pct(x.get("queue_share_of_p99"))) for name, x in r["ratios"].items()]
    out.append(md_table(("scheme", "violations / protean's", "protean's p99 / p99", "queue share of p99"), rows))
    out += ["", "## Best effort and cold starts", ""]
    rows = [(name, m["be"]["requests"], m["be"]["errors"], fmt(m["be"]["p50"]), fmt(m["be"]["p99"]),
             "-" if m["cold_starts"]["total"] is None else m["cold_starts"]["total"],
             (m.get("instances") or {}).get("retired", "-"), _bursts((m.get("instances") or {}).get("by_burst")),
             m["generator_bottleneck"] or "-") for name, m in runs.items()]
    out.append(md_table(("scheme", "BE requests", "BE errors", "BE p50 ms", "BE p99 ms", "cold starts",
                         "retired", "started/retired per burst", "generator"), rows))
    failed = [(name, msg, n) for name, m in runs.items() for msg, n in (m.get("error_messages") or {}).items()]
    if failed:
        out += ["", "Failed requests, most frequent messages:", "",
                md_table(("scheme", "class: error", "requests"), failed)]
    out += ["", "Parameters the paper does not give, as used here:", ""]
    out += [f"- {k}: {v}" for k, v in r["not_given"].items()]
    lines = [f"{name}: strict compliance {_pct(m['strict']['compliance'])}, p99 {fmt(m['strict']['p99_ms'])} ms, "
             f"BE p99 {fmt(m['be']['p99'])} ms" for name, m in runs.items()]
    return lines, "\n".join(out) + "\n"


def figures(r: dict[str, Any]) -> dict[str, Figure]:
    """``strict_cdf`` (with the SLO line) and ``p99_breakdown`` (stacked bars)."""
    from matplotlib.figure import Figure

    runs = r["runs"]
    cdf = Figure(figsize=(7, 4))
    ax = cdf.subplots()
    for name, m in runs.items():
        lat = m["strict_latency_ms"]
        if lat:
            ax.plot(lat, [100 * (i + 1) / len(lat) for i in range(len(lat))], label=name)
    ax.axvline(r["slo_ms"], color="k", linestyle="--", label=f"SLO {r['slo_ms']:.0f} ms")
    ax.set_xlabel("strict end-to-end latency (ms)")
    ax.set_ylabel("percentile")
    ax.set_ylim(0, 100)
    ax.legend(fontsize="small")
    ax.set_title("Strict latency CDF (PROTEAN Fig. 8)")
    bars = Figure(figsize=(7, 4))
    ax = bars.subplots()
    names = list(runs)
    bottom = [0.0] * len(names)
    for k in COMPONENTS:
        vals = [(runs[n].get("strict_p99_breakdown_ms") or {}).get(k) or 0.0 for n in names]
        ax.bar(names, vals, bottom=bottom, label=k, color=COLOURS[k])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(r["slo_ms"], color="k", linestyle="--", label="SLO")
    ax.set_ylabel("strict p99 (ms)")
    ax.legend(fontsize="small")
    ax.set_title("Strict p99 breakdown (PROTEAN Fig. 6)")
    return {"strict_cdf": cdf, "p99_breakdown": bars}
