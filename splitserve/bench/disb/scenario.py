"""disb: REEF's DISB workloads under five preemption schemes (REEF §7, Fig. 11, 12, 15b, 16).

Each scheme (``rt-only``, ``seq``, ``concurrent``, ``reef``, ``idle``) gets its own server, started with
``--preemption SCHEME`` and every DISB model loaded. On a CPU node the models must contend for
the same cores for preemption to matter, so every model runs one instance with one thread,
pinned to the same CPU set (``cpus``, default CPU 0). The load generator runs in two separate
processes, pinned to the other CPUs where there are any: one sends the real-time (RT) open-loop
arrivals on schedule, the other runs the best-effort (BE) continuous clients back to back, so
the RT stream is never slowed by the BE clients' work. ``rt-only`` refuses BE requests, so its
runs send the RT stream alone: it is the reference every other scheme is normalised to.

The CPU cannot serve DISB's published rates (100 VGG-19 req/s is several cores' worth), so RT
rates are scaled: by ``rate_scale`` when it is set, otherwise per workload so that the RT stream
needs ``rt_load`` of one core, from each model's compute time measured on the first server.
Preemption latency is the time from the preemption flag being raised to the worker stopping at
a segment boundary (the server's event log); seq's counterpart is the time an RT request waits
in the server's queue. Restore overhead compares how long BE batches that were preempted
actually ran (start or resume to preempted or done, summed) with uninterrupted BE batches of
the same model in the same runs. The one-to-one pairs (Fig. 16) run in reef mode with the BE
model on the RT model's CPU ("shared", preempted) and on another CPU ("padded").
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench import arrivals as arr
from splitserve.bench.arrivals import Arrival
from splitserve.bench.disb import report
from splitserve.bench.disb.run import (
    KEEP,
    ClosedTask,
    DisbJob,
    be_batches,
    busy_share,
    compute_waits,
    dist,
    drive,
    normalised,
    preemptions,
    ratio,
    restore_overhead,
    run_metrics,
)
from splitserve.bench.disb.workload import (
    BUILTIN,
    MODELS,
    Task,
    Workload,
    WorkloadSpec,
    builtin,
    load_workload,
    workload_arrivals,
)
from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.bench.ownserver import EVENT_LIMIT, fetch_events, own_server, server_now
from splitserve.bench.scenarios.base import Context, ScenarioOutput, report_intro, write_repository
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.transports import Target, close_sync, open_sync
from splitserve.bench.validate import Expected
from splitserve.errors import InvalidInput

NAME = "disb"
SUMMARY = "DISB workloads A-E and REAL under rt-only, seq, concurrent, reef and idle: RT latency, throughput, " \
          "preemption latency, restore overhead, padding pairs (REEF Fig. 11/12/15b/16)."
TRANSPORTS: tuple[str, ...] = ("tcp", "unix")
SCHEMES: tuple[str, ...] = report.SCHEMES


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = MODELS  # loaded on every server, besides any model a workload file names
    transports: tuple[str, ...] = ("tcp",)  # the first one carries the load
    workloads: tuple[str, ...] = ()  # built-in A-E, REAL; empty: all six (quick: A, C), none if files are given
    workload_file: tuple[str, ...] = ()  # DISB JSON workload files, run after the built-in ones
    schemes: tuple[str, ...] = SCHEMES
    duration_s: float = 20.0  # per workload and scheme (a file's own "time" is replaced by this)
    warmup_s: float = 1.0  # left out of every number
    rate_scale: float = 0.0  # multiplies every RT rate; 0: per workload, so RT needs rt_load of one core
    rt_load: float = 0.4  # share of one core the RT stream should need when rate_scale is 0
    cpus: tuple[int, ...] = (0,)  # every model's one single-thread instance is pinned to these CPUs
    connections: int = 4  # RT generator connections
    probe_requests: int = 10  # sequential RT requests per model to time its compute (calibration)
    pairs: tuple[str, ...] = ("vgg19:resnet152", "resnet152:densenet201", "densenet201:inception_v3",
                              "inception_v3:distilbert", "distilbert:vgg19")  # RT:BE, reef, Fig. 16
    pair_duration_s: float = 10.0
    cuda_graphs: str = "auto"  # on a GPU (--device cuda): CUDA graphs per batch size, auto | on | off
    # segments launched ahead at most (0: each model's default, 4 on a GPU); 1 is no launch
    # ahead, against which a GPU run measures what the bounded launch-ahead gives
    segment_capacity: int = 0
    pair_cpu: int = 1  # the BE model's CPU in the padded layout

    def __post_init__(self) -> None:
        # user mistakes are refused here, before a results folder or a server exists
        _check(self)
        resolve_workloads(self)

    @classmethod
    def quick(cls) -> Params:
        return cls(duration_s=4.0, warmup_s=0.5, probe_requests=5, pairs=("vgg19:resnet152",), pair_duration_s=3.0)


# -- workloads ----------------------------------------------------------------------------------


def resolve_workloads(p: Params, quick: bool = False) -> list[WorkloadSpec]:
    """The workloads a run will use, every file read and checked before anything starts.

    A malformed file raises ValueError naming the file and the field (``tasks[0].load.type``).
    """
    files: list[WorkloadSpec] = []
    for path in p.workload_file:
        try:
            w = load_workload(path)
        except InvalidInput as e:
            raise ValueError(f"bad DISB workload file: {e.message}") from None
        files.append(WorkloadSpec(w.name or Path(path).stem, workload=w))
    names = [n.upper() for n in p.workloads]
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise ValueError(f"unknown DISB workloads {', '.join(unknown)}; choose from {', '.join(BUILTIN)}")
    if not names and not files:
        names = ["A", "C"] if quick else list(BUILTIN)
    out = [WorkloadSpec(n, builtin=n) for n in names] + files
    labels = [w.label for w in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two workloads share a name ({', '.join(labels)}); give each file its own \"name\"")
    return out


def workload_models(spec: WorkloadSpec) -> set[str]:
    w = spec.workload or builtin(spec.builtin or "A", 1.0)
    return {t.client.model_name for t in w.tasks}


def _called(specs: Sequence[WorkloadSpec], cls: str) -> set[str]:
    """The models tasks of class ``cls`` call."""
    return {t.client.model_name for s in specs for t in (s.workload or builtin(s.builtin or "A", 1.0)).tasks
            if t.cls == cls}


def best_effort_models(specs: Sequence[WorkloadSpec]) -> set[str]:
    """Models only best-effort tasks call: their default class is ``be``, which under
    preemption ``idle`` puts their workers under SCHED_IDLE (every call names its class,
    so no other scheme sees the difference)."""
    return _called(specs, "be") - _called(specs, "rt")


def both_class_models(specs: Sequence[WorkloadSpec]) -> set[str]:
    """Models tasks of both classes call: under preemption ``idle`` each gets a second
    instance kept for its best-effort calls (``be_instances``), under SCHED_IDLE."""
    return _called(specs, "be") & _called(specs, "rt")


def _task_rate(t: Task, duration: float) -> float | None:
    """Requests/s of an RT task's schedule; None for a closed-loop (continuous) one."""
    if t.load.type in ("periodic", "poisson"):
        return t.load.frequency
    if t.load.type == "trace":
        assert t.load.trace is not None
        return sum(1 for ms in t.load.trace if ms < duration * 1e3) / duration
    return None


