"""The multimodel scenario's figures, report and plots, from the numbers ``scenario.run`` measured.

No processes and no sockets: every ratio here comes from one run's own numbers (``figures``),
so the unit tests check them on synthetic runs. matplotlib is imported only to draw.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from splitserve.bench.access import cost_ratio, predicted_vs_ceiling, predicted_vs_every_request, within, zipf_shares
from splitserve.bench.multimodel import device
from splitserve.bench.scenarios.base import fmt, md_table

COLOURS = {"sequential": "#d62728", "uniform": "#2b7bba", "zipf": "#2ca02c"}
TOLERANCE = 0.2  # the cost model's predictions must hold within +-20 %


class Setup(Protocol):
    """What the report reads of the run's parameters (``scenario.Params``)."""

    cache: int
    drop_cache: bool
    requests: int
    accessed: tuple[int, ...]
    fig2_models: int
    patterns: tuple[str, ...]
    zipf_a: float
    concurrent_models: int
    device: str


def figures(p: Setup, r: dict[str, Any]) -> dict[str, Any]:
    """The run's ratios, each from this run's own numbers, with the goal each is held to."""
    lru, ceiling, every = r.get("lru", {}), r.get("no-limit", {}), r.get("load-every-request", {})
    f: dict[str, Any] = {}
    miss = np.concatenate([c["_latency"][c["_miss"]] for c in lru.values()]) if lru else np.empty(0)
    hit = np.concatenate([c["_latency"][~c["_miss"]] for c in lru.values()]) if lru else np.empty(0)
    rr = cost_ratio(miss, hit)
    f["r"] = {"value": rr, "mean_miss_ms": float(miss.mean()) if miss.size else None,
              "mean_hit_ms": float(hit.mean()) if hit.size else None, "paper_implied": 4.0}
    f["miss_ratio_equal"] = {k: c["loads_equal_reference"] for k, c in lru.items()}
    cells = {}
    for key, c in lru.items():
        base = ceiling.get(key)
        measured = c["throughput_rps"] / base["throughput_rps"] if base and base["throughput_rps"] else None
        predicted = predicted_vs_ceiling(c["miss_ratio"], rr) if rr is not None else None
        cells[key] = {"miss_ratio": c["miss_ratio"], "measured": measured, "predicted": predicted,
                      "within": within(measured, predicted, TOLERANCE)}
    f["vs_ceiling"] = cells
    fig2 = {pat: lru.get(f"{pat}/{p.fig2_models}") for pat in p.patterns}
    means = [fig2[pat]["latency_ms"]["mean"] for pat in ("sequential", "uniform", "zipf") if fig2.get(pat)]
    f["mean_order"] = means == sorted(means, reverse=True) if len(means) == 3 else None
    if fig2.get("sequential") and fig2.get("uniform"):
        ratio = fig2["sequential"]["latency_ms"]["p99"] / fig2["uniform"]["latency_ms"]["p99"]
        f["p99_sequential_over_uniform"] = {"value": ratio, "ok": 0.75 <= ratio <= 1.33}
    vs_every = {}
    for pat, c in every.items():
        mine = fig2.get(pat)
        if mine and rr is not None:
            measured = mine["throughput_rps"] / c["throughput_rps"]
            predicted = predicted_vs_every_request(mine["miss_ratio"], rr)
            vs_every[pat] = {"measured": measured, "predicted": predicted,
                             "within": within(measured, predicted, TOLERANCE)}
    f["vs_every_request"] = vs_every
    spawn, seq = r.get("spawn-per-load"), fig2.get("sequential")
    if spawn and seq and seq["miss_ms"]["p50"]:
        ratio = spawn["miss_ms"]["p50"] / seq["miss_ms"]["p50"]
        f["reload_spawn_over_spares"] = {"value": ratio, "spawn_ms": spawn["miss_ms"]["p50"],
                                         "spares_ms": seq["miss_ms"]["p50"], "ok": ratio >= 10}
    fork = r.get("fork-per-load")
    if fork and fork["miss_ms"]["p50"]:
        f["reload_fork"] = {"fork_ms": fork["miss_ms"]["p50"],
                            "spawn_over_fork": spawn["miss_ms"]["p50"] / fork["miss_ms"]["p50"] if spawn else None,
                            "fork_over_spares": fork["miss_ms"]["p50"] / seq["miss_ms"]["p50"]
                            if seq and seq["miss_ms"]["p50"] else None}
    if "overlap" in r:
        f["overlap_p99"] = {"value": r["overlap"]["p99_ratio"], "ok": (r["overlap"]["p99_ratio"] or 99) <= 1.2}
    mem = r.get("memory")
    if mem:
        mine = [x for n, x in mem["models"].items() if n in r["copies"] and x["loads"]]
        charge = max((x["weights_bytes"] + x["private_bytes"] * max(1, x["instances"]) for x in mine), default=0)
        loads = [x["last_load_ms"] for x in mine if x["last_load_ms"] is not None]
        f["memory"] = {"largest_charge_bytes": charge, "copies_the_budget_holds": r["budget_bytes"] // charge
                       if charge else None, "mean_last_load_ms": float(np.mean(loads)) if loads else None}
    f |= device.figures(r)
    conc = r.get("concurrent")
    if conc:
        single = lru.get(f"uniform/{p.concurrent_models}")
        f["concurrent"] = {"errors": conc["errors"], "wrong": conc["wrong"],
                           "throughput_vs_concurrency_1": conc["throughput_rps"] / single["throughput_rps"]
                           if single else None}
    return f


