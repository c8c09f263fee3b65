"""packrat: Packrat's ⟨instances, threads, batch⟩ choice vs one fat instance (Packrat Fig. 4, 5, 6).

The model is profiled first (L[t, b] for every thread count 1..T and each batch size B), in a
profile store that outlives the run, so a later run on the same machine reuses it. Then, for
each B, one server serves two variants on the same T CPUs: the fat instance (fixed placement,
one instance with T threads) and Packrat's choice (packrat placement, non-adaptive, batch B,
T threads). Both aggregate B single-sample requests (or whatever came within ``timeout_ms``)
into one batch; Packrat splits it over its instances. The batch latency is measured by sending
B requests at once from one client and timing until the last answer (repeated ``reps``
times); throughput by a closed loop of 2B clients. Expected values come from the profile:
the plan's latency and the fat instance's profiled latency at (T, B).

The timeline starts an adaptive Packrat server (batch B starts at the smallest size, a short
``reconfig_timeout_s``) and offers open-loop Poisson load in steps: low, high, low (by default
0.2, 0.9 and 0.2 times the closed-loop peak measured for that starting configuration). Latency is
windowed on the client's clock; every reconfiguration the server records (its ``switched_at``
on the server's clock) is mapped onto the client's clock through the ``now`` the placement
endpoint returns. Every request must be answered: requests the server refused (answered with an
error, e.g. a full queue) and requests never answered (lost) are counted apart.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.arrivals import from_rate_trace, to_arrivals
from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.bench.jobs import OpenLoopJob, run_open_loop
from splitserve.bench.loadgen import run_in_processes
from splitserve.bench.ownserver import get_json, own_server
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro, write_repository
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.scenarios.trace import windowed
from splitserve.bench.timing import bottleneck, closed_loop_run, workload
from splitserve.bench.transports import Target, close_sync, open_sync
from splitserve.bench.validate import Expected

NAME = "packrat"
SUMMARY = "Profile, then Packrat's <instances, threads, batch> vs one fat instance per batch size, expected " \
          "vs measured; adaptive reconfiguration under a load step (Packrat Fig. 4/5/6)."
MODELS: tuple[str, ...] = ("lenet", "resnet18", "resnet50", "resnet18_imagenet", "resnet50_imagenet", "lstm",
                           "bert_tiny", "vgg19", "resnet152", "densenet201", "inception_v3", "distilbert",
                           "matmul8k", "vecadd1k")
TRANSPORTS: tuple[str, ...] = ("tcp", "unix")
COLOURS = {"fat": "#ff7f0e", "packrat": "#2b7bba"}
SETTLE_S = 15.0  # after the timeline's load: most seconds to wait for a reconfiguration in flight


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("resnet18",)
    transports: tuple[str, ...] = ("tcp",)
    threads: tuple[int, ...] = ()  # T is the largest (default: every usable CPU); 1..T are all profiled
    batches: tuple[int, ...] = ()  # batch sizes B (default: powers of two up to the model's max batch)
    reps: int = 30  # measured batches per variant and B
    warmup: int = 3  # unmeasured batches before them
    closed_s: float = 5.0  # closed-loop run (2B clients) per variant and B; 0: skip
    timeout_ms: float = 5.0  # batch aggregation timeout, both variants
    budget_s: float = 2.0  # profiler: most seconds per (threads, batch) point
    profile_dir: str = ""  # profile store; empty: <out>/.packrat-profiles (kept between runs)
    reprofile: bool = False  # measure again even if the store has every point
    timeline: bool = True
    step_rates: tuple[float, ...] = ()  # req/s per step; empty: step_fractions x the starting B's peak
    step_fractions: tuple[float, ...] = (0.2, 0.9, 0.2)  # of the closed-loop peak at the smallest B
    step_s: float = 20.0
    reconfig_timeout_s: float = 5.0
    window_s: float = 0.5  # timeline latency window
    connections: int = 4  # timeline generator connections

    def __post_init__(self) -> None:
        # user mistakes are refused here, before a results folder or a server exists
        if any(t < 1 for t in self.threads) or any(b < 1 for b in self.batches):
            raise ValueError(f"threads {list(self.threads)} and batches {list(self.batches)} must all be >= 1")
        if self.reps < 1 or self.warmup < 0 or self.closed_s < 0 or self.timeout_ms < 0:
            raise ValueError("reps must be >= 1; warmup, closed_s and timeout_ms >= 0")
        if self.timeline and (self.step_s <= 0 or not (self.step_rates or self.step_fractions)
                              or min(self.step_rates or self.step_fractions) < 0):
            raise ValueError("the timeline needs step_s > 0 and step rates (or fractions) >= 0")

    @classmethod
    def quick(cls) -> Params:
        return cls(batches=(1, 2, 4, 8), reps=8, warmup=2, closed_s=1.5, budget_s=1.0, step_s=6.0,
                   reconfig_timeout_s=3.0)


# -- profile -------------------------------------------------------------------------------------


def _threads(p: Params) -> int:
    usable = len(os.sched_getaffinity(0))
    T = max(p.threads) if p.threads else usable
    if not 1 <= T <= usable:
        raise ValueError(f"threads: T={T} must be within 1..{usable} (the usable CPUs)")
    return T


def _batches(p: Params, arch: str) -> list[int]:
    from splitserve.models.catalog import zoo_entry
    from splitserve.placement.profiler import default_batches

    top = zoo_entry(arch).max_batch
    bs = sorted(set(p.batches)) if p.batches else default_batches(top)
    if bs[-1] > top:
        raise ValueError(f"batches {bs}: {arch} takes at most {top} samples per batch")
    return bs


def ensure_profile(ctx: Context, arch: str, T: int, batches: list[int]) -> tuple[Any, bool]:
    """The stored profile of ``arch`` with every (t <= T, b in batches) point; measured where
    missing. Returns (ModelProfile, whether anything was measured now).

    Missing thread counts are measured by ``splitserve profile`` in a child process (its output
    is kept as ``profile-<arch>.log``) and merged with what the store already held.
    """
    import subprocess
    import sys

    from splitserve.placement.optimizer import LatencyProfile
    from splitserve.placement.profiler import ModelProfile, load_profile, save_profile
    from splitserve.registry import Registry

    p: Params = ctx.params  # type: ignore[assignment]
    store = Path(p.profile_dir) if p.profile_dir else ctx.results.path.parent / ".packrat-profiles"
    store.mkdir(parents=True, exist_ok=True)
    reg = Registry(store)
    try:
        have = None if p.reprofile else load_profile(reg, arch)
    finally:
        reg.close()
    table = dict(have.latency.table) if have else {}
    segments = dict(have.segments) if have else {}
    missing = sorted({t for t in range(1, T + 1) for b in batches if (t, b) not in table})
    if not missing:
        ctx.notes.append(f"{arch}: every profile point was already in {store}: reused")
        return have, False
    cmd = [sys.executable, "-m", "splitserve", "profile", arch, "--threads", ",".join(map(str, missing)),
           "--batches", ",".join(map(str, batches)), "--data-dir", str(store), "--budget-s", str(p.budget_s)]
    with ctx.task(f"{arch}: profiling threads {missing}, batches {batches}", 1):
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    (ctx.results.path / f"profile-{arch}.log").write_text(" ".join(cmd) + "\n\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    reg = Registry(store)
    try:
        new = load_profile(reg, arch)
        if new is None:
            raise RuntimeError(f"`splitserve profile {arch}` stored no profile in {store}")
        table.update(new.latency.table)
        segments.update(new.segments)
        prof = ModelProfile(LatencyProfile(arch, table), segments, new.machine)
        save_profile(reg, prof)  # the command stored only the thread counts it measured
    finally:
        reg.close()
    ctx.notes.append(f"{arch}: profile store {store} (threads {missing} measured in this run)")
    return prof, True


def _as(prof: Any, name: str, T: int) -> Any:
    """``prof`` restricted to t <= T, stored under the served name ``name``."""
    from splitserve.placement.optimizer import LatencyProfile
    from splitserve.placement.profiler import ModelProfile

    table = {k: v for k, v in prof.latency.table.items() if k[0] <= T}
    return ModelProfile(LatencyProfile(name, table), {k: v for k, v in prof.segments.items() if k[0] <= T},
                        prof.machine)


def _store_profiles(prof: Any, names: list[str], T: int) -> Any:
    """``prepare`` for a server: the profile under each Packrat variant's name in its registry."""
    def prepare(data: Path) -> None:
        from splitserve.placement.profiler import save_profile
        from splitserve.registry import Registry

        reg = Registry(data)
        try:
            for n in names:
                save_profile(reg, _as(prof, n, T))
        finally:
            reg.close()
    return prepare