def rt_core_load(w: Workload, compute_s: Mapping[str, float], scalable: bool) -> float:
    """Share of one core the RT schedule of ``w`` needs: sum of rate x batch x compute time, over
    its periodic and poisson tasks (``scalable``) or its trace tasks (not)."""
    total = 0.0
    for t in w.tasks:
        if t.cls != "rt" or (t.load.type in ("periodic", "poisson")) != scalable:
            continue
        rate = _task_rate(t, w.time)
        if rate:
            total += rate * t.client.batch_size * compute_s.get(t.client.model_name, 0.0)
    return total


def choose_scale(spec: WorkloadSpec, p: Params, compute_s: Mapping[str, float]) -> float:
    """``rate_scale`` if set, else the scale that makes the RT stream need ``rt_load`` of a core.

    Built-in workloads scale every RT schedule (REAL's trace is generated at the scaled rate);
    a file's trace tasks are replayed as written, so only its periodic and poisson tasks make
    up the rest. A workload whose RT work is all closed loop (B) is not scaled.
    """
    if p.rate_scale > 0:
        return p.rate_scale
    if spec.builtin:
        w = builtin(spec.builtin, p.duration_s, 1.0)
        fixed, load = 0.0, rt_core_load(w, compute_s, True) + rt_core_load(w, compute_s, False)
    else:
        assert spec.workload is not None
        w = dataclasses.replace(spec.workload, time=p.duration_s)
        fixed, load = rt_core_load(w, compute_s, False), rt_core_load(w, compute_s, True)
    if load <= 0:
        return 1.0
    return max(p.rt_load - fixed, 0.05 * p.rt_load) / load


