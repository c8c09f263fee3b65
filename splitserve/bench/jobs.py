"""Load-generator jobs that run in their own processes (``loadgen.run_in_processes``).

A job is a module-level coroutine function (spawn pickles it by name) that receives a small
picklable spec, opens its own connections, builds its own inputs from specs and a seed, runs
``open_loop`` or ``closed_loop`` and returns the ``RunResult``. Importing this module does not
import torch: a generator process stays small and starts fast.

Each job also watches its own CPU time: a generator process that was busy for most of the
run may itself have limited the load, and its result says so (``generator_bottleneck``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.bench.arrivals import Arrival, shard
from splitserve.bench.inputs import as_call_arg, make_inputs, nbytes
from splitserve.bench.loadgen import Outcome, RunResult, closed_loop, open_loop

# A generator process busy for more than this share of the run's wall time was CPU-bound.
CPU_BOUND_SHARE = 0.9
_DISTINCT_INPUTS = 8


@dataclass(frozen=True)
class Workload:
    """What to send and where: a transport, its URL, a model and its input specs (as dicts)."""

    transport: str
    url: str
    model: str
    inputs: tuple[dict[str, Any], ...]
    outputs: tuple[dict[str, Any], ...] = ()
    seed: int = 0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class OpenLoopJob:
    workload: Workload
    arrivals: tuple[Arrival, ...]
    connections: int = 4
    drain_timeout_s: float | None = 30.0
    max_in_flight: int = 10_000


@dataclass(frozen=True)
class ClosedLoopJob:
    workload: Workload
    clients: int  # over all generator processes
    duration_s: float
    warmup_s: float = 0.0  # each client sends at least one request after it (``loadgen.closed_loop``)


Send = Callable[[Arrival], Awaitable[Outcome]]


def _outcome(r: Any) -> Outcome:
    # A transport that does not report server timings leaves them all 0: record "unknown".
    total = getattr(r, "total_us", 0) or 0
    if not total:
        return Outcome(ok=True)
    return Outcome(ok=True, server_queue_s=r.queue_us / 1e6, server_compute_s=r.compute_us / 1e6,
                   server_total_s=total / 1e6)


async def _open_pool(w: Workload, n: int) -> tuple[list[Any], Callable[[], Awaitable[None]]]:
    """``n`` connected clients for ``w`` and a function that closes them all."""
    if w.transport == "echo":
        from splitserve.bench.echo import HEADER_SIZE, AsyncEchoClient

        host, port = w.url.split("://", 1)[1].rsplit(":", 1)
        pool: list[Any] = [
            await AsyncEchoClient(host, int(port), HEADER_SIZE + nbytes(w.inputs),
                                  HEADER_SIZE + nbytes(w.outputs)).connect()
            for _ in range(n)
        ]

        async def close_echo() -> None:
            await asyncio.gather(*(c.close() for c in pool), return_exceptions=True)

        return pool, close_echo

    from splitserve.bench.transports import close_async, open_async

    pool = [await open_async(w.transport, w.url, w.timeout_s) for _ in range(n)]

    async def close() -> None:
        await asyncio.gather(*(close_async(c) for c in pool), return_exceptions=True)

    return pool, close


def _sender(w: Workload, pool: list[Any]) -> Send:
    samples = [as_call_arg(s) for s in make_inputs(w.inputs, _DISTINCT_INPUTS, w.seed)]
    sent = 0

    def pick(arrival: Arrival) -> Any:
        nonlocal sent
        sent += 1
        if arrival.tag and arrival.tag.startswith("client-"):
            return pool[int(arrival.tag[7:]) % len(pool)]  # a closed-loop client keeps its connection
        return pool[sent % len(pool)]  # open loop: round robin over the connections

    if w.transport == "echo":
        async def send_echo(arrival: Arrival) -> Outcome:
            await pick(arrival).call()
            return Outcome(ok=True)

        return send_echo

    async def send(arrival: Arrival) -> Outcome:
        client = pick(arrival)
        return _outcome(await client.infer_result(w.model, samples[sent % len(samples)]))

    return send


def _quiet() -> None:
    # A spawned generator has no logging set up, so warnings would go to stderr through
    # logging's last-resort handler and break the progress bar; the result carries them.
    root = logging.getLogger("splitserve")
    if not root.handlers and not logging.getLogger().handlers:
        root.addHandler(logging.NullHandler())


def _flag_cpu(result: RunResult, cpu_s: float, wall_s: float, index: int) -> RunResult:
    share = cpu_s / wall_s if wall_s > 0 else 0.0
    if share > CPU_BOUND_SHARE:
        reason = f"generator process {index} was busy {share:.0%} of the run (CPU-bound)"
        result.generator_bottleneck = True
        result.bottleneck_reason = "; ".join(r for r in (result.bottleneck_reason, reason) if r)
    return result


async def run_open_loop(index: int, count: int, job: OpenLoopJob) -> RunResult:
    """This process's share of ``job.arrivals`` (every ``count``-th), sent open loop."""
    _quiet()
    pool, close = await _open_pool(job.workload, max(1, job.connections))
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = await open_loop(_sender(job.workload, pool), shard(job.arrivals, index, count),
                                 max_in_flight=job.max_in_flight, drain_timeout_s=job.drain_timeout_s)
        return _flag_cpu(result, time.process_time() - cpu0, time.perf_counter() - wall0, index)
    finally:
        await close()


async def run_closed_loop(index: int, count: int, job: ClosedLoopJob) -> RunResult:
    """This process's share of ``job.clients`` closed-loop clients, one connection each."""
    _quiet()
    mine = job.clients // count + (1 if index < job.clients % count else 0)
    if mine == 0:
        return RunResult(mode="closed", origin=time.time())
    pool, close = await _open_pool(job.workload, mine)
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = await closed_loop(_sender(job.workload, pool), mine, duration_s=job.duration_s,
                                   model=job.workload.model, warmup_s=job.warmup_s)
        return _flag_cpu(result, time.process_time() - cpu0, time.perf_counter() - wall0, index)
    finally:
        await close()
