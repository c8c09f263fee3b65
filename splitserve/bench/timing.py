"""Timing loops the scenarios share: sequential calls over a client, the in-process model,
the echo floor, and closed-loop runs in generator processes. (The profiler's measuring
process is another thing: ``splitserve.placement.measure``.)

Sequential loops run in the bench process with the garbage collector paused, one call at a
time, and keep every call's time (µs) so scenarios can report medians and tails.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.inputs import as_call_arg
from splitserve.bench.jobs import ClosedLoopJob, Workload, run_closed_loop
from splitserve.bench.loadgen import RunResult, run_in_processes
from splitserve.bench.results import percentiles


@contextmanager
def busy(cores: int) -> Iterator[None]:
    """``cores`` processes spinning on a CPU each while the block runs (a busy host)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextmanager
def gc_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class CallTimes:
    """Per-call times in µs: end to end as the client saw it, and what the server reported."""

    e2e_us: np.ndarray
    queue_us: np.ndarray
    compute_us: np.ndarray
    total_us: np.ndarray
    last_outputs: list[np.ndarray]

    @property
    def server_reported(self) -> bool:
        """Whether the transport carried the server's timings (all zero when it did not)."""
        return bool(np.any(self.total_us))


def time_calls(client: Any, model: str, sample: Sequence[np.ndarray], n: int, warmup: int) -> CallTimes:
    """``n`` sequential ``infer_result`` calls after ``warmup`` untimed ones."""
    arg = as_call_arg(sample)
    r = None
    for _ in range(warmup):
        r = client.infer_result(model, arg)
    e2e = np.empty(n)
    q = np.empty(n)
    c = np.empty(n)
    tot = np.empty(n)
    clock = time.perf_counter
    with gc_paused():
        for i in range(n):
            t0 = clock()
            r = client.infer_result(model, arg)
            e2e[i] = clock() - t0
            q[i], c[i], tot[i] = r.queue_us, r.compute_us, r.total_us
    outputs = [np.asarray(v) for v in r.outputs.values()] if r is not None else []
    return CallTimes(e2e * 1e6, q, c, tot, outputs)


def time_local(arch: str, seed: int, sample: Sequence[np.ndarray], n: int, warmup: int,
               threads: int = 1) -> np.ndarray:
    """µs per forward pass of the zoo model in this process, numpy in and out (the ideal)."""
    import torch

    from splitserve.bench.validate import reference_model

    model = reference_model(arch, seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # as the server's worker runs it

    def once() -> None:
        with torch.inference_mode():
            outs = model(*[torch.from_numpy(a[None]) for a in sample])
            for o in outs if isinstance(outs, (list, tuple)) else [outs]:
                o.numpy()

    try:
        for _ in range(warmup):
            once()
        out = np.empty(n)
        clock = time.perf_counter
        with gc_paused():
            for i in range(n):
                t0 = clock()
                once()
                out[i] = clock() - t0
    finally:
        torch.set_num_threads(before)
    return out * 1e6


def time_echo(host: str, port: int, request_bytes: int, response_bytes: int, n: int, warmup: int,
              poll_us: int = 0) -> np.ndarray:
    """µs per round trip of the plain TCP echo, with these request and response sizes, by a
    client that polls for each answer up to ``poll_us`` before it sleeps (0: never)."""
    from splitserve.bench.echo import EchoClient

    with EchoClient(host, port, request_bytes, response_bytes, poll_us=poll_us) as c:
        for _ in range(warmup):
            c.call()
        out = np.empty(n)
        clock = time.perf_counter
        with gc_paused():
            for i in range(n):
                t0 = clock()
                c.call()
                out[i] = clock() - t0
    return out * 1e6


def lat_stats(us: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """min, mean, p50, p90, p99, max of µs values (None when empty)."""
    arr = np.asarray(us, dtype=np.float64)
    if arr.size == 0:
        return {k: None for k in ("min", "mean", "p50", "p90", "p99", "max")}
    p50, p90, p99 = percentiles(arr, (50, 90, 99))
    return {"min": float(arr.min()), "mean": float(arr.mean()), "p50": p50, "p90": p90, "p99": p99,
            "max": float(arr.max())}


def workload(transport: str, url: str, model: str, arch: str, seed: int = 0) -> Workload:
    """A generator workload for ``model`` (served as zoo architecture ``arch``)."""
    from splitserve.models.catalog import zoo_entry

    entry = zoo_entry(arch)
    return Workload(transport, url, model, tuple(s.to_dict() for s in entry.inputs),
                    tuple(s.to_dict() for s in entry.outputs), seed)


def closed_loop_run(w: Workload, clients: int, duration_s: float, generators: int = 1,
                    warmup_s: float = 0.0) -> RunResult:
    """``clients`` closed-loop clients for ``duration_s`` from ``generators`` processes; each
    sends at least one request after ``warmup_s``, the part its ``summary`` will measure."""
    procs = max(1, min(generators, clients))
    return run_in_processes(run_closed_loop, (ClosedLoopJob(w, clients, duration_s, warmup_s),), processes=procs,
                            timeout_s=duration_s + 180.0)


def bottleneck(summary: dict[str, Any]) -> str | None:
    """Why the generator limited the run (None when it kept up)."""
    if summary.get("generator_bottleneck"):
        return summary.get("bottleneck_reason") or "the load generator could not keep up"
    return None