def scaled(spec: WorkloadSpec, scale: float, duration: float) -> Workload:
    """The workload to run: a built-in at ``scale``, or a file with its periodic and poisson
    rates times ``scale`` (trace tasks replayed as written) running for ``duration`` s."""
    if spec.builtin:
        return builtin(spec.builtin, duration, scale)
    assert spec.workload is not None
    tasks = tuple(
        dataclasses.replace(t, load=dataclasses.replace(t.load, frequency=t.load.frequency * scale))
        if t.load.frequency is not None else t
        for t in spec.workload.tasks
    )
    return dataclasses.replace(spec.workload, tasks=tasks, time=duration)


def make_job(p: Params, url: str, w: Workload, arrivals: Sequence[Arrival], loaded: Mapping[str, str],
             gen_cpus: Sequence[int], with_be: bool = True) -> DisbJob:
    """The generator job for ``w``; ``loaded`` maps served model names to zoo architectures."""
    from splitserve.models.catalog import zoo_entry

    continuous = [t for t in w.tasks if t.load.type == "continuous"]
    task = lambda t: ClosedTask(t.id, t.client.model_name, t.cls, t.client.batch_size)  # noqa: E731
    used = {a.model for a in arrivals} | {t.client.model_name for t in continuous}
    return DisbJob(
        transport=p.transports[0], url=url,
        inputs=tuple((m, tuple(s.to_dict() for s in zoo_entry(loaded.get(m, m)).inputs)) for m in sorted(used)),
        arrivals=tuple(arrivals),
        batches=tuple((t.id, t.client.batch_size) for t in w.tasks if t.client.batch_size != 1),
        rt_tasks=tuple(task(t) for t in continuous if t.cls == "rt"),
        be_tasks=tuple(task(t) for t in continuous if t.cls == "be") if with_be else (),
        duration_s=w.time, connections=p.connections, drain_timeout_s=max(10.0, w.time), seed=p.seed,
        cpus=tuple(gen_cpus),
    )


# -- the run ------------------------------------------------------------------------------------------


def _check(p: Params) -> tuple[list[tuple[str, str]], list[int]]:
    """Refuse bad parameters before starting anything; the pairs and the usable CPUs."""
    bad = [s for s in p.schemes if s not in SCHEMES]
    if bad:
        raise ValueError(f"unknown schemes {', '.join(bad)}; choose from {', '.join(SCHEMES)}")
    usable = sorted(os.sched_getaffinity(0))
    if not p.cpus or any(c not in usable for c in p.cpus):
        raise ValueError(f"cpus {list(p.cpus)} must be among the usable CPUs {usable}")
    pairs = []
    for text in p.pairs:
        rt, _, be = text.partition(":")
        if not rt or not be or rt not in MODELS or be not in MODELS:
            raise ValueError(f"pair {text!r}: write RT:BE with two of {', '.join(MODELS)}")
        pairs.append((rt, be))
    if p.duration_s <= p.warmup_s or (pairs and p.pair_duration_s <= p.warmup_s):
        raise ValueError("duration_s and pair_duration_s must be longer than warmup_s")
    if not p.transports:
        raise ValueError("give a transport (tcp or unix)")
    return pairs, usable