def broken(r: dict[str, Any]) -> list[str]:
    """Promises the server broke: wrong answers, errors, and lru loads that are not LRU's misses."""
    runs = [(f"{v} {k}", c) for v in ("no-limit", "lru", "lru-disk", "load-every-request")
            for k, c in r.get(v, {}).items()]
    runs += [(f"B4 {ph}{who}", x) for ph in ("quiet", "loading") if "overlap" in r
             for who, x in (("", r["overlap"][ph]), (", the other client", r["overlap"][ph]["background"]))]
    runs += [(sub, r[sub]) for sub in ("spawn-per-load", "fork-per-load", "concurrent") if sub in r]
    out = [f"{what}: {c['wrong']} wrong answers, {c['errors']} errors" + (f" {c['first_errors']}"
                                                                          if c.get("first_errors") else "")
           for what, c in runs if c["wrong"] or c["errors"]]
    out += [f"{v} {k}: {c['loads']} loads, the reference LRU misses {c['reference_misses']}"
            for v in ("lru", "lru-disk") for k, c in r.get(v, {}).items() if not c["loads_equal_reference"]]
    return out + device.broken(device.figures(r))


def _ok(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "**no**"


def markdown(intro: str, p: Setup, r: dict[str, Any], f: dict[str, Any], max_batch: int) -> tuple[list[str], str]:
    """The summary lines the CLI prints and the report's markdown (``intro`` first), from the run's
    numbers ``r`` and its figures ``f``."""
    report = [intro, "",
              f"{len(r['copies'])} copies of `{r['arch']}` ({r['weights_bytes'] / 2**20:.1f} MiB of weights each, "
              f"max batch {max_batch}), cache {p.cache} models, byte budget {r['budget_bytes'] / 2**20:.0f} MiB, "
              f"{p.requests} requests per sequence, concurrency 1, evicted weights "
              + ("dropped from the page cache (disk tier)." if p.drop_cache else "left in the page cache."), ""]
    lines: list[str] = []
    if "memory" in f:
        x = f["memory"]
        report += [f"By bytes, the budget holds {x['copies_the_budget_holds']} copies at the largest charge a load "
                   f"measured ({x['largest_charge_bytes'] / 2**20:.1f} MiB: weights + private bytes), so the model "
                   f"count ({p.cache}) is what binds. The server's own load time (`last_load_ms` in `/v2/memory`) "
                   f"averaged {fmt(x['mean_last_load_ms'], 1)} ms over the copies; the rest of a miss is releasing "
                   "the victim, waiting for the one loader, and the request itself.", ""]
    rr = f["r"]
    if rr["value"] is not None:
        report += [f"**Miss cost** r = (mean miss - mean hit) / mean hit = ({fmt(rr['mean_miss_ms'], 1)} - "
                   f"{fmt(rr['mean_hit_ms'], 1)}) / {fmt(rr['mean_hit_ms'], 1)} = **{rr['value']:.2f}** over every "
                   "lru sequence (the paper's figures imply r = 4).", ""]
        lines.append(f"miss cost r = {rr['value']:.2f} (paper: 4)")
    lru = r.get("lru", {})
    if lru:
        fig2 = [(pat, lru[f"{pat}/{p.fig2_models}"]) for pat in p.patterns]
        report += [f"## B1 (Fig. 2): {p.fig2_models} models, cache {p.cache}", "",
                   md_table(("pattern", "shares used", "reference misses", "server loads", "equal", "mean ms",
                             "p50 ms", "p80 ms", "p99 ms"),
                            [(pat, " / ".join(f"{s:.1%}" for s in c["shares"]),
                              f"{c['reference_misses']} ({c['miss_ratio']:.3f})", c["loads"],
                              _ok(c["loads_equal_reference"]), fmt(c["latency_ms"]["mean"], 1),
                              fmt(c["latency_ms"]["p50"], 1),
                              fmt(float(np.percentile(c["_latency"], 80)) if c["requests"] else None, 1),
                              fmt(c["latency_ms"]["p99"], 1)) for pat, c in fig2]), "",
                   f"Zipf({p.zipf_a:g}) truncated to 1..{p.fig2_models} has shares "
                   + " / ".join(f"{s:.1%}" for s in zipf_shares(p.fig2_models, p.zipf_a))
                   + " (not the paper's 50 % / 37.5 %, rafiqi.md E5). "
                   f"mean(sequential) > mean(uniform) > mean(zipf): {_ok(f['mean_order'])}. "
                   + (f"p99 sequential / uniform = {f['p99_sequential_over_uniform']['value']:.2f} (goal 0.75-1.33: "
                      f"{_ok(f['p99_sequential_over_uniform']['ok'])})." if "p99_sequential_over_uniform" in f
                      else ""), ""]
        equal = sum(f["miss_ratio_equal"].values())
        lines.append(f"server loads = reference LRU misses in {equal}/{len(f['miss_ratio_equal'])} sequences")
    cells = f["vs_ceiling"]
    if cells and "no-limit" in r:
        rows = []
        for key, c in cells.items():
            mine, base = lru[key], r["no-limit"][key]
            rows.append((*key.split("/"), f"{c['miss_ratio']:.3f}", fmt(mine["throughput_rps"], 1),
                         fmt(base["throughput_rps"], 1), fmt(c["measured"], 2), fmt(c["predicted"], 2),
                         _ok(c["within"]), fmt(mine["latency_ms"]["p90"], 1), fmt(base["latency_ms"]["p90"], 1)))
        held = [c["within"] for c in cells.values() if c["within"] is not None]
        report += ["## B2 (Figs 3/4): throughput and p90 against the number of models accessed", "",
                   "Measured: lru throughput / no-limit throughput on the same sequence; predicted: 1 / (1 + m·r) "
                   f"with this run's m and r; goal within ±{TOLERANCE:.0%}.", "",
                   md_table(("pattern", "M", "miss ratio m", "lru req/s", "no-limit req/s", "measured", "predicted",
                             "within", "lru p90 ms", "no-limit p90 ms"), rows), ""]
        lines.append(f"throughput vs no-limit within ±{TOLERANCE:.0%} of 1/(1+m·r) in {sum(held)}/{len(held)} "
                     "sequences")
    if f["vs_every_request"]:
        report += [f"## B3 (b): lru against loading on every request ({p.fig2_models} models)", "",
                   "Load-every-request's wall time includes the client's evict call after each answer "
                   "(mean shown); its requests' own latency does not.", "",
                   md_table(("pattern", "load-every-request req/s", "its evict call ms", "lru req/s", "measured",
                             "predicted (1+r)/(1+m·r)", "within"),
                            [(pat, fmt(r["load-every-request"][pat]["throughput_rps"], 1),
                              fmt(r["load-every-request"][pat]["evict_ms_mean"], 1),
                              fmt(lru[f"{pat}/{p.fig2_models}"]["throughput_rps"], 1), fmt(c["measured"], 2),
                              fmt(c["predicted"], 2), _ok(c["within"])) for pat, c in f["vs_every_request"].items()]),
                   ""]
        lines.append("lru / load-every-request, measured vs (1+r)/(1+m·r): " + ", ".join(
            f"{pat} {fmt(c['measured'], 2)} vs {fmt(c['predicted'], 2)}" for pat, c in f["vs_every_request"].items()))
    if "reload_spawn_over_spares" in f:
        x = f["reload_spawn_over_spares"]
        report += ["## B3 (c): reload with a new process against a spare", "",
                   f"Median miss (reload plus one inference): {fmt(x['spawn_ms'], 0)} ms when each load starts a "
                   f"process (no spares, no recycling; two models, room for one), {fmt(x['spares_ms'], 1)} ms with "
                   f"spares (lru, sequential over {p.fig2_models}): **{x['value']:.1f}x** (goal >= 10x: "
                   f"{_ok(x['ok'])}).", ""]
        lines.append(f"reload: new process / spare = {x['value']:.1f}x (goal >= 10x)")
    if "reload_fork" in f:
        x = f["reload_fork"]
        report += ["## B3 (d): reload with a process forked from the fork server", "",
                   f"Median miss: {fmt(x['fork_ms'], 0)} ms when each load forks its process from the node's fork "
                   f"server (no spares, no recycling): a new interpreter's reload over it "
                   f"**{fmt(x['spawn_over_fork'], 1)}x**, it over a spare's {fmt(x['fork_over_spares'], 1)}x.", ""]
        lines.append(f"reload: new interpreter / forked = {fmt(x['spawn_over_fork'], 1)}x, "
                     f"forked / spare = {fmt(x['fork_over_spares'], 1)}x")
    if "overlap" in r:
        o = r["overlap"]
        report += ["## B4: a resident model while others load", "",
                   md_table(("phase", "requests", "p50 ms", "p99 ms", "other client's requests", "loads meanwhile"),
                            [(ph, o[ph]["requests"], fmt(o[ph]["latency_ms"]["p50"], 1),
                              fmt(o[ph]["latency_ms"]["p99"], 1), o[ph]["background"].get("requests"),
                              o[ph]["loads"]) for ph in ("quiet", "loading")]), "",
                   f"p99 while loading / p99 without loads = **{fmt(o['p99_ratio'], 2)}** (goal <= 1.2: "
                   f"{_ok(f['overlap_p99']['ok'])}); p50 ratio {fmt(o['p50_ratio'], 2)}.", ""]
        lines.append(f"resident model p99 while others load / without: {fmt(o['p99_ratio'], 2)} (goal <= 1.2)")
    conc = r.get("concurrent")
    if conc:
        x = f["concurrent"]
        report += [f"## B5: {conc['clients']} clients over {conc['models']} models, cache {p.cache}", "",
                   f"{conc['sent']} requests in {conc['wall_s']:.1f} s: {conc['ok']} answered ({conc['wrong']} wrong), "
                   f"{conc['errors']} errors {conc['error_kinds'] or ''}; {conc['loads']} loads, "
                   f"{conc['evictions']} evictions; {fmt(conc['throughput_rps'], 1)} req/s, p50 "
                   f"{fmt(conc['latency_ms']['p50'], 1)} ms, p99 {fmt(conc['latency_ms']['p99'], 1)} ms"
                   + (f"; throughput / the concurrency-1 uniform run over the same models: "
                      f"**{x['throughput_vs_concurrency_1']:.2f}** (goal >= 1)"
                      if x["throughput_vs_concurrency_1"] is not None else "") + ".", ""]
        lines.append(f"{conc['clients']} clients: {conc['errors']} errors, {conc['wrong']} wrong, "
                     f"{fmt(conc['throughput_rps'], 1)} req/s")
    gpu_lines, gpu_report = device.markdown(p.device, f)
    return lines + gpu_lines, "\n".join(report + gpu_report)


def plots(p: Setup, r: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
    """The run's figures by file name: the latency CDFs (Fig. 2) and throughput and p90 against M (Figs 3/4)."""
    figs = {}
    if r.get("lru"):
        figs["latency_cdf"] = _plot_cdf(p, r)
    if r.get("lru") or r.get("no-limit"):
        figs["vs_models"] = _plot_vs_models(p, r, f)
    return figs


def public(v: Any) -> Any:
    """``v`` without the raw per-request arrays kept for the figures."""
    if isinstance(v, dict):
        return {k: public(x) for k, x in v.items() if not k.startswith("_")}
    return v


def _plot_cdf(p: Setup, r: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for pat in p.patterns:
        for variant, style in (("lru", "-"), ("load-every-request", ":")):
            c = r.get(variant, {}).get(f"{pat}/{p.fig2_models}" if variant == "lru" else pat)
            if c is None or not c["requests"]:
                continue
            xs = np.sort(c["_latency"])
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), style, color=COLOURS.get(pat), label=f"{variant}, {pat}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{p.fig2_models} models, cache {p.cache}: latency CDF per access pattern (Rafiqi Fig. 2)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_vs_models(p: Setup, r: dict[str, Any], f: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    tput, p90 = fig.subplots(1, 2)
    ms = sorted({*p.accessed, p.fig2_models})
    for pat in p.patterns:
        c = COLOURS.get(pat)
        for variant, style in (("lru", "-o"), ("no-limit", "--")):
            cells = [r.get(variant, {}).get(f"{pat}/{m}") for m in ms]
            if not any(cells):
                continue
            tput.plot(ms, [x["throughput_rps"] if x else np.nan for x in cells], style, ms=3, color=c,
                      label=f"{variant}, {pat}")
            p90.plot(ms, [x["latency_ms"]["p90"] if x else np.nan for x in cells], style, ms=3, color=c,
                     label=f"{variant}, {pat}")
        pred = [(f["vs_ceiling"].get(f"{pat}/{m}") or {}).get("predicted") for m in ms]
        base = [r.get("no-limit", {}).get(f"{pat}/{m}") for m in ms]
        if any(x is not None for x in pred) and all(base):
            tput.plot(ms, [b["throughput_rps"] * x if x is not None else np.nan for b, x in zip(base, pred)], ":",
                      color=c, label=f"predicted, {pat}")
    for ax in (tput, p90):
        ax.axvline(p.cache + 0.5, color="grey", lw=1, ls="--")
        ax.set_xticks(ms)
        ax.set_xlabel("models accessed M (dashed line: the cache)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    tput.set_ylabel("throughput (req/s)")
    p90.set_ylabel("p90 latency (ms)")
    tput.set_title("throughput vs models accessed (Rafiqi Fig. 4)", fontsize=9)
    p90.set_title("p90 latency vs models accessed (Rafiqi Fig. 3)", fontsize=9)
    fig.tight_layout()
    return fig
