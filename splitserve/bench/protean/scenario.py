"""protean: PROTEAN's evaluation on one node (PROTEAN §5-6, Fig. 5/6/8/11/13/15, §4.2).

Every scheme (``protean``, ``naive``, ``colocate``, ``timeshare``, ``smart-static``,
``protean-no-keepalive``, ``protean-no-wait``, ``protean-be-spill``) is a set of ``ServerConfig`` overrides (``schemes.SCHEMES``) on a
server of its own, and every server gets the identical arrival list: a Wikipedia-like
(peak:mean 316:303) or Twitter-like (4561:2969) trace, or a CSV file, with half the requests
strict (``rt``) for one model and half best-effort for a model that switches every
``switch_s`` seconds. The strict model is profiled first (L[threads, batch] at its batch, the
store Packrat uses); its solo latency on the whole node at the batch, times ``slo_multiplier``,
is the SLO each strict request carries (``slo_ms``), and the same profile gives the solo time
on each partition for the p99 breakdown. The node's capacity is measured on the first
scheme's server, before its run, by ``capacity_rounds`` closed loops of ``2 × batch`` clients
per model (models interleaved, each loop's warm-up left out), each model's capacity their
median; the mix's capacity is the harmonic combination of those, and the trace is scaled to
``load`` of it. ``trace=onoff`` is on/off bursts over a base rate (the keep-alive comparison).
Compliance is computed from end-to-end latency measured from each request's arrival time in
the trace (client queueing counts) and cross-checked with the server's
``splitserve_slo_requests_total``. ``scenario=crowded`` sends more strict work than one
partition serves, so smart-static's largest partition is crowded, and compares ``protean``
with ``smart-static`` (the η ablation) and with ``protean-no-wait`` (Algorithm 1 without
splitserve's waits: a strict batch's wait-for-free and a BE batch's keeping off strict work).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench import traces
from splitserve.bench.arrivals import Arrival, from_rate_trace
from splitserve.bench.ownserver import EVENT_LIMIT, fetch_events, get_json, own_server, server_now
from splitserve.bench.protean import analysis, report
from splitserve.bench.protean.load import TraceJob, capacity, drive
from splitserve.bench.protean.schemes import REFERENCE, SCHEMES, check_schemes, server_env, settings_problems
from splitserve.bench.scenarios.base import Context, ScenarioOutput, report_intro, write_repository
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.transports import Target
from splitserve.bench.validate import Expected
from splitserve.protean.node_partitions import parse_geometry

NAME = "protean"
SUMMARY = ("PROTEAN on one node: strict SLO compliance, p99 breakdown, SLO-crossing percentile, BE tail and cold "
           "starts for protean vs naive, colocate, timeshare and smart-static on identical Wikipedia- or "
           "Twitter-like arrivals (PROTEAN Fig. 5/6/8/11/13/15).")
MODELS: tuple[str, ...] = ("resnet152", "densenet201", "vgg19", "inception_v3", "distilbert", "resnet18", "lenet")
TRANSPORTS: tuple[str, ...] = ("tcp", "unix")
TRACES: tuple[str, ...] = ("wiki", "twitter", "onoff")  # or the path of a CSV trace (time,rate or time,model,class)
SETTINGS: tuple[str, ...] = ("mix", "crowded")


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("resnet152", "densenet201", "vgg19", "distilbert")  # the strict one, then BE ones
    transports: tuple[str, ...] = ("tcp",)
    scenario: str = "mix"  # mix: the 50/50 evaluation; crowded: the large partition is crowded (eta ablation)
    schemes: tuple[str, ...] = ("protean", "naive", "colocate", "timeshare", "smart-static", "protean-no-keepalive")
    trace: str = "wiki"  # wiki | twitter | onoff | a CSV file
    burst_peak: float = 3.0  # onoff: a burst's rate over the mean (bursts of burst_s every burst_period_s)
    burst_period_s: float = 12.0  # onoff: one burst per period, after a gap (longer than a no-keep-alive retirement)
    burst_s: float = 2.0  # onoff: how long a burst lasts
    duration_s: float = 40.0  # of the trace, per scheme
    warmup_s: float = 4.0  # left out of every number
    load: float = 0.7  # offered load as a fraction of the node's measured capacity for the mix
    strict_share: float = 0.5  # PROTEAN §5: 50/50 strict/BE (crowded: 0.75)
    switch_s: float = 20.0  # PROTEAN §5: the BE model changes every ~20 s
    batch: int = 4  # max_batch_size of every model (PROTEAN picks batches with 50-200 ms on 7g)
    slo_multiplier: float = 3.0  # PROTEAN §5: SLO = 3x solo at the batch on the whole device (Fig. 15: 2)
    geometry: str = ""  # static partition core counts for every server ("1,1"); empty: the server's own
    capacity_s: float = 1.0  # measured seconds of each closed loop of the capacity measurement
    capacity_rounds: int = 3  # closed loops per model, models interleaved; each model's capacity is their median
    capacity_warmup_s: float = 0.5  # seconds at the start of every capacity loop left out (all clients send at once)
    connections: int = 8  # fast-path connections of the generator
    queue_slots: int = 1024  # per model and class: room for a burst of the open loop (bounded)
    budget_s: float = 1.0  # profiler: most seconds per (threads, batch) point
    profile_dir: str = ""  # profile store; empty: <out>/.packrat-profiles (shared with bench packrat)
    reprofile: bool = False  # measure the profile again even if the store has it
    fbr_cores: int = 1  # cores of the partition the co-location runs that fit the FBRs share (0: none run)
    keep_samples: int = 5000  # strict latencies kept per scheme in result.json (for the CDF)

    def check(self) -> None:
        check_schemes(self.schemes)
        if self.scenario not in SETTINGS:
            raise ValueError(f"scenario must be one of {', '.join(SETTINGS)}, got {self.scenario!r}")
        if self.trace not in TRACES and not Path(self.trace).is_file():
            raise ValueError(f"trace must be one of {', '.join(TRACES)} or a CSV file, got {self.trace!r}")
        if len(self.models) < 2:
            raise ValueError("models: name the strict model, then at least one best-effort model")
        if not 0 < self.load <= 5:
            raise ValueError(f"load must be a fraction of capacity in (0, 5], got {self.load}")
        if self.duration_s <= self.warmup_s:
            raise ValueError("duration_s must be longer than warmup_s")
        if self.batch < 1 or self.slo_multiplier <= 0 or self.switch_s <= 0:
            raise ValueError("batch, slo_multiplier and switch_s must be positive")
        if self.capacity_rounds < 1 or self.capacity_s <= 0 or self.capacity_warmup_s < 0:
            raise ValueError("capacity_rounds and capacity_s must be positive, capacity_warmup_s at least 0")

    @classmethod
    def quick(cls) -> Params:
        return cls(models=("resnet152", "vgg19", "distilbert"), schemes=("protean", "timeshare"), duration_s=15.0,
                   warmup_s=2.0, switch_s=5.0, capacity_rounds=1, budget_s=0.5, connections=4)

    def resolved(self) -> Params:
        """The parameters the chosen ``scenario`` runs with: crowded defaults to mostly strict
        load (strict_share 0.75) at 0.6 of capacity, more strict work than one partition
        serves, so smart-static's largest partition is crowded (by strict batches: on a node
        of equal partitions best effort never shares it), and protean vs smart-static and
        protean-no-wait (what was not set)."""
        if self.scenario != "crowded":
            return self
        import dataclasses

        default = Params()
        change: dict[str, Any] = {}
        if self.strict_share == default.strict_share:
            change["strict_share"] = 0.75
        if self.load == default.load:
            change["load"] = 0.6
        if self.schemes in (default.schemes, Params.quick().schemes):
            change["schemes"] = ("protean", "smart-static", "protean-no-wait")
        return dataclasses.replace(self, **change)


# Parameters the paper does not give, recorded with their values in every result.json.
NOT_GIVEN = {
    "batch_timeout": "none: work-conserving batching (a free instance takes what waits, up to the batch)",
    "latency_origin": "the request's arrival time in the trace (client queueing counts)",
    "be_switch": "uniform among the BE models, never the same one twice in a row",
    "strict_share_draw": "exactly round(share x n) arrivals, chosen at random",
    "capacity": "median of capacity_rounds closed loops of 2 x batch clients per model (models interleaved, "
                "capacity_warmup_s of each left out) on the first scheme's server, harmonic mix",
    "solo": "the stored L[threads, batch] profile of the strict model (isolated, pinned process); solo on c "
            "cores is the best of L[t, batch] for t <= c",
    "p99_breakdown": "each part's share of the mean latency of requests at or above p99, applied to p99",
    "request_to_batch": "the latest batch of the model done before the reply arrived (server clock)",
}


def _arrivals(p: Params, mean_rate: float, strict: str, bes: Sequence[str]) -> tuple[list[Arrival], dict[str, Any]]:
    """The run's arrival list at ``mean_rate`` req/s, and what it was made of."""
    rng = np.random.default_rng(p.seed)
    if p.trace in TRACES:
        if p.trace == "onoff":
            points = traces.on_off_like(p.duration_s, mean_rate, rng, p.burst_peak, p.burst_period_s, p.burst_s)
        else:
            points = (traces.wiki_like if p.trace == "wiki" else traces.twitter_like)(p.duration_s, mean_rate, rng)
        times = from_rate_trace(points, p.duration_s, rng)
        info = {"kind": p.trace, "peak_to_mean": traces.peak_to_mean_of(points, p.duration_s)}
        if p.trace == "onoff":  # when each burst ran, to set the autoscaler's resizes against
            ends = [t for t, _ in points[1:]] + [p.duration_s]
            info["bursts_s"] = [[t, min(end, p.duration_s)] for (t, r), end in zip(points, ends) if r > points[0][1]]
    else:
        csv = traces.load_csv(p.trace)
        if csv.kind == "arrivals":  # replayed as written: models and classes are the file's
            return [a for a in csv.arrivals if a.t < p.duration_s], {"kind": "csv-arrivals", "file": p.trace}
        end = max(t for t, _ in csv.rates) or p.duration_s
        raw_mean = traces.mean_rate_of(csv.rates, end)
        scale = mean_rate / raw_mean if raw_mean > 0 else 0.0
        points = [(t * p.duration_s / end, r * scale) for t, r in csv.rates]
        times = from_rate_trace(points, p.duration_s, rng)
        info = {"kind": "csv-rate", "file": p.trace, "peak_to_mean": traces.peak_to_mean_of(points, p.duration_s)}
    schedule = traces.switch_schedule(p.duration_s, p.switch_s, list(bes), rng)
    info |= {"mean_rate_rps": mean_rate, "be_schedule": schedule}
    return traces.strict_be_mix(times, strict, schedule, p.strict_share, rng), info