def _probe(ctx: Context, url: str, models: Mapping[str, str]) -> dict[str, float]:
    """Median server compute time (s) of one RT sample per model, sequential requests."""
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    client = open_sync(p.transports[0], url)
    out = {}
    try:
        for name, arch in models.items():
            x = as_call_arg(make_inputs(zoo_entry(arch).inputs, 1, p.seed)[0])
            times = [client.infer_result(name, x, cls="rt").compute_us for _ in range(max(1, p.probe_requests))]
            out[name] = float(np.median(times)) / 1e6
    finally:
        close_sync(client)
    return out


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    if ctx.urls:
        raise ValueError("disb starts one server per scheme with its own settings; it cannot measure a running "
                         "server (--url)")
    pairs, usable = _check(p)
    specs = resolve_workloads(p, ctx.quick)
    wanted = set(p.models) | {m for s in specs for m in workload_models(s)}
    for m in sorted(wanted):
        zoo_entry(m)  # a file naming an unknown model fails here, before any server starts
    loaded = {m: m for m in sorted(wanted)}
    pad_ok = len(usable) > 1 and p.pair_cpu in usable and p.pair_cpu not in p.cpus
    if pairs and not pad_ok:
        ctx.notes.append(f"the padded layout needs a CPU other than {list(p.cpus)}: pair_cpu {p.pair_cpu} is not "
                         f"usable here (usable: {usable}); only the shared layout was run")
    pads = {f"{be}_pad": be for _, be in pairs} if pad_ok else {}
    gen_cpus = [c for c in usable if c not in p.cpus]
    cfg = {"instances": 1, "threads": 1, "default_class": "rt", "cuda_graphs": p.cuda_graphs,
           **({"segment_capacity": p.segment_capacity} if p.segment_capacity else {})}
    models_cfg = {
        **{m: {**cfg, "cpus": list(p.cpus), "share_cpus": True, "artifact": {"kind": "zoo", "arch": m}}
           for m in loaded},
        **{n: {**cfg, "cpus": [p.pair_cpu], "share_cpus": True, "artifact": {"kind": "zoo", "arch": a}}
           for n, a in pads.items()},
    }
    repo = write_repository(ctx.results.path / "repository", models_cfg, p.device)
    # idle demotes the workers of be models: its own repository, where the models only
    # best-effort tasks call default to be (elsewhere a call naming no class stays rt), and
    # those both classes call have a second instance for their best-effort calls
    be_only, both = best_effort_models(specs), both_class_models(specs)
    idle_repo = write_repository(ctx.results.path / "repository-idle", {
        m: {**c, "default_class": "be"} if m in be_only else
        {**c, "instances": 2, "be_instances": 1} if m in both else c for m, c in models_cfg.items()},
        p.device) if "idle" in p.schemes else repo
    schemes = [s for s in SCHEMES if s in p.schemes]
    if pairs and "reef" not in schemes:
        schemes.append("reef-pairs")  # a reef server for the pairs alone
    compute_s: dict[str, float] = {}
    probes: dict[str, dict[str, float]] = {}
    scales: dict[str, float] = {}
    runs: dict[str, dict[str, Any]] = {s.label: {} for s in specs}
    pair_runs: dict[str, dict[str, Any]] = {}
    truncated = False
    for scheme in schemes:
        mode = "reef" if scheme == "reef-pairs" else scheme
        models = dict(loaded) if scheme != "reef-pairs" else {}
        if mode == "reef":
            models.update({rt: rt for rt, _ in pairs} | {be: be for _, be in pairs} | pads)
        args = ["--repository", str(idle_repo if mode == "idle" else repo), "--preemption", mode] + [a for m in models for a in ("--load", m)]
        with own_server(ctx, scheme, args) as server:
            target = Target(server.urls)
            ctx.validate(target, {m: Expected(a) for m, a in models.items()}, p.transports[:1])
            url, http = target.url(p.transports[0]), server.urls["http"]
            with ctx.task(f"{scheme}: timing each model", 1):
                probes[scheme] = _probe(ctx, url, models)
            if not compute_s:
                compute_s = dict(probes[scheme])
            if scheme != "reef-pairs":
                with ctx.task(f"{scheme}: DISB workloads", len(specs)) as advance:
                    for k, spec in enumerate(specs):
                        scales.setdefault(spec.label, choose_scale(spec, p, compute_s))
                        w = scaled(spec, scales[spec.label], p.duration_s)
                        arrivals, _ = workload_arrivals(w, np.random.default_rng(p.seed + k))
                        job = make_job(p, url, w, arrivals, loaded, gen_cpus, with_be=mode != "rt-only")
                        t0, load0 = server_now(http), os.getloadavg()[0]
                        result = drive(job)
                        time.sleep(0.2)  # let the last done events land
                        events, more = fetch_events(http, t0)
                        truncated |= more
                        m = run_metrics(result, p.duration_s, p.warmup_s)
                        m["loadavg_1min"] = [load0, os.getloadavg()[0]]
                        m["preemption"] = preemptions(events)
                        m["be_batches"] = be_batches(events)
                        m["rt_core_share"] = busy_share(events, "rt")
                        waits = compute_waits(events, "rt")
                        m["rt_start_us"], m["rt_start_samples_us"] = dist(waits), waits[:KEEP]
                        m["rt_requests_scheduled"] = len(arrivals) if arrivals or not job.rt_tasks else None
                        runs[spec.label][scheme] = m
                        advance(1)
            if mode == "reef" and pairs:
                with ctx.task("reef: one-to-one pairs", len(pairs)) as advance:
                    for rt, be in pairs:
                        pair_runs[f"{rt}:{be}"] = _pair(p, url, http, rt, be, pads, compute_s, gen_cpus)
                        advance(1)
    if truncated:
        ctx.notes.append(f"a run logged more than {EVENT_LIMIT} scheduler events; only the last were analysed")
    return _output(p, specs, runs, pair_runs, scales, compute_s, probes, gen_cpus)


