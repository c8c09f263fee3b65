"""The load generator: open-loop and closed-loop drivers around an injected sender.

The generator knows nothing about transports. A scenario hands it ``send(arrival)``, an async
callable that issues one request and returns an ``Outcome``; HTTP, gRPC and the fast path
each provide one. Open loop sends every arrival on schedule whether or not earlier answers
came back, and measures latency from the *scheduled* time, so a slow server cannot hide its
queueing by slowing the generator down (coordinated omission). Closed loop runs N clients
that each send back to back, for peak throughput and single-stream latency (SplitRPC §6).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import queue
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from splitserve.bench.arrivals import Arrival
from splitserve.bench.results import percentiles

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

# A generator whose p99 send lag exceeds this is not offering the load it was asked for.
DEFAULT_MAX_SEND_LAG_S = 1e-3
_LATENCY_PS: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)


@dataclass
class Outcome:
    """What a sender reports for one request: success, the error if not, server timings."""

    ok: bool
    error: str | None = None
    server_queue_s: float | None = None  # time the request waited in the server's queue
    server_compute_s: float | None = None  # time the model ran on it
    server_total_s: float | None = None  # receive to reply, as the server measured it


SendFn = Callable[[Arrival], Awaitable[Outcome]]


@dataclass(slots=True)
class Sample:
    """One request as the generator saw it; times in seconds from the start of the run.

    Open loop: ``scheduled`` is when the arrival was due, ``sent`` when ``send`` was called.
    Closed loop: there is no schedule, so ``scheduled == sent``. Either way ``latency`` is
    ``done - scheduled``.
    """

    scheduled: float
    sent: float
    done: float
    ok: bool
    model: str
    cls: str
    tag: str | None = None
    error: str | None = None
    server_queue_s: float | None = None
    server_compute_s: float | None = None
    server_total_s: float | None = None

    @property
    def latency(self) -> float:
        """Seconds from when the request was due to when its answer arrived."""
        return self.done - self.scheduled

    @property
    def send_lag(self) -> float:
        """Seconds the generator was late sending this request."""
        return self.sent - self.scheduled


_SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Sample))


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else seconds * 1e3


def _stats(samples: Sequence[Sample], window_from: float) -> dict[str, Any]:
    """Counts, throughput and latency percentiles of ``samples`` (latency over ok ones only)."""
    ok = [s for s in samples if s.ok]
    lat = np.array([s.latency for s in ok], dtype=np.float64)
    lag = np.array([s.send_lag for s in samples], dtype=np.float64)
    window = (max(s.done for s in samples) - window_from) if samples else 0.0
    p50, p90, p99, p999 = percentiles(lat, _LATENCY_PS)
    out: dict[str, Any] = {
        "count": len(samples),
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "window_s": window,
        "throughput_rps": len(ok) / window if window > 0 else None,
        "latency_ms": {
            "mean": _ms(float(lat.mean())) if lat.size else None,
            "p50": _ms(p50),
            "p90": _ms(p90),
            "p99": _ms(p99),
            "p999": _ms(p999),
            "max": _ms(float(lat.max())) if lat.size else None,
        },
        "send_lag_p99_ms": _ms(percentiles(lag, (99.0,))[0]),
    }
    server: dict[str, Any] = {}
    for name in ("server_queue_s", "server_compute_s", "server_total_s"):
        vals = [getattr(s, name) for s in ok if getattr(s, name) is not None]
        if vals:
            v50, v99 = percentiles(vals, (50.0, 99.0))
            server[name[len("server_"):-2] + "_ms"] = {
                "mean": _ms(float(np.mean(vals))), "p50": _ms(v50), "p99": _ms(v99),
            }
    if server:
        out["server"] = server
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            key = s.error or "unknown"
            errors[key] = errors.get(key, 0) + 1
    if errors:
        out["error_kinds"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    return out


@dataclass
class RunResult:
    """Every sample of one run, whether the generator kept up, and summaries of both.

    ``origin`` is the wall-clock time (``time.time()``) at which the run's time 0 fell; it lets
    results from several processes be put on one time axis (``merge_results``).
    """

    samples: list[Sample] = field(default_factory=list)
    mode: str = "open"  # open | closed | mixed
    origin: float = 0.0
    generator_bottleneck: bool = False
    bottleneck_reason: str | None = None
    max_in_flight: int = 0  # most requests outstanding at once

    def summary(self, warmup_s: float = 0.0) -> dict[str, Any]:
        """Counts, throughput (ok/s over the measured window), latency and send-lag stats.

        Samples scheduled before ``warmup_s`` are left out. The window runs from the first
        measured send to the last answer. ``by_class`` repeats the numbers per
        ``"model/cls"``. Latencies are in ms and cover successful requests only.
        """
        kept = [s for s in self.samples if s.scheduled >= warmup_s]
        start = min((s.sent for s in kept), default=0.0)
        out = {
            "mode": self.mode,
            "warmup_s": warmup_s,
            **_stats(kept, start),
            "generator_bottleneck": self.generator_bottleneck,
            "bottleneck_reason": self.bottleneck_reason,
            "max_in_flight": self.max_in_flight,
        }
        groups: dict[str, list[Sample]] = {}
        for s in kept:
            groups.setdefault(f"{s.model}/{s.cls}", []).append(s)
        out["by_class"] = {k: _stats(v, start) for k, v in sorted(groups.items())}
        return out

    def to_dict(self, include_samples: bool = True) -> dict[str, Any]:
        """Plain, JSON-ready form: metadata, ``summary()`` and samples as column lists."""
        d: dict[str, Any] = {
            "mode": self.mode,
            "origin": self.origin,
            "generator_bottleneck": self.generator_bottleneck,
            "bottleneck_reason": self.bottleneck_reason,
            "max_in_flight": self.max_in_flight,
            "summary": self.summary(),
        }
        if include_samples:
            d["samples"] = {name: [getattr(s, name) for s in self.samples] for name in _SAMPLE_FIELDS}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        """Rebuild a result written by ``to_dict(include_samples=True)``."""
        cols = d.get("samples") or {name: [] for name in _SAMPLE_FIELDS}
        n = len(cols["scheduled"])
        samples = [Sample(**{name: cols[name][i] for name in _SAMPLE_FIELDS}) for i in range(n)]
        return cls(
            samples=samples,
            mode=d["mode"],
            origin=d["origin"],
            generator_bottleneck=d["generator_bottleneck"],
            bottleneck_reason=d["bottleneck_reason"],
            max_in_flight=d["max_in_flight"],
        )


def merge_results(results: Sequence[RunResult]) -> RunResult:
    """One result holding every sample of ``results``, on the earliest run's time axis.

    Used for generator processes that ran side by side, and for an open-loop real-time stream
    run next to closed-loop best-effort clients (DISB).
    """
    if not results:
        return RunResult()
    origin = min(r.origin for r in results)
    samples: list[Sample] = []
    for r in results:
        shift = r.origin - origin
        samples.extend(
            replace(s, scheduled=s.scheduled + shift, sent=s.sent + shift, done=s.done + shift)
            for s in r.samples
        )
    samples.sort(key=lambda s: s.scheduled)
    modes = {r.mode for r in results}
    reasons = [r.bottleneck_reason for r in results if r.bottleneck_reason]
    return RunResult(
        samples=samples,
        mode=modes.pop() if len(modes) == 1 else "mixed",
        origin=origin,
        generator_bottleneck=any(r.generator_bottleneck for r in results),
        bottleneck_reason="; ".join(reasons) or None,
        # concurrent runs overlap, so their peaks can add up
        max_in_flight=sum(r.max_in_flight for r in results),
    )


async def _call(send: SendFn, arrival: Arrival) -> Outcome:
    # A sender that raises (connection refused, bad reply) is a failed request, not a failed run.
    try:
        return await send(arrival)
    except Exception as e:
        logger.debug("send failed for %s", arrival, exc_info=True)
        return Outcome(ok=False, error=f"{type(e).__name__}: {e}")


def _sample(arrival: Arrival, scheduled: float, sent: float, done: float, out: Outcome) -> Sample:
    return Sample(
        scheduled=scheduled, sent=sent, done=done, ok=out.ok, model=arrival.model,
        cls=arrival.cls, tag=arrival.tag, error=None if out.ok else (out.error or "error"),
        server_queue_s=out.server_queue_s, server_compute_s=out.server_compute_s,
        server_total_s=out.server_total_s,
    )


async def open_loop(
    send: SendFn,
    arrivals: Sequence[Arrival],
    clock: Clock = time.perf_counter,
    max_in_flight: int = 10_000,
    max_send_lag_s: float = DEFAULT_MAX_SEND_LAG_S,
    drain_timeout_s: float | None = None,
) -> RunResult:
    """Send each arrival at its time ``t`` (seconds after the call) and collect the answers.

    Every request runs in its own task, so slow answers never delay later sends. Up to
    ``max_in_flight`` requests may be outstanding; at the cap the next send waits for a slot.
    After the last send the run waits for outstanding answers, at most ``drain_timeout_s``
    (None: for ever); those still missing are cancelled and recorded as errors. The result is
    flagged ``generator_bottleneck`` when the cap was hit or the p99 send lag exceeded
    ``max_send_lag_s``: then the server did not see the load that was asked for.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    ordered = sorted(arrivals, key=lambda a: a.t)
    samples: list[Sample] = []
    slots = asyncio.Semaphore(max_in_flight)
    in_flight = 0
    peak = 0
    cap_hit = False
    start = clock()
    origin = time.time()

    async def one(arrival: Arrival) -> None:
        nonlocal in_flight
        try:
            sent = clock() - start
            out = await _call(send, arrival)
            samples.append(_sample(arrival, arrival.t, sent, clock() - start, out))
        except asyncio.CancelledError:
            samples.append(_sample(
                arrival, arrival.t, sent, clock() - start,
                Outcome(ok=False, error="no answer before the run ended"),
            ))
            raise
        finally:
            in_flight -= 1
            slots.release()

    tasks: list[asyncio.Task[None]] = []
    try:
        for arrival in ordered:
            delay = arrival.t - (clock() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if slots.locked():
                cap_hit = True
            await slots.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            tasks.append(asyncio.create_task(one(arrival)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            if pending:
                logger.warning("%d requests still unanswered after the drain timeout", len(pending))
    finally:
        # on a drain timeout, or when the run itself is cancelled, no request task outlives it
        pending = {t for t in tasks if not t.done()}
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    samples.sort(key=lambda s: s.scheduled)
    result = RunResult(samples=samples, mode="open", origin=origin, max_in_flight=peak)
    reasons: list[str] = []
    if cap_hit:
        reasons.append(f"in-flight cap of {max_in_flight} reached")
    lag_p99 = percentiles([s.send_lag for s in samples], (99.0,))[0]
    if lag_p99 > max_send_lag_s:
        reasons.append(f"p99 send lag {lag_p99 * 1e3:.2f} ms > {max_send_lag_s * 1e3:.2f} ms")
    if reasons:
        result.generator_bottleneck = True
        result.bottleneck_reason = "; ".join(reasons)
        logger.warning("load generator could not keep up: %s", result.bottleneck_reason)
    return result


async def closed_loop(
    send: SendFn,
    clients: int,
    duration_s: float | None = None,
    requests_per_client: int | None = None,
    model: str = "",
    cls: str = "be",
    clock: Clock = time.perf_counter,
    warmup_s: float = 0.0,
) -> RunResult:
    """``clients`` concurrent clients, each sending its next request as soon as the last one
    is answered, until ``duration_s`` has passed or each sent ``requests_per_client``
    (whichever comes first; at least one must be given).

    No request starts after ``duration_s``, except a client's first at or after ``warmup_s``
    (the part ``summary`` measures): a client whose calls outlast the window sends that one
    late, so a run on a slow machine is measured, not empty. Those in flight at the end are
    still awaited. Latency is ``done - sent``. Arrivals carry ``t`` = seconds since the start
    and ``tag`` = ``client-<i>``.
    """
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    if duration_s is None and requests_per_client is None:
        raise ValueError("closed_loop needs duration_s or requests_per_client")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if requests_per_client is not None and requests_per_client < 1:
        raise ValueError(f"requests_per_client must be >= 1, got {requests_per_client}")
    samples: list[Sample] = []
    in_flight = 0
    peak = 0
    start = clock()
    origin = time.time()

    async def client(i: int) -> None:
        nonlocal in_flight, peak
        tag = f"client-{i}"
        n = 0
        measured = False
        while requests_per_client is None or n < requests_per_client:
            sent = clock() - start
            if duration_s is not None and sent >= duration_s and measured:
                break
            measured = sent >= warmup_s
            arrival = Arrival(sent, model, cls, tag)
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                out = await _call(send, arrival)
            finally:
                in_flight -= 1
            samples.append(_sample(arrival, sent, sent, clock() - start, out))
            n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    samples.sort(key=lambda s: s.scheduled)
    return RunResult(samples=samples, mode="closed", origin=origin, max_in_flight=peak)


# A generator job: job(index, count, *args) -> coroutine giving the RunResult of that process.
Job = Callable[..., Coroutine[Any, Any, RunResult]]


def _process_main(job: Job, index: int, count: int, args: tuple[Any, ...], barrier: Any,
                  barrier_timeout_s: float, results: Any) -> None:
    try:
        barrier.wait(barrier_timeout_s)  # start all generators together
        result = asyncio.run(job(index, count, *args))
        results.put((index, result.to_dict(include_samples=True), None))
    except BaseException:  # the parent must hear about any failure, even KeyboardInterrupt
        results.put((index, None, traceback.format_exc()))


def run_in_processes(
    job: Job,
    args: tuple[Any, ...] = (),
    processes: int = 2,
    timeout_s: float | None = None,
    start_timeout_s: float = 60.0,
) -> RunResult:
    """Run ``job(index, processes, *args)`` in ``processes`` spawned processes; merge results.

    Keeps the generator off the server's event loop and GIL, and spreads a high rate over
    several cores. ``job`` must be a module-level async function (spawn pickles it by name) and
    builds its own sender inside the child, e.g. ``open_loop(make_sender(...),
    shard(arrivals, index, count))``. Processes start measuring together; results come back as
    plain dicts and are merged with ``merge_results``. A failing child raises RuntimeError
    with its traceback; ``timeout_s`` bounds the whole wait.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_process_main,
            args=(job, i, processes, args, barrier, start_timeout_s, results_q),
            name=f"splitserve-loadgen-{i}",
            daemon=True,
        )
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    collected: dict[int, dict[str, Any]] = {}
    failures: list[str] = []
    try:
        # Read before joining: a child cannot exit while its large result sits in the pipe.
        while len(collected) + len(failures) < processes:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"load generator processes did not finish within {timeout_s} s")
            try:
                index, payload, error = results_q.get(timeout=wait)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"load generator process {dead[0].name} died with exit code {dead[0].exitcode}"
                    ) from None
                continue
            if error is not None:
                failures.append(f"process {index}:\n{error}")
            else:
                collected[index] = payload
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()  # only our own children, each by its handle
                p.join()
    if failures:
        raise RuntimeError("load generator process failed: " + "\n".join(failures))
    return merge_results([RunResult.from_dict(collected[i]) for i in sorted(collected)])