# -- measurements --------------------------------------------------------------------------------


def batch_latency(client: Any, name: str, samples: list[Any], reps: int, warmup: int) -> dict[str, Any]:
    """Send ``len(samples)`` requests at once, time until the last answer; ``reps`` times."""
    e2e, compute, queue = [], [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        calls = [client.submit(name, x) for x in samples]
        outs = [c.result() for c in calls]
        if i >= warmup:
            e2e.append((time.perf_counter() - t0) * 1e3)
            compute.append(max(o.compute_us for o in outs) / 1e3)
            queue.append(max(o.queue_us for o in outs) / 1e3)
    return {"e2e_ms": _stats(e2e), "compute_ms": _stats(compute), "queue_ms": _stats(queue)}


def _stats(v: list[float]) -> dict[str, float | None]:
    if not v:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(np.mean(v)), "p50": float(np.median(v)), "p99": float(np.percentile(v, 99))}


def variants(arch: str, T: int, batches: list[int], timeout_ms: float, cpus: list[int]) -> dict[str, dict[str, Any]]:
    """Per B: ``<arch>_fat_b<B>`` (one instance, T threads on ``cpus``) and ``<arch>_pk_b<B>``."""
    out: dict[str, dict[str, Any]] = {}
    for b in batches:
        art = {"kind": "zoo", "arch": arch}
        # Every variant is measured alone, on the same T CPUs: they all ask to share them.
        out[f"{arch}_fat_b{b}"] = {"max_batch_size": b, "instances": 1, "threads": T, "cpus": cpus,
                                   "share_cpus": True,
                                   "batching": {"policy": "timeout", "max_delay_ms": timeout_ms, "preferred_batch": b},
                                   "placement": {"kind": "fixed"}, "artifact": art}
        out[f"{arch}_pk_b{b}"] = {"max_batch_size": b, "artifact": art, "cpus": cpus, "share_cpus": True,
                                  "placement": {"kind": "packrat", "threads": T, "batch": b, "adaptive": False,
                                                "timeout_ms": timeout_ms}}
    return out


