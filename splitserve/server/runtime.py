"""A served model inside the front end: its tensor queues, scheduler and worker processes.

Everything here runs on the front end's event loop. The scheduler decides; this module
does the I/O its decisions need (send batch descriptors, answer calls, restart workers).
A runtime knows its node only through ``ports.RuntimeEnv``; it is the ``ModelPort`` of
the transports, the ``ScheduledModel`` of the coordinator and the ``ManagedModel`` of
management.

Identity and residency are separate. The model's identity (record, func_id, rings and
tensor queues, scheduler with its queued calls, statistics) lives as long as the runtime,
i.e. as long as the model is registered. Its residency (worker processes holding its
weights) comes and goes: ``evict`` releases the weights of every instance and the next
call loads them again, while the identity stays untouched.

Workers start bound to nothing and are bound by a LOAD, always: a fresh process and a
spare from the node's pool (``RuntimeEnv.workers``; an eviction gives its processes back
to it) take the same path, so there is one way to load, one
timeout (``worker_start_timeout_s``, for the start and again for the LOAD), and one way a
load fails (``on_load_failed``, with the process left up and reusable). The price, one
more control message at start, is small beside loading the weights. Each instance's
residency is the scheduler's (``scheduler.model_scheduler.Residency``): an instance
whose process is starting or loading is LOADING, one releasing its weights UNLOADING,
and neither is given a batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from splitserve.errors import (
    BadSize, DeadlineMissed, InvalidInput, ModelNotReady, ShuttingDown, SplitServeError, WorkerFailed,
)
from splitserve.memory.weights import drop_page_cache, weights_file
from splitserve.modelconfig import BatchingConfig
from splitserve.placement.partition import InstancePlacement, NodePartition
from splitserve.placement.placer import PartitionPlacer, make_placer
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord
from splitserve.scheduler.model_scheduler import CLASSES, ModelScheduler, Residency
from splitserve.scheduler.policy import make_policy
from splitserve.scheduler.priority import InstanceView, PriorityMode
from splitserve.scheduler.request import Batch, QueuedRequest
from splitserve.server.metrics import ModelGauges
from splitserve.server.monitor import Call
from splitserve.server.ports import InstanceWorker, MemoryFootprint, ModelState, ModelStats, RuntimeEnv
from splitserve.tensorqueue import SlotRing, TensorQueue, ring_slots
from splitserve.worker.messages import DIRECT_BATCH, DoneMsg, LoadedMsg, Msg, RunMsg, UnloadedMsg
from splitserve.worker.counters import DirectCounts
from splitserve.worker.pool import Residency as WorkerResidency
from splitserve.worker.spec import BindSpec, DirectSpec, QueueFds

log = logging.getLogger(__name__)

_RUNNING = (ModelState.LOADING, ModelState.READY)


class ModelRuntime:
    """One model as served: queues per class, a scheduler, one worker per instance."""

    def __init__(self, env: RuntimeEnv, record: ModelRecord) -> None:
        self.env = env
        self.settings = env.config
        self.node = env.node
        self.loop = env.loop
        self.record = record
        self.config = record.config
        self.name = record.name
        self.func_id = record.func_id
        cfg = self.config
        sizes = [t.nbytes for t in cfg.inputs + cfg.outputs]
        self.nslots = ring_slots(sizes, max(cfg.queue_slots or self.settings.batching.queue_slots, 2 * cfg.max_batch_size))
        self.rings = {c: SlotRing(self.nslots) for c in CLASSES}
        self.tqs: dict[RequestClass, tuple[list[TensorQueue], list[TensorQueue]]] = {
            c: (
                [TensorQueue(t.nbytes, self.nslots, name=f"{self.name}-{c.name}-in-{t.name}") for t in cfg.inputs],
                [TensorQueue(t.nbytes, self.nslots, name=f"{self.name}-{c.name}-out-{t.name}") for t in cfg.outputs],
            )
            for c in CLASSES
        }
        self.sched = ModelScheduler(self.name, make_policy(cfg.batching), cfg.max_batch_size, queue_limit=self.nslots,
                                    rt_policy=self.settings.reef.rt_policy, class_order=self.settings.reef.class_order)
        # Per instance id: its worker. Where each instance sits (threads, batch, CPUs) is the
        # node's ResourceManager's record; instances exist while the model holds its CPUs
        # (from a load until its unload gives them back).
        self.workers: dict[int, InstanceWorker] = {}
        self.resources = env.resources
        self._backoff: dict[int, float] = {}
        self._start_failures: dict[int, int] = {}  # consecutive failed starts per instance
        self._weights: dict[int, int] = {}  # bytes of the weights each resident instance holds
        # What a residency of this model takes, for the node's memory budget: stored from an
        # earlier run, else the weights file's header; updated by every LOADED, so the next
        # load is charged what the last one measured.
        self.footprint = env.footprints.footprint(record)
        # One stored profile feeds Packrat's optimizer and the workers' padding budgets.
        self.profile = env.profile(self.name)
        self.placer = make_placer(self.name, cfg, self.settings.packrat.placement, self.profile.latency if self.profile else None,
                                  self.settings.packrat.packrat_default_share, self.settings.packrat.fixed_cpus_shared,
                                  env.partitions)
        if (policy := self.placer.policy()) is not None:
            self.sched.policy = policy
        self.stats = ModelStats(slo=env.metrics.slo_tally(self.name))
        self.slo_s = self._model_slo()  # the SLO of its real-time calls that name none (None: no SLO)
        self.state = ModelState.UNLOADED
        self.error: str | None = None  # why the last load failed
        self._retry_at = 0.0  # FAILED: when a request may retry the load (perf_counter)
        # False after a user's unload: requests are refused (MODEL_NOT_READY) until a load;
        # a model that was never unloaded still starts lazily on first use.
        self.enabled = True
        # Releasing the weights (evict): no load starts until every instance is ABSENT.
        self._evicting = False
        self._evict_lock = asyncio.Lock()  # one eviction at a time (a second waits, then finds nothing resident)
        # The memory manager never evicts it (an operator's evict still does); an explicit load may set it.
        self.keep_resident = cfg.memory.keep_resident
        self._asked = False  # residency requested from the node's memory manager, not granted yet
        self._reconfiguring = 0  # placement changes under way: not evictable meanwhile
        # Loaded for calls that wait and has not dispatched any of them yet: evicting it now
        # would undo the load before it served anyone (a livelock when models swap fast).
        self._unserved = False
        self._ready_event = asyncio.Event()  # set when a load ends (READY or FAILED) or is abandoned
        self._changed = asyncio.Event()  # set on every kick: waits below re-check their condition
        self._kick_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.default_class = RequestClass.RT if cfg.default_class == "rt" else RequestClass.BE
        self._batch_s: dict[int, float] = {}  # batch size -> EWMA of its compute time (s)
        # What each change of placement cost (bounded: the newest placement_history).
        self.reconfigurations: deque[dict] = deque(maxlen=self.settings.packrat.placement_history)
        self._repack_task: asyncio.Task | None = None
        # Direct calls (ServerConfig.transports.fast_direct) counted by workers this model no longer
        # holds; the live ones are read from their pages.
        self._direct_past = DirectCounts()
        # instance -> the port of its worker's TCP direct endpoint (from LOADED; the OS picks it)
        self._direct_tcp_ports: dict[int, int] = {}

    def _model_slo(self) -> float | None:
        """``[slo]`` in seconds: a target, or k x the profiled solo latency at the model's
        largest batch on every CPU of the node (PROTEAN §5), as far as the profile reaches."""
        slo = self.config.slo
        solo = None
        if slo.multiplier is not None:
            if self.profile is None:
                log.warning("model %s: [slo] multiplier needs a latency profile (splitserve profile %s); "
                            "its real-time calls have no SLO unless they name slo_ms", self.name, self.name)
                return None
            lat = self.profile.latency
            solo = lat.latency(min(len(self.resources.cpus), lat.max_threads), self.config.max_batch_size)
        return slo.seconds(solo)

    # -- instances -------------------------------------------------------------------

    def _repack_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("model %s: repack not made: %s", self.name, task.exception())

    async def repack(self, batch: int) -> dict:
        """Packrat: serve a batch of ``batch`` with the plan the optimizer picks for it, through
        the node's applier (instances that keep their shape stay; the rest switch without a
        pause in service). ResourcesUnavailable when that cannot be done in the model's budget:
        it stays on its plan then."""
        return await self._change(lambda: self.placer.plan_for(batch))

    async def resize(self, instances: int) -> None:
        """Change the instance count without dropping requests. Fixed placement takes CPUs for
        added instances; Packrat splits its budget and B over ``instances``. A model that holds
        no CPUs (not loaded) gets that many at its next load."""
        self.placer.instances = instances
        if self.sched.instances:
            await self._change(lambda: self.placer.resize(self.resources, self._serving_placements(), instances))

    async def _change(self, decide: Callable[[], list[InstancePlacement]]) -> dict:
        """Hand a change of this model's placement to the node's applier; its record."""
        def wanted() -> dict[str, list[InstancePlacement]]:
            if not self.sched.instances:
                raise ModelNotReady(f"model {self.name!r} is not loaded: it holds no CPUs to change")
            return {self.name: decide()}

        self._reconfiguring += 1
        try:
            records = await self.env.placements.apply(wanted)
        finally:
            self._reconfiguring -= 1
        self.env.memory.batch_done(self)  # it may be a victim again
        return {**records[self.name], **self.placer.describe()}

    def _serving_placements(self) -> list[InstancePlacement]:
        return [p for i in self.sched.serving() if (p := self.resources.placed(self.name, i)) is not None]

    def _place(self) -> None:
        """Take the model's CPUs from the node and add its instances (at load, and again after
        an unload gave them back); raises ResourcesUnavailable naming what is in use."""
        try:
            for p in self.placer.place(self.resources):
                self._add_instance(p)
        except BaseException:
            for i in list(self.sched.instances):
                self._forget_instance(i)
            self.resources.release(self.name)
            raise

    def _add_instance(self, placement: InstancePlacement, standby: bool = False) -> int:
        batch = placement.batch if self.placer.per_instance_batch else None
        iid = self.sched.add_instance(max_batch=batch, standby=standby)
        try:
            self.resources.place(self.name, iid, placement)
        except BaseException:
            self.sched.remove(iid)
            raise
        self._backoff[iid] = self.settings.workers.worker_restart_backoff_s
        self._start_failures[iid] = 0
        return iid

    # -- PlacedModel (the node's placement applier) --------------------------------------

    def add_standby(self, placements: Sequence[InstancePlacement]) -> list[int]:
        ids: list[int] = []
        try:
            for p in placements:
                ids.append(self._add_instance(p, standby=True))
        except BaseException:
            for i in ids:
                self._forget_instance(i)
            raise
        if self.state in _RUNNING:
            for i in ids:
                self._spawn(i)
        return ids

    async def until_ready(self, instances: Sequence[int]) -> None:
        if self.state in _RUNNING:
            await self._wait_instances(list(instances))

    def switch(self, activate: Sequence[int], retire: Sequence[int], final: bool) -> None:
        self.sched.activate(list(activate), list(retire))
        if final:
            self.placer.settle(self._serving_placements())
        self.kick()

    async def retire(self, instances: Sequence[int]) -> None:
        await self._drain_all(list(instances))

    def changed(self, record: Mapping[str, Any]) -> None:
        self.placer.settle(self._serving_placements())
        if not record["ok"]:
            log.warning("model %s: placement change to %s not made: %s", self.name, record["shapes"],
                        record.get("error"))
            return
        if not record["waves"]:
            return  # the wanted placement is what serves already: nothing happened
        self.reconfigurations.append({**record, **self.placer.describe()})
        log.info("model %s: placement now %s (new set ready in %.2fs, old drained in %.2fs)", self.name,
                 record["shapes"], record["start_s"], record["drain_s"])

    async def _wait_instances(self, ids: list[int]) -> None:
        """Until the instances ``ids`` are up; ModelNotReady if one gave up starting (or
        the model stopped trying). Bounded: every start attempt is (worker_start_timeout_s)."""
        cfg = self.settings
        attempts = cfg.workers.worker_start_attempts

        def up() -> bool:
            return all(self.sched.instances[i].ready for i in ids if i in self.sched.instances)

        def settled() -> bool:
            gave_up = any(self._start_failures.get(i, 0) >= attempts for i in ids)
            return up() or gave_up or self.state not in _RUNNING

        deadline = time.perf_counter() + attempts * (cfg.workers.worker_start_timeout_s + cfg.workers.worker_restart_backoff_max_s)
        await self._until(settled, deadline)
        if not up():
            raise ModelNotReady(f"model {self.name!r}: new instances did not start: {self.error or 'timed out'}")

    async def _until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``done()`` (re-checked at every kick) or ``deadline``; returns done()."""
        while not done():
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass
        return True

    def _forget_instance(self, iid: int) -> None:
        self.sched.remove(iid)
        self.resources.unplace(self.name, iid)
        for d in (self.workers, self._backoff, self._start_failures, self._weights):
            d.pop(iid, None)
        self._weights_changed()

    @property
    def instance_count(self) -> int:
        return len(self.sched.serving())

    # -- PartitionedModel (the node's partition manager) ---------------------------------

    def placed_now(self) -> bool:
        return bool(self.sched.instances) and self.state in _RUNNING

    def waiting_requests(self, cls: RequestClass | None = None) -> int:
        return self.sched.waiting(cls)

    def placements_on(self, partitions: Sequence[NodePartition]) -> list[InstancePlacement]:
        if not isinstance(self.placer, PartitionPlacer):
            raise InvalidInput(f"model {self.name!r} is not placed on the node's partitions")
        return self.placer.move(self.resources, self._serving_placements(), partitions)

    # -- lifecycle -------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Ask the node's memory manager for residency if the model holds none (models load
        on first use; the manager starts the load when it fits, perhaps at once). A FAILED
        model is retried only once ``load_retry_s`` has passed since it failed."""
        if not self.enabled or self.env.stopping() or self._evicting or self.state in (*_RUNNING, ModelState.STOPPING):
            return
        if self.state is ModelState.FAILED:
            if time.perf_counter() < self._retry_at:
                return
            self.state = ModelState.EVICTED  # the retry waits like any load: calls queue meanwhile
        if not self._asked:
            self._asked = True
            self._ready_event.clear()
        self.env.memory.request(self, self.sched.waiting(RequestClass.RT) > 0)

    # -- ResidentModel (the memory manager) -------------------------------------------------

    def charge(self) -> int:
        return self.footprint.charge(self.instance_count or self.placer.instances or self.config.instances)

    def pinned(self) -> bool:
        if self._unserved and not self.sched.waiting():
            self._unserved = False  # the calls it loaded for are gone (deadlines): nothing to serve first
        return self._unserved or bool(self._reconfiguring) or any(st.busy for st in self.sched.instances.values())

    def holds_memory(self) -> bool:
        return self.state in _RUNNING or self._evicting

    def begin_load(self) -> None:
        if not self._asked or not self.enabled or self.env.stopping() or self.holds_memory():
            self._asked = False
            self.env.memory.released(self)  # granted too late: it holds nothing, the reservation goes back
            return
        self._asked = False
        self._load()

    def refuse_load(self, reason: str) -> None:
        self._asked = False
        self._fail(reason)

    def _load(self) -> None:
        self.state, self.error = ModelState.LOADING, None
        self._ready_event.clear()
        if not self.sched.instances:
            try:
                self._place()
            except SplitServeError as e:
                self._fail(str(e))
                return
        self._start_missing()

    def _start_missing(self) -> None:
        """Bring up every serving instance that is not resident (a fresh count of failed
        starts): spawn a worker where there is none, LOAD into one bound to nothing."""
        for i in self.sched.serving():
            handle = self.workers.get(i)
            if handle is None:
                self._start_failures[i] = 0
                self._spawn(i)
            elif handle.residency is WorkerResidency.UNBOUND:
                self._start_failures[i] = 0
                self._bind(i)

    async def wait_ready(self) -> None:
        """Load the model (an explicit load retries a FAILED one at once) and wait until it
        serves; ModelNotReady with the load error if it fails. Bounded: each start attempt
        has worker_start_timeout_s and there are worker_start_attempts of them."""
        if not self.enabled:
            raise ModelNotReady(f"model {self.name!r} was unloaded; load it again first")
        if self._evicting:  # bounded: evict kills what has not released its weights by its deadline
            await self._until(lambda: not self._evicting,
                              time.perf_counter() + self.settings.workers.drain_timeout_s + self.settings.workers.stop_timeout_s)
        if self.state is ModelState.FAILED:
            self._retry_at = 0.0  # an explicit load retries at once (through the memory manager, like any load)
        elif self.state is ModelState.READY:
            self._start_missing()  # instances that gave up starting get another go
        self.ensure_started()
        if self.state in _RUNNING or self._asked:  # nothing asked (e.g. the node is stopping): nothing to wait for
            await self._ready_event.wait()
        if self.state is not ModelState.READY:
            raise ModelNotReady(f"model {self.name!r} failed to load: {self.error or self.state}")

    def _spawn(self, i: int) -> None:
        """Get instance ``i`` a process from the node's pool: a spare that is up gets the
        LOAD now; one that is starting gets it from ``on_ready``."""
        self.workers[i] = handle = self.env.workers.take(self, i)
        self.sched.set_residency(i, Residency.LOADING)
        if handle.residency is WorkerResidency.UNBOUND:
            log.info("model %s: instance %d binds spare worker %d", self.name, i, handle.pid)
            self._bind(i)
            return
        timeout = self.settings.workers.worker_start_timeout_s
        self.loop.call_later(timeout, self._start_timed_out, handle, timeout)
        log.info("model %s: instance %d waits for worker %d to start", self.name, i, handle.pid)

    @staticmethod
    def _start_timed_out(handle: InstanceWorker, timeout: float) -> None:
        if handle.alive and not handle.started:
            handle.kill(f"worker (pid {handle.pid}) was not ready within worker_start_timeout_s={timeout:g}s")

    def _bind_spec(self, i: int) -> BindSpec:
        """What binds instance ``i``'s worker to this model: config, artifact, queues, the
        stored profile's segment times for its thread count, its CPUs and threads, and
        whether to measure its memory (only while the model's size is not measured)."""
        placed = self.resources.placed(self.name, i)
        assert placed is not None, "an instance is placed before its worker binds"
        return BindSpec(
            self.config.to_dict(), str(self.record.path) if self.record.path else None,
            {str(int(c)): QueueFds(self.nslots, [q.fd for q in ins], [q.fd for q in outs])
             for c, (ins, outs) in self.tqs.items()},
            self.config.capacity, self._profiled_segment_times(i), cpus=sorted(placed.cpus), threads=placed.threads,
            measure=not self.footprint.measured, direct=self._direct_spec(i))

    def _direct_spec(self, i: int) -> DirectSpec | None:
        """Instance ``i``'s direct endpoint, with the front end's stream limits (None: off)."""
        s = self.settings
        if not s.transports.fast_direct:
            return None
        return DirectSpec(
            str(self._direct_path(i)), self.func_id, s.transports.direct_max_connections, s.transports.fast_max_in_flight,
            s.transports.fast_out_high_water, s.transports.fast_out_low_water, s.transports.fast_max_pending_out, s.transports.frame_timeout_s,
            s.transports.fast_reads_per_wakeup, s.reef.preemption is PriorityMode.RT_ONLY, s.transports.direct_suspend_poll_s,
            s.transports.direct_stage_bytes, int(self.slo_s * 1e6) if self.slo_s else 0, s.direct_tcp_host, s.transports.direct_spin_us,
            s.transports.direct_compiled)

    def _direct_path(self, i: int) -> Path:
        return self.settings.direct_dir / f"{self.func_id}-{i}.sock"

    def _direct_instances(self) -> list[int]:
        """Instances whose direct endpoints take calls now (bound, not retiring)."""
        if not self.settings.transports.fast_direct or self.state is not ModelState.READY:
            return []
        return [i for i in self.sched.serving()
                if self.sched.instances[i].ready and not self.sched.instances[i].draining
                and (h := self.workers.get(i)) is not None and h.ready]

    def direct_endpoints(self) -> list[str]:
        """``unix://`` URLs of the direct endpoints of instances that serve now: what a
        LOOKUP gives a client that sends its calls straight to the workers."""
        return [f"unix://{self._direct_path(i)}" for i in self._direct_instances()]

    def direct_tcp_endpoints(self) -> list[str]:
        """``tcp://`` URLs of the same instances' TCP direct endpoints (empty without
        ``ServerConfig.direct_tcp_host``). The host is the address they bind, the fast
        path's: a client reaches them at the host it reached the front end at."""
        host = self.settings.direct_tcp_host
        if host is None:
            return []
        netloc = f"[{host}]" if ":" in host else host
        return [f"tcp://{netloc}:{port}" for i in self._direct_instances()
                if (port := self._direct_tcp_ports.get(i)) is not None]

    def direct_counts(self) -> DirectCounts:
        """Direct calls of this model so far: workers gone, plus the live ones' pages (all
        zero while the direct path is off). Their SLO outcomes join the model's SLO metric
        and statistics here, so every read of the statistics or the metrics sees them."""
        total = self._direct_past
        if not self.settings.transports.fast_direct:
            return total
        for handle in self.workers.values():
            total = total + handle.counters.snapshot()
        self.env.metrics.count_direct_slo(self.name, total.slo())
        return total

    def _harvest_direct(self, instance: int, handle: InstanceWorker) -> None:
        """A worker leaves this model (unloaded or gone): keep what its page counted; its
        TCP endpoint is gone."""
        self._direct_tcp_ports.pop(instance, None)
        if self.settings.transports.fast_direct:
            self._direct_past = self._direct_past + handle.counters.snapshot().finished()

    def _profiled_segment_times(self, i: int) -> list[tuple[int, int, int]]:
        placed = self.resources.placed(self.name, i)
        if self.profile is None or placed is None:
            return []
        return self.profile.segment_times_ns(placed.threads)

    def _bind(self, i: int) -> None:
        """LOAD this model into instance ``i``'s worker (up, bound to nothing); the
        instance is LOADING, never dispatched to, until ``on_loaded``."""
        handle = self.workers[i]
        if self.settings.transports.fast_direct:
            handle.counters.set_admit(self.settings.transports.direct_admit)
        if not handle.send_load(self._bind_spec(i)):
            return  # gone: its exit is handled as any other
        self.sched.set_residency(i, Residency.LOADING)
        timeout = self.settings.workers.worker_start_timeout_s
        self.loop.call_later(timeout, self._load_timed_out, handle, handle.binding, timeout)

    @staticmethod
    def _load_timed_out(handle: InstanceWorker, binding: int | None, timeout: float) -> None:
        if handle.alive and handle.residency is WorkerResidency.LOADING and handle.binding == binding:
            handle.kill(f"worker (pid {handle.pid}) did not load the model within worker_start_timeout_s={timeout:g}s")

    def on_ready(self, instance: int, info: dict) -> None:
        if instance not in self.sched.instances or self.state not in _RUNNING:
            return  # a model that failed, is stopping or was evicted has asked this worker to go
        self._bind(instance)

    def on_loaded(self, instance: int, msg: LoadedMsg) -> None:
        if instance not in self.sched.instances or self.state not in _RUNNING:
            return  # evicted, failed or stopping while it loaded: the worker is being killed or stopped
        self.sched.set_residency(instance, Residency.RESIDENT)
        self._weights[instance] = msg.nbytes
        if msg.direct_tcp_port is not None:
            self._direct_tcp_ports[instance] = msg.direct_tcp_port
        self._weights_changed()
        if msg.private_bytes is None:
            self.footprint = replace(self.footprint, weights_bytes=msg.nbytes)
        else:  # measured: kept across restarts
            self.footprint = MemoryFootprint(msg.nbytes, msg.private_bytes, measured=True)
            self.env.footprints.save(self.record, self.footprint, msg.load_ns / 1e6)
        self.stats.loads += 1
        self.stats.load_ns += msg.load_ns
        self._backoff[instance] = self.settings.workers.worker_restart_backoff_s
        self._start_failures[instance] = 0
        if self.state is ModelState.LOADING and not self.sched.instances[instance].standby:
            self.state = ModelState.READY  # serve as soon as one instance can
            self._unserved = self.sched.waiting() > 0
        if self.state is ModelState.READY and all(self.sched.instances[i].ready for i in self.sched.serving()):
            self._ready_event.set()  # a load returns when every instance is up
        if self.state is ModelState.READY:
            self.env.memory.loaded(self, self.charge())
        log.info("model %s: instance %d loaded (%d segments, %d B of weights in %.0f ms)", self.name, instance,
                 msg.segments, msg.nbytes, msg.load_ns / 1e6)
        self.kick()

    def on_load_failed(self, instance: int, binding: int, text: str) -> None:
        """The worker could not load the model; it stays up, bound to nothing, and is
        reused by a retry. Handled as a failed start that the worker explained."""
        log.error("model %s: instance %d failed to load: %s", self.name, instance, text)
        if instance not in self.sched.instances:
            return
        self.sched.set_residency(instance, Residency.ABSENT)
        self.kick()
        if self.state in _RUNNING:
            self._start_failed(instance, text, explained=True)

    def on_unloaded(self, instance: int, msg: UnloadedMsg) -> None:
        """The worker released the model: its process goes back to the node's pool (kept as
        a spare if its memory came back, else stopped); the next load takes one anew."""
        handle = self.workers.pop(instance, None)
        if handle is not None:
            self._harvest_direct(instance, handle)
            self.env.workers.give_back(handle, msg.rss_anon)
        if instance not in self.sched.instances:
            return
        self.sched.set_residency(instance, Residency.ABSENT)
        self._weights.pop(instance, None)
        self._weights_changed()
        log.info("model %s: instance %d released its weights (binding %s)", self.name, instance, msg.binding)
        self._evict_progress()
        self.kick()

    def _weights_changed(self) -> None:
        self.stats.weights_bytes = sum(self._weights.values())

    def on_failed(self, instance: int, batch_id: int, text: str) -> None:
        if batch_id == 0:  # the worker could not start; it exits now and on_exit decides
            log.error("model %s: instance %d failed to start: %s", self.name, instance, text)
            return
        batch = self.sched.complete(instance, batch_id)
        if batch is None:
            log.error("model %s: instance %d reported batch %d failed, which it was not running",
                      self.name, instance, batch_id)
        else:
            self.node.finished(self, instance, batch, ok=False)
            self._answer_batch(batch, WorkerFailed(f"model {self.name!r} raised: {text}"))
        self._unload_when_idle(instance)
        self.kick()
        self.env.memory.batch_done(self)

    def on_exit(self, instance: int, handle: InstanceWorker) -> None:
        if self.workers.get(instance) is handle:
            del self.workers[instance]
            self._harvest_direct(instance, handle)
            self._worker_gone(instance, handle)
            self._evict_progress()
        self.kick()

    def _worker_gone(self, instance: int, handle: InstanceWorker) -> None:
        st = self.sched.instances.get(instance)
        if st is None:
            return
        was = st.residency
        for lost in self.sched.set_residency(instance, Residency.ABSENT):
            self.node.finished(self, instance, lost, ok=False)
            self._answer_batch(lost, WorkerFailed(f"worker of {self.name!r} (pid {handle.pid}) died during the batch"))
        if self._weights.pop(instance, None) is not None:
            self._weights_changed()
        if st.draining:
            self._forget_instance(instance)
            return
        if self.state not in _RUNNING or handle.stopping:
            return  # asked to go: the model failed, is stopping, was unloaded or evicted
        if was is not Residency.LOADING:
            self._restart_later(instance, f"instance {instance} (pid {handle.pid}) exited")
        else:  # died (or was killed) while starting or loading
            reason = (handle.start_error or handle.killed_for
                      or f"worker (pid {handle.pid}) exited before it was ready")
            self._start_failed(instance, reason, explained=handle.start_error is not None)

    def _start_failed(self, instance: int, reason: str, explained: bool) -> None:
        """An instance did not come up. An error the worker ``explained`` (its start or its
        LOAD failed, e.g. a bad artifact) fails the model at once (the same file fails the
        same way); a crash or a timeout is retried, and fails the model after
        worker_start_attempts in a row. Other instances that serve keep serving."""
        self._start_failures[instance] += 1
        attempts = self.settings.workers.worker_start_attempts
        others = any(self.sched.instances[i].ready for i in self.sched.serving() if i != instance)
        given_up = self._start_failures[instance] >= attempts
        if others:
            if given_up:
                self.error = reason
                log.error("model %s: instance %d did not start %d times (%s); the others keep serving, "
                          "a load retries it", self.name, instance, attempts, reason)
                self._ready_event.set()  # a load waiting for it ends with what serves
            else:
                self._restart_later(instance, reason)
        elif given_up or explained:
            self._fail(reason)
        else:
            self._restart_later(instance, reason)

    def _restart_later(self, instance: int, why: str) -> None:
        delay = self._backoff[instance]
        self._backoff[instance] = min(delay * 2, self.settings.workers.worker_restart_backoff_max_s)
        log.warning("model %s: %s; restarting in %.1fs", self.name, why, delay)
        self.loop.call_later(delay, self._restart, instance)

    def _restart(self, instance: int) -> None:
        st = self.sched.instances.get(instance)
        if self.state not in _RUNNING or st is None or st.draining:
            return
        handle = self.workers.get(instance)
        if handle is None:
            self._spawn(instance)
        elif handle.residency is WorkerResidency.UNBOUND:  # its LOAD failed: the same process tries again
            self._bind(instance)

    def _fail(self, reason: str) -> None:
        """The model could not load: FAILED, refusing calls (MODEL_NOT_READY and the reason)
        until ``load_retry_s`` passed; the instances stay, so a retry starts them again."""
        retry_s = self.settings.workers.load_retry_s
        self.state, self.error = ModelState.FAILED, reason
        self._retry_at = time.perf_counter() + retry_s
        log.error("model %s failed to load: %s; calls are refused, a request after %gs or a load retries it",
                  self.name, reason, retry_s)
        for handle in list(self.workers.values()):
            handle.kill(f"model {self.name!r} failed to load")
        self._ready_event.set()
        self._fail_waiting(ModelNotReady(f"model {self.name!r} failed to load: {reason}"))
        self.env.memory.load_failed(self, reason)

    async def _drain_all(self, ids: list[int]) -> None:
        """Retire the instances ``ids``: no new batches; each gets drain_timeout_s."""
        deadline = time.perf_counter() + self.settings.workers.drain_timeout_s
        await asyncio.gather(*(self._drain_and_stop(i, deadline) for i in ids))

    async def _drain_and_stop(self, i: int, deadline: float) -> None:
        """Let instance ``i`` finish its batches (a suspended one resumes here), then stop it.

        At ``deadline`` a suspended batch is handed back to the queue (it reruns from
        segment 0 elsewhere) and a worker still running its batch is killed, which
        answers that batch WORKER_FAILED."""
        st = self.sched.instances.get(i)
        if st is None:
            return
        st.draining = True
        self.kick()
        if not await self._until(lambda: not st.busy, deadline):
            batch = self.sched.take_suspended(i)
            if batch is not None:
                log.warning("model %s: instance %d could not resume its preempted batch %d before its drain "
                            "deadline; the batch reruns on another instance", self.name, i, batch.batch_id)
                self.node.finished(self, i, batch, ok=False)
                self.sched.requeue(batch)
                self.kick()
        handle = self.workers.get(i)
        if handle is not None:
            await handle.stop(timeout=max(0.0, deadline - time.perf_counter()))
        if i in self.sched.instances:
            self._forget_instance(i)

    async def load(self) -> None:
        """An explicit load (management): serve again after a user's unload, retry a FAILED
        load at once, and wait until the model serves."""
        self.enabled = True
        await self.wait_ready()

    async def unload(self, deadline: float | None = None, reason: str = "was unloaded", *,
                     disable: bool = False) -> None:
        """Stop dispatching and stop the workers. Calls still waiting, and batches preempted
        mid-run, are answered SHUTTING_DOWN; running batches may finish until ``deadline``
        (default: stop_timeout_s from now), after which their workers are killed and the
        batches answered WORKER_FAILED. ``disable`` (a user's unload): calls are refused
        MODEL_NOT_READY until the next ``load``, instead of starting the model again."""
        if disable:
            self.enabled = False
        if deadline is None:
            deadline = time.perf_counter() + self.settings.workers.stop_timeout_s
        self.state = ModelState.STOPPING
        self._evicting = False  # an eviction under way ends here: the workers stop
        error = ShuttingDown(f"model {self.name!r} {reason}")
        self._fail_waiting(error)
        for i in list(self.sched.instances):
            batch = self.sched.take_suspended(i)
            if batch is not None:
                self.node.finished(self, i, batch, ok=False)
                self._answer_batch(batch, error)
        for handle in list(self.workers.values()):
            if handle.residency in (WorkerResidency.STARTING, WorkerResidency.LOADING):  # nothing to finish
                handle.kill(f"model {self.name!r} {reason} while loading")
        if not await self._until(lambda: not any(s.busy for s in self.sched.instances.values()), deadline):
            log.error("model %s: batches still running at the stop deadline; killing their workers", self.name)
        handles = list(self.workers.values())
        await asyncio.gather(*(h.stop(timeout=max(0.0, deadline - time.perf_counter())) for h in handles))
        for i in list(self.sched.instances):  # a worker whose exit is not handled yet still owes its batch
            for lost in self.sched.set_residency(i, Residency.ABSENT):
                self.node.finished(self, i, lost, ok=False)
                self._answer_batch(lost, WorkerFailed(f"model {self.name!r} stopped during the batch"))
        self.workers.clear()
        self._weights.clear()
        for i in list(self.sched.instances):  # the CPUs go back to the node; a load takes them anew
            self._forget_instance(i)
        self.resources.release(self.name)
        self._weights_changed()
        self.state = ModelState.UNLOADED
        self._asked = False
        self._ready_event.set()  # a load that was waiting ends (not ready)
        self.env.memory.released(self)
        self.kick()

    async def evict(self, deadline: float | None = None) -> bool:
        """Release the weights of every instance and give their memory back, keeping the
        model: its func_id, queues, scheduler, statistics and queued calls stay, calls are
        still taken (they queue), and the first one loads it again. False, and nothing
        done, if nothing is resident or loading (never loaded, failed, stopping, evicted).

        Running batches end first, until ``deadline`` (default: drain_timeout_s from now);
        then their workers are killed and the batches answered WORKER_FAILED. A preempted
        batch goes back to its queue and reruns from segment 0 (segments are idempotent;
        its restore point lived in the binding). Each process that released its weights
        goes back to the node's pool of spares (or exits; see ``worker.spares``)."""
        async with self._evict_lock:
            if not self.release_residency():
                return False
            if deadline is None:
                deadline = time.perf_counter() + self.settings.workers.drain_timeout_s
            if not await self._until(lambda: not self._evicting, deadline):
                for i, st in self.sched.instances.items():
                    handle = self.workers.get(i)
                    if handle is not None and st.residency is not Residency.ABSENT:
                        handle.kill(f"model {self.name!r}: instance {i} did not release its weights by the "
                                    "eviction's deadline")
                await self._until(lambda: not self._evicting, time.perf_counter() + self.settings.workers.stop_timeout_s)
            return True

    def release_residency(self) -> bool:
        """Begin an eviction (``evict`` waits for it): the model turns EVICTED, workers still
        starting or loading are killed, resident instances turn UNLOADING (no new batches)
        and release their weights as soon as their batch is done. False if nothing is
        resident or loading."""
        if self.state not in _RUNNING or self._evicting:
            return False
        self.state, self._evicting = ModelState.EVICTED, True
        self._ready_event.set()  # a load that was waiting ends: the model is not resident
        self.env.memory.evicting(self)
        for i, st in list(self.sched.instances.items()):  # a kill may report the exit at once
            handle = self.workers.get(i)
            if handle is None:
                continue
            if st.ready:
                self.sched.set_residency(i, Residency.UNLOADING)
                self._unload_when_idle(i)
            elif handle.residency in (WorkerResidency.STARTING, WorkerResidency.LOADING):  # nothing to finish
                handle.kill(f"model {self.name!r} was evicted while loading")
        log.info("model %s: evicting (releasing the weights of %d instance(s))", self.name, len(self.workers))
        self._evict_progress()
        return True

    def _unload_when_idle(self, i: int) -> None:
        """Send UNLOAD to an UNLOADING instance once no batch runs on it; a batch suspended
        there goes back to its queue first (UNLOAD drops its restore point)."""
        st = self.sched.instances.get(i)
        handle = self.workers.get(i)
        if st is None or handle is None or st.residency is not Residency.UNLOADING or st.running is not None:
            return
        if not handle.ready:
            return  # its UNLOAD is sent already
        batch = self.sched.take_suspended(i)
        if batch is not None:
            log.info("model %s: preempted batch %d goes back to the queue before instance %d unloads", self.name,
                     batch.batch_id, i)
            self.node.finished(self, i, batch, ok=False)
            self.sched.requeue(batch)
        handle.send_unload()  # False: gone, and on_exit takes it from here

    def _evict_progress(self) -> None:
        """End the eviction once no instance holds or is changing its weights; calls that
        arrived meanwhile load the model again."""
        if not self._evicting or any(st.residency is not Residency.ABSENT for st in self.sched.instances.values()):
            return
        self._evicting = False
        self.stats.evictions += 1
        log.info("model %s: evicted; its weights are released, the next call loads it", self.name)
        if self.settings.memory.evict_drop_cache:
            path = weights_file(self.config, self.record.path, self.settings.cache_path)
            if path is not None:  # off the loop: the kernel may write back or walk many pages
                self.loop.run_in_executor(None, drop_page_cache, path)
        self.env.memory.released(self)
        self.kick()
        if self.sched.waiting():
            self.ensure_started()

    def kill_workers(self, reason: str) -> None:
        """Kill every worker now (the node exits without draining)."""
        for handle in list(self.workers.values()):
            handle.kill(reason)

    def close(self) -> None:
        """Release the shared memory (after unload)."""
        for ins, outs in self.tqs.values():
            for q in ins + outs:
                q.close()

    # -- requests --------------------------------------------------------------------

    def will_serve(self) -> bool:
        """A call would be served without an explicit load (resident or not: one that is
        not loads on the call)."""
        return self._refusal(time.perf_counter()) is None

    def _refusal(self, now: float) -> SplitServeError | None:
        """Why a call for this model is refused now, or None. A FAILED model whose retry
        time has come is not refused: the call's arrival retries the load."""
        if not self.enabled:
            return ModelNotReady(f"model {self.name!r} was unloaded; load it again first")
        if self.env.stopping():
            return ShuttingDown("the server is shutting down")
        if self.state is ModelState.STOPPING:
            return ShuttingDown(f"model {self.name!r} is being unloaded")
        if self.state is ModelState.FAILED and now < self._retry_at:
            return ModelNotReady(f"model {self.name!r} failed to load: {self.error} (a request retries the load "
                                 f"in {self._retry_at - now:.0f} s, an explicit load at once)")
        return None

    def alloc(self, cls: RequestClass, count: int) -> int:
        refused = self._refusal(time.perf_counter())
        if refused is not None:
            raise refused
        if count > self.config.max_batch_size:
            raise BadSize(f"{count} samples exceed max_batch_size {self.config.max_batch_size} of {self.name!r}")
        return self.rings[cls].alloc(count)

    def input_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return [q.view(seq, count) for q in self.tqs[cls][0]]

    def output_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return [q.view(seq, count) for q in self.tqs[cls][1]]

    def plan_room(self, cls: RequestClass, count: int, movable: dict[int, int]) -> list[int] | None:
        return self.rings[cls].plan_room(count, movable)

    def release(self, call: Call) -> None:
        self.rings[call.cls].release(call.seq, call.count)

    def submit(self, call: Call) -> None:
        """RX_COMPLETE: queue the call for a batch. Answers at once instead if it cannot run
        (the model failed, was unloaded or is stopping meanwhile) or is bounded out."""
        call.rx_complete()
        if call.cls == RequestClass.RT and call.slo is None and self.slo_s is not None:
            call.slo = call.t_ready + self.slo_s  # admitted: a refusal below counts as dropped too
        self.ensure_started()
        refused = self._refusal(call.t_rx)
        if refused is None and self.state is ModelState.FAILED:  # its retry did not start: still failed
            refused = ModelNotReady(f"model {self.name!r} failed to load: {self.error}")
        if refused is not None:
            self._answer(call, refused)
            return
        try:
            self.sched.enqueue(QueuedRequest(call.seq, call.count, call.cls, call.t_rx, call.deadline, call,
                                             slo=call.slo))
        except SplitServeError as e:
            self._answer(call, e)
            return
        self.placer.observe(self.sched.waiting(), call.t_rx)
        self.kick()

    def kick(self) -> None:
        """Run the scheduler once this loop iteration is done (batches what arrived together)."""
        self._changed.set()
        if not self._kick_scheduled:
            self._kick_scheduled = True
            self.loop.call_soon(self._schedule)

    def _schedule(self) -> None:
        self._kick_scheduled = False
        now = time.perf_counter()
        for req in self.sched.expire(now):
            self._answer(req.handle, DeadlineMissed(f"deadline passed after {1e3 * (now - req.arrival):.1f} ms in queue"))
        if self.state in _RUNNING:  # stopping: nothing new starts
            for batch in self.node.schedule(self, now):
                self._start(batch, now)
        if self.state is ModelState.READY and (self._repack_task is None or self._repack_task.done()):
            wanted = self.placer.propose(now)
            if wanted is not None:
                self._repack_task = self.loop.create_task(self._change(lambda: wanted))
                self._repack_task.add_done_callback(self._repack_done)
        self._arm_timer(now)

    def _start(self, batch: Batch, now: float) -> None:
        if not batch.resume_segment:
            for r in batch.requests:
                r.handle.t_dispatch = now
        self._unserved = False
        self.env.memory.touch(self, now)
        self.node.started(self, batch)
        handle = self.workers.get(batch.instance)
        if handle is None or not handle.ready or not handle.send_run(
            RunMsg(int(batch.cls), batch.batch_id, batch.seq, batch.count, batch.resume_segment)
        ):
            self.sched.complete(batch.instance, batch.batch_id)
            self.node.finished(self, batch.instance, batch, ok=False)
            self._answer_batch(batch, WorkerFailed(f"instance {batch.instance} of {self.name!r} is not running"))

    def _arm_timer(self, now: float) -> None:
        wake = self.sched.next_wakeup(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake is not None:
            self._timer = self.loop.call_later(max(0.0, wake - now), self.kick)

    def on_done(self, instance: int, msg: DoneMsg) -> None:
        # Checked before anything is taken off the instance: a report for another batch
        # must not cost the running batch its answer.
        batch = self.sched.running(instance, msg.batch_id)
        if batch is None:
            log.error("model %s: instance %d reported batch %d %s, which it was not running", self.name, instance,
                      msg.batch_id, "preempted" if msg.kind == Msg.PREEMPTED else "done")
            return
        if msg.kind == Msg.PREEMPTED:
            self._on_preempted(instance, msg)
            self._unload_when_idle(instance)
            self.kick()
            return
        self.sched.complete(instance, msg.batch_id)
        self.node.finished(self, instance, batch, ok=True)
        if msg.first_segment == 0:  # a whole, uninterrupted run: a clean sample of batch time
            old = self._batch_s.get(batch.count)
            sample = msg.compute_ns / 1e9
            weight = self.settings.reef.batch_time_weight
            self._batch_s[batch.count] = sample if old is None else old + weight * (sample - old)
            self.sched.batch_done(sample)
        st = self.stats
        st.execution_count += 1
        self.env.metrics.executions.labels(self.name).inc()
        st.compute_ns += msg.compute_ns
        st.batch_sizes[batch.count] = st.batch_sizes.get(batch.count, 0) + 1
        st.last_inference_ms = int(time.time() * 1000)
        t_done, t_start_w = time.perf_counter(), msg.start_ns / 1e9
        for r in batch.requests:
            call = r.handle
            call.compute_ns, call.t_done, call.t_start_w = msg.compute_ns, t_done, t_start_w
        self._answer_batch(batch, None)
        self._unload_when_idle(instance)
        self.kick()
        self.env.memory.batch_done(self)

    def _on_preempted(self, instance: int, msg: DoneMsg) -> None:
        """The worker stopped its batch at a segment boundary: suspend it here (its restore
        point stays in the worker), lower the flag, and tell the node."""
        restore = msg.first_segment + msg.segments_run
        batch = self.sched.preempted(instance, restore)
        handle = self.workers.get(instance)
        if handle is not None:
            handle.flag.clear()
        if batch is None:
            return
        self.stats.preemptions += 1
        self.env.metrics.preemptions.labels(self.name).inc()
        self.env.metrics.preemption_latency.labels(self.name).observe(msg.preempt_ns / 1e9)
        self.node.preempted(self, instance, batch, restore, msg.preempt_ns)

    def _answer_batch(self, batch: Batch, error: SplitServeError | None) -> None:
        for r in batch.requests:
            self._answer(r.handle, error)

    def _answer(self, call: Call, error: SplitServeError | None) -> None:
        if call.replied:  # the watchdog answered it: only its slots are still to come back
            call.answer(error)
            return
        st = self.stats
        if error is None:
            st.success += 1
            st.inference_count += call.count
            st.queue_ns += int(max(0.0, call.t_dispatch - call.t_rx) * 1e9)
        else:
            st.failure += 1
        try:
            call.answer(error)
        except Exception:  # a broken sink must not take the loop or other calls with it
            log.exception("model %s: answering call %d failed", self.name, call.req_id)
        if error is None:
            st.request_ns += int((call.t_work - call.t_ready) * 1e9)
        else:
            st.failure_ns += int((call.t_work - call.t_ready) * 1e9)
        self.env.metrics.observe_call(self.name, call, error)

    def _fail_waiting(self, error: SplitServeError) -> None:
        for q in self.sched.queues.values():
            for r in q.drain():
                self._answer(r.handle, error)

    def expected_batch_s(self, count: int) -> float:
        """Expected compute time of a batch of ``count``, from batches seen so far."""
        if count in self._batch_s:
            return self._batch_s[count]
        if not self._batch_s:
            return 0.0
        # scale the nearest measured size linearly: a fair guess until this size is seen
        near = min(self._batch_s, key=lambda b: abs(b - count))
        return self._batch_s[near] * count / near

    # -- ScheduledModel (the coordinator) ----------------------------------------------

    def instance_views(self, preempt_raised: Callable[[int, int], bool]) -> list[InstanceView]:
        rt_waiting = self.sched.waiting(RequestClass.RT)
        oldest = self.sched.oldest_waiting()
        rt_due = self.sched.next_rt_due()
        out = []
        for i, st in self.sched.instances.items():
            b = st.running
            began = None if b is None else b.created if b.started is None else b.started
            placed = self.resources.placed(self.name, i)
            running_cls, running_batch = (b.cls, b.batch_id) if b else (None, 0)
            if b is None and self.settings.transports.fast_direct and (h := self.workers.get(i)) is not None:
                d = h.counters.snapshot()  # what its direct path runs, from its page
                if d.rt_running or d.in_flight_be:
                    running_cls = RequestClass.RT if d.rt_running else RequestClass.BE
                    running_batch = DIRECT_BATCH
            out.append(InstanceView(
                model=self.name, instance=i, cpus=self.resources.instance_cpus(self.name, i),
                ready=st.ready, running_cls=running_cls, running_batch=running_batch,
                preempt_raised=bool(running_batch) and preempt_raised(i, running_batch),
                expected_end=began + self.expected_batch_s(b.count) if b is not None and began is not None else None,
                suspended=st.suspended is not None, rt_waiting=rt_waiting, oldest_waiting=oldest,
                partition=placed.partition if placed is not None else -1, running_count=b.count if b else 0,
                started=began, rt_due=rt_due,
            ))
        return out

    def rt_waiting(self) -> int:
        return self.sched.waiting(RequestClass.RT)

    def start_batches(self, now: float, classes: Sequence[RequestClass],
                      may_start: Callable[[int, RequestClass], bool] | None,
                      pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None = None) -> list[Batch]:
        return self.sched.schedule(now, tuple(classes), may_start, pick)

    def preempt(self, instance: int, batch_id: int) -> Batch | None:
        handle = self.workers.get(instance)
        if batch_id == DIRECT_BATCH:  # the worker's own best-effort batches: held at their next boundary
            if handle is None:
                return None
            handle.flag.hold_direct(True)
            return Batch(self.name, instance, RequestClass.BE, 0, 0, [], time.perf_counter(), DIRECT_BATCH)
        st = self.sched.instances.get(instance)
        if handle is None or st is None or st.running is None:
            return None
        handle.flag.raise_for(batch_id)
        return st.running

    def clear_preempt(self, instance: int, batch_id: int) -> None:
        handle = self.workers.get(instance)
        if handle is None:
            return
        if batch_id == DIRECT_BATCH:
            handle.flag.hold_direct(False)
        else:
            handle.flag.clear()

    def direct_activity(self) -> tuple[bool, bool, bool]:
        """(real-time work, best-effort work, a direct real-time batch running) now: queued
        or running here, or held by the workers' direct paths (``ScheduledModel``)."""
        rt = bool(self.sched.waiting(RequestClass.RT))
        be = bool(self.sched.waiting(RequestClass.BE))
        running = False
        for i, st in self.sched.instances.items():
            if st.running is not None:
                rt, be = rt or st.running.cls == RequestClass.RT, be or st.running.cls == RequestClass.BE
            be = be or st.suspended is not None
            if (h := self.workers.get(i)) is not None:
                d = h.counters.snapshot()
                running = running or bool(d.rt_running)
                rt, be = rt or bool(d.in_flight_rt), be or bool(d.in_flight_be)
        return rt, be, running

    def set_direct_bell(self, on: bool) -> None:
        for handle in self.workers.values():
            handle.counters.set_bell(on)

    def on_direct(self, instance: int) -> None:
        """Instance ``instance``'s direct real-time batch began or ended (its doorbell)."""
        self.node.direct_changed()

    def pad(self, deadlines: Mapping[int, float]) -> None:
        # The worker reads its deadline on CLOCK_MONOTONIC; the node decides on perf_counter.
        now_pc, now_ns = time.perf_counter(), time.monotonic_ns()
        for i, handle in self.workers.items():
            end = deadlines.get(i, 0.0)
            handle.flag.set_padding_deadline(now_ns + int((end - now_pc) * 1e9) if end else 0)

    # -- ModelPort (transports) and ManagedModel (management) ----------------------------

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        serving = self.sched.serving()
        placed = [self.resources.placed(self.name, i) for i in serving]
        return {
            "name": self.name, "func_id": self.func_id, "version": cfg.version, "state": self.state,
            "inputs": [t.to_dict() for t in cfg.inputs], "outputs": [t.to_dict() for t in cfg.outputs],
            "max_batch_size": cfg.max_batch_size, "default_class": cfg.default_class,
            "slo_s": self.slo_s,  # real-time calls that name no SLO get this one (a cluster gateway counts by it)
            "instances": self.instance_count,
            "threads": [p.threads if p else 0 for p in placed],
            "cpus": [sorted(p.cpus) if p else [] for p in placed],
            "pids": [self.workers[i].pid if i in self.workers else None for i in serving],
            "partitions": [p.partition if p else -1 for p in placed],
            # Residency: ``enabled`` says calls are taken (a model that is not resident
            # loads on the next one); ``residency`` is each serving instance's.
            "enabled": self.enabled,
            "residency": [self.sched.instances[i].residency.value for i in serving],
            "weights_bytes": self.stats.weights_bytes,
            # The workers' own endpoints (ServerConfig.transports.fast_direct; empty: send calls here),
            # and the calls they took directly.
            "direct": self.direct_endpoints(),
            # the same workers' TCP endpoints, for clients that reach the node over TCP (a
            # key of its own: clients that know only ``direct`` keep using the Unix ones)
            "direct_tcp": self.direct_tcp_endpoints(),
            "direct_counts": self.direct_counts().to_dict(),
        }

    @property
    def dispatch_max_batch(self) -> int:
        return self.sched.max_batch

    def set_batching(self, batching: BatchingConfig, max_batch: int | None) -> None:
        """Swap the batching policy (and the dispatch limit, at most ``max_batch_size``, which
        the queues were sized for) in place; queued requests stay."""
        if self.placer.policy() is not None:
            raise InvalidInput(f"model {self.name!r} uses {self.placer.kind.value} placement: its batching follows "
                               "its plan")
        if max_batch is not None and not 1 <= max_batch <= self.config.max_batch_size:
            raise InvalidInput(f"max_batch_size must be 1..{self.config.max_batch_size} for {self.name!r} "
                               "(the tensor queues were sized for that; register a new version to raise it)")
        self.sched.policy = make_policy(batching)
        if max_batch is not None:
            self.sched.max_batch = max_batch
        self.config = self.config.with_changes(batching=asdict(batching))
        self.kick()

    def placement(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.name, **self.placer.describe(), "now": time.perf_counter()}
        out["instances"] = [
            {"id": i, "threads": p.threads, "batch": self.sched.instances[i].max_batch or self.config.max_batch_size,
             "cpus": sorted(p.cpus), "shared": p.shared, "partition": p.partition, "ready": self.sched.instances[i].ready,
             "residency": self.sched.instances[i].residency.value}
            for i in self.sched.serving() if (p := self.resources.placed(self.name, i)) is not None
        ]
        out["reconfigurations"] = list(self.reconfigurations)
        out["partitions"] = self.resources.snapshot(self.name)["partitions"]
        return out

    def gauges(self) -> ModelGauges:
        """Live state for the metrics' gauges."""
        return ModelGauges(
            self.name, {c: len(q) for c, q in self.sched.queues.items()},
            sum(1 for st in self.sched.instances.values() if st.ready and not st.draining),
            self.state is ModelState.FAILED, self.direct_counts() if self.settings.transports.fast_direct else None)
