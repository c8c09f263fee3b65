"""Latency profiles and co-location slowdowns on a node's MIG devices, one set per MIG profile.

PROTEAN knows each job's solo time and FBR "on all viable slices" (§3 L197): on a MIG node a
slice is a MIG profile (``"1g.18gb"``), and two devices of one profile are the same machine.
So each profile present on the node is measured once, on its first MIG device in NVML order,
the way the profiler measures a CPU core set: an isolated measuring process
(``placement.measure``) per profile, started with that device alone in
``CUDA_VISIBLE_DEVICES`` (it is the process's ``cuda:0``) and one intra-op host thread (the
GPU does the work; the host thread only launches it). Co-location runs put every member's
process on the same device, PROTEAN's "MIG + MPS" sharing of a slice (without an MPS daemon
the device time-slices between them, which is what a worker on that device would see).

Everything is stored per MIG profile (``profiler.profile_kind``: ``latency@1g.18gb``,
``colocation@1g.18gb``, ``fbr@1g.18gb``), which ``protean.profiles.ProteanProfiles`` reads
for a partition whose shape is that profile. Who calls it: ``splitserve profile MODEL --mig``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.placement.devices import WORKER_DEVICE, GpuPartition
from splitserve.placement.profiler import (
    ColocationProfile, ColocationRun, MeasuringProcesses, ModelProfile, colocation_measurers, colocation_plan,
    machine_id, run_colocations, sweep_profile,
)

# The measuring process's intra-op threads on a MIG device; its L[t, b] is stored at t = 1.
MIG_THREADS = 1
VISIBLE = "CUDA_VISIBLE_DEVICES"


def devices_by_profile(parts: Sequence[GpuPartition]) -> dict[str, GpuPartition]:
    """The MIG device each MIG profile of ``parts`` is measured on: its first in NVML order.
    Whole GPUs (no profile) are not slices and are left out."""
    out: dict[str, GpuPartition] = {}
    for p in parts:
        if p.profile is not None:
            out.setdefault(p.profile, p)
    return out


def on_mig(config: ModelConfig) -> ModelConfig:
    """``config`` as a measuring process on a MIG device runs it: on its one visible device."""
    return replace(config, device=WORKER_DEVICE)


def mig_env(device: GpuPartition) -> dict[str, str]:
    """The environment that makes ``device`` a measuring process's only GPU."""
    return {VISIBLE: device.uuid}


def _usable_cpus(cpus: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(sorted(cpus if cpus is not None else os.sched_getaffinity(0)))


def profile_mig(config: ModelConfig, model_dir: Path | None, cache_dir: Path, parts: Sequence[GpuPartition],
                batches: Sequence[int], *, min_iters: int = 5, max_iters: int = 50, budget_s: float = 2.0,
                cpus: Sequence[int] | None = None,
                on_point: Callable[[str, int, float], None] | None = None,
                sweep: Callable[..., ModelProfile] = sweep_profile) -> dict[str, ModelProfile]:
    """L[1, b] of ``config`` on every MIG profile of ``parts`` (see the module doc), by
    profile; ``on_point(profile, batch, seconds)`` as each point finishes. ``cpus``: where the
    measuring processes run (default: every usable CPU). ``sweep`` runs the measuring
    processes (``profiler.sweep_profile``; a test without a GPU passes its own). InvalidInput
    when ``parts`` has no MIG device."""
    devices = devices_by_profile(parts)
    if not devices:
        raise InvalidInput("no MIG devices to profile on: this node's GPUs have MIG off, or it has none")
    if any(b < 1 or b > config.max_batch_size for b in batches):
        raise InvalidInput(f"batch sizes must be within 1..{config.max_batch_size} for {config.name!r}")
    where = _usable_cpus(cpus)
    out: dict[str, ModelProfile] = {}
    for profile, device in devices.items():
        def point(t: int, b: int, s: float, profile: str = profile) -> None:
            if on_point is not None:
                on_point(profile, b, s)

        out[profile] = sweep(on_mig(config), model_dir, cache_dir, [(MIG_THREADS, where, mig_env(device))],
                             batches, min_iters=min_iters, max_iters=max_iters, budget_s=budget_s,
                             on_point=point)
    return out


def profile_mig_colocation(configs: Sequence[ModelConfig], device: GpuPartition, batch: int | Mapping[str, int],
                           cache_dir: Path, *, model_dirs: Mapping[str, Path | None] | None = None,
                           sets: Sequence[Sequence[str]] | None = None, cpus: Sequence[int] | None = None,
                           budget_s: float = 1.0, min_iters: int = 3,
                           on_run: Callable[[ColocationRun], None] | None = None) -> ColocationProfile:
    """Co-location runs of ``configs`` on the MIG ``device`` (``profiler.profile_colocation``
    on a slice instead of a core set): each model alone there, then each set of ``sets``
    (default ``colocation_sets``) together, all in warm processes that see only ``device``.
    Each run's ``cores`` is the device's compute slices (what ``fit_stored_fbr`` groups runs
    by within a profile)."""
    if device.profile is None:
        raise InvalidInput(f"{device.name} ({device.uuid}) is a whole GPU, not a MIG device")
    by_name, sets, batches = colocation_plan([on_mig(c) for c in configs], batch, sets)
    where = _usable_cpus(cpus)
    measurers = [replace(m, threads=MIG_THREADS)
                 for m in colocation_measurers(list(by_name.values()), batches, sets, where, model_dirs)]

    def on_slice(run: ColocationRun) -> ColocationRun:
        return replace(run, cores=device.compute_slices)

    with MeasuringProcesses(measurers, cache_dir, env=mig_env(device)) as procs:
        solo, runs = run_colocations(procs, range(len(measurers)), sets, budget_s=budget_s, min_iters=min_iters,
                                     on_run=None if on_run is None else lambda r: on_run(on_slice(r)))
    return ColocationProfile(device.compute_slices, where, solo, [on_slice(r) for r in runs], machine_id())