def _static(ctx: Context, arch: str, T: int, batches: list[int], prof: Any) -> dict[str, Any]:
    from splitserve.models.catalog import zoo_entry
    from splitserve.placement.optimizer import optimize
    from splitserve.placement.topology import allocate, read_topology

    p: Params = ctx.params  # type: ignore[assignment]
    (cpus,) = allocate([T], read_topology())
    configs = variants(arch, T, batches, p.timeout_ms, cpus)
    repo = write_repository(ctx.results.path / "repository", configs)
    pk = [n for n in configs if "_pk_" in n]
    args = ["--repository", str(repo), "--preemption", "concurrent"] + [a for n in configs for a in ("--load", n)]
    rows: dict[int, dict[str, Any]] = {}
    with own_server(ctx, f"{arch}-static", args, _store_profiles(prof, pk, T)) as server:
        target = Target(server.urls)
        ctx.validate(target, {n: Expected(arch) for n in configs}, p.transports[:1])
        url = target.url(p.transports[0])
        for name in pk:  # what the server actually chose, next to the optimizer's plan
            served = get_json(f"{server.urls['http']}/v2/models/{name}/placement")
            rows[int(name.rsplit("_b", 1)[1])] = {"served": served}
        samples = [as_call_arg(s) for s in make_inputs(zoo_entry(arch).inputs, max(batches), p.seed)]
        with ctx.task(f"{arch}: fat vs packrat per batch size", 2 * len(batches)) as advance:
            for b in batches:
                plan = optimize(prof.latency, T, b)
                row = rows[b]
                row["plan"] = plan.to_dict()
                row["expected"] = {"fat_ms": plan.fat_latency * 1e3, "packrat_ms": plan.latency * 1e3,
                                   "speedup": plan.speedup, "fat_rps": b / plan.fat_latency,
                                   "packrat_rps": b / plan.latency}
                for kind, name in (("fat", f"{arch}_fat_b{b}"), ("packrat", f"{arch}_pk_b{b}")):
                    client = open_sync(p.transports[0], url)
                    try:
                        m = batch_latency(client, name, samples[:b], p.reps, p.warmup)
                    finally:
                        close_sync(client)
                    if p.closed_s > 0:
                        warmup = min(0.3, p.closed_s / 4)
                        res = closed_loop_run(workload(p.transports[0], url, name, arch, p.seed), 2 * b, p.closed_s,
                                              warmup_s=warmup)
                        s = res.summary(warmup_s=warmup)
                        m["closed"] = {"clients": 2 * b, "throughput_rps": s["throughput_rps"], "errors": s["errors"],
                                       "p99_ms": s["latency_ms"]["p99"], "generator_bottleneck": bottleneck(s)}
                    m["batch_rps"] = b / (m["e2e_ms"]["p50"] / 1e3)
                    row[kind] = m
                    advance(1)
                f, k = row["fat"], row["packrat"]
                row["measured"] = {
                    "speedup_e2e": f["e2e_ms"]["p50"] / k["e2e_ms"]["p50"],
                    "speedup_compute": f["compute_ms"]["p50"] / k["compute_ms"]["p50"],
                    "throughput_gain": (k["closed"]["throughput_rps"] or 0) / f["closed"]["throughput_rps"]
                    if "closed" in k and f["closed"]["throughput_rps"] else None,
                }
    return {"T": T, "cpus": cpus, "batches": {str(b): r for b, r in rows.items()}}


