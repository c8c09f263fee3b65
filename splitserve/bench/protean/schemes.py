"""The schemes PROTEAN is compared with, each nothing but ``ServerConfig`` overrides.

The table is the schemes' contract: a scheme never gets a code path of its own in the server,
so a difference between two schemes' numbers is a difference between their settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from splitserve.config import ServerConfig, settings_env

# scheme -> ServerConfig field -> value (PROTEAN §5 baselines; see docs/protean-bench.md)
SCHEMES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "protean": MappingProxyType({"partitioning": "protean"}),
    # Naive Slicing: static partitions, load-balanced, strictness-agnostic
    "naive": MappingProxyType({"partitioning": "static", "class_order": "arrival", "preemption": "concurrent"}),
    # INFless/Llama: everything co-located on all the node's cores, strictness-agnostic
    "colocate": MappingProxyType({"partitioning": "colocate", "class_order": "arrival",
                                  "preemption": "concurrent"}),
    # Molecule (beta): one batch at a time on the whole node, in arrival order
    "timeshare": MappingProxyType({"partitioning": "colocate", "class_order": "arrival", "preemption": "seq"}),
    # the §2.2 straw man: strict always on the largest partition (the ablation of eta)
    "smart-static": MappingProxyType({"partitioning": "static", "strict_placement": "largest",
                                      "preemption": "concurrent"}),
    # PROTEAN with immediate scale-down: the cold-start comparison of §4.2
    "protean-no-keepalive": MappingProxyType({"partitioning": "protean", "protean_keep_alive_s": 0}),
    # PROTEAN without splitserve's waits, strict (wait-for-free) and BE (keeping off strict
    # work): Algorithm 1 as the paper has it
    "protean-no-wait": MappingProxyType({"partitioning": "protean", "protean_wait_for_free": False,
                                         "protean_be_max_wait_s": 0}),
    # PROTEAN with the paper's BE first fit, which may start BE beside a running strict batch:
    # the ablation of splitserve's BE wait alone
    "protean-be-spill": MappingProxyType({"partitioning": "protean", "protean_be_max_wait_s": 0}),
})

# The scheme every other one is set against in the ratios (violations, p99, queue share).
REFERENCE = "protean"


def check_schemes(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` in the table's order, refusing unknown ones with the valid ones listed."""
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        raise ValueError(f"unknown schemes {', '.join(unknown)}; choose from {', '.join(SCHEMES)}")
    if not names:
        raise ValueError(f"give at least one scheme; choose from {', '.join(SCHEMES)}")
    return tuple(n for n in SCHEMES if n in names)


def server_env(overrides: Mapping[str, Any]) -> dict[str, str]:
    """The ``SPLITSERVE_*`` variables that set ``overrides`` on a server (every ServerConfig
    field reads its own), so a scheme needs no flag of its own."""
    return settings_env(overrides)


def expected_config(overrides: Mapping[str, Any]) -> ServerConfig:
    """The configuration a server started with ``server_env(overrides)`` must be running
    (the same resolution the server applies: defaults, environment, then the overrides)."""
    return ServerConfig.from_env(**{k: v for k, v in overrides.items()})


def _concurrency(events: Sequence[Mapping[str, Any]]) -> int:
    """The most batches the event log shows running at once (start/resume to done/failed/preempted)."""
    running: set[tuple[str, int, int]] = set()
    most = 0
    for e in sorted(events, key=lambda e: (e["t"], e["kind"] in ("start", "resume"))):
        key = (str(e.get("model")), int(e.get("instance", 0)), int(e.get("batch", 0)))
        if e["kind"] in ("start", "resume"):
            running.add(key)
            most = max(most, len(running))
        elif e["kind"] in ("done", "failed", "preempted"):
            running.discard(key)
    return most


def settings_problems(scheme: str, overrides: Mapping[str, Any], partitions: Any, events: Any,
                      geometry: Sequence[int] = ()) -> list[str]:
    """What a scheme's server shows that its settings did not take: ``partitions`` is its
    ``GET /v2/partitions`` body, ``events`` its ``/v2/scheduler/events`` body over the run,
    ``geometry`` the partition core counts asked for (empty: not checked). Empty when every
    setting took; a run with problems must not report numbers as the scheme's."""
    want = expected_config(overrides)
    out: list[str] = []
    if not isinstance(partitions, Mapping) or not isinstance(events, Mapping):
        return [f"{scheme}: the server answered no /v2/partitions or no scheduler events"]
    placement = want.protean.strict_placement.resolve(want.protean.partitioning).value
    seen = {"partitioning": (partitions.get("partitioning"), want.protean.partitioning.value),
            "strict_placement": (partitions.get("strict_placement"), placement),
            "preemption": (events.get("mode"), want.reef.preemption.value),
            "class_order": (events.get("class_order"), want.reef.class_order.value),
            "protean_keep_alive_s": (partitions.get("keep_alive_s"), want.protean.protean_keep_alive_s)}
    if placement == "eta":
        seen["protean_wait_for_free"] = (partitions.get("wait_for_free"), want.protean.protean_wait_for_free)
        seen["protean_be_max_wait_s"] = (partitions.get("be_max_wait_s"), want.protean.protean_be_max_wait_s)
    out += [f"{scheme}: {name} is {got!r}, not {wanted!r}" for name, (got, wanted) in seen.items() if got != wanted]
    parts = partitions.get("partitions") or []
    cores = sorted((len(p["cpus"]) for p in parts), reverse=True)
    if geometry and cores != sorted(geometry, reverse=True):
        out.append(f"{scheme}: partitions of {cores} cores, not {sorted(geometry, reverse=True)}")
    if want.protean.partitioning.value == "colocate" and len(parts) != 1:
        out.append(f"{scheme}: colocate shares every core in one partition, the server has {len(parts)}")
    ids = {int(p["id"]) for p in parts}
    starts = [e for e in events.get("events", []) if e["kind"] == "start"]
    if not starts:
        out.append(f"{scheme}: no batch started during the run")
    off = sorted({int(e.get("partition", -1)) for e in starts} - ids)
    if off and not partitions.get("changes"):  # partition ids change only with the geometry
        out.append(f"{scheme}: batches started on partitions {off}, not the server's {sorted(ids)}")
    if placement == "largest" and not partitions.get("changes") and parts:
        largest = max(parts, key=lambda p: (len(p["cpus"]), p.get("mem_bytes", 0), -int(p["id"])))["id"]
        elsewhere = sum(1 for e in starts if e.get("cls") == "rt" and e.get("partition") != largest)
        if elsewhere:
            out.append(f"{scheme}: {elsewhere} strict batches ran off the largest partition {largest}")
    if want.reef.preemption.value == "seq" and _concurrency(events.get("events", [])) > 1:
        out.append(f"{scheme}: preemption seq, yet {_concurrency(events.get('events', []))} batches ran at once")
    return out
