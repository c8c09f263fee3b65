"""One DISB run: the load-generator job and the numbers drawn from its samples and from the
server's scheduler event log.

The job runs in two spawned processes (``loadgen.run_in_processes``): process 0 sends the
real-time (RT) open-loop arrivals on schedule and runs any RT continuous task; process 1 runs
the best-effort (BE) continuous tasks as closed-loop clients. Every request names its model
and class, so one connection serves every model. The analysis functions are pure: samples and
event dicts in, numbers out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.arrivals import Arrival
from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.bench.loadgen import Outcome, RunResult, closed_loop, merge_results, open_loop, run_in_processes
from splitserve.bench.results import percentiles
from splitserve.bench.transports import close_async, open_async

KEEP = 5000  # raw per-request values kept per distribution (enough for a CDF)


@dataclass(frozen=True)
class ClosedTask:
    """A continuous DISB task: one closed-loop client of ``model`` in class ``cls``."""

    id: str
    model: str
    cls: str
    batch: int = 1


@dataclass(frozen=True)
class DisbJob:
    """What the two generator processes send. Process 0: the RT open-loop arrivals and any RT
    continuous tasks; process 1: the BE continuous tasks."""

    transport: str
    url: str
    inputs: tuple[tuple[str, tuple[dict[str, Any], ...]], ...]  # model -> its input specs
    arrivals: tuple[Arrival, ...]
    batches: tuple[tuple[str, int], ...]  # open-loop task id -> samples per request
    rt_tasks: tuple[ClosedTask, ...]
    be_tasks: tuple[ClosedTask, ...]
    duration_s: float
    connections: int = 4
    drain_timeout_s: float = 10.0
    seed: int = 0
    timeout_s: float = 60.0
    cpus: tuple[int, ...] = ()  # pin the generator here (empty: anywhere)

    @property
    def processes(self) -> int:
        return 2 if self.be_tasks else 1


def _outcome(r: Any) -> Outcome:
    if not getattr(r, "total_us", 0):
        return Outcome(ok=True)
    return Outcome(ok=True, server_queue_s=r.queue_us / 1e6, server_compute_s=r.compute_us / 1e6,
                   server_total_s=r.total_us / 1e6)


class _Inputs:
    """Deterministic request inputs per model, with ``batch`` samples per request."""

    def __init__(self, job: DisbJob) -> None:
        self.samples = {m: make_inputs(specs, 8, job.seed) for m, specs in job.inputs}
        self.n = 0

    def next(self, model: str, batch: int) -> Any:
        samples = self.samples[model]
        self.n += 1
        if batch == 1:
            return as_call_arg(samples[self.n % len(samples)])
        picked = [samples[(self.n + k) % len(samples)] for k in range(batch)]
        return as_call_arg([np.stack([s[i] for s in picked]) for i in range(len(picked[0]))])


async def _closed(job: DisbJob, task: ClosedTask, inputs: _Inputs) -> RunResult:
    client = await open_async(job.transport, job.url, job.timeout_s)
    try:
        async def send(a: Arrival) -> Outcome:
            return _outcome(await client.infer_result(task.model, inputs.next(task.model, task.batch), cls=task.cls))

        result = await closed_loop(send, 1, duration_s=job.duration_s, model=task.model, cls=task.cls)
    finally:
        await close_async(client)
    for s in result.samples:
        s.tag = task.id
    return result


async def _open(job: DisbJob, inputs: _Inputs) -> RunResult:
    pool = [await open_async(job.transport, job.url, job.timeout_s) for _ in range(max(1, job.connections))]
    batch = dict(job.batches)
    sent = 0
    try:
        async def send(a: Arrival) -> Outcome:
            nonlocal sent
            sent += 1
            client = pool[sent % len(pool)]
            x = inputs.next(a.model, batch.get(a.tag or "", 1))
            return _outcome(await client.infer_result(a.model, x, cls=a.cls))

        return await open_loop(send, job.arrivals, drain_timeout_s=job.drain_timeout_s)
    finally:
        await asyncio.gather(*(close_async(c) for c in pool), return_exceptions=True)


async def run_disb_load(index: int, count: int, job: DisbJob) -> RunResult:
    """Generator process ``index``: 0 sends the RT stream, 1 runs the BE clients."""
    root = logging.getLogger("splitserve")
    if not root.handlers and not logging.getLogger().handlers:
        root.addHandler(logging.NullHandler())  # the result carries warnings; stderr would break the bar
    if job.cpus:
        os.sched_setaffinity(0, job.cpus)
    inputs = _Inputs(job)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if index == 0:
        parts = [_closed(job, t, inputs) for t in job.rt_tasks]
        if job.arrivals:
            parts.append(_open(job, inputs))
    else:
        parts = [_closed(job, t, inputs) for t in job.be_tasks]
    if not parts:
        return RunResult(mode="open", origin=time.time())
    result = merge_results(await asyncio.gather(*parts))
    share = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    if index == 0 and share > 0.9:
        result.generator_bottleneck = True
        reason = f"the RT generator process was busy {share:.0%} of the run (CPU-bound)"
        result.bottleneck_reason = "; ".join(r for r in (result.bottleneck_reason, reason) if r)
    return result


def drive(job: DisbJob) -> RunResult:
    return run_in_processes(run_disb_load, (job,), processes=job.processes,
                            timeout_s=job.duration_s + job.drain_timeout_s + 120.0)



# -- analysis (pure) ---------------------------------------------------------------------------


def dist(values: Sequence[float]) -> dict[str, float | None]:
    if not len(values):
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = percentiles(values, (50.0, 90.0, 99.0))
    return {"n": len(values), "mean": float(np.mean(values)), "p50": p50, "p90": p90, "p99": p99,
            "max": float(np.max(values))}


def _class_metrics(ss: Sequence[Any], warmup: float, end: float) -> dict[str, Any]:
    ok = [s for s in ss if s.ok]
    lat = [s.latency * 1e3 for s in ok]
    done = sum(1 for s in ok if warmup <= s.done <= end)
    q = [s.server_queue_s * 1e3 for s in ok if s.server_queue_s is not None]
    c = [s.server_compute_s * 1e3 for s in ok if s.server_compute_s is not None]
    d = dist(lat)
    return {"requests": len(ss), "ok": len(ok), "errors": len(ss) - len(ok),
            "mean_ms": d["mean"], "p50_ms": d["p50"], "p99_ms": d["p99"], "max_ms": d["max"],
            "throughput_rps": done / (end - warmup) if end > warmup else None,
            "queue_ms": dist(q), "compute_ms": dist(c)}


def run_metrics(result: RunResult, duration: float, warmup: float) -> dict[str, Any]:
    """RT and BE numbers of one run. Latency covers requests scheduled after ``warmup``;
    throughput counts answers that arrived between ``warmup`` and ``duration``."""
    kept = [s for s in result.samples if s.scheduled >= warmup]
    rt = [s for s in kept if s.cls == "rt"]
    be = [s for s in kept if s.cls == "be"]
    out: dict[str, Any] = {"rt": _class_metrics(rt, warmup, duration), "be": _class_metrics(be, warmup, duration)}
    window = duration - warmup
    out["overall_rps"] = sum(1 for s in rt + be if s.ok and warmup <= s.done <= duration) / window \
        if window > 0 else None
    out["rt_queue_samples_ms"] = [s.server_queue_s * 1e3 for s in rt if s.ok and s.server_queue_s is not None][:KEEP]
    lag = [s.send_lag * 1e3 for s in rt]
    out["rt_send_lag_p99_ms"] = percentiles(lag, (99.0,))[0] if lag else None
    out["generator_bottleneck"] = result.bottleneck_reason if result.generator_bottleneck else None
    tasks: dict[str, Any] = {}
    for tag in sorted({s.tag or s.model for s in kept}):
        tasks[tag] = _class_metrics([s for s in kept if (s.tag or s.model) == tag], warmup, duration)
    out["by_task"] = tasks
    errors: dict[str, int] = {}
    for s in kept:
        if not s.ok:
            errors[s.error or "error"] = errors.get(s.error or "error", 0) + 1
    if errors:
        out["error_kinds"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])
    return out


def preemptions(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Flag-raised preemptions (their flag -> stopped latency, ms) and padding stops (a BE
    segment that would have overrun the RT work's expected end: no flag, the worker stopped
    itself) in an event log, with how soon each padding stop was resumed (ms)."""
    raised: set[tuple[str, int]] = set()
    padded: dict[tuple[str, int], float] = {}
    latency: list[float] = []
    gaps: list[float] = []
    padding = 0
    for e in events:
        key = (e["model"], e["batch"])
        if e["kind"] == "preempt":
            raised.add(key)
        elif e["kind"] == "preempted":
            if key in raised:
                latency.append(e["latency_ns"] / 1e6)
                raised.discard(key)
            else:
                padding += 1
                padded[key] = e["t"]
        elif e["kind"] == "resume" and key in padded:
            gaps.append((e["t"] - padded.pop(key)) * 1e3)
        elif e["kind"] in ("done", "failed"):
            raised.discard(key)
    return {"preemptions": len(latency), "padding_stops": padding, "latency_ms": latency,
            "padding_resume_ms": dist(gaps)}


