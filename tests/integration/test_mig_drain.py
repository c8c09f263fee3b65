"""Draining GPU partitions before a MIG geometry change destroys them, on a real node: the
model with an instance on a partition being destroyed is unloaded (not disabled) and its
partition forgotten; a model elsewhere keeps serving; the drained one loads again when
asked. The GPUs are a fake NVML listing handed to the node's assigner (this machine has
none); the workers are real processes on the CPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

from splitserve.placement.gpus import read_gpus
from splitserve.server.ports import ModelState
from tests.fake_nvml import GIB, FakeGpu, FakeNvml
from tests.inproc import quiet_config, server_in_thread


def test_the_models_on_destroyed_partitions_are_drained_and_load_again(tmp_path: Path) -> None:
    config = quiet_config(tmp_path / "data", cache_dir=tmp_path / "cache", load=("lenet", "vecadd1k"))
    with server_in_thread(config, "mig-drain") as server:
        devices = server.env.devices
        assert devices is not None
        gpus = read_gpus(FakeNvml([FakeGpu("NVIDIA H200", 141 * GIB, None, (), [], u) for u in ("GPU-a", "GPU-b")]))
        devices.listing = lambda: gpus
        devices.assign("lenet", 0, "cuda:0")  # as a lenet on GPU-a would hold it
        devices.assign("vecadd1k", 0, "cuda:1")
        assert server._drain_gpu_partitions(frozenset({"GPU-a"})) is True
        assert server.runtime("lenet").state is ModelState.UNLOADED
        assert server.runtime("vecadd1k").state is ModelState.READY  # on a partition the plan keeps
        assert devices.owners_on({"GPU-a"}) == set() and devices.owners_on({"GPU-b"}) == {"vecadd1k"}
        assert server._drain_gpu_partitions(frozenset({"GPU-x"})) is True  # nothing there: nothing to do
        asyncio.run_coroutine_threadsafe(server.runtime("lenet").wait_ready(), server.loop).result(timeout=120)
        assert server.runtime("lenet").state is ModelState.READY  # unloaded, not disabled: it loads again