def _text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:  # loopback, our own server
            return r.read().decode()
    except (urllib.error.URLError, OSError):
        return None


def _partition_cores(doc: Any) -> dict[int, int]:
    """Partition id -> cores, from ``GET /v2/partitions`` (contract: id, cpus per partition)."""
    rows = doc.get("partitions", []) if isinstance(doc, Mapping) else doc if isinstance(doc, list) else []
    return {int(r["id"]): len(r["cpus"]) for r in rows if isinstance(r, Mapping) and "id" in r and "cpus" in r}


def _find(doc: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a JSON document (None when absent)."""
    if isinstance(doc, Mapping):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for v in doc:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def _cold_starts(partitions: Any, metrics: str | None) -> dict[str, Any]:
    """Cold starts as the server reports them: ``cold_starts`` in /v2/partitions and every
    ``*cold_start*`` counter in /metrics (None where the server has neither)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics or ""):
        if "cold_start" in family.name:
            for s in family.samples:
                if s.name.endswith("_total"):
                    counters[s.name] = counters.get(s.name, 0.0) + float(s.value)
    found = _find(partitions, "cold_starts")
    total = sum(found.values()) if isinstance(found, Mapping) else found
    return {"partitions": found, "metrics": counters or None,
            "total": total if total is not None else (sum(counters.values()) if counters else None)}


