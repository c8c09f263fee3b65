"""cluster-spot: PROTEAN Fig. 9 on emulated revocations, simulated at the paper's scale.

Schemes ``protean``, ``spot-only`` and ``on-demand-only`` at each P_rev (0, 0.354, 0.708) on
the identical Wikipedia-like trace (50/50 strict/BE) run in ``splitserve.cluster.policy.sim``: the
dispatch, ledger, autoscaler, procurement, revocation emulator and cost ledger of the
cluster, with a discrete-event clock. Each point is (cost normalised to on-demand-only on
the same trace and seed, strict SLO compliance), plus strict and BE p99, evictions,
fallbacks, requeued and lost requests (lost must be 0). Service times come from a stored
latency profile of ``model`` (``splitserve profile``, the store ``bench packrat`` uses) when
one exists, else the stated constant model. No server is started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench import traces
from splitserve.bench.arrivals import from_rate_trace
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.cluster.policy.sim import Workload, simulate
from splitserve.cluster.pools import ProcurementPolicy
from splitserve.cluster.config import ClusterConfig

NAME = "cluster-spot"
SUMMARY = "PROTEAN Fig. 9: normalised cost vs strict SLO compliance per procurement scheme and P_rev (simulated)."
MODELS: tuple[str, ...] = ("resnet50", "resnet18", "lenet")
TRANSPORTS: tuple[str, ...] = ()
REFERENCE = "on-demand-only"

# What the paper leaves open, as simulated here (also in result.json and the report).
ASSUMPTIONS = {
    "revocation_interval": "a notice may come to each live spot node every revocation_interval_s (60 s)",
    "replacement_spot": "a new spot request fails with probability P_rev, known at once",
    "launch": "spot and on-demand nodes serve launch_s (60 s) after their request (boot and model load)",
    "doomed_node": "serves until its replacement serves or drain_lead_s before eviction; work left "
                   "drain_margin_s before eviction is re-sent",
    "replacement": "ordered at the notice; protean buys it on-demand at once when a spot node would serve after "
                   "the doomed node stops (deadline - drain_lead_s) and an on-demand one would come sooner (with "
                   "equal launch times, as here, it stays spot first)",
    "dispatch": "strict work prefers on-demand nodes and BE work spot nodes only on nodes with fewer than "
                "dispatch_prefer_below in flight; busier nodes compete by load",
    "protean_return": "protean asks spot to replace an on-demand node that has served spot_return_s (120 s), "
                      "again spot_return_s after a refused request; the on-demand node leaves once the spot one "
                      "serves (the paper: spot VMs 'when available', on-demand 'during periods of unavailability')",
    "node": "one model, one batch at a time, strict first, work-conserving batches of one class",
    "refusal": "a request no node can take is answered QUEUE_FULL or MODEL_NOT_READY; a strict one is a miss",
    "scale": "the paper's 5000 req/s on 8 A100s is scaled to load x the nodes' capacity of the simulated model",
}


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("resnet50",)  # the model whose stored profile gives batch times, if there is one
    schemes: tuple[str, ...] = ("protean", "spot-only", "on-demand-only")
    p_revs: tuple[float, ...] = (0.0, 0.354, 0.708)  # PROTEAN §5: high, moderate, low spot availability
    nodes: int = 8  # PROTEAN §5: 8 workers
    duration_s: float = 3600.0  # of trace
    load: float = 0.7  # offered load as a fraction of the nodes' capacity
    strict_share: float = 0.5  # PROTEAN §5: 50/50 strict/BE
    batch: int = 8
    batch_s: float = 0.1  # constant model: a full batch's time (a batch of b: batch_s x (0.25 + 0.75 b/batch))
    slo_multiplier: float = 3.0  # PROTEAN §5: SLO = 3x the solo batch time
    pricing: str = "aws"  # aws | azure | gcp (Table 3)
    profile_dir: str = ""  # profile store; empty: <results>/.packrat-profiles

    @classmethod
    def quick(cls) -> Params:
        return cls(duration_s=600.0)

    def check(self) -> None:
        for s in self.schemes:
            ProcurementPolicy.parse(s, "scheme")
        if REFERENCE not in self.schemes:
            raise ValueError(f"schemes must include {REFERENCE} (costs are normalised to it)")
        if not all(0 <= p <= 1 for p in self.p_revs) or not self.p_revs:
            raise ValueError("p_revs must be probabilities in [0, 1]")
        if self.nodes < 1 or self.batch < 1 or not 0 < self.load <= 2 or self.duration_s <= 0:
            raise ValueError("nodes and batch must be >= 1, load in (0, 2], duration_s > 0")


def _batch_times(ctx: Context, p: Params) -> tuple[list[float], str]:
    """Seconds per batch size 1..batch: the stored profile's L[t, b] at its most threads,
    else the constant model; and where they came from."""
    from splitserve.placement.profiler import load_profile
    from splitserve.registry import Registry

    store = Path(p.profile_dir) if p.profile_dir else ctx.results.path.parent / ".packrat-profiles"
    if p.models and (store / "registry.sqlite3").exists():
        reg = Registry(store)
        try:
            prof = load_profile(reg, p.models[0])
        finally:
            reg.close()
        if prof is not None:
            t = max(t for t, _ in prof.latency.table)
            return ([prof.latency.latency(t, b) for b in range(1, p.batch + 1)],
                    f"stored profile of {p.models[0]} at {t} threads ({store})")
    return ([p.batch_s * (0.25 + 0.75 * b / p.batch) for b in range(1, p.batch + 1)],
            f"constant model: {p.batch_s * 1e3:g} ms per batch of {p.batch}, 25 % of it fixed (no stored profile)")


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    p.check()
    times_b, source = _batch_times(ctx, p)
    ctx.notes.append(f"batch times: {source}")
    solo = times_b[-1]
    capacity = p.nodes * p.batch / solo
    rng = np.random.default_rng(p.seed)
    points = traces.wiki_like(p.duration_s, p.load * capacity, rng)
    times = from_rate_trace(points, p.duration_s, rng)
    strict = (rng.random(len(times)) < p.strict_share).tolist()
    work = Workload(times.tolist(), strict, p.batch, times_b, p.slo_multiplier * solo)
    runs: dict[str, dict[str, Any]] = {}
    with ctx.task(f"{len(p.schemes) * len(p.p_revs)} simulations of {len(times):,} requests",
                  len(p.schemes) * len(p.p_revs)) as advance:
        for p_rev in p.p_revs:
            for scheme in p.schemes:
                cfg = ClusterConfig(min_nodes=p.nodes, max_nodes=p.nodes, procurement=scheme, p_rev=p_rev,
                                    pricing=p.pricing, revocation_seed=p.seed).checked()
                runs[f"{scheme}@{p_rev:g}"] = {"scheme": scheme, "p_rev": p_rev, **simulate(cfg, work, p.seed)}
                advance(1)
    for r in runs.values():
        ref = runs[f"{REFERENCE}@{r['p_rev']:g}"]["cost"]["dollars"]
        r["normalised_cost"] = r["cost"]["dollars"] / ref if ref else None
    cfg = ClusterConfig(pricing=p.pricing)
    result = {"batch_times_s": times_b, "batch_times_from": source, "slo_ms": work.slo_s * 1e3,
              "capacity_rps": capacity, "offered_rps": p.load * capacity, "requests": len(times),
              "peak_to_mean": traces.peak_to_mean_of(points, p.duration_s),
              "prices": dataclasses.asdict(cfg.prices), "cluster": _config_dict(cfg),
              "assumptions": ASSUMPTIONS, "runs": runs}
    broken = [f"{k}: {r['lost']} requests lost" for k, r in runs.items() if r["lost"]]
    lines, report = _report(p, result)
    return ScenarioOutput(result, report, {"fig9": _figure(p, runs)}, lines, broken)


def _config_dict(cfg: ClusterConfig) -> dict[str, Any]:
    return {f.name: str(getattr(cfg, f.name)) if isinstance(getattr(cfg, f.name), str) else getattr(cfg, f.name)
            for f in dataclasses.fields(cfg)}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _report(p: Params, r: dict[str, Any]) -> tuple[list[str], str]:
    rows = [(k, _pct(x["strict"]["compliance"]), fmt(x["normalised_cost"], 3), fmt(x["cost"]["dollars"], 2),
             fmt(x["strict"]["p99_ms"]), fmt(x["be"]["p99_ms"]), x["notices"], x["evictions"], x["fallbacks"],
             x["spot_failures"], x["requeued"], x["strict"]["errors"] + x["be"]["errors"], x["lost"])
            for k, x in r["runs"].items()]
    out = [report_intro(__doc__), "",
           f"{p.nodes} nodes, batch {p.batch}; batch times from {r['batch_times_from']}; SLO "
           f"{r['slo_ms']:.1f} ms ({p.slo_multiplier:g} x solo); {r['requests']:,} requests over {p.duration_s:g} s "
           f"at {fmt(r['offered_rps'])} req/s mean ({p.load:g} of {fmt(r['capacity_rps'])}), wiki-like trace "
           f"(peak:mean {r['peak_to_mean']:.3f}); prices {p.pricing}: on-demand ${r['prices']['on_demand']}/h, spot "
           f"${r['prices']['spot']}/h.", "",
           md_table(("run", "strict SLO", "cost / on-demand-only", "$", "strict p99 ms", "BE p99 ms", "notices",
                     "evictions", "fallbacks", "failed spot requests", "requeued", "errors", "lost"), rows),
           "", "Assumptions where the paper is silent:", ""]
    out += [f"- {k}: {v}" for k, v in r["assumptions"].items()]
    lines = [f"{k}: strict SLO {_pct(x['strict']['compliance'])}, cost {fmt(x['normalised_cost'], 3)} of "
             f"on-demand-only, lost {x['lost']}" for k, x in r["runs"].items()]
    return lines, "\n".join(out) + "\n"


def _figure(p: Params, runs: dict[str, dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    colours = {"protean": "#2b7bba", "spot-only": "#d62728", "on-demand-only": "#2ca02c"}
    markers = dict(zip(p.p_revs, "o^sDv"))
    for x in runs.values():
        comp = x["strict"]["compliance"]
        if comp is None or x["normalised_cost"] is None:
            continue
        ax.scatter(x["normalised_cost"], 100 * comp, color=colours.get(x["scheme"], "k"),
                   marker=markers.get(x["p_rev"], "o"), s=60)
    for s, c in colours.items():
        ax.scatter([], [], color=c, label=s)
    for pr, m in markers.items():
        ax.scatter([], [], color="grey", marker=m, label=f"P_rev {pr:g}")
    ax.set_xlabel("cost normalised to on-demand-only")
    ax.set_ylabel("strict SLO compliance (%)")
    ax.set_xlim(0, 1.1)
    ax.set_ylim(0, 102)
    ax.legend(fontsize="small", loc="lower right")
    ax.set_title("Cost vs strict SLO compliance (PROTEAN Fig. 9, simulated)")
    return fig
