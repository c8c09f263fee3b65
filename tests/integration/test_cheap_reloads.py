"""Cheap reloads on a real server: an evicted model's memory really goes back, a reload
binds a spare process instead of starting one, a recycled process serves the next model
with that model's weights (never the last one's), and a model's measured size survives a
restart so it is not measured again."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from splitserve.config import WorkerSection
from splitserve.models.zoo import build_zoo_model
from splitserve.placement.profiler import machine_id
from splitserve.registry import Registry
from tests.inproc import quiet_config, run_server, until, write_model
from tests.integration.test_worker_residency import Queues, Recorder, load, run_and_check, start, unload, zoo

BOUND_S = 120.0  # no scenario needs this long; reaching it means something hangs


def rss(pid: int) -> int | None:
    """The process's resident memory (anonymous, file-backed and shared), None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None  # a zombie: its memory is gone


def reference(seed: int, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return build_zoo_model("resnet18", seed)(torch.from_numpy(x))[0].numpy()


def test_evicted_memory_returns_a_reload_binds_a_spare_and_a_recycled_process_serves_another_model(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "r18a", "resnet18")
    with (write_model(repo, "r18b", "resnet18") / "config.toml").open("a") as f:
        f.write("seed = 1\n")  # the file ends in its [artifact] table: a distinct copy of the architecture
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache", spare_workers=1)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)

    async def scenario(server):
        a = server.runtime("r18a")
        first = (await server.infer("r18a", [x])).outputs[0]
        (pid_a,) = [h.pid for h in a.workers.values()]
        await until(lambda: server.pool.spares == 1)  # the pool has refilled what the load took
        processes = {pid_a, *(h.pid for h in server.pool.idle)}
        weights, before = a.stats.weights_bytes, rss(pid_a)
        await a.evict()
        after = rss(pid_a)
        second = (await server.infer("r18a", [x])).outputs[0]  # loads it again
        (reloaded_by,) = [h.pid for h in a.workers.values()]
        await a.evict()  # its process goes back to the pool once more ...
        b = server.runtime("r18b")
        third = (await server.infer("r18b", [x])).outputs[0]  # ... and serves the other model
        (pid_b,) = [h.pid for h in b.workers.values()]
        return first, second, third, weights, before, after, processes, reloaded_by, pid_b

    first, second, third, weights, before, after, processes, reloaded_by, pid_b = run_server(
        cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert weights >= 40_000_000  # resnet18 for CIFAR: 44.7 MB
    assert reloaded_by in processes  # the reload took a process that was up: none started
    assert pid_b == reloaded_by  # the process that served r18a, recycled, now serves r18b
    want_a, want_b = reference(0, x), reference(1, x)
    np.testing.assert_allclose(first, want_a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(second, want_a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(third, want_b, rtol=1e-4, atol=1e-5)  # its own weights (I10) ...
    assert not np.allclose(third, want_a, rtol=1e-2, atol=1e-3)  # ... never the last model's
    if before is None or after is None:
        pytest.skip(f"the worker's resident memory could not be read from /proc (before {before}, after {after})")
    assert before - after >= 0.8 * weights, (before, after, weights)  # I9


def test_a_models_measured_size_survives_a_restart_and_is_not_measured_again(tmp_path):
    write_model(tmp_path / "repo", "m", "lenet")
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", cache_dir=tmp_path / "cache",
                       spare_workers=0)
    x = [np.zeros((1, 1, 28, 28), np.uint8)]

    async def measure(server):
        rt = server.runtime("m")
        # from the architecture (no weights file yet), read off the loop before the first load
        before = await asyncio.to_thread(server.footprints.footprint, server.records["m"])
        assert not before.measured and before.weights_bytes > 0
        await server.infer("m", x)
        return rt.footprint

    async def restarted(server):
        rt = server.runtime("m")
        await server.infer("m", x)
        return rt.footprint, rt.stats.loads

    def stored() -> dict:
        registry = Registry(cfg.data_dir)
        try:
            return registry.load_profile("m", machine_id(), "memory")
        finally:
            registry.close()

    measured = run_server(cfg, lambda s: asyncio.wait_for(measure(s), BOUND_S))
    assert measured.measured and measured.weights_bytes > 0
    first = stored()
    footprint, loads = run_server(cfg, lambda s: asyncio.wait_for(restarted(s), BOUND_S))
    # the second server's load took the stored size and did not measure (nor store) it again
    assert loads == 1 and footprint == measured and stored() == first


def thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of ``pid`` may run on (``Cpus_allowed_list`` of every task)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cpus: set[int] = set()
                for part in line.split(":")[1].strip().split(","):
                    lo, _, hi = part.partition("-")
                    cpus.update(range(int(lo), int(hi or lo) + 1))
                out.append(cpus)
    return out


def test_each_load_places_the_process_anew_all_its_threads_included_and_a_measured_load_reports_its_memory(tmp_path):
    """A spare is started before anyone knows its instance: the LOAD pins it. A process
    reused for another placement moves every thread, torch's pool threads included."""
    cpus = sorted(os.sched_getaffinity(0))
    q = Queues(zoo("resnet18"), "place-resnet18")

    async def story() -> tuple:
        owner = Recorder()
        h = start(owner, tmp_path)
        try:
            await owner.next("ready")
            first_load = await load(owner, h, replace(q.bind(), cpus=[cpus[0]], threads=2, measure=True))
            await run_and_check(owner, h, q, batch_id=1)  # two threads: torch's pool has started its thread
            first = thread_cpus(h.pid)
            await unload(owner, h)
            second_load = await load(owner, h, replace(q.bind(), cpus=[cpus[-1]], threads=1))
            await run_and_check(owner, h, q, batch_id=2)
            return first_load, first, second_load, thread_cpus(h.pid)
        finally:
            await h.stop(WorkerSection.stop_timeout_s)

    try:
        first_load, first, second_load, second = asyncio.run(asyncio.wait_for(story(), BOUND_S))
    finally:
        q.close()
    assert len(first) >= 2 and all(c == {cpus[0]} for c in first), first
    assert all(c == {cpus[-1]} for c in second), second
    # activations of a batch of 16 and the runtime's own allocations: measured once, when asked
    assert first_load.private_bytes is not None and first_load.private_bytes > 0
    assert second_load.private_bytes is None
