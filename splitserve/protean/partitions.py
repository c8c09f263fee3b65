"""PROTEAN on one node: the node's partitions, the per-batch choice of one, the instance
autoscaler and geometry changes, on the loop.

With ``ServerConfig.protean.partitioning`` other than none the root builds one ``PartitionManager``.
It carves the worker cores into partitions at start (``Carved`` partitions of the node's
``ResourceManager``, so nothing else pins onto them), and is:

- the runtimes' ``PartitionSource`` (``RuntimeEnv.partitions``): each model's
  ``PartitionPlacer`` puts warm instances on every partition;
- the coordinator's ``BatchPlacement``: for every batch, the instance whose partition the
  node's ``strict_placement`` picks (PROTEAN's Algorithm 1, smart-static or naive);
- management's ``PartitionControl``: ``GET``/``POST /v2/partitions``.

Every change of placement it makes (an autoscaler's resize, a geometry change from the
controller or an operator) goes through the node's one applier (``PlacementChanger``), so
the old instances drain while the new ones serve and no request is lost or answered twice.
The deciders are pure (``placement.protean``, ``placement.autoscale``,
``placement.node_partitions``); this module reads the node, calls them on timers and
applies what they say.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from splitserve.config import ServerConfig
from splitserve.protean.instance_autoscale import InstanceAutoscaler
from splitserve.protean.node_partitions import (
    BatchChooser, initial_layout, parse_geometry, slice_cpus, slots_of, split_memory, worker_cpus,
)
from splitserve.placement.partition import (
    Carved, InstancePlacement, NodePartition, OnPartition, Partitioning, StrictPlacement, cpu_list,
)
from splitserve.protean.distributor import Job, JobDistributor, Slot
from splitserve.protean.geometry import Geometry, carve
from splitserve.protean.mig_slots import MigBatchChooser
from splitserve.protean.reconfig import GeometryController, ProteanSettings, derive_thresholds
from splitserve.placement.resources import ResourceManager
from splitserve.protean.slowdown import Shape, SlowdownModel
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import InstanceView, PriorityMode
from splitserve.server.metrics import Metrics
from splitserve.memory.footprints import MemoryFootprint
from splitserve.server.applier import PlacementChanger
from splitserve.server.coordinator import Chosen

log = logging.getLogger(__name__)

NODE_OWNER = "node"  # the owner of the node's partitions in the ResourceManager


class ProteanProfileSource(Protocol):
    """What PROTEAN's deciders read of the node's stored profiles (``protean.profiles.ProteanProfiles``,
    over the registry): the slowdown model's solo times and FBRs and Algorithm 1's batch
    memory. Built once by the root; read on the loop (each model's profiles are read once,
    then kept until ``forget``). None means "not profiled here": never a made-up number."""

    def solo(self, model: str, shape: Shape, batch: int) -> float | None:
        """Seconds one batch of ``batch`` takes alone on a partition of ``shape``: ``cores``
        cores (the stored L[cores, batch]) or a MIG profile (its own latency profile); None
        without such a profile."""

    def fbr(self, model: str, mig: str | None = None) -> float | None:
        """The model's fitted FBR on the node's cores (on the MIG profile ``mig``); None when
        never fitted or unidentified."""

    def footprint(self, model: str, batch: int, mig: str | None = None) -> int | None:
        """Bytes a batch of ``batch`` takes: the per-batch footprint, else (on the CPUs) the
        private bytes the model's load measured (``kind="memory"``), else None; ``mig``: the
        device bytes measured on that MIG profile."""

    def forget(self, model: str | None = None) -> None:
        """Read ``model``'s (every model's: None) profiles again on next use, e.g. after
        ``splitserve profile`` stored new ones."""


class PartitionedModel(Protocol):
    """One model as the node's partition manager drives it (``server.model.placement.ModelPlacement``,
    a model's ``placements``): its
    autoscaler reads the pending work and sets the instance count; a geometry change moves
    its instances onto new partitions through the node's applier."""

    name: str
    footprint: MemoryFootprint  # measured at its first load (private bytes: one instance's own, at max batch)

    @property
    def instance_count(self) -> int: ...

    @property
    def dispatch_max_batch(self) -> int: ...

    def placed_now(self) -> bool:
        """It holds instances (loaded or loading): autoscaling and geometry changes apply to it."""

    def waiting_requests(self, cls: RequestClass | None = None) -> int:
        """Requests waiting for a batch (of ``cls``, or of every class)."""

    async def resize(self, instances: int) -> None:
        """Serve with ``instances`` instances (the placer spreads them over the partitions)."""

    def placements_on(self, partitions: Sequence[NodePartition]) -> list[InstancePlacement]:
        """As many instances as serve now, on ``partitions`` (``NodePartition``s of a new
        geometry); takes the model's places on them from the ``ResourceManager``."""

    def kick(self) -> None:
        """Run a scheduling pass soon (a strict batch waiting for a partition is due to be
        decided again)."""


