"""The load of one scheme's run: the open-loop trace over the fast path, every strict request
carrying its SLO, and the closed loops that measure capacity. Runs in the bench process or a
spawned generator process; knows nothing of schemes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.bench.arrivals import Arrival
from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.bench.loadgen import Outcome, RunResult, closed_loop, open_loop, run_in_processes
from splitserve.bench.protean.analysis import closed_loop_rps
from splitserve.bench.transports import close_async, open_async


@dataclass(frozen=True)
class TraceJob:
    """What the generator process sends: ``arrivals`` open loop over ``connections`` fast-path
    connections; rt requests carry ``slo_ms``."""

    url: str
    inputs: tuple[tuple[str, tuple[dict[str, Any], ...]], ...]  # model -> its input specs
    arrivals: tuple[Arrival, ...]
    slo_ms: float
    connections: int = 8
    drain_timeout_s: float = 30.0
    seed: int = 0
    timeout_s: float = 60.0
    transport: str = "tcp"


def _outcome(r: Any) -> Outcome:
    return Outcome(ok=True, server_queue_s=r.queue_us / 1e6, server_compute_s=r.compute_us / 1e6,
                   server_total_s=r.total_us / 1e6)


def _samples(job: TraceJob) -> dict[str, list[Any]]:
    return {m: [as_call_arg(x) for x in make_inputs(specs, 8, job.seed)] for m, specs in job.inputs}


async def run_trace(index: int, count: int, job: TraceJob) -> RunResult:
    """Generator process body (``loadgen.run_in_processes``): the whole trace, open loop."""
    root = logging.getLogger("splitserve")
    if not root.handlers and not logging.getLogger().handlers:
        root.addHandler(logging.NullHandler())  # the result carries warnings; stderr would break the bar
    samples = _samples(job)
    pool = [await open_async(job.transport, job.url, job.timeout_s) for _ in range(max(1, job.connections))]
    sent = 0
    try:
        async def send(a: Arrival) -> Outcome:
            nonlocal sent
            sent += 1
            xs = samples[a.model]
            slo = job.slo_ms if a.cls == "rt" else None
            return _outcome(await pool[sent % len(pool)].infer_result(a.model, xs[sent % len(xs)], cls=a.cls,
                                                                       slo_ms=slo))

        return await open_loop(send, job.arrivals, drain_timeout_s=job.drain_timeout_s)
    finally:
        await asyncio.gather(*(close_async(c) for c in pool), return_exceptions=True)


def drive(job: TraceJob) -> tuple[RunResult, float]:
    """Run ``job`` in a generator process. Returns its result and the offset that puts its
    sample times on the server's clock: ``server time = sample time + offset``.

    Both are ``perf_counter`` (CLOCK_MONOTONIC, one clock for every process on the host);
    the result's origin is wall time, converted here with this process's reading of both.
    """
    duration = max((a.t for a in job.arrivals), default=0.0)
    result = run_in_processes(run_trace, (job,), processes=1,
                              timeout_s=duration + job.drain_timeout_s + 120.0)
    offset = result.origin + (time.perf_counter() - time.time())
    return result, offset


async def _closed(url: str, transport: str, model: str, x: Sequence[Any], cls: str, clients: int,
                  duration_s: float, warmup_s: float) -> RunResult:
    client = await open_async(transport, url, 60.0)
    try:
        n = 0

        async def send(a: Arrival) -> Outcome:
            nonlocal n
            n += 1
            return _outcome(await client.infer_result(model, x[n % len(x)], cls=cls))

        return await closed_loop(send, clients, duration_s=duration_s, model=model, cls=cls, warmup_s=warmup_s)
    finally:
        await close_async(client)


def capacity(url: str, model: str, specs: Sequence[dict[str, Any]], batch: int, duration_s: float,
             seed: int = 0, transport: str = "tcp", warmup_s: float = 0.0) -> dict[str, Any]:
    """Closed-loop throughput of ``model`` with ``2 × batch`` clients (full batches, one always
    waiting behind the running one) for ``duration_s`` after ``warmup_s``: its requests/s on
    the node alone, counting the answers after the warm-up (``analysis.closed_loop_rps``)."""
    x = [as_call_arg(v) for v in make_inputs(specs, 8, seed)]
    result = asyncio.run(_closed(url, transport, model, x, "be", 2 * batch, warmup_s + duration_s, warmup_s))
    ok = [s for s in result.samples if s.ok]
    return {"rps": closed_loop_rps([s.done for s in ok], warmup_s), "requests": len(result.samples),
            "errors": len(result.samples) - len(ok), "clients": 2 * batch, "duration_s": duration_s,
            "warmup_s": warmup_s}
