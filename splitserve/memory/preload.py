"""Which start-up models (``ServerConfig.load``) a node loads at start: only those that fit.

Loading every named model in turn under a memory budget makes the later ones evict the
earlier ones (LRU), so the node starts by loading models it then throws away, and one
larger than a budget fails the start. ``plan_preload`` walks the models in the operator's
order (for ``*``: the order they were registered in) and keeps each one that fits beside
those already kept, in every budget at once: host bytes, device bytes on each GPU partition
(a whole GPU or a MIG device: the smaller of the device budget and its memory), and the
count of resident models. A model that does not fit is skipped with the reason; it loads on
its first call, as any other model does. Nothing already kept is given up for a later one.

Sizes are what the memory manager charges (``ResidentModel.charge``/``device_charge``): the
measurement of an earlier load here when there is one, else the estimate from the weights
file (on a device: the weights once per instance, a lower bound), which the plan says. Pure:
sizes and budgets in, a plan out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

GIB = float(1 << 30)


@dataclass(frozen=True)
class Candidate:
    """A start-up model as the plan sees it: host bytes its residency is charged, device bytes
    per GPU partition UUID, and whether they were measured (else estimated)."""

    name: str
    host_bytes: int
    device_bytes: Mapping[str, int] = field(default_factory=dict)
    measured: bool = True


@dataclass(frozen=True)
class PreloadPlan:
    """The models to load at start, in order, and each skipped one with why."""

    load: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_preload(candidates: Sequence[Candidate], host_budget: int | None = None, device_budget: int | None = None,
                 device_memory: Mapping[str, int] | None = None, max_models: int | None = None) -> PreloadPlan:
    """The start-up models that fit together, in ``candidates``' order (see the module doc).

    ``host_budget``: host bytes resident models may take (None: no limit); ``device_budget``:
    device bytes per GPU partition (None: no limit beyond ``device_memory``, each partition's
    bytes by UUID); ``max_models``: resident models at once (None: no limit)."""
    memory = dict(device_memory or {})
    kept: list[str] = []
    skipped: list[tuple[str, str]] = []
    host = 0
    device: dict[str, int] = {}
    for c in candidates:
        why = None
        if max_models is not None and len(kept) >= max_models:
            why = f"max_resident_models {max_models} reached by {', '.join(kept)}"
        elif host_budget is not None and host + c.host_bytes > host_budget:
            why = (f"needs {_gib(c.host_bytes)} of host memory; {_gib(max(0, host_budget - host))} of the "
                   f"{_gib(host_budget)} budget is left")
        else:
            for uuid, need in sorted(c.device_bytes.items()):
                room = min(device_budget if device_budget is not None else float("inf"),
                           memory.get(uuid, float("inf")))
                if device.get(uuid, 0) + need > room:
                    why = (f"needs {_gib(need)} on GPU partition {uuid}; {_gib(max(0, room - device.get(uuid, 0)))} "
                           f"of its {_gib(room)} is left")
                    break
        if why is not None:
            skipped.append((c.name, why if c.measured else f"{why} (estimated: not loaded on this node before)"))
            continue
        kept.append(c.name)
        host += c.host_bytes
        for uuid, need in c.device_bytes.items():
            device[uuid] = device.get(uuid, 0) + need
    return PreloadPlan(tuple(kept), tuple(skipped))