def _timeline(ctx: Context, arch: str, T: int, batches: list[int], prof: Any, peak: float) -> dict[str, Any]:
    p: Params = ctx.params  # type: ignore[assignment]
    name = f"{arch}_pk_adaptive"
    cfg = {name: {"max_batch_size": max(batches), "artifact": {"kind": "zoo", "arch": arch},
                  "placement": {"kind": "packrat", "threads": T, "batch": min(batches), "adaptive": True,
                                "timeout_ms": p.timeout_ms, "reconfig_timeout_s": p.reconfig_timeout_s}}}
    repo = write_repository(ctx.results.path / "repository", cfg)
    rates = list(p.step_rates) or [round(f * peak, 1) for f in p.step_fractions]
    duration = p.step_s * len(rates)
    points = [(i * p.step_s, r) for i, r in enumerate(rates)]
    args = ["--repository", str(repo), "--preemption", "concurrent", "--load", name]
    with own_server(ctx, f"{arch}-timeline", args, _store_profiles(prof, [name], T)) as server:
        url, http = Target(server.urls).url(p.transports[0]), server.urls["http"]
        placement = f"{http}/v2/models/{name}/placement"
        before, off0 = _clock(placement)
        times = from_rate_trace(points, duration, np.random.default_rng(p.seed))
        job = OpenLoopJob(workload(p.transports[0], url, name, arch, p.seed), tuple(to_arrivals(times, name)),
                          p.connections, drain_timeout_s=max(10.0, p.step_s))
        with ctx.task(f"{arch}: load steps {rates} req/s, {p.step_s:g} s each", 1):
            result = run_in_processes(run_open_loop, (job,), processes=1, timeout_s=duration + 180)
        # a repack sets the target B when it starts and is recorded when its switch is done:
        # let one still in flight finish (bounded), so the record shows where the load left it
        after, off1 = _clock(placement)
        settle_end = time.monotonic() + SETTLE_S
        while _in_flight(after, before.get("batch")) and time.monotonic() < settle_end:
            time.sleep(0.25)
            after, off1 = _clock(placement)
    offset = (off0 + off1) / 2  # client wall clock - server perf_counter
    reconfigs = [{"t": r["switched_at"] + offset - result.origin, "batch": r.get("batch"), "shapes": r["shapes"],
                  "start_s": r.get("start_s"), "drain_s": r.get("drain_s"), "in_place": r.get("in_place", False)}
                 for r in after["reconfigurations"]]
    s = result.summary()
    windows = max(1, int(round(duration / p.window_s)))
    lost = sum(1 for x in result.samples if not x.ok and _lost(x.error or ""))
    return {"model": name, "rates": rates, "step_s": p.step_s, "duration_s": duration, "requests": s["count"],
            "ok": s["ok"], "errors": s["errors"], "refused": s["errors"] - lost, "lost": lost,
            "error_kinds": s.get("error_kinds", {}),
            "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"],
            "initial": {"batch": before.get("batch"), "instances": before["instances"]},
            "final": {"batch": after.get("batch"), "instances": after["instances"]},
            "reconfigurations": reconfigs, "clock_offset_spread_ms": abs(off1 - off0) * 1e3,
            "in_flight_at_end": _in_flight(after, before.get("batch")),
            "windows": windowed(result, duration, windows), "generator_bottleneck": bottleneck(s)}