def _pair(p: Params, url: str, http: str, rt: str, be: str, pads: Mapping[str, str], compute_s: Mapping[str, float],
          gen_cpus: Sequence[int]) -> dict[str, Any]:
    """RT ``rt`` periodic at ``rt_load`` of a core: alone, beside BE ``be`` on its CPU, and
    beside BE on another CPU (padding)."""
    from splitserve.models.catalog import zoo_entry

    rate = (100.0 * p.rate_scale) if p.rate_scale > 0 else p.rt_load / max(compute_s.get(rt, 0.01), 1e-4)
    times = arr.uniform(rate, p.pair_duration_s)
    arrivals = arr.to_arrivals(times, rt, "rt", f"{rt}_rt")
    layouts = {"alone": None, "shared": be}
    pad = next((n for n, a in pads.items() if a == be), None)
    if pad is not None:
        layouts["padded"] = pad
    out: dict[str, Any] = {"rt_model": rt, "be_model": be, "rate_rps": rate}
    for layout, be_name in layouts.items():
        tasks = (ClosedTask(f"{be}_be", be_name, "be"),) if be_name else ()
        inputs = {rt: rt, **({be_name: be} if be_name else {})}
        job = DisbJob(p.transports[0], url,
                      tuple((n, tuple(s.to_dict() for s in zoo_entry(a).inputs)) for n, a in inputs.items()),
                      tuple(arrivals), (), (), tasks, p.pair_duration_s, p.connections,
                      max(10.0, p.pair_duration_s), p.seed, cpus=tuple(gen_cpus))
        t0, load0 = server_now(http), os.getloadavg()[0]
        result = drive(job)
        time.sleep(0.2)
        events = fetch_events(http, t0)[0]
        m = run_metrics(result, p.pair_duration_s, p.warmup_s)
        m["loadavg_1min"] = [load0, os.getloadavg()[0]]
        m["preemption"] = preemptions(events)
        m["preemption"]["latency_ms"] = m["preemption"]["latency_ms"][:KEEP]
        if layout == "shared":  # one BE model alone beside the RT one: the cleanest restore measurement
            m["restore_overhead"] = restore_overhead(be_batches(events))
        out[layout] = m
    alone = out["alone"]
    for layout in ("shared", "padded"):
        if layout in out:
            out[layout]["rt_mean_vs_alone"] = ratio(out[layout]["rt"]["mean_ms"], alone["rt"]["mean_ms"])
            out[layout]["rt_p99_vs_alone"] = ratio(out[layout]["rt"]["p99_ms"], alone["rt"]["p99_ms"])
    return out