def compute_waits(events: Sequence[Mapping[str, Any]], cls: str = "rt") -> list[float]:
    """Each ``cls`` request's arrival -> its compute starting in the worker (µs, from the
    worker's own stamp in the done events): the preemption latency, queueing, dispatch and the
    worker's wake-up on a core other work was using together."""
    return [float(w) for e in events if e["kind"] == "done" and e["cls"] == cls for w in e.get("waits_us", ())]


def busy_share(events: Sequence[Mapping[str, Any]], cls: str = "rt") -> float | None:
    """Share of the log's time span during which some ``cls`` batch was running (the union of
    start/resume -> preempted/done/failed intervals): how much of a core that class kept busy
    when its models share one core."""
    if len(events) < 2:
        return None
    spans: list[tuple[float, float]] = []
    on: dict[tuple[str, int], float] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["cls"] != cls:
            continue
        key = (e["model"], e["batch"])
        if e["kind"] in ("start", "resume"):
            on[key] = e["t"]
        elif e["kind"] in ("preempted", "done", "failed") and key in on:
            spans.append((on.pop(key), e["t"]))
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    times = [e["t"] for e in events]
    span = max(times) - min(times)
    return total / span if span > 0 else None


def be_batches(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every BE batch that started and finished inside the log: its model, how often it was
    stopped, how long it ran (start/resume -> preempted/done, summed) and how long it sat
    suspended (preempted -> resume), in ms."""
    by_batch: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for e in events:
        by_batch.setdefault((e["model"], e["batch"]), []).append(e)
    out = []
    for (model, _), evs in by_batch.items():
        if evs[0]["cls"] != "be" or evs[0]["kind"] != "start" or evs[-1]["kind"] != "done":
            continue
        ran = suspended = 0.0
        on = off = None
        stops = 0
        for e in evs:
            k = e["kind"]
            if k in ("start", "resume"):
                if off is not None:
                    suspended += e["t"] - off
                on, off = e["t"], None
            elif k in ("preempted", "done") and on is not None:
                ran += e["t"] - on
                on = None
                if k == "preempted":
                    stops += 1
                    off = e["t"]
        out.append({"model": model, "stops": stops, "ran_ms": ran * 1e3, "suspended_ms": suspended * 1e3})
    return out


def restore_overhead(batches: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: mean running time of BE batches that were stopped vs never stopped; ``ratio``
    (1.0: resuming costs nothing) and ``per_stop_ms`` (the extra running time per stop)."""
    out: dict[str, dict[str, Any]] = {}
    for model in sorted({b["model"] for b in batches}):
        clean = [b["ran_ms"] for b in batches if b["model"] == model and b["stops"] == 0]
        hit = [b for b in batches if b["model"] == model and b["stops"] > 0]
        c = float(np.mean(clean)) if clean else None
        h = float(np.mean([b["ran_ms"] for b in hit])) if hit else None
        stops = float(np.mean([b["stops"] for b in hit])) if hit else None
        out[model] = {"clean_n": len(clean), "clean_ms": c, "preempted_n": len(hit), "preempted_ms": h,
                      "stops_per_preempted": stops,
                      "suspended_ms": float(np.mean([b["suspended_ms"] for b in hit])) if hit else None,
                      "ratio": h / c if c and h is not None else None,
                      "per_stop_ms": (h - c) / stops if c is not None and h is not None and stops else None}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def normalised(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each scheme's RT latency and throughputs over rt-only's (Fig. 11); None without rt-only.

    ``be`` is BE throughput over rt-only's overall throughput (rt-only serves no BE)."""
    base = runs.get("rt-only")
    out: dict[str, dict[str, float | None]] = {}
    for scheme, m in runs.items():
        b = base or {}
        out[scheme] = {
            "rt_mean": ratio(m["rt"]["mean_ms"], b.get("rt", {}).get("mean_ms")),
            "rt_p99": ratio(m["rt"]["p99_ms"], b.get("rt", {}).get("p99_ms")),
            "overall": ratio(m["overall_rps"], b.get("overall_rps")),
            "be": ratio(m["be"]["throughput_rps"], b.get("overall_rps")),
        }
    return out