def _in_flight(doc: dict[str, Any], initial_batch: int | None) -> bool:
    """Whether a reconfiguration has started (the target B moved) but not switched yet."""
    recs = [r for r in doc.get("reconfigurations", []) if r.get("batch") is not None]
    return doc.get("batch") != (recs[-1]["batch"] if recs else initial_batch)


def _lost(error: str) -> bool:
    """Whether a failed request was never answered (vs answered with an error status)."""
    return error.startswith(("no answer", "ConnectionError", "TimeoutError", "OSError", "ConnectionResetError",
                             "IncompleteReadError"))


def _clock(url: str) -> tuple[dict[str, Any], float]:
    """The placement document and (client wall clock - server clock) at the moment it was made."""
    t0 = time.time()
    doc = get_json(url)
    return doc, (t0 + time.time()) / 2 - doc["now"]


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    if ctx.urls:
        raise ValueError("packrat starts its own servers (profiles, placements); it cannot measure a running "
                         "server (--url)")
    T = _threads(p)
    plan = {arch: _batches(p, arch) for arch in p.models}
    results: dict[str, Any] = {}
    for arch, batches in plan.items():
        prof, measured = ensure_profile(ctx, arch, T, batches)
        r = _static(ctx, arch, T, batches, prof)
        r["profile"] = {"measured_now": measured, "machine": prof.machine,
                        "latency_ms": {f"{t},{b}": v * 1e3 for (t, b), v in sorted(prof.latency.table.items())
                                       if t <= T and b in batches}}
        if p.timeline:
            start = r["batches"][str(min(batches))]["packrat"]  # the adaptive server starts there
            peak = (start.get("closed") or {}).get("throughput_rps") or start["batch_rps"]
            r["timeline"] = _timeline(ctx, arch, T, batches, prof, peak)
        results[arch] = r
    return _output(p, results)


