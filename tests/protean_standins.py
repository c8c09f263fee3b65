"""Minimal private stand-ins for the pure PROTEAN modules (``placement.slowdown``,
``placement.protean``, ``placement.autoscale``) that another branch writes, following the
issue's contract, so the node's tests run before that branch is merged. ``install()`` puts
them in ``sys.modules`` only where the real module cannot be imported; once it exists, the
real one is used and this file can go."""

from __future__ import annotations

import importlib
import math
import sys
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


# -- placement.slowdown ------------------------------------------------------------------------

def interference(fbrs: Iterable[float]) -> float:
    return max(sum(fbrs), 1.0)


def eta(rdf: float, own_fbr: float, corunner_fbrs: Iterable[float]) -> float:
    return rdf * interference([own_fbr, *corunner_fbrs])


class SlowdownModel:
    def __init__(self, solo: Callable[[str, int, int], float | None], fbr: Mapping[str, float], whole_cores: int,
                 unknown_fbr: float = 1.0) -> None:
        self.solo, self.fbr, self.whole_cores, self.unknown_fbr = solo, fbr, whole_cores, unknown_fbr

    def rdf(self, model: str, batch: int, cores: int) -> float:
        part, whole = self.solo(model, cores, batch), self.solo(model, self.whole_cores, batch)
        return part / whole if part and whole else 1.0

    def fbr_of(self, model: str) -> float:
        return self.fbr.get(model, self.unknown_fbr)

    def eta(self, model: str, batch: int, cores: int, corunners: Sequence[str]) -> float:
        return eta(self.rdf(model, batch, cores), self.fbr_of(model), [self.fbr_of(m) for m in corunners])

    def predict(self, model: str, batch: int, cores: int, corunners: Sequence[str]) -> float | None:
        solo = self.solo(model, cores, batch)
        return None if solo is None else solo * interference([self.fbr_of(model), *map(self.fbr_of, corunners)])


# -- placement.protean -------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    model: str
    batch: int
    strict: bool
    mem_bytes: int


@dataclass(frozen=True)
class Slot:
    id: int
    cores: int
    mem_bytes: int
    running: tuple[Job, ...] = ()


def _smallest_first(slots: Sequence[Slot]) -> list[Slot]:
    return sorted(slots, key=lambda s: (s.cores, s.mem_bytes))


def tag_partitions(slots: Sequence[Slot], be_mem: int) -> dict[int, float]:
    tags = {s.id: 0.0 for s in slots}
    for s in _smallest_first(slots):
        if be_mem <= 0:
            break
        tags[s.id] = min(1.0, be_mem / s.mem_bytes) if s.mem_bytes else 1.0
        be_mem = max(0, be_mem - s.mem_bytes)
    return tags


class JobDistributor:
    def __init__(self, model: SlowdownModel) -> None:
        self.model = model

    def choose(self, job: Job, slots: Sequence[Slot], tags: Mapping[int, float], eligible: Collection[int],
               be_models: Sequence[str] = ()) -> int | None:
        cands = [s for s in slots if s.id in eligible]
        if not job.strict:
            for s in _smallest_first(cands):
                if s.mem_bytes - sum(j.mem_bytes for j in s.running) >= job.mem_bytes:
                    return s.id
            return None
        def key(s: Slot) -> tuple[float, int, int]:
            return (self.model.eta(job.model, job.batch, s.cores, [j.model for j in s.running]), -s.cores, -s.mem_bytes)
        open_ = [s for s in cands if tags.get(s.id, 0.0) < 1]
        pool = open_ or cands
        return min(pool, key=key).id if pool else None


@dataclass(frozen=True)
class Geometry:
    units: tuple[int, ...]


INITIAL_GEOMETRY = Geometry((4, 2, 1))
FALLBACK_GEOMETRY = Geometry((4, 3))
SMALL_SETS = ((1, 2), (3,))


def cpu_unit(worker_cores: int) -> int | None:
    return worker_cores // 7 if worker_cores >= 7 else None


def carve(geometry: Geometry, cpus: Sequence[int], unit: int) -> list[tuple[int, ...]]:
    out, at = [], 0
    for u in geometry.units:
        out.append(tuple(cpus[at:at + u * unit]))
        at += u * unit
    return out


@dataclass(frozen=True)
class ProteanSettings:
    monitor_interval_s: float = 2.0
    ewma_weight: float = 0.5
    wait_limit: int = 3
    reconfig_fraction: float = 0.3
    require_same_target: bool = False
    t_low: float | None = None
    t_high: float | None = None
    keep_alive_s: float = 600.0
    unknown_fbr: float = 1.0


class GeometryController:
    def __init__(self, settings: ProteanSettings, groups: int, unit_mem: int, be_mem: Callable[[float], int],
                 thresholds: Callable[[Geometry, float], tuple[float, float]] | None = None) -> None:
        self.current = [INITIAL_GEOMETRY] * groups
        self.last: dict = {}

    def tick(self, now: float, be_waiting: float) -> list[tuple[int, Geometry]]:
        return []

    def applied(self, group: int, geometry: Geometry) -> None:
        self.current[group] = geometry


# -- placement.autoscale -----------------------------------------------------------------------

@dataclass
class InstanceAutoscaler:
    keep_alive_s: float
    cold_starts: dict[str, int] = field(default_factory=dict)

    def tick(self, now: float, pending: Mapping[str, int], batch: Mapping[str, int],
             current: Mapping[str, int]) -> dict[str, int]:
        out = {}
        for m, cur in current.items():
            want = max(1, math.ceil(pending.get(m, 0) / max(1, batch.get(m, 1))))
            if want > cur:
                self.cold_starts[m] = self.cold_starts.get(m, 0) + want - cur
            out[m] = max(want, cur)  # never retires here: the keep-alive is the real module's
        return out


_MODULES = {
    "splitserve.placement.slowdown": ("interference", "eta", "SlowdownModel"),
    "splitserve.placement.protean": ("Job", "Slot", "tag_partitions", "JobDistributor", "Geometry", "INITIAL_GEOMETRY",
                                     "FALLBACK_GEOMETRY", "SMALL_SETS", "cpu_unit", "carve", "ProteanSettings",
                                     "GeometryController"),
    "splitserve.placement.autoscale": ("InstanceAutoscaler",),
}


def install() -> None:
    """Put a stand-in in ``sys.modules`` for each of the modules that cannot be imported yet."""
    here = globals()
    for name, names in _MODULES.items():
        try:
            importlib.import_module(name)
        except ImportError:
            mod = types.ModuleType(name, "stand-in (tests/protean_standins.py)")
            for n in names:
                setattr(mod, n, here[n])
            sys.modules[name] = mod