def protean_settings(config: ServerConfig) -> ProteanSettings:
    """The ``protean_*`` settings as Algorithm 2 and the autoscaler take them."""
    return ProteanSettings(
        monitor_interval_s=config.protean.protean_monitor_interval_s, ewma_weight=config.protean.protean_ewma_weight,
        wait_limit=config.protean.protean_wait_limit, reconfig_fraction=config.protean.protean_reconfig_fraction,
        require_same_target=config.protean.protean_require_same_target, t_low=config.protean.protean_t_low,
        t_high=config.protean.protean_t_high, keep_alive_s=config.protean.protean_keep_alive_s,
        unknown_fbr=config.protean.protean_unknown_fbr, wait_for_free=config.protean.protean_wait_for_free,
        be_max_wait_s=config.protean.protean_be_max_wait_s)


class PartitionManager:
    """The node's partitions and what PROTEAN does with them (see the module doc).

    ``models()`` gives the node's models; ``view()`` the coordinator's view of every instance
    (what runs where); ``total_mem`` the bytes the partitions share by cores; ``profiles``
    (settable once the registry is open) the solo latencies, FBRs and footprints.
    """

    def __init__(self, config: ServerConfig, resources: ResourceManager, changer: PlacementChanger,
                 models: Callable[[], Iterable[PartitionedModel]], view: Callable[[], list[InstanceView]],
                 metrics: Metrics, total_mem: int, profiles: ProteanProfileSource | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 mig_geometry: Callable[[Sequence[int]], object] | None = None) -> None:
        self.config = config
        self.partitioning = config.protean.partitioning
        self.warm = config.protean.partition_warm_instances
        self.resources = resources
        self.changer = changer
        self.models = models
        self.view = view
        self.metrics = metrics
        self.total_mem = total_mem
        self.profiles = profiles
        self.clock = clock
        # the controller's geometry on the node's MIG GPUs (``server.mig_geometry``; blocking: run off the loop)
        self.mig_geometry = mig_geometry
        # η placement among the MIG devices a model's instances hold (set by the root once its devices exist)
        self.mig: MigBatchChooser | None = None
        self.cpus = worker_cpus(sorted(resources.cpus))
        layout = initial_layout(config.protean.partitioning, config.protean.geometry, self.cpus)
        self.geometry: Geometry | None = layout.geometry  # PROTEAN's units, None for a static layout
        self.unit = layout.unit
        self._parts = self._carve(layout.cpu_sets)
        self.settings = protean_settings(config)
        self.policy = config.protean.strict_placement.resolve(config.protean.partitioning)
        self.slowdown = self._slowdown_model()
        self.chooser = BatchChooser(self.policy, self._distributor())
        self.autoscaler = InstanceAutoscaler(config.protean.protean_keep_alive_s)
        self.controller: GeometryController | None = None
        self.controller_off: str | None = None  # why no geometry controller runs
        if self.geometry is not None and self.unit is not None:
            self.controller = GeometryController(self.settings, 1, self._unit_mem(), self._be_mem_of,
                                                 self._thresholds)
        else:
            self.controller_off = (f"{len(self.cpus)} worker cores: PROTEAN's geometries need at least 7"
                                   if config.protean.partitioning is Partitioning.PROTEAN else
                                   f"partitioning {config.protean.partitioning.value} keeps its geometry")
        self.changes: deque[dict[str, Any]] = deque(maxlen=config.packrat.placement_history)
        self._lock = asyncio.Lock()  # one geometry change at a time
        self._timers: list[asyncio.TimerHandle] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # model -> when its waiting batch is decided again, and the callback armed for it (the
        # time is kept here: uvloop returns a plain Handle, without when(), for a delay under 1 ms)
        self._wakes: dict[str, tuple[float, asyncio.Handle]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._scaling: dict[str, int] = {}  # model -> the instance count its resize under way brings
        self.cold_starts: dict[str, int] = {}  # model -> instances scale-up started (that came up)
        self.retired: dict[str, int] = {}  # model -> instances scale-down retired (that went)
        # the autoscaler's resizes, oldest first: when each was asked and landed, so a report can
        # set instances started and retired against the load (bounded like placement records)
        self.resizes: deque[dict[str, Any]] = deque(maxlen=config.packrat.placement_history)
        # The models that stand for the BE and the strict mix in Algorithm 2 (the one with most
        # work of the class at the last tick): Job(model, batch, strict, bytes of one batch).
        self._main: dict[bool, Job] = {}
        log.info("partitions (%s, strict placement %s): %s on worker CPUs %s", self.partitioning.value,
                 self.policy.value, "; ".join(f"{p.id}: {cpu_list(p.cpus)}" for p in self._parts),
                 cpu_list(self.cpus))
        if len(resources.cpus) <= 2:
            log.info("partitions: %d CPUs: the front end shares the partitions' cores with the workers",
                     len(resources.cpus))
        if self.controller is None and config.protean.partitioning is Partitioning.PROTEAN:
            log.info("partitions: no geometry controller (%s); static geometry", self.controller_off)

    # -- PartitionSource (the models' placers) ------------------------------------------------

    def current(self) -> list[NodePartition]:
        return list(self._parts)

    # -- the partitions ------------------------------------------------------------------

    def _carve(self, cpu_sets: Sequence[Sequence[int]]) -> list[NodePartition]:
        mems = split_memory(self.total_mem, cpu_sets)
        parts: list[NodePartition] = []
        try:
            for cpus, mem in zip(cpu_sets, mems):
                p = self.resources.allocate(NODE_OWNER, Carved(frozenset(cpus)))
                parts.append(NodePartition(p.id, p.cpus, mem))
        except BaseException:
            for p in parts:
                self.resources.release_partition(p.id)
            raise
        return parts

    def _release(self, parts: Sequence[NodePartition]) -> None:
        """Give back partitions no instance sits on any more, with the models' places on them."""
        for part in parts:
            places = [p for p in self.resources.partitions()
                      if isinstance(p.request, OnPartition) and p.request.partition == part.id]
            placed = self.resources.placement()
            busy = {m for m, insts in placed.items() for q in insts.values() if q.partition == part.id}
            if busy:
                log.error("partition %d still holds instances of %s; kept", part.id, ", ".join(sorted(busy)))
                continue
            for p in places:
                self.resources.release_partition(p.id)
            self.resources.release_partition(part.id)

    # -- profiles ------------------------------------------------------------------------

    def _solo(self, model: str, shape: Shape, batch: int) -> float | None:
        return self.profiles.solo(model, shape, batch) if self.profiles is not None else None

    def _slowdown_model(self) -> SlowdownModel:
        """The slowdown model over the FBRs known now."""
        fbr: dict[str, float] = {}
        if self.profiles is not None:
            for m in self.models():
                value = self.profiles.fbr(m.name)
                if value is not None:
                    fbr[m.name] = value
        return SlowdownModel(self._solo, fbr, len(self.cpus), self.config.protean.protean_unknown_fbr)

    def _distributor(self) -> JobDistributor | None:
        if self.policy is not StrictPlacement.ETA:
            return None
        return JobDistributor(self.slowdown, self._batch_mem, wait_for_free=self.settings.wait_for_free,
                              be_max_wait_s=self.settings.be_max_wait_s)

    def _refresh(self) -> None:
        """Look at the FBRs again (a model's FBR can be fitted, or a model registered, while
        the node runs: every autoscaler tick does). The distributor is kept: it holds the
        partitions waiting strict batches wait for."""
        self.slowdown = self._slowdown_model()
        if self.chooser.distributor is not None:
            self.chooser.distributor.model = self.slowdown

    def _batch_mem(self, model: str) -> int | None:
        """Bytes one batch of ``model`` at its dispatch size holds (None: not a model here)."""
        models = {m.name: m for m in self.models()}
        m = models.get(model)
        return self.mem(model, m.dispatch_max_batch, models) if m is not None else None

    def _unit_mem(self) -> int:
        """Memory of one "1g" partition: the partitions' memory in proportion to cores."""
        assert self.unit is not None
        return self.total_mem * self.unit // len(self.cpus)

    def mem(self, model: str, batch: int, models: Mapping[str, PartitionedModel]) -> int:
        """Bytes a batch of ``batch`` of ``model`` takes: its profiled footprint, else what its
        instance added at its first load (measured at max batch)."""
        found = self.profiles.footprint(model, batch) if self.profiles is not None else None
        if found is not None:
            return found
        m = models.get(model)
        return m.footprint.private_bytes if m is not None else 0

    # -- BatchPlacement (the coordinator) --------------------------------------------------

    def _be_demand(self, node: Sequence[InstanceView],
                   models: Mapping[str, PartitionedModel]) -> tuple[int, list[str]]:
        """Best-effort memory demand (Algorithm 1's BE_mem): batches of BE requests queued,
        and BE batches running, each at its footprint; and the models they belong to."""
        total, names = 0, []
        for v in node:
            if v.running_cls == RequestClass.BE:
                total += self.mem(v.model, v.running_count, models)
                names.append(v.model)
        for m in models.values():
            waiting = m.waiting_requests(RequestClass.BE)
            if waiting:
                batch = m.dispatch_max_batch
                total += math.ceil(waiting / batch) * self.mem(m.name, batch, models)
                names.append(m.name)
        return total, list(dict.fromkeys(names))

    def choose(self, model: str, cls: RequestClass, batch_size: int, idle: Sequence[int],
               node: Sequence[InstanceView]) -> Chosen | None:
        """See ``coordinator.BatchPlacement.choose``. Under η placement a model whose
        instances hold MIG devices is placed among those (``mig``), every other among the
        CPU partitions."""
        if self.mig is not None and self.policy is StrictPlacement.ETA and self.mig.serves(model, idle):
            models = {m.name: m for m in self.models()}
            be_mem, be_models = self._be_demand(node, models)
            return self.mig.choose(self._job(model, cls, batch_size, node, models), idle, node, be_mem, be_models,
                                   lambda m, b: self.mem(m, b, models))
        parts = self._parts
        ids = {p.id for p in parts}
        where = {v.instance: v.partition for v in node if v.model == model}
        eligible = {where[i] for i in idle if where.get(i) in ids}
        if not eligible:
            return None
        models = {m.name: m for m in self.models()}
        be_mem, be_models = self._be_demand(node, models)
        job = self._job(model, cls, batch_size, node, models)
        now = self.clock()
        plan = self.chooser.place(job, self._slots(node, models), eligible, be_mem, be_models, now,
                                  placed=set(where.values()) & ids)
        if plan.until is not None:
            if job.strict:
                log.debug("model %s: strict batch of %d waits for partition %s until %+.3f s (run now: %.3f s, "
                          "wait: %.3f s)", model, batch_size, plan.wait_for, plan.until - now, plan.run_now_s,
                          plan.wait_s)
            else:
                log.debug("model %s: BE batch of %d keeps off partitions with strict work until %+.3f s",
                          model, batch_size, plan.until - now)
            self._wake(model, plan.until - now)
        instance = next((i for i in idle if where.get(i) == plan.slot), None)
        return Chosen(instance, plan.tag) if instance is not None else None

    def _job(self, model: str, cls: RequestClass, batch_size: int, node: Sequence[InstanceView],
             models: Mapping[str, PartitionedModel]) -> Job:
        """The batch being placed, as Algorithm 1 sees it: its memory, and the due of a strict
        batch's head request or the arrival of a BE batch's oldest."""
        mine = next((v for v in node if v.model == model), None)
        strict = cls == RequestClass.RT
        due = mine.rt_due if mine is not None and strict else None
        arrived = mine.oldest_waiting if mine is not None and not strict else None
        return Job(model, batch_size, strict, self.mem(model, batch_size, models), due=due, arrived=arrived)

    def _slots(self, node: Sequence[InstanceView], models: Mapping[str, PartitionedModel]) -> list[Slot]:
        """Algorithm 1's view of the partitions: each with the batches running on it, from when."""
        ids = {p.id for p in self._parts}
        running = [(v.partition, Job(v.model, v.running_count, v.running_cls == RequestClass.RT,
                                     self.mem(v.model, v.running_count, models), started=v.started))
                   for v in node if v.running_cls is not None and v.partition in ids]
        return slots_of(self._parts, running)

    def _wake(self, model: str, delay: float) -> None:
        """Decide ``model``'s waiting batch again after ``delay`` s even if nothing ends
        meanwhile (an end kicks it sooner: the coordinator). An earlier wake already armed is
        kept: a model with a strict and a BE batch waiting is asked again at the sooner of the
        two, and that pass arms the other again."""
        if self._loop is None:  # not started: nothing runs, so nothing waits
            return
        at = self._loop.time() + max(0.0, delay)
        old = self._wakes.get(model)
        if old is not None:
            armed, handle = old
            if not handle.cancelled() and armed <= at:
                return
            handle.cancel()
        self._wakes[model] = (at, self._loop.call_at(at, self._kick, model))

    def _kick(self, model: str) -> None:
        self._wakes.pop(model, None)
        for m in self.models():
            if m.name == model:
                m.kick()

    def partition_of(self, model: str, instance: int) -> int:
        """The node partition ``model``'s ``instance`` sits on (-1: not placed)."""
        placed = self.resources.placed(model, instance)
        return placed.partition if placed is not None else -1

    # -- timers: autoscaler and geometry controller ------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start ticking on ``loop``: the autoscaler, and the geometry controller when it runs."""
        self._loop = loop
        self._every(loop, self.config.protean.partition_autoscale_s, self._autoscale)
        if self.controller is not None:
            self._every(loop, self.settings.monitor_interval_s, self._monitor)

    def _every(self, loop: asyncio.AbstractEventLoop, period: float, tick: Callable[[], None]) -> None:
        def run() -> None:
            try:
                tick()
            except Exception:  # a tick that fails must not stop the next ones
                log.exception("partitions: %s failed", tick.__name__)
            self._timers.append(loop.call_later(period, run))
        self._timers.append(loop.call_later(period, run))

    async def stop(self) -> None:
        """Stop ticking; a change under way is cancelled (the applier leaves what serves serving)."""
        for t in [*self._timers, *(handle for _, handle in self._wakes.values())]:
            t.cancel()
        self._timers.clear()
        self._wakes.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, what: str, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"partitions-{what}")
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("partitions: %s not made: %s", what, t.exception())
        task.add_done_callback(done)
        return task

    def _autoscale(self) -> None:
        """One instance per pending batch, warm ones on every partition, surplus retired after the keep-alive."""
        self._refresh()
        models = [m for m in self.models() if m.placed_now()]
        # A resize under way already brings its instances: counting the old number would make
        # every tick until it lands ask (and count cold starts) for the same instances again.
        current = {m.name: self._scaling.get(m.name, m.instance_count) for m in models}
        target = self.autoscaler.tick(self.clock(), {m.name: m.waiting_requests() for m in models},
                                      {m.name: m.dispatch_max_batch for m in models}, current)
        floor = self.warm * len(self._parts)
        # One instance per pending batch is unbounded in a burst; on a CPU node instances
        # beyond a few per partition only time-slice its cores, and starting dozens at once
        # starves the ones serving (seen: 49 workers asked for at once on 2 cores, none up in 120 s).
        ceiling = self.config.protean.partition_max_instances * len(self._parts)
        for m in models:
            want = max(min(target.get(m.name, current[m.name]), ceiling), floor)
            if self.config.reef.preemption is PriorityMode.SEQ:
                # seq runs one batch on the node at a time: an instance beyond the warm ones
                # could never run a batch beside another, it would only cost a cold start
                want = min(want, max(floor, current[m.name]))
            if want != current[m.name] and m.name not in self._scaling and not self._lock.locked():
                log.info("autoscaler: model %s %d -> %d instances", m.name, current[m.name], want)
                self._scaling[m.name] = want
                record = {"model": m.name, "from": current[m.name], "asked": want, "to": None,
                          "asked_at": self.clock(), "done_at": None}  # to and done_at: when it lands
                self.resizes.append(record)
                task = self._spawn(f"resize of {m.name}", m.resize(want))
                task.add_done_callback(functools.partial(self._resized, m, m.instance_count, record))

    def _resized(self, model: PartitionedModel, before: int, record: dict[str, Any], _task: asyncio.Task) -> None:
        """A resize ended: the instances it added are the cold starts, those it removed are
        retired (a resize that failed, or did not land in full, changed fewer than asked)."""
        self._scaling.pop(model.name, None)
        now = model.instance_count
        added = now - before
        if added > 0:
            self.cold_starts[model.name] = self.cold_starts.get(model.name, 0) + added
            self.metrics.cold_starts.labels(model.name).inc(added)
        elif added < 0:
            self.retired[model.name] = self.retired.get(model.name, 0) - added
        record.update(to=now, done_at=self.clock())

    def _be_mem_of(self, be_requests: float) -> int:
        """Algorithm 2's mem(BE_model, n): whole batches of the main BE model at its footprint."""
        be = self._main.get(False)
        return math.ceil(be_requests / be.batch) * be.mem_bytes if be is not None else 0

    def _thresholds(self, candidate: Geometry, pred: float) -> tuple[float, float]:
        """T_low and T_high for ``candidate``: crossovers of the η model for the main strict
        and BE models (open, 0 and infinity, until both are known with a footprint)."""
        strict, be = self._main.get(True), self._main.get(False)
        if strict is None or be is None or be.mem_bytes <= 0:
            return 0.0, math.inf
        assert self.unit is not None
        return derive_thresholds(candidate, self.slowdown, strict, be, unit_cores=self.unit,
                                 unit_mem=self._unit_mem())

    def _monitor(self) -> None:
        """Algorithm 2's tick: forecast best-effort demand; change the geometry when it says so."""
        assert self.controller is not None
        models = {m.name: m for m in self.models()}
        node = self.view()
        for strict, cls in ((True, RequestClass.RT), (False, RequestClass.BE)):
            work = {n: m.waiting_requests(cls) + sum(v.model == n and v.running_cls == cls for v in node)
                    for n, m in models.items()}
            if any(work.values()):  # the model with most work of the class stands for its mix
                main = max(work, key=lambda n: work[n])
                batch = models[main].dispatch_max_batch
                self._main[strict] = Job(main, batch, strict, self.mem(main, batch, models))
        be = sum(m.waiting_requests(RequestClass.BE) for m in models.values())
        decided = self.controller.tick(self.clock(), float(be))
        log.debug("geometry controller: %s", self.controller.last)
        for group, geometry in decided:  # each is in flight for the controller until ``applied``
            self._spawn("geometry change", self._controller_change(group, geometry))

    async def _controller_change(self, group: int, geometry: Geometry) -> None:
        assert self.unit is not None and self.controller is not None
        log.info("geometry controller: re-carving to %s (%s)", geometry, self.controller.last)
        before = self.controller.current[group]
        try:
            await self._reconfigure(carve(geometry, self.cpus, self.unit), "controller", geometry)
            if self.mig_geometry is not None and self.geometry == geometry:
                await asyncio.to_thread(self.mig_geometry, geometry.units)
        finally:  # a change that failed leaves the old geometry in force
            self.controller.applied(group, geometry if self.geometry == geometry else before)

    # -- geometry changes -----------------------------------------------------------------

    async def set_geometry(self, geometry: str) -> dict[str, Any]:
        """See ``ports.PartitionControl.set_geometry``."""
        sets = slice_cpus(parse_geometry(geometry), self.cpus)
        await self._reconfigure(sets, "operator", None)
        return self.snapshot()

    async def _reconfigure(self, cpu_sets: Sequence[Sequence[int]], origin: str, geometry: Geometry | None) -> None:
        """Carve ``cpu_sets`` and move every placed model's instances onto them through the
        node's applier (new set standby, one switch, old set drained), then give the old
        partitions back. On failure the old partitions keep serving and the new ones go."""
        async with self._lock:
            old, new = self._parts, []
            t0 = self.clock()

            def decide() -> dict[str, list[Any]]:
                new.extend(self._carve(cpu_sets))
                self._parts = new
                return {m.name: m.placements_on(new) for m in self.models() if m.placed_now()}

            try:
                records = await self.changer.apply(decide)
            except BaseException as e:
                if new:
                    self._parts = old
                    self._release(new)
                self.metrics.geometry_changes.labels(origin, "failed").inc()
                self.changes.append({"origin": origin, "ok": False, "error": str(e) or type(e).__name__,
                                     "cpus": [list(s) for s in cpu_sets], "at": t0})
                raise
            self._release(old)
            if origin == "operator" or geometry is not None:
                self.geometry = geometry
            self.metrics.geometry_changes.labels(origin, "ok").inc()
            self.changes.append({"origin": origin, "ok": True, "cpus": [list(s) for s in cpu_sets], "at": t0,
                                 "took_s": self.clock() - t0, "models": sorted(records)})
            log.info("partitions (%s): now %s", origin, "; ".join(f"{p.id}: {cpu_list(p.cpus)}" for p in new))

    # -- PartitionControl (management) --------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """``GET /v2/partitions``'s body (see ``ports.PartitionControl.snapshot``)."""
        node = self.view()
        models = {m.name: m for m in self.models()}
        parts = self._parts
        be_mem, _ = self._be_demand(node, models)
        tags = self.chooser.tags(self._slots(node, models), be_mem)
        distributor = self.chooser.distributor
        on: dict[int, dict[str, list[int]]] = {p.id: {} for p in parts}
        for model, insts in self.resources.placement().items():
            for i, q in insts.items():
                if q.partition in on:
                    on[q.partition].setdefault(model, []).append(i)
        controller = self.controller.last if self.controller is not None else {"off": self.controller_off}
        return {
            "partitioning": self.partitioning.value, "strict_placement": self.policy.value,
            "worker_cpus": list(self.cpus), "geometry": [p.cores for p in parts],
            "geometry_units": list(self.geometry.units) if self.geometry is not None else None,
            "unit_cores": self.unit, "be_mem_bytes": be_mem, "warm_per_partition": self.warm,
            "partitions": [{"id": p.id, "cpus": sorted(p.cpus), "cores": p.cores, "mem_bytes": p.mem_bytes,
                            "tag": tags.get(p.id, 0.0), "instances": on[p.id]} for p in parts],
            "controller": controller, "cold_starts": dict(self.cold_starts),
            "cold_starts_asked": dict(self.autoscaler.cold_starts), "retired": dict(self.retired),
            "resizes": list(self.resizes),
            "keep_alive_s": self.autoscaler.keep_alive_s,
            "wait_for_free": distributor is not None and distributor.wait_for_free,
            "be_max_wait_s": distributor.be_max_wait_s if distributor is not None else None,
            "waiting_for": distributor.held(self.clock()) if distributor is not None else {},
            "changes": list(self.changes), "now": self.clock(),
        }