# -- report ---------------------------------------------------------------------------------------


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    figures: dict[str, Any] = {}
    for arch, r in results.items():
        bs = sorted(int(b) for b in r["batches"])
        rows = []
        for b in bs:
            x = r["batches"][str(b)]
            e, m, f, k = x["expected"], x["measured"], x["fat"], x["packrat"]
            shapes = " + ".join(f"{s['count']}x({s['threads']}t, b{s['batch']})" for s in x["plan"]["shapes"])
            served = " + ".join(f"({i['threads']}t, b{i['batch']}, cpus {i['cpus']})"
                                for i in x["served"]["instances"])
            rows.append((b, shapes, served, fmt(e["fat_ms"], 2), fmt(e["packrat_ms"], 2), fmt(e["speedup"], 2, "x"),
                         fmt(f["e2e_ms"]["p50"], 2), fmt(k["e2e_ms"]["p50"], 2), fmt(m["speedup_e2e"], 2, "x"),
                         fmt(f["compute_ms"]["p50"], 2), fmt(k["compute_ms"]["p50"], 2),
                         fmt(m["speedup_compute"], 2, "x"),
                         fmt((f.get("closed") or {}).get("throughput_rps"), 1),
                         fmt((k.get("closed") or {}).get("throughput_rps"), 1), fmt(m["throughput_gain"], 2, "x")))
        prof = r["profile"]["latency_ms"]
        ts = sorted({int(k.split(",")[0]) for k in prof})
        report += [f"## {arch} (T = {r['T']} threads on CPUs {r['cpus']})", "",
                   "Profile, mean batch latency in ms" +
                   (" (measured in this run)" if r["profile"]["measured_now"] else " (reused from the store)") + ":",
                   "", md_table(("threads", *[f"b={b}" for b in bs]),
                                [(t, *[fmt(prof.get(f"{t},{b}"), 2) for b in bs]) for t in ts]), "",
                   "Fat instance vs Packrat per batch size B (E2E: B requests sent at once until the last answer, "
                   "median; compute: the slowest instance's server compute time, median; closed loop: 2B clients):",
                   ""] + ([f"T = {r['T']} is every usable CPU here: the server's front end, the client and the load "
                           "generator run on the model's cores too, so measured throughput falls short of the "
                           "profile's B / L for both variants.", ""] if r["T"] >= len(os.sched_getaffinity(0))
                          else []) + [
                   "", md_table(("B", "plan", "served", "expected fat ms", "expected packrat ms", "expected speedup",
                                 "fat E2E ms", "packrat E2E ms", "E2E speedup", "fat compute ms",
                                 "packrat compute ms", "compute speedup", "fat req/s", "packrat req/s",
                                 "throughput gain"), rows), ""]
        lines.append(f"{arch} T={r['T']}: Packrat over one fat instance, expected / measured E2E / closed-loop "
                     "throughput: " + ", ".join(
                         f"B={b} {fmt(r['batches'][str(b)]['expected']['speedup'], 2, 'x')} / "
                         f"{fmt(r['batches'][str(b)]['measured']['speedup_e2e'], 2, 'x')} / "
                         f"{fmt(r['batches'][str(b)]['measured']['throughput_gain'], 2, 'x')}" for b in bs))
        figures[f"packrat_{arch}"] = _plot_static(arch, r)
        tl = r.get("timeline")
        if tl:
            recs = tl["reconfigurations"]
            report += [f"### {arch}: adaptive timeline", "",
                       f"Open-loop Poisson steps of {tl['rates']} req/s, {tl['step_s']:g} s each, reconfiguration "
                       f"timeout {p.reconfig_timeout_s:g} s. Started at B={tl['initial']['batch']}, ended at "
                       f"B={tl['final']['batch']}" + (" (that reconfiguration had not switched yet)"
                                                      if tl["in_flight_at_end"] else "") + ". Reconfigurations that "
                       f"switched after the load ended ({tl['duration_s']:g} s) were waited for up to {SETTLE_S:g} s."
                       f" {tl['requests']} requests: {tl['ok']} answered, "
                       f"**{tl['refused']} refused** by the server (answered with an error), **{tl['lost']} lost** "
                       f"(never answered); p50 {fmt(tl['p50_ms'], 1)} ms, p99 {fmt(tl['p99_ms'], 1)} ms. "
                       "Reconfiguration times are mapped to the client's clock (two readings "
                       f"{fmt(tl['clock_offset_spread_ms'], 2)} ms apart).", "",
                       md_table(("t (s)", "new B", "shapes (threads, batch)", "in place", "new set ready s", "drain s"),
                                [(fmt(c["t"], 2), c["batch"], c["shapes"], "yes" if c["in_place"] else "",
                                  fmt(c["start_s"], 2), fmt(c["drain_s"], 2)) for c in recs]) if recs else
                       "No reconfiguration happened.", ""]
            if tl["generator_bottleneck"]:
                report += [f"The generator fell behind: {tl['generator_bottleneck']}.", ""]
            if tl["error_kinds"]:
                report += ["Errors: " + "; ".join(f"{k}: {n}" for k, n in tl["error_kinds"].items()) + ".", ""]
            lines.append(f"{arch} timeline: {len(recs)} reconfiguration(s) (B " +
                         " -> ".join(str(b) for b in [tl["initial"]["batch"]] + [c["batch"] for c in recs]) +
                         f"), {tl['requests']} requests, {tl['refused']} refused, {tl['lost']} lost")
            figures[f"packrat_{arch}_timeline"] = _plot_timeline(arch, tl)
    return ScenarioOutput({"models": results}, "\n".join(report), figures, lines)


