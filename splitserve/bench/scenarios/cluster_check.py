"""cluster-check: the cluster simulator checked against a small real run of the same trace.

One seeded trace of strict and best-effort ``lenet`` calls (Wikipedia-like shape, a minute
or two) is served twice with the same ``ClusterConfig``: by a live local Ray cluster (a head
and up to ``max_nodes`` raylets on 127.0.0.1, the controller, gateway and revocation
emulator of ``splitserve cluster``) and by ``splitserve.cluster.policy.sim`` (the same pure
dispatch, ledger, autoscaler, procurement, revocation emulator and cost ledger on a
discrete-event clock). The simulator is calibrated on the real run, and only on what it
cannot know: when the trace started after the cluster did, how long a node took from its
request to serving (mean of the real bill), and the node's answer time (the real median
latency, for every batch size). Both columns are reduced to the same figures (nodes
requested per market, notices, evictions, requests answered and lost, cost by the same
cost ledger normalised to a simulated on-demand-only run of the trace, strict SLO
compliance, nodes over time) and set side by side with their differences.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitserve import errors
from splitserve.bench import traces
from splitserve.bench.arrivals import Arrival, from_rate_trace
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.cluster.policy.cost import CostLedger
from splitserve.cluster.policy.sim import ClusterSim, Workload
from splitserve.cluster.pools import Market, ProcurementPolicy
from splitserve.cluster.config import ClusterConfig

NAME = "cluster-check"
SUMMARY = "The cluster simulator against a real local Ray cluster on one seeded trace: both columns and the differences."
MODELS: tuple[str, ...] = ("lenet",)
TRANSPORTS: tuple[str, ...] = ()
_POLL_S = 0.5
# the agreement the design note asks of the simulator (§5.3): strict compliance within this
# many points, normalised cost within this fraction
COMPLIANCE_POINTS = 5.0
COST_FRACTION = 0.10


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet",)
    seed: int = 7  # with p_rev 0.25: a notice at 30 s and a failed spot request for its replacement
    procurement: str = "protean"
    min_nodes: int = 1
    max_nodes: int = 3  # serving raylets at most (each is a raylet and a server on this machine)
    duration_s: float = 90.0  # of trace
    rate_rps: float = 20.0  # mean offered load through the gateway
    strict_share: float = 0.5  # PROTEAN §5: 50/50 strict/BE
    slo_ms: float = 100.0  # strict requests' SLO (carried on each call)
    p_rev: float = 0.25  # chance of a notice per interval, and of a spot request failing
    revocation_interval_s: float = 30.0  # longer than a node's boot here, so the first draw finds it serving
    notice_min_s: float = 40.0  # long enough for a replacement to boot on a loaded 2-core machine
    notice_max_s: float = 60.0
    drain_lead_s: float = 10.0
    drain_margin_s: float = 4.0
    keep_alive_s: float = 30.0
    requests_per_node: int = 8
    connections: int = 4
    start_timeout_s: float = 240.0

    @classmethod
    def quick(cls) -> Params:
        return cls(duration_s=60.0)

    def check(self) -> None:
        ProcurementPolicy.parse(self.procurement, "procurement")
        if not 1 <= self.min_nodes <= self.max_nodes <= 4:
            raise ValueError("need 1 <= min_nodes <= max_nodes <= 4 (each node is a raylet and a server here)")
        if self.duration_s <= 0 or self.rate_rps <= 0 or self.slo_ms <= 0:
            raise ValueError("duration_s, rate_rps and slo_ms must be positive")

    def cluster(self, **overrides: Any) -> ClusterConfig:
        """The one configuration both runs use (the simulator's adds the measured launch time)."""
        return ClusterConfig.from_env(
            min_nodes=self.min_nodes, max_nodes=self.max_nodes, procurement=self.procurement, p_rev=self.p_rev,
            revocation_interval_s=self.revocation_interval_s, notice_min_s=self.notice_min_s,
            notice_max_s=self.notice_max_s, drain_lead_s=self.drain_lead_s, drain_margin_s=self.drain_margin_s,
            keep_alive_s=self.keep_alive_s, requests_per_node=self.requests_per_node, revocation_seed=self.seed,
            reconcile_interval_s=0.5, autoscale_interval_s=1.0, **overrides)


# -- what one run reports, the same for both ---------------------------------------------------


@dataclass
class Side:
    """One run reduced to what both can report; times in seconds from the first node's request."""

    requests: int
    answered: int
    lost: int
    strict: int
    strict_met: int
    notices: int
    fallbacks: int
    spot_failures: int
    bill: CostLedger
    end: float  # billing stops here (the run's last answer)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, serving, billed), on change


def ledger_of(bill: Iterable[dict[str, Any]], t0: float, end: float) -> CostLedger:
    """The controller's bill (``status()['bill']``, epoch seconds) as a cost ledger on the run's
    clock (seconds after ``t0``), cut at ``end``: a node still running then is billed to it."""
    ledger = CostLedger()
    for r in sorted(bill, key=lambda r: r["requested_at"]):
        requested = r["requested_at"] - t0
        if requested > end:
            continue
        ledger.requested(r["node"], r["node_type"], Market.parse(r["market"]), r["price_per_hour"], requested)
        for what in ("ready", "drained"):
            at = r[f"{what}_at"]
            if at is not None and at - t0 <= end:
                getattr(ledger, what)(r["node"], at - t0)
        if r["ended_at"] is not None and r["ended_at"] - t0 <= end:
            ledger.ended(r["node"], r["ended_at"] - t0, evicted=r["evicted"])
    return ledger


_ANSWER_ERRORS = frozenset(c.__name__ for c in vars(errors).values()
                           if isinstance(c, type) and issubclass(c, errors.SplitServeError))


def answered(ok: bool, error: str | None) -> bool:
    """Whether a call got an answer: a result, or a splitserve error with its code (a timeout
    or a lost connection is no answer)."""
    return ok or (error or "").split(":", 1)[0] in _ANSWER_ERRORS


def mean_nodes(timeline: Sequence[tuple[float, int, int]], end: float) -> tuple[float, float]:
    """Time-weighted mean of (serving, billed) nodes from the first point to ``end``."""
    if not timeline or end <= timeline[0][0]:
        return 0.0, 0.0
    span = end - timeline[0][0]
    serving = billed = 0.0
    for (t, s, b), nxt in zip(timeline, [*timeline[1:], (end, 0, 0)]):
        dt = max(0.0, min(nxt[0], end) - t)
        serving += s * dt
        billed += b * dt
    return serving / span, billed / span


def figures(side: Side, reference_dollars: float) -> dict[str, float | int | None]:
    """The compared figures of one run; cost normalised to ``reference_dollars`` (on-demand-only)."""
    recs = side.bill.records()
    cost = side.bill.summary(side.end)
    serving, billed = mean_nodes(side.timeline, side.end)
    return {
        "spot nodes requested": sum(r.market is Market.SPOT for r in recs),
        "on-demand nodes requested": sum(r.market is Market.ON_DEMAND for r in recs),
        "failed spot requests": side.spot_failures,
        "fallbacks": side.fallbacks,
        "notices": side.notices,
        "evictions": cost["evictions"],
        "requests": side.requests,
        "answered": side.answered,
        "lost": side.lost,
        "strict SLO compliance %": 100.0 * side.strict_met / side.strict if side.strict else None,
        "cost $": cost["dollars"],
        "cost / on-demand-only": cost["dollars"] / reference_dollars if reference_dollars else None,
        "spot node-hours": cost["node_hours"][str(Market.SPOT)],
        "on-demand node-hours": cost["node_hours"][str(Market.ON_DEMAND)],
        "mean serving nodes": serving,
        "mean billed nodes": billed,
    }


def compare(sim: dict[str, Any], real: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """(figure, simulated, real, real − simulated) for every figure both have."""
    rows = []
    for k, s in sim.items():
        r = real.get(k)
        rows.append((k, s, r, None if s is None or r is None else r - s))
    return rows


def agreement(sim: dict[str, Any], real: dict[str, Any]) -> dict[str, bool | None]:
    """The design note's checks: nothing lost in either, compliance within
    ``COMPLIANCE_POINTS`` points, normalised cost within ``COST_FRACTION`` of the simulator's."""
    c_s, c_r = sim["strict SLO compliance %"], real["strict SLO compliance %"]
    n_s, n_r = sim["cost / on-demand-only"], real["cost / on-demand-only"]
    return {"nothing lost": sim["lost"] == 0 and real["lost"] == 0,
            "compliance": None if c_s is None or c_r is None else abs(c_r - c_s) <= COMPLIANCE_POINTS,
            "cost": None if not n_s or n_r is None else abs(n_r - n_s) <= COST_FRACTION * n_s}


# -- the two runs ------------------------------------------------------------------------------


def _trace(p: Params) -> tuple[np.ndarray, list[bool]]:
    rng = np.random.default_rng(p.seed)
    points = traces.wiki_like(p.duration_s, p.rate_rps, rng)
    times = from_rate_trace(points, p.duration_s, rng)
    return times, (rng.random(len(times)) < p.strict_share).tolist()


def _sim_side(cfg: ClusterConfig, work: Workload, seed: int, start: float) -> tuple[Side, dict[str, Any]]:
    sim = ClusterSim(cfg, work, seed)
    r = sim.run(start, horizon_s=120.0)
    side = Side(r["requests"], r["answered"], r["lost"], r["strict"]["requests"], r["strict"]["met"], r["notices"],
                r["fallbacks"], r["spot_failures"], sim.cost, r["end_s"], [tuple(x) for x in r["nodes_over_time"]])
    return side, r


def _real_run(ctx: Context, p: Params, times: np.ndarray, strict: list[bool]) -> dict[str, Any]:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("bench cluster-check runs a local Ray cluster: install the cluster extra "
                           "(pip install -e '.[cluster]', which scripts/setup.sh does)") from e

    from splitserve.bench.protean.load import TraceJob, drive
    from splitserve.cluster.actors.local import LocalCluster
    from splitserve.cluster.actors.node_server import NodeSpec
    from splitserve.config import env_cache_dir
    from splitserve.models.catalog import zoo_entry

    model = p.models[0]
    cache = env_cache_dir()
    root = tempfile.mkdtemp(prefix="ssray-")
    local = LocalCluster(p.cluster(), root, NodeSpec(token="cluster-check", cache_dir=str(cache) if cache else None,
                                                     tmp_root=root), gateway_port=0, models=(model,))
    polls: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def poll(controller: Any) -> None:
        # nodes over time, as the controller sees them: serving (ACTIVE) and billed (not ended)
        while not stop.wait(_POLL_S):
            s = ray.get(controller.status.remote())
            polls.append((time.time(), sum(n["state"] == "active" for n in s["nodes"]),
                          sum(r["ended_at"] is None for r in s["bill"])))

    try:
        with ctx.task(f"starting a Ray head and {p.min_nodes} serving node(s)", 1):
            h = local.start(timeout_s=p.start_timeout_s)
        poller = threading.Thread(target=poll, args=(h.controller,), name="cluster-check-poll", daemon=True)
        poller.start()
        arrivals = tuple(Arrival(float(t), model, "rt" if s else "be") for t, s in zip(times, strict))
        specs = tuple(s.to_dict() for s in zoo_entry(model).inputs)
        job = TraceJob(f"tcp://127.0.0.1:{h.gateway_port}", ((model, specs),), arrivals, p.slo_ms,
                       connections=p.connections, drain_timeout_s=60.0, seed=p.seed)
        try:
            with ctx.task(f"{len(arrivals):,} calls over {p.duration_s:g} s through the gateway", 1):
                result, _ = drive(job)
            status = ray.get(h.controller.status.remote())
            gateway = ray.get(h.gateway.stats.remote())
        finally:
            stop.set()
            poller.join()
    finally:
        local.stop()
    return {"result": result, "status": status, "gateway": gateway, "polls": polls}


def _real_side(real: dict[str, Any], slo_s: float) -> tuple[Side, float, float]:
    """The real run as a ``Side``; also when the trace started on the run's clock, and the
    mean seconds from a node's request to its serving."""
    result, status = real["result"], real["status"]
    bill = status["bill"]
    t0 = min(r["requested_at"] for r in bill)
    samples = result.samples
    end = result.origin - t0 + max((s.done for s in samples), default=0.0)
    ledger = ledger_of(bill, t0, end)
    boots = [r.ready_at - r.requested_at for r in ledger.records() if r.ready_at is not None]
    strict = [s for s in samples if s.cls == "rt"]
    timeline: list[tuple[float, int, int]] = []
    for t, serving, billed in real["polls"]:
        if not timeline or timeline[-1][1:] != (serving, billed):
            timeline.append((t - t0, serving, billed))
    rev = status["revocations"]
    side = Side(len(samples), sum(answered(s.ok, s.error) for s in samples),
                sum(not answered(s.ok, s.error) for s in samples), len(strict),
                sum(s.ok and s.latency <= slo_s for s in strict), rev["notices"], status["fallbacks"],
                rev["spot_failures"], ledger, end, timeline)
    return side, result.origin - t0, float(np.mean(boots)) if boots else 0.0


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    p.check()
    times, strict = _trace(p)
    slo_s = p.slo_ms / 1e3
    real = _real_run(ctx, p, times, strict)
    real_side, start, launch_s = _real_side(real, slo_s)
    t0 = min(r["requested_at"] for r in real["status"]["bill"])
    ok = [s.latency for s in real["result"].samples if s.ok]
    answer_s = float(np.median(ok)) if ok else 1e-3
    batch = 8
    work = Workload(times.tolist(), strict, batch, [answer_s] * batch, slo_s)
    cfg = p.cluster(spot_launch_s=launch_s, on_demand_launch_s=launch_s)
    # the real trace starts once the first node serves (LocalCluster.start waits for it); the
    # simulator's first node serves after the mean launch time, which may be the later of the two
    start = max(start, launch_s)
    sim_side, sim_raw = _sim_side(cfg, work, p.seed, start)
    ref_side, _ = _sim_side(dataclasses.replace(cfg, procurement=ProcurementPolicy.ON_DEMAND_ONLY), work, p.seed,
                            start)
    reference = ref_side.bill.summary(ref_side.end)["dollars"]
    fig_sim, fig_real = figures(sim_side, reference), figures(real_side, reference)
    rows = compare(fig_sim, fig_real)
    agree = agreement(fig_sim, fig_real)
    status = real["status"]
    result = {
        "model": p.models[0], "requests": len(times), "cluster": {k: str(v) if isinstance(v, str) else v
                                                                  for k, v in dataclasses.asdict(cfg).items()},
        "calibration": {"trace_start_s": start, "launch_s": launch_s, "answer_s": answer_s,
                        "reference_on_demand_only_dollars": reference},
        "sim": fig_sim, "real": fig_real, "agreement": agree,
        "differences": {k: d for k, _, _, d in rows},
        "notices": {"sim": sim_raw["notice_times"],
                    "real": [(r["node"][:12], r["drained_at"]) for r in status["bill"] if r["drained_at"]]},
        "nodes_over_time": {"sim": sim_side.timeline, "real": real_side.timeline},
        "bill": {"sim": [dataclasses.asdict(r) | {"market": str(r.market)} for r in sim_side.bill.records()],
                 "real": [dataclasses.asdict(r) | {"market": str(r.market)} for r in real_side.bill.records()]},
        "gateway": {k: real["gateway"].get(k) for k in ("delivered", "resent", "dropped", "answers_by_node")},
        # (seconds on the run's clock, latency ms or the error): where the real run missed
        "real_strict_misses": [(round(real["result"].origin - t0 + s.scheduled, 2),
                                round(s.latency * 1e3, 1) if s.ok else s.error)
                               for s in real["result"].samples if s.cls == "rt" and not (s.ok and s.latency <= slo_s)],
    }
    if real["result"].generator_bottleneck:
        ctx.notes.append(f"load generator: {real['result'].bottleneck_reason}")
    broken = [f"{who}: {f['lost']} requests lost" for who, f in (("sim", fig_sim), ("real", fig_real)) if f["lost"]]
    return ScenarioOutput(result, _report(p, result, rows), {"nodes": _plot(sim_side.timeline, real_side.timeline)},
                          _lines(rows, agree), broken)


def _cell(v: Any) -> str:
    return "-" if v is None else fmt(v, 3) if isinstance(v, float) else str(v)


def _report(p: Params, r: dict[str, Any], rows: list[tuple[str, Any, Any, Any]]) -> str:
    c = r["calibration"]
    out = [report_intro(__doc__), "",
           f"{r['requests']:,} {r['model']} calls over {p.duration_s:g} s ({p.rate_rps:g} req/s mean, "
           f"{p.strict_share:g} strict, SLO {p.slo_ms:g} ms); {p.procurement}, {p.min_nodes}-{p.max_nodes} nodes, "
           f"P_rev {p.p_rev:g} per {p.revocation_interval_s:g} s, notices {p.notice_min_s:g}-{p.notice_max_s:g} s, "
           f"seed {p.seed}.", "",
           f"Calibration from the real run: the trace began {c['trace_start_s']:.1f} s after the first node's "
           f"request; a node served {c['launch_s']:.1f} s after its request (mean); median answer "
           f"{c['answer_s'] * 1e3:.2f} ms. Cost normalised to a simulated on-demand-only run of the trace "
           f"(${c['reference_on_demand_only_dollars']:.4f}).", "",
           md_table(("figure", "simulated", "real", "real - simulated"),
                    [(k, _cell(s), _cell(x), _cell(d)) for k, s, x, d in rows]), "",
           "Agreement (design note §5.3: compliance within "
           f"{COMPLIANCE_POINTS:g} points, normalised cost within {COST_FRACTION:.0%}): "
           + ", ".join(f"{k} {'yes' if v else 'no' if v is not None else '-'}" for k, v in r["agreement"].items()),
           "", f"Notices (sim: at, deadline): {r['notices']['sim']}; real (node, drained at): {r['notices']['real']}",
           ""]
    return "\n".join(out)


def _lines(rows: list[tuple[str, Any, Any, Any]], agree: dict[str, bool | None]) -> list[str]:
    keep = ("notices", "evictions", "lost", "strict SLO compliance %", "cost / on-demand-only", "mean billed nodes")
    return [f"{k}: sim {_cell(s)}, real {_cell(x)}" for k, s, x, _ in rows if k in keep] + [
        "agreement: " + ", ".join(f"{k} {v}" for k, v in agree.items())]


def _plot(sim: Sequence[tuple[float, int, int]], real: Sequence[tuple[float, int, int]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.subplots()
    for name, tl, style in (("sim", sim, "-"), ("real", real, "--")):
        if not tl:
            continue
        ts = [t for t, _, _ in tl]
        ax.step(ts, [s for _, s, _ in tl], style, where="post", color="#2b7bba", label=f"{name}: serving")
        ax.step(ts, [b for _, _, b in tl], style, where="post", color="#d62728", label=f"{name}: billed")
    ax.set_xlabel("seconds after the first node's request")
    ax.set_ylabel("nodes")
    ax.legend(fontsize="small")
    ax.set_title("Nodes over time: simulator vs a real local Ray cluster", fontsize=9)
    fig.tight_layout()
    return fig
