"""The one profiler: per model, mean batch latency L[t, b] and per-segment latency.

Packrat's optimizer reads L[t, b]; REEF's padding rule and the worker's segment budget
read the per-segment times; both come from the same stored profile (registry table
``profiles``, keyed by model and machine). Each thread count runs in its own isolated
process pinned to that many CPUs of one socket, one at a time, so measurements do not
disturb each other.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.topology import allocate, read_topology


def machine_id() -> str:
    """What a profile was measured on: host, CPU model and usable CPU count."""
    model = "unknown-cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{model}|{len(os.sched_getaffinity(0))}cpu"


@dataclass(frozen=True)
class ModelProfile:
    """L[t, b] and the per-segment split of it, for one model on one machine."""

    latency: LatencyProfile
    segments: dict[tuple[int, int], list[float]]  # (t, b) -> seconds per segment
    machine: str

    def segments_to_dict(self) -> dict[str, list[float]]:
        return {f"{t},{b}": v for (t, b), v in self.segments.items()}

    def segment_times_ns(self, threads: int) -> list[tuple[int, int, int]]:
        """For a worker with ``threads`` threads: (segment, batch, ns) (its padding budget)."""
        return [(i, b, int(s * 1e9)) for (t, b), segs in self.segments.items() if t == threads
                for i, s in enumerate(segs)]


def default_batches(max_batch: int) -> list[int]:
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b *= 2
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def profile_model(config: ModelConfig, model_dir: Path | None, cache_dir: Path, threads: Sequence[int],
                  batches: Sequence[int], *, min_iters: int = 5, max_iters: int = 50, budget_s: float = 2.0,
                  on_point: Callable[[int, int, float], None] | None = None) -> ModelProfile:
    """Measure every (t, b); ``on_point(t, b, seconds)`` is called as each one finishes."""
    cores = read_topology()
    if max(threads) > len(cores):
        raise InvalidInput(f"cannot profile {max(threads)} threads on a machine with {len(cores)} usable CPUs")
    if any(b < 1 or b > config.max_batch_size for b in batches):
        raise InvalidInput(f"batch sizes must be within 1..{config.max_batch_size} for {config.name!r}")
    table: dict[tuple[int, int], float] = {}
    segments: dict[tuple[int, int], list[float]] = {}
    for t in sorted(set(threads)):
        (cpus,) = allocate([t], cores)
        job = {"config": config.to_dict(), "model_dir": str(model_dir) if model_dir else None,
               "cache_dir": str(cache_dir), "threads": t, "cpus": cpus, "batches": sorted(set(batches)),
               "min_iters": min_iters, "max_iters": max_iters, "budget_s": budget_s}
        # stderr goes to a file: a chatty child must never block on a full pipe we do not read
        with tempfile.TemporaryFile() as err, subprocess.Popen(
                [sys.executable, "-m", "splitserve.placement.measure", json.dumps(job)],
                stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                point = json.loads(line)
                key = (t, int(point["batch"]))
                table[key] = float(point["mean_s"])
                segments[key] = [float(x) for x in point["segments_s"]]
                if on_point is not None:
                    on_point(t, key[1], table[key])
            if proc.wait() != 0:
                err.seek(0)
                raise InvalidInput(f"profiling {config.name!r} with {t} threads failed: "
                                   f"{err.read().decode(errors='replace')[-2000:]}")
    return ModelProfile(LatencyProfile(config.name, table), segments, machine_id())


def save_profile(registry: Any, profile: ModelProfile) -> None:
    registry.save_profile(profile.latency.model, profile.machine, "latency", profile.latency.to_dict())
    registry.save_profile(profile.latency.model, profile.machine, "segments", profile.segments_to_dict())


def load_profile(registry: Any, model: str, machine: str | None = None) -> ModelProfile | None:
    """The stored profile of ``model`` on this machine (None if it was never profiled here)."""
    machine = machine or machine_id()
    lat = registry.load_profile(model, machine, "latency")
    if lat is None:
        return None
    segs = registry.load_profile(model, machine, "segments") or {}
    return ModelProfile(
        LatencyProfile.from_dict(lat),
        {tuple(int(x) for x in k.split(",")): v for k, v in segs.items()},  # type: ignore[misc]
        machine,
    )