def _plot_static(arch: str, r: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    bs = sorted(int(b) for b in r["batches"])
    rows = [r["batches"][str(b)] for b in bs]
    fig = Figure(figsize=(10, 3.8))
    lat, tput = fig.subplots(1, 2)
    for kind, key in (("fat", "fat"), ("packrat", "packrat")):
        c = COLOURS[kind]
        lat.plot(bs, [x["expected"][f"{key}_ms"] for x in rows], "--", color=c, label=f"{kind}, expected (profile)")
        lat.plot(bs, [x[kind]["e2e_ms"]["p50"] for x in rows], "-o", ms=3, color=c, label=f"{kind}, measured E2E")
        lat.plot(bs, [x[kind]["compute_ms"]["p50"] for x in rows], ":", marker=".", color=c,
                 label=f"{kind}, measured compute")
        tput.plot(bs, [x["expected"][f"{key}_rps"] for x in rows], "--", color=c, label=f"{kind}, expected (B / L)")
        closed = [(x[kind].get("closed") or {}).get("throughput_rps") for x in rows]
        if any(v is not None for v in closed):
            tput.plot(bs, [v if v is not None else math.nan for v in closed], "-o", ms=3, color=c,
                      label=f"{kind}, measured closed loop")
    for ax in (lat, tput):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch size B")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    lat.set_ylabel("batch latency (ms)")
    tput.set_ylabel("throughput (req/s)")
    lat.set_title(f"{arch}, T={r['T']}: batch latency (Packrat Fig. 4)", fontsize=9)
    tput.set_title(f"{arch}, T={r['T']}: throughput (Packrat Fig. 5)", fontsize=9)
    fig.tight_layout()
    return fig


def _plot_timeline(arch: str, tl: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    mid = [(w["t0"] + w["t1"]) / 2 for w in tl["windows"]]
    xs = [x for i in range(len(tl["rates"])) for x in (i * tl["step_s"], (i + 1) * tl["step_s"])]
    top.plot(xs, [r for r in tl["rates"] for _ in (0, 1)], color="grey", label="offered rate")
    top.plot(mid, [w["rate_rps"] for w in tl["windows"]], "o", ms=3, color="black", label="arrivals per window")
    bottom.plot(mid, [w["p50_ms"] for w in tl["windows"]], "-", color="#9ecae1", label="p50")
    bottom.plot(mid, [w["p99_ms"] for w in tl["windows"]], "-", color="#2b7bba", label="p99")
    for c in tl["reconfigurations"]:
        for ax in (top, bottom):
            ax.axvline(c["t"], color="#d62728", ls="--", lw=1)
        top.annotate(f"B={c['batch']}", (c["t"], 0), xytext=(3, 3), textcoords="offset points", fontsize=8,
                     color="#d62728")
    top.set_ylabel("req/s")
    bottom.set_ylabel("latency per window (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("time (s); dashed: reconfigurations")
    top.set_title(f"{tl['model']}: adaptive Packrat under a load step (Packrat Fig. 6); {tl['refused']} refused, "
                  f"{tl['lost']} lost", fontsize=9)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