def _output(p: Params, specs: Sequence[WorkloadSpec], runs: dict[str, dict[str, Any]], pair_runs: dict[str, Any],
            scales: Mapping[str, float], compute_s: Mapping[str, float], probes: Mapping[str, Any],
            gen_cpus: Sequence[int]) -> ScenarioOutput:
    norm = {w: normalised(per) for w, per in runs.items()}
    reef_lat = report.pool(runs, "reef", lambda m: m["preemption"]["latency_ms"])
    fig12 = {
        "reef_preemption_latency_ms": dist(reef_lat),
        "reef_preemption_latency_by_workload_ms": {w: dist(per["reef"]["preemption"]["latency_ms"])
                                                   for w, per in runs.items() if "reef" in per},
        "reef_padding_stops": sum(m["preemption"]["padding_stops"] for per in runs.values()
                                  for s, m in per.items() if s == "reef"),
        "reef_rt_queue_ms": {w: per["reef"]["rt"]["queue_ms"] for w, per in runs.items() if "reef" in per},
        "seq_rt_queue_ms": {w: per["seq"]["rt"]["queue_ms"] for w, per in runs.items() if "seq" in per},
        "rt_start_us": {w: {s: m["rt_start_us"] for s, m in per.items()} for w, per in runs.items()},
        "samples": {"reef_preemption_latency_ms": reef_lat[:KEEP]},
    }
    # restore overhead by source: every reef DISB run pooled, and each pair's shared run (one BE
    # model beside the RT one, no other BE work sharing the core: the cleanest measurement)
    restore = {"DISB workloads": restore_overhead(report.pool(runs, "reef", lambda m: m["be_batches"]))}
    restore |= {f"pair {n}": pr["shared"]["restore_overhead"] for n, pr in pair_runs.items() if "shared" in pr}
    restore = {src: r for src, r in restore.items() if r}
    for per in runs.values():
        for m in per.values():
            m["restore_overhead"] = restore_overhead(m.pop("be_batches"))
            m["preemption"]["latency_ms"] = m["preemption"]["latency_ms"][:KEEP]
    result = {
        "workloads": {s.label: {"scale": scales.get(s.label), "builtin": s.builtin,
                                "file": s.workload.to_dict() if s.workload else None} for s in specs},
        "compute_ms": {m: v * 1e3 for m, v in compute_s.items()},
        "probes_ms": {s: {m: v * 1e3 for m, v in pr.items()} for s, pr in probes.items()},
        "generator_cpus": list(gen_cpus),
        "runs": runs, "normalised": norm, "fig12": fig12, "restore_overhead": restore, "pairs": pair_runs,
    }
    figures = report.figures(runs, norm, restore, pair_runs)
    lines, markdown = report.markdown(report_intro(__doc__), p, specs, runs, norm, pair_runs, scales,
                                      compute_s, fig12, restore, gen_cpus)
    return ScenarioOutput(result, markdown, figures, lines)


