"""The node's memory manager: applies ``memory.cache.ResidencyCache``'s decisions.

One per node, built by the composition root and handed to every model's residency as its
``ResidencyBroker``. It runs on the node's loop (every call is a loop callback, so there
are no locks): a model asks it for residency before any load, and it starts the evictions
and loads the cache decides, re-planning after every request for a model that is not
resident, every load and eviction that ends, and every batch that ends while a load waits
(a victim that was busy may be free then).

Calls go one way. A model reports to the manager through ``ResidencyBroker``; what a model
has to report while it carries out one of the manager's commands (``begin_load``,
``release_residency``, ``refuse_load``: a load that fails to place, an eviction with
nothing left to release) it returns with the command as ``Report``s, which the manager
applies and then plans again; it never calls back into a manager that is planning. It logs ``load_start``, ``load_done``,
``evict_start`` and ``evict_done`` into the coordinator's event log and keeps the memory
metrics. Without a budget (``memory_budget_bytes`` and ``max_resident_models`` unset) it
grants every request at once, as the node did before it had a manager, and logs nothing.

An evicted GPU model whose weights fit the pinned host tier (``memory.host_tier.PinnedTier``,
its own budget: ``pinned_tier_bytes``) is *parked*: its workers stay, holding the weights in
page-locked host memory only, so its device bytes come back to the device budget and its
next load is a reload from there (the first batch copies the weights back segment by
segment as it runs), not a load from disk. What the tier drops to make room (least
recently used) is released as any eviction; a model larger than the tier, and every CPU
model, is released as before.

A load's size is what its runtime knows (``ResidentModel.charge``: measured by its last
load, or 0 when nothing is known); when the load measures more, the measured bytes replace
the reservation at once and the next plan evicts least recently used models until the
budget holds again (the budget can be exceeded by that difference meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from splitserve.config import MemorySection
from splitserve.memory.cache import HOLDING, Residency, ResidencyCache
from splitserve.memory.host_tier import PinnedTier
from splitserve.server.metrics import Metrics
from splitserve.memory.footprints import MemoryFootprint

log = logging.getLogger(__name__)


class ReportKind(StrEnum):
    """What a model reports to its broker (each one a ``ResidencyBroker`` method)."""

    REQUEST = "request"
    LOADED = "loaded"
    EVICTING = "evicting"
    RELEASED = "released"
    LOAD_FAILED = "load_failed"


@dataclass(frozen=True, slots=True)
class Report:
    """One report a model made while it carried out a command of the manager: returned with
    the command, so the model never calls back into the manager that commanded it."""

    kind: ReportKind
    rt_waiting: bool = False  # REQUEST: real-time calls wait for it
    nbytes: int = 0  # LOADED: what it holds
    reason: str = ""  # LOAD_FAILED: why


class ResidentModel(Protocol):
    """One model as the memory manager drives it (a model's ``residency``,
    ``server.model.residency.ModelResidency``)."""

    name: str
    enabled: bool  # False after an operator's unload: it waits for no load
    keep_resident: bool  # never chosen as a victim
    footprint: MemoryFootprint  # what its last load measured (or nothing yet)

    @property
    def instance_count(self) -> int: ...

    def charge(self) -> int:
        """Bytes a residency of it takes now (weights once, private bytes per instance; 0 when unknown)."""

    def device_charge(self) -> dict[str, int]:
        """Device bytes per GPU partition UUID a residency of it takes now (each instance's
        copy; empty on the CPU or while its device size is unknown)."""

    def pinned(self) -> bool:
        """Not evictable now: a batch runs or is suspended on it, or its placement is changing."""

    def holds_memory(self) -> bool:
        """Its weights are resident, loading, or being released."""

    def begin_load(self) -> Sequence[Report]:
        """Load it now (the manager reserved its bytes); ends in the broker's ``loaded`` or
        ``load_failed`` (now: among the reports it returns)."""

    def pinned_charge(self) -> int:
        """Page-locked host bytes its weights take when parked (every instance's copy; 0: it
        never parks, a CPU model)."""

    def release_residency(self, park: bool = False) -> Sequence[Report]:
        """Start releasing its weights (calls keep queueing); ends in the broker's ``released``.
        With ``park``, the workers keep them in page-locked host memory (the pinned tier).
        Empty if nothing was resident or loading, or it is being released already; else
        EVICTING first (and RELEASED when nothing was left to release)."""

    def release_parked(self) -> None:
        """The pinned tier dropped it: the workers that parked its weights release them."""

    def weights_parked(self) -> bool:
        """Some worker holds its weights in page-locked host memory now (parked)."""

    def refuse_load(self, reason: str) -> Sequence[Report]:
        """It can never fit: fail it (its waiting calls get MODEL_NOT_READY with ``reason``)."""


class ResidencyBroker(Protocol):
    """The node's memory manager (``MemoryManager``) as a model's residency calls it: it asks
    for residency before any load, reports batch starts (the LRU clock) and ends, and every
    change of what it holds. Without a budget every request is granted at once."""

    def request(self, model: ResidentModel, rt_waiting: bool) -> None:
        """Calls wait for ``model``, which holds nothing: load it when it fits (perhaps now)."""

    def touch(self, name: str, now: float) -> None:
        """A batch of model ``name`` began (Rafiqi's "begins classification")."""

    def batch_done(self, name: str) -> None:
        """Batches of model ``name`` ended (or its placement change did): a victim that was
        busy may be free now."""

    def loaded(self, model: ResidentModel, nbytes: int) -> None:
        """``model`` serves, holding ``nbytes`` (again after every LOADED, as measured)."""

    def evicting(self, model: ResidentModel) -> None:
        """``model`` began releasing its weights (the manager's choice or an operator's evict)."""

    def released(self, model: ResidentModel) -> None:
        """``model`` holds nothing any more (evicted, unloaded, or its load was abandoned)."""

    def load_failed(self, model: ResidentModel, reason: str) -> None:
        """``model``'s load failed; its waiting calls were answered."""


class MemoryManager:
    """Rafiqi's memory manager on the node's loop (the runtimes' ``ResidencyBroker``).

    ``note(kind, model)`` appends to the coordinator's event log; ``spares()`` counts the
    node's idle worker processes (ready, and still starting); ``clock`` is perf_counter
    seconds, the LRU's clock."""

    def __init__(self, config: MemorySection, metrics: Metrics, note: Callable[[str, str], None] = lambda k, m: None,
                 spares: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.managed = config.managed
        loads = config.max_concurrent_loads if self.managed else 1 << 30  # no manager: every load starts at once
        self.cache = ResidencyCache(config.memory_budget_bytes, config.max_resident_models, loads,
                                    config.device_budget_bytes)
        self.tier = PinnedTier(config.pinned_tier_bytes)  # evicted GPU models' weights, page-locked
        self.metrics = metrics
        self._note = note
        self.spares = spares
        self.clock = clock
        self.models: dict[str, ResidentModel] = {}
        self._load_began: dict[str, float] = {}
        self.last_load_ms: dict[str, float] = {}
        if config.memory_budget_bytes is not None:
            metrics.memory_budget.set(config.memory_budget_bytes)

    # -- ResidencyBroker ---------------------------------------------------------------------

    def request(self, model: ResidentModel, rt_waiting: bool) -> None:
        self._apply(model, Report(ReportKind.REQUEST, rt_waiting=rt_waiting))
        self._plan()

    def touch(self, name: str, now: float) -> None:
        self.cache.touch(name, now)

    def batch_done(self, name: str) -> None:
        if self.cache.load_queue():  # a load may wait for a victim that was busy
            self._plan()

    def loaded(self, model: ResidentModel, nbytes: int) -> None:
        self._apply(model, Report(ReportKind.LOADED, nbytes=nbytes))
        self._plan()  # what it measured may exceed what it reserved

    def evicting(self, model: ResidentModel) -> None:
        self._apply(model, Report(ReportKind.EVICTING))

    def released(self, model: ResidentModel) -> None:
        self._apply(model, Report(ReportKind.RELEASED))
        self._plan()

    def load_failed(self, model: ResidentModel, reason: str) -> None:
        self._apply(model, Report(ReportKind.LOAD_FAILED, reason=reason))
        self._plan()

    # -- what the reports change -----------------------------------------------------------------

    def _apply(self, model: ResidentModel, report: Report) -> None:
        kind = report.kind
        if kind is ReportKind.REQUEST:
            self.models[model.name] = model
            self.cache.request(model.name, self.clock(), report.rt_waiting)
        elif kind is ReportKind.LOADED:
            self._loaded(model, report.nbytes)
        elif kind is ReportKind.EVICTING:
            self.models[model.name] = model
            self.cache.evicting(model.name)
            self._event("evict_start", model.name)
        elif kind is ReportKind.RELEASED:
            self._released(model)
        else:
            self.cache.failed(model.name, report.reason)
            self._load_began.pop(model.name, None)
            self.metrics.model_resident_bytes.labels(model.name).set(0)

    def _loaded(self, model: ResidentModel, nbytes: int) -> None:
        self.models[model.name] = model
        e = self.cache.entry(model.name)
        first = e.residency is Residency.LOADING
        self.cache.loaded(model.name, nbytes, model.device_charge())
        self.metrics.model_resident_bytes.labels(model.name).set(nbytes)
        if first:
            # reloaded (or loaded anew): the workers free the pinned copy after its first batch
            self.tier.forget(model.name)
            began = self._load_began.pop(model.name, None)
            if began is not None:
                seconds = self.clock() - began
                self.last_load_ms[model.name] = seconds * 1e3
                self.metrics.model_load_seconds.labels(model.name).observe(seconds)
            self.metrics.model_loads.labels(model.name).inc()
            self._event("load_done", model.name)
            log.info("memory: %s resident (%d bytes; %d of %s reserved)", model.name, nbytes, self.cache.reserved,
                     self.config.memory_budget_bytes)

    def _released(self, model: ResidentModel) -> None:
        e = self.cache.entry(model.name)
        was = e.residency
        self.cache.released(model.name, disabled=not model.enabled)
        if not model.weights_parked():  # unloaded (workers stopped), or a worker could not park: nothing held
            self.tier.forget(model.name)
        self._load_began.pop(model.name, None)
        self.metrics.model_resident_bytes.labels(model.name).set(0)
        if was is Residency.EVICTING:
            self.metrics.model_evictions.labels(model.name).inc()
            self._event("evict_done", model.name)

    # -- the node's other parts ----------------------------------------------------------------

    def forget(self, name: str) -> None:
        """``name`` was unregistered."""
        self.models.pop(name, None)
        self.cache.forget(name)
        self.tier.forget(name)
        self._load_began.pop(name, None)
        self.last_load_ms.pop(name, None)

    def refresh_metrics(self) -> None:
        """Gauges from live state, just before a scrape."""
        self.metrics.memory_reserved.set(self.cache.reserved)
        self.metrics.worker_spares.set(self.spares()[0])

    def status(self) -> dict[str, Any]:
        """``GET /v2/memory``: budget, reserved and resident bytes, LRU order, the load queue, and each model."""
        cache, now = self.cache, self.clock()
        tier_held = self.tier.held()
        spares, starting = self.spares()
        models = {}
        for name, e in sorted(cache.entries.items()):
            m = self.models.get(name)
            footprint = m.footprint if m is not None else None
            models[name] = {
                # an evicting model is on its way out: users see it as EVICTED (it loads on its next request)
                "residency": (Residency.EVICTED if e.residency is Residency.EVICTING else e.residency).value,
                "reason": e.reason if e.residency is Residency.FAILED else
                ("releasing its weights" if e.residency is Residency.EVICTING else None),
                "weights_bytes": footprint.weights_bytes if footprint is not None else 0,
                "private_bytes": footprint.private_bytes if footprint is not None else 0,
                "reserved_bytes": e.charge if e.residency in HOLDING else 0,
                "device_bytes": footprint.device_bytes if footprint is not None else 0,
                "device_reserved_bytes": dict(e.device_charge) if e.residency in HOLDING else {},
                "pinned_bytes": tier_held.get(name, 0),
                "instances": m.instance_count if m is not None else 0,
                "loads": e.loads, "evictions": e.evictions,
                "last_load_ms": self.last_load_ms.get(name),
                "keep_resident": m.keep_resident if m is not None else e.keep_resident,
                "last_used_s_ago": None if e.last_used is None else max(0.0, now - e.last_used),
            }
        return {
            "budget_bytes": self.config.memory_budget_bytes, "max_resident_models": self.config.max_resident_models,
            "max_concurrent_loads": self.config.max_concurrent_loads, "reserved_bytes": cache.reserved,
            "device_budget_bytes": self.config.device_budget_bytes, "device_reserved_bytes": cache.device_reserved(),
            "pinned_tier_budget_bytes": self.tier.budget, "pinned_tier_bytes": self.tier.used,
            "pinned_tier": list(tier_held),
            "resident_bytes": sum(e.charge for e in cache.entries.values() if e.residency is Residency.RESIDENT),
            "lru": cache.lru(),
            "loading": sorted(n for n, e in cache.entries.items() if e.residency is Residency.LOADING),
            "load_queue": cache.load_queue(), "spares": spares, "spares_starting": starting,
            "loads": sum(e.loads for e in cache.entries.values()),
            "evictions": sum(e.evictions for e in cache.entries.values()),
            "models": models,
        }

    # -- applying the plan -----------------------------------------------------------------------

    def _event(self, kind: str, name: str) -> None:
        if self.managed:  # without a manager the event log stays as it was: batches only
            self._note(kind, name)

    def _plan(self) -> None:
        """Plan and carry the plan out, again while the models' answers changed something (a
        load that failed to place, an eviction with nothing left to release)."""
        while self._plan_once():
            pass

    def _answered(self, model: ResidentModel, reports: Sequence[Report]) -> bool:
        """Apply what ``model`` reported while it carried out a command; True if that calls
        for another plan."""
        for report in reports:
            self._apply(model, report)
        return any(r.kind is not ReportKind.EVICTING for r in reports)

    def _plan_once(self) -> bool:
        cache = self.cache
        for name, m in self.models.items():
            e = cache.entry(name)
            e.keep_resident = m.keep_resident
            if e.residency not in HOLDING:
                e.charge, e.device_charge = m.charge(), m.device_charge()
        busy = {n for n, m in self.models.items() if m.pinned()}
        plan = cache.plan(self.clock(), busy)
        again = False
        for name in plan.evict:
            m = self.models[name]
            park = self._offer_to_tier(m)
            log.info("memory: evicting %s (least recently used) to make room%s", name,
                     "; its weights wait in the pinned host tier" if park else "")
            reports = m.release_residency(park)
            if not reports and not m.holds_memory():
                reports = [Report(ReportKind.RELEASED)]  # it held nothing after all
            again = self._answered(m, reports) or again
        for name, why in plan.refuse.items():
            log.warning("memory: %s", why)
            again = self._answered(self.models[name], self.models[name].refuse_load(why)) or again
        for name in plan.load:
            m = self.models[name]
            self._load_began[name] = self.clock()
            self._event("load_start", name)
            again = self._answered(m, m.begin_load()) or again
        return again

    # -- the pinned host tier ------------------------------------------------------------------

    def _offer_to_tier(self, m: ResidentModel) -> bool:
        """Whether the victim ``m`` parks its weights in the pinned tier; the models the tier
        drops for it (least recently used, never one reloading now) release theirs."""
        nbytes = m.pinned_charge()
        if nbytes <= 0:
            return False  # a CPU model, or one whose size is not known yet
        # never dropped: copies in flight (reloading, parking now: nothing would free them) and
        # models a call waits for (their load is the reload this tier is for)
        reloading = [n for n, e in self.cache.entries.items()
                     if e.residency in (Residency.LOADING, Residency.EVICTING) or e.wanted_since is not None]
        offer = self.tier.offer(m.name, nbytes, self.clock(), reloading)
        for name in offer.drop:
            log.info("memory: the pinned host tier drops %s (least recently used) for %s", name, m.name)
            dropped = self.models.get(name)
            if dropped is not None:
                dropped.release_parked()
        if not offer.keep:
            log.info("memory: %s is released, not parked: %s", m.name, offer.reason)
        return offer.keep
