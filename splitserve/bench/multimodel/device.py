"""The multimodel scenario's GPU arm (``-p device=cuda``): Rafiqi Figs 2-5 served from device memory.

The copies are registered on the device, and the ``lru`` server runs under the node's real
device budget (``--device-budget``: room for ``cache`` copies by their device bytes on each
GPU, beside the model count) with the pinned host tier on (the server's default), so an
evicted copy's weights wait in page-locked host memory and its reload copies them back
while its first batch runs. A second lru server, ``lru-disk`` (``--pinned-tier 0``), gets
the same sequences, interleaved: its reloads read the weights from disk (dropped from the
page cache). A reload's cost is a sequence's mean miss minus its mean hit, over every
sequence; pinned against disk is held to the >= 3x goal (PipeSwitch, Rafiqi Fig. 5).

Without CUDA the arm is unavailable and says so: nothing runs on the CPU under a GPU label.
Pure apart from ``cuda_available``: the figures come from the run's own numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from splitserve.bench.scenarios.base import fmt

GOAL = 3.0  # reload from the pinned tier at least this many times faster than from disk
# Device bytes one copy may take beside its weights (activations at batch 8, the caching
# allocator's slack, CUDA graph pools), so the model count binds and the reference LRU applies.
DEVICE_ALLOWANCE = 256 << 20


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (torch imported only here)."""
    import torch

    return bool(torch.cuda.is_available())


def require_cuda(device: str, available: Callable[[], bool] = cuda_available) -> None:
    """ValueError, saying so plainly, when ``device`` is a GPU and there is none here."""
    if device != "cpu" and not available():
        raise ValueError(f"multimodel on {device} is unavailable without CUDA (torch.cuda.is_available() is False "
                         "here): its GPU arm (device budget, pinned-tier reloads) did not run, and no numbers are "
                         "reported; run it on a GPU machine, or with device=cpu")


def device_budget(cache: int, weights_bytes: int, given: int | None) -> int:
    """Device bytes per GPU for the lru servers: ``given``, else room for ``cache`` copies."""
    return given if given is not None else cache * (weights_bytes + DEVICE_ALLOWANCE)


def server_args(budget: int, pinned: bool) -> list[str]:
    """The GPU arm's lru flags: the device budget, and (``lru-disk``) the pinned tier off."""
    return ["--device-budget", str(budget), *([] if pinned else ["--pinned-tier", "0"])]


def _reload_ms(cells: Mapping[str, Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """(mean miss - mean hit, median miss) over every sequence's requests; None without misses."""
    lat = [c["_latency"] for c in cells.values()]
    miss_mask = [c["_miss"] for c in cells.values()]
    if not lat:
        return None, None
    miss = np.concatenate([x[m] for x, m in zip(lat, miss_mask)])
    hit = np.concatenate([x[~m] for x, m in zip(lat, miss_mask)])
    if not miss.size or not hit.size:
        return None, float(np.median(miss)) if miss.size else None
    return float(miss.mean() - hit.mean()), float(np.median(miss))


def figures(r: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU arm's figures: reload from the pinned tier against from disk, and whether the
    lru server's device bytes stayed within its device budget (at the end of the run)."""
    out: dict[str, Any] = {}
    if r.get("lru") and r.get("lru-disk"):
        pinned, pinned_p50 = _reload_ms(r["lru"])
        disk, disk_p50 = _reload_ms(r["lru-disk"])
        ratio = disk / pinned if pinned and disk and pinned > 0 else None
        out["reload"] = {"pinned_ms": pinned, "disk_ms": disk, "pinned_miss_p50_ms": pinned_p50,
                         "disk_miss_p50_ms": disk_p50, "ratio": ratio, "goal": GOAL,
                         "ok": None if ratio is None else ratio >= GOAL}
    mem = r.get("memory") or {}
    if mem.get("device_budget_bytes") is not None:
        reserved = {k: int(v) for k, v in (mem.get("device_reserved_bytes") or {}).items()}
        out["device_memory"] = {"budget_bytes": mem["device_budget_bytes"], "reserved_bytes": reserved,
                                "within": all(v <= mem["device_budget_bytes"] for v in reserved.values()),
                                "pinned_tier_budget_bytes": mem.get("pinned_tier_budget_bytes"),
                                "pinned_tier_bytes": mem.get("pinned_tier_bytes")}
    return out


def broken(f: Mapping[str, Any]) -> list[str]:
    """The device budget exceeded is a broken promise (a slow pinned tier is a missed goal)."""
    x = f.get("device_memory")
    return [] if x is None or x["within"] else [f"device bytes {x['reserved_bytes']} exceed the device budget "
                                                f"{x['budget_bytes']}"]


def markdown(device: str, f: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(summary lines, report lines) of the GPU arm; empty on the CPU."""
    lines: list[str] = []
    report: list[str] = []
    x = f.get("device_memory")
    if x is not None:
        report += [f"## On {device}: the device budget", "",
                   f"Device budget {x['budget_bytes'] / 2**20:.0f} MiB per GPU; reserved at the end "
                   + (", ".join(f"{k}: {v / 2**20:.0f} MiB" for k, v in x["reserved_bytes"].items()) or "none")
                   + f" (within: {'yes' if x['within'] else '**no**'}); pinned tier "
                   f"{fmt((x['pinned_tier_bytes'] or 0) / 2**20, 0)} of "
                   f"{fmt((x['pinned_tier_budget_bytes'] or 0) / 2**20, 0)} MiB.", ""]
    y = f.get("reload")
    if y is not None:
        report += ["## B6 (Fig. 5): reload from the pinned tier against from disk", "",
                   f"Mean miss minus mean hit over every sequence: pinned tier (lru) {fmt(y['pinned_ms'], 1)} ms, "
                   f"disk (lru-disk, `--pinned-tier 0`) {fmt(y['disk_ms'], 1)} ms; median miss "
                   f"{fmt(y['pinned_miss_p50_ms'], 1)} vs {fmt(y['disk_miss_p50_ms'], 1)} ms: pinned "
                   f"**{fmt(y['ratio'], 2)}x** faster (goal >= {GOAL:g}x: "
                   f"{'-' if y['ok'] is None else 'yes' if y['ok'] else '**no**'}).", ""]
        lines.append(f"reload: pinned tier {fmt(y['ratio'], 2)}x faster than disk (goal >= {GOAL:g}x)")
    return lines, report