def ensure_fbrs(ctx: Context, p: Params, store: Path) -> dict[str, Any]:
    """Every model's fitted FBR (kind ``fbr``) in the profile ``store``: co-location runs of
    the strict model with each best-effort one, itself and all of them on ``fbr_cores`` cores
    (``splitserve profile STRICT --colocate BE...``), measured where the store lacks a fit.
    Returns model -> the stored fit (``FbrFit.to_dict()``), absent for a model with none."""
    import subprocess
    import sys

    from splitserve.placement.profiler import machine_id
    from splitserve.registry import Registry

    def stored() -> dict[str, Any]:
        reg = Registry(store)
        try:
            return {m: d for m in p.models if (d := reg.load_profile(m, machine_id(), "fbr")) is not None}
        finally:
            reg.close()

    have = {} if p.reprofile else stored()
    if p.fbr_cores < 1 or len(have) == len(p.models):
        if have:
            ctx.notes.append(f"FBRs of {', '.join(have)} reused from {store}")
        return have
    cmd = [sys.executable, "-m", "splitserve", "profile", p.models[0], *(a for m in p.models[1:] for a in
           ("--colocate", m)), "--cores", str(p.fbr_cores), "--batch", str(p.batch), "--data-dir", str(store),
           "--budget-s", str(p.budget_s)]
    with ctx.task(f"co-locating {', '.join(p.models)} on {p.fbr_cores} cores (FBRs)", 1):
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    (ctx.results.path / "profile-colocate.log").write_text(" ".join(cmd) + "\n\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return stored()


def fbr_summary(fits: Mapping[str, Any], models: Sequence[str]) -> dict[str, Any]:
    """Per model: its FBR as the node reads it (None: unidentified or never fitted), and the
    fit's keys, residuals and equation count."""
    from splitserve.placement.profiler import fbr_of
    from splitserve.protean.slowdown import FbrFit

    out: dict[str, Any] = {}
    for m in models:
        fit = FbrFit.from_dict(fits[m]) if m in fits else None
        out[m] = {"fbr": fbr_of(fit, m) if fit else None,
                  "unidentified": [k for k in fit.unidentified if k.split("@")[0] == m] if fit else None,
                  "equations": fit.equations if fit else 0,
                  "residuals": {k: v for k, v in fit.residuals.items()} if fit else {}}
    return out


def scheme_numbers(result: Any, offset: float, events: Sequence[Mapping[str, Any]], cores: Mapping[int, int],
                   solo: Any, whole: int, slo_s: float, p: Params, strict: str) -> dict[str, Any]:
    """Every number of one scheme's run (samples scheduled before warm-up are left out)."""
    kept = [s for s in result.samples if s.scheduled >= p.warmup_s]
    rt = [s for s in kept if s.cls == "rt"]
    be = [s for s in kept if s.cls == "be"]
    rt_ok = [s for s in rt if s.ok]
    lat = [s.latency for s in rt_ok]
    errors = len(rt) - len(rt_ok)
    batches = analysis.batch_partitions(events, strict)
    samples = [analysis.StrictSample(s.latency, s.server_compute_s or 0.0,
                                     cores.get(analysis.partition_of(s.done + offset, batches), whole))
               for s in rt_ok]
    share = analysis.compliance(lat, errors, slo_s)
    d = analysis.dist_ms(lat)
    bd = analysis.tail_breakdown(samples, solo, whole)
    used: dict[str, int] = {}
    for _, part in batches:
        used[str(part)] = used.get(str(part), 0) + 1
    be_ok = [s.latency for s in be if s.ok]
    failed = Counter(f"{s.cls}: {s.error}" for s in kept if not s.ok)
    return {
        "strict": {"requests": len(rt), "errors": errors, "compliance": share,
                   "violations": None if share is None else round((1 - share) * len(rt)),
                   "p50_ms": d["p50"], "p99_ms": d["p99"], "max_ms": d["max"],
                   "crossing_percentile": analysis.crossing_percentile(lat, errors, slo_s)},
        "strict_p99_breakdown_ms": {k: v * 1e3 for k, v in bd.items()} if bd else None,
        "strict_batches_by_partition": used,
        "be": {"requests": len(be), "errors": len(be) - len(be_ok), **analysis.dist_ms(be_ok)},
        "error_messages": dict(failed.most_common(5)),
        "generator_bottleneck": result.bottleneck_reason if result.generator_bottleneck else None,
        "strict_latency_ms": sorted(v * 1e3 for v in lat)[:: max(1, len(lat) // max(1, p.keep_samples))],
    }


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.bench.scenarios.packrat import ensure_profile
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    if ctx.urls:
        raise ValueError("protean starts one server per scheme with its own settings; it cannot measure a running "
                         "server (--url)")
    strict, bes = p.models[0], tuple(p.models[1:])
    for m in p.models:
        if p.batch > zoo_entry(m).max_batch:
            raise ValueError(f"batch {p.batch}: {m} takes at most {zoo_entry(m).max_batch} samples per batch")
    whole = len(os.sched_getaffinity(0))
    prof, _ = ensure_profile(ctx, strict, whole, [p.batch])
    fits = ensure_fbrs(ctx, p, Path(p.profile_dir) if p.profile_dir else ctx.results.path.parent / ".packrat-profiles")

    def solo(cores: int) -> float:
        """Solo seconds of a batch on ``cores`` cores: the best of the profiled thread counts
        up to that (a model alone on a partition runs with whatever count is fastest there;
        on a busy host more threads than free cores are slower, not faster)."""
        return min(prof.latency.latency(t, p.batch) for t in range(1, max(1, min(cores, whole)) + 1))

    slo_s = p.slo_multiplier * solo(whole)
    repo = write_repository(ctx.results.path / "repository", {
        m: {"max_batch_size": p.batch, "instances": 1, "threads": whole, "queue_slots": p.queue_slots,
            "default_class": "rt" if m == strict else "be", "artifact": {"kind": "zoo", "arch": m}}
        for m in p.models})

    def prepare(data: Path) -> None:  # the strict model's profile and every fitted FBR, for the servers' eta
        from splitserve.placement.profiler import machine_id, save_profile
        from splitserve.registry import Registry

        reg = Registry(data)
        try:
            save_profile(reg, prof)
            for m, fit in fits.items():
                reg.save_profile(m, machine_id(), "fbr", fit)
        finally:
            reg.close()

    specs = {m: tuple(s.to_dict() for s in zoo_entry(m).inputs) for m in p.models}
    shares = {strict: p.strict_share, **{b: (1 - p.strict_share) / len(bes) for b in bes}}
    caps: dict[str, Any] = {}
    arrivals: list[Arrival] = []
    trace_info: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    servers: dict[str, dict[str, Any]] = {}
    truncated = False
    schemes = check_schemes(p.schemes)
    for scheme in schemes:
        overrides = dict(SCHEMES[scheme])
        if p.geometry and overrides["partitioning"] != "colocate":  # colocate is every core in one partition
            overrides["geometry"] = p.geometry
        args = ["--repository", str(repo)] + [a for m in p.models for a in ("--load", m)]
        with own_server(ctx, scheme, args, prepare, env=server_env(overrides)) as server:
            target = Target(server.urls)
            url, http = target.url(p.transports[0]), server.urls["http"]
            ctx.validate(target, {m: Expected(m) for m in p.models}, p.transports[:1])
            if not caps:
                loops: dict[str, list[dict[str, Any]]] = {m: [] for m in p.models}
                began = time.perf_counter()
                with ctx.task(f"{scheme}: capacity of each model", p.capacity_rounds * len(p.models)) as advance:
                    for _ in range(p.capacity_rounds):
                        for m in p.models:
                            loops[m].append(capacity(url, m, specs[m], p.batch, p.capacity_s, p.seed,
                                                     p.transports[0], p.capacity_warmup_s))
                            advance(1)
                steady = analysis.steady_capacity({m: [c["rps"] for c in v] for m, v in loops.items()}, shares)
                mix = steady["mix_rps"]
                caps = {m: {"rps": steady["rps"][m], "loops": v} for m, v in loops.items()}
                caps |= {"mix_rps": mix, "mix_rps_by_round": steady["mix_rps_by_round"], "measured_on": scheme,
                         "took_s": time.perf_counter() - began}
                arrivals, trace_info = _arrivals(p, p.load * mix, strict, bes)
            job = TraceJob(url, tuple(specs.items()), tuple(arrivals), slo_s * 1e3, p.connections,
                           max(30.0, p.duration_s), p.seed, transport=p.transports[0])
            with ctx.task(f"{scheme}: {len(arrivals)} requests over {p.duration_s:g} s", 1):
                t0 = server_now(http)
                result, offset = drive(job)
            time.sleep(0.2)  # let the last done events land in the log
            events, more = fetch_events(http, t0)
            truncated |= more
            try:
                partitions = get_json(f"{http}/v2/partitions")
            except (urllib.error.URLError, OSError, ValueError):
                partitions = None
            rules = get_json(f"{http}/v2/scheduler/events?since=1e18&limit=1") | {"events": events}
            wrong = settings_problems(scheme, overrides, partitions, rules,
                                      parse_geometry(overrides["geometry"]) if "geometry" in overrides else ())
            if wrong:
                raise RuntimeError("a server did not run its scheme's settings, so its numbers would not be the "
                                   "scheme's:\n" + "\n".join(wrong))
            metrics = _text(f"{http}/metrics")
            m = scheme_numbers(result, offset, events, _partition_cores(partitions), solo, whole, slo_s, p, strict)
            slo = analysis.prom_counter(metrics or "", "splitserve_slo_requests", {"model": strict, "class": "rt"})
            m["server_slo"] = slo or None
            m["cold_starts"] = _cold_starts(partitions, metrics)
            resizes = partitions.get("resizes", []) if isinstance(partitions, Mapping) else []
            m["instances"] = {
                "retired": sum((_find(partitions, "retired") or {}).values()), "resizes": len(resizes),
                "by_burst": analysis.resizes_by_burst(resizes, trace_info["bursts_s"], offset)
                if "bursts_s" in trace_info else None,
                "timeline": [{"model": r["model"], "from": r["from"], "to": r["to"], "at_s": r["asked_at"] - offset,
                              "took_s": None if r["done_at"] is None else r["done_at"] - r["asked_at"]}
                             for r in resizes]}  # at_s: trace time the resize was asked at
            m["partitions"] = partitions
            runs[scheme] = m
            servers[scheme] = {"overrides": overrides}
    if truncated:
        ctx.notes.append(f"a run logged more than {EVENT_LIMIT} scheduler events; only the last were analysed")
    result = {
        "setting": p.scenario, "strict_model": strict, "be_models": list(bes), "whole_cores": whole,
        "slo_ms": slo_s * 1e3, "solo_ms": {c: solo(c) * 1e3 for c in range(1, whole + 1)},
        "fbr": fbr_summary(fits, p.models), "fbr_cores": p.fbr_cores,
        "capacity": caps, "trace": trace_info, "offered_rps": trace_info.get("mean_rate_rps"),
        "requests": len(arrivals), "schemes": servers, "not_given": NOT_GIVEN,
        "runs": runs, "ratios": analysis.ratios(runs, REFERENCE),
    }
    lines, markdown = report.markdown(report_intro(__doc__), p, result)
    return ScenarioOutput(result, markdown, report.figures(result), lines)
