"""A model's residency: load, unload and evict its weights, as the memory manager grants.

This is the piece of a model the node's memory manager drives (``ResidentModel``, declared
next to it in ``memory/manager.py``). A model asks for residency before any
load and loads when granted; ``evict`` releases the weights of every instance and the next
call loads them again, while the model's identity (queues, scheduler, statistics, queued
calls) stays untouched.

What it tells the memory manager while carrying out one of the manager's commands
(``begin_load``, ``release_residency``, ``refuse_load``) it returns with the command as
``Report``s instead of calling the manager back; at any other time it reports at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from splitserve.errors import ModelNotReady, ShuttingDown, SplitServeError, WorkerFailed
from splitserve.memory.weights import drop_page_cache, weights_file
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import Residency as InstanceResidency
from splitserve.server.model.core import ModelCore
from splitserve.server.model.dispatch import Dispatch
from splitserve.server.model.instances import Instances
from splitserve.memory.footprints import MemoryFootprint
from splitserve.memory.manager import Report, ReportKind
from splitserve.server.ports import ModelState
from splitserve.worker.pool import Residency as WorkerResidency

log = logging.getLogger(__name__)


class ModelResidency:
    """Whether the model's weights are in memory (the memory manager's ``ResidentModel``)."""

    def __init__(self, core: ModelCore, instances: Instances, dispatch: Dispatch) -> None:
        self.core = core
        self.name = core.name
        self.instances = instances
        self.dispatch = dispatch
        # Releasing the weights (evict): no load starts until every instance is ABSENT.
        self._evicting = False
        self._park = False  # the eviction under way keeps the weights in page-locked host memory
        self._evict_lock = asyncio.Lock()  # one eviction at a time (a second waits, then finds nothing resident)
        self._asked = False  # residency requested from the node's memory manager, not granted yet
        self._held: list[Report] | None = None  # reports made while a command of the manager runs
        # The footprint (what residency is charged) is read off the loop before the first request.
        self._footprint_known = False
        self._reading = False

    # -- talking to the memory manager ---------------------------------------------------------

    def _report(self, report: Report) -> None:
        """Tell the memory manager now, or, inside one of its commands, with the command's answer."""
        if self._held is not None:
            self._held.append(report)
            return
        broker, kind = self.core.env.memory, report.kind
        if kind is ReportKind.REQUEST:
            broker.request(self, report.rt_waiting)
        elif kind is ReportKind.LOADED:
            broker.loaded(self, report.nbytes)
        elif kind is ReportKind.EVICTING:
            broker.evicting(self)
        elif kind is ReportKind.RELEASED:
            broker.released(self)
        else:
            broker.load_failed(self, report.reason)

    def _command(self, run: Callable[[], object]) -> list[Report]:
        """Carry out a command of the memory manager; what it reported meanwhile."""
        self._held = []
        try:
            run()
            return self._held
        finally:
            self._held = None

    def begin_load(self) -> list[Report]:
        """The manager's grant: load now (``ResidentModel``)."""
        return self._command(self._begin_load)

    def release_residency(self, park: bool = False) -> list[Report]:
        """The manager's choice of a victim: release the weights, or with ``park`` keep them
        in page-locked host memory in the workers (``ResidentModel``)."""
        return self._command(lambda: self.begin_eviction(park))

    def release_parked(self) -> None:
        """The pinned host tier let go of the model: every worker that parked it releases it
        and goes back to the node's pool (``Instances.on_unloaded``)."""
        for handle in list(self.core.workers.values()):
            if handle.residency is WorkerResidency.PARKED:
                handle.send_unload()

    def refuse_load(self, reason: str) -> list[Report]:
        """The manager's refusal: the model can never fit (``ResidentModel``)."""
        return self._command(lambda: self._refuse(reason))

    # -- what the memory manager reads -------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.core.enabled

    @property
    def keep_resident(self) -> bool:
        return self.core.keep_resident

    @property
    def footprint(self) -> MemoryFootprint:
        return self.core.footprint

    @property
    def instance_count(self) -> int:
        return len(self.core.sched.serving())

    def charge(self) -> int:
        core = self.core
        return core.footprint.charge(self.instance_count or core.placer.instances or core.config.instances)

    def device_charge(self, at_least_weights: bool = False) -> dict[str, int]:
        """Device bytes per partition UUID (see ``ResidentModel``). ``at_least_weights``: a GPU
        model no load has measured on its device yet counts each instance at its weights'
        bytes, a lower bound (what the start-up preload plans with); else it counts nothing
        until its LOADED says."""
        core = self.core
        devices = core.env.devices
        footprint = core.footprint
        if at_least_weights and not footprint.device_bytes and core.config.device.startswith("cuda"):
            footprint = replace(footprint, device_bytes=footprint.weights_bytes)
        if devices is None or not footprint.device_bytes:
            return {}
        per: dict[str, int] = {}
        for i in range(self.instance_count or core.placer.instances or core.config.instances):
            uuid = devices.expected(self.name, i, core.config.device)
            if uuid is not None:
                per[uuid] = per.get(uuid, 0) + 1
        return footprint.device_charge(per)

    def weights_parked(self) -> bool:
        return any(h.residency is WorkerResidency.PARKED for h in self.core.workers.values())

    def pinned_charge(self) -> int:
        core = self.core
        if not core.config.device.startswith("cuda"):
            return 0  # host memory is a CPU model's device: nothing to park
        return core.footprint.weights_bytes * (self.instance_count or core.placer.instances or core.config.instances)

    def pinned(self) -> bool:
        d, sched = self.dispatch, self.core.sched
        if d.unserved and not sched.waiting():
            d.unserved = False  # the calls it loaded for are gone (deadlines): nothing to serve first
        return d.unserved or bool(self.core.reconfiguring) or any(st.busy for st in sched.instances.values()) \
            or d.direct_held() > 0  # its workers hold direct calls: it is as busy as with a batch

    def holds_memory(self) -> bool:
        return self.core.running or self._evicting

    # -- loading ---------------------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Ask the node's memory manager for residency if the model holds none (models load
        on first use; the manager starts the load when it fits, perhaps at once). A FAILED
        model is retried only once ``load_retry_s`` has passed since it failed."""
        core = self.core
        if not core.enabled or core.env.stopping() or self._evicting or core.running \
                or core.state is ModelState.STOPPING:
            return
        if core.state is ModelState.FAILED:
            if time.perf_counter() < core.retry_at:
                return
            core.state = ModelState.EVICTED  # the retry waits like any load: calls queue meanwhile
        if not self._asked:
            self._asked = True
            core.ready_event.clear()
        if not self._footprint_known:  # the request waits for what it will be charged
            if not self._reading:
                self._reading = True
                core.env.off_loop(self._read_footprint, self._footprint_read)
            return
        self._report(Report(ReportKind.REQUEST, rt_waiting=core.sched.waiting(RequestClass.RT) > 0))

    async def read_footprint(self) -> MemoryFootprint:
        """What the memory manager will charge this model, read now (off the loop) when it is
        not known yet, and kept: what the start-up preload plans with, before any load."""
        core = self.core
        if not self._footprint_known:
            done: asyncio.Future[MemoryFootprint] = asyncio.get_running_loop().create_future()
            core.env.off_loop(self._read_footprint, done.set_result)
            footprint = await done
            if not self._footprint_known:  # a LOADED's measurement (never before this) wins
                core.footprint, self._footprint_known = footprint, True
        return core.footprint

    def _read_footprint(self) -> MemoryFootprint:
        """Off the loop: the stored measurement, else the weights file's header, else unknown."""
        core = self.core
        try:
            return core.env.footprints.footprint(core.record)
        except Exception:  # a size is not known: its first LOADED measures it
            log.exception("model %s: could not read its stored footprint", self.name)
            return MemoryFootprint()

    def _footprint_read(self, footprint: MemoryFootprint) -> None:
        """Back on the loop: ask for residency now, if still wanted; else wake the waiters."""
        core = self.core
        self._reading = False
        if not self._footprint_known:  # a LOADED's measurement (never before this) wins
            core.footprint, self._footprint_known = footprint, True
        if self._asked:
            self._asked = False
            self.ensure_started()
            if not self._asked and not core.running:  # nothing asked (stopping, unloaded, evicting)
                core.ready_event.set()  # wait_ready sees the state

    def _begin_load(self) -> None:
        core = self.core
        if not self._asked or not core.enabled or core.env.stopping() or self.holds_memory():
            self._asked = False
            # granted too late: it holds nothing, the reservation goes back
            self._report(Report(ReportKind.RELEASED))
            return
        self._asked = False
        core.state, core.error = ModelState.LOADING, None
        core.ready_event.clear()
        if not core.sched.instances:
            try:
                self._place()
            except SplitServeError as e:
                self.fail(str(e))
                return
        self.instances.start_missing()

    def _refuse(self, reason: str) -> None:
        self._asked = False
        self.fail(reason)

    def _place(self) -> None:
        """Take the model's CPUs from the node and add its instances (at load, and again after
        an unload gave them back); raises ResourcesUnavailable naming what is in use."""
        core = self.core
        try:
            for p in core.placer.place(core.resources):
                self.instances.add(p)
        except BaseException:
            for i in list(core.sched.instances):
                self.instances.forget(i)
            core.resources.release(self.name)
            raise

    def loaded(self, instance: int) -> None:
        """Instance ``instance`` holds the weights now: the model serves as soon as one can."""
        core = self.core
        if core.state is ModelState.LOADING and not core.sched.instances[instance].standby:
            core.state = ModelState.READY  # serve as soon as one instance can
            self.dispatch.unserved = core.sched.waiting() > 0
        if core.state is ModelState.READY and all(core.sched.instances[i].ready for i in core.sched.serving()):
            core.ready_event.set()  # a load returns when every instance is up
        if core.state is ModelState.READY:
            self._report(Report(ReportKind.LOADED, nbytes=self.charge()))

    async def wait_ready(self) -> None:
        """Load the model (an explicit load retries a FAILED one at once) and wait until it
        serves; ModelNotReady with the load error if it fails. Bounded: each start attempt
        has worker_start_timeout_s and there are worker_start_attempts of them."""
        core = self.core
        if not core.enabled:
            raise ModelNotReady(f"model {self.name!r} was unloaded; load it again first")
        if self._evicting:  # bounded: evict kills what has not released its weights by its deadline
            await core.until(lambda: not self._evicting,
                             time.perf_counter() + core.settings.workers.drain_timeout_s + core.settings.workers.stop_timeout_s)
        if core.state is ModelState.FAILED:
            core.retry_at = 0.0  # an explicit load retries at once (through the memory manager, like any load)
        elif core.state is ModelState.READY:
            self.instances.start_missing()  # instances that gave up starting get another go
        self.ensure_started()
        if core.running or self._asked:  # nothing asked (e.g. the node is stopping): nothing to wait for
            await core.ready_event.wait()
        if core.state is not ModelState.READY:
            raise ModelNotReady(f"model {self.name!r} failed to load: {core.error or core.state}")

    def fail(self, reason: str) -> None:
        """The model could not load: FAILED, refusing calls (MODEL_NOT_READY and the reason)
        until ``load_retry_s`` passed; the instances stay, so a retry starts them again."""
        core = self.core
        retry_s = core.settings.workers.load_retry_s
        core.state, core.error = ModelState.FAILED, reason
        core.retry_at = time.perf_counter() + retry_s
        log.error("model %s failed to load: %s; calls are refused, a request after %gs or a load retries it",
                  self.name, reason, retry_s)
        self.instances.kill_all(f"model {self.name!r} failed to load")
        core.ready_event.set()
        self.dispatch.fail_waiting(ModelNotReady(f"model {self.name!r} failed to load: {reason}"))
        self._report(Report(ReportKind.LOAD_FAILED, reason=reason))

    async def load(self) -> None:
        """An explicit load (management): serve again after a user's unload, retry a FAILED
        load at once, and wait until the model serves."""
        self.core.enabled = True
        await self.wait_ready()

    # -- unloading -------------------------------------------------------------------------------

    async def unload(self, deadline: float | None = None, reason: str = "was unloaded", *,
                     disable: bool = False) -> None:
        """Stop dispatching and stop the workers. Calls still waiting, and batches preempted
        mid-run, are answered SHUTTING_DOWN; running batches may finish until ``deadline``
        (default: stop_timeout_s from now), after which their workers are killed and the
        batches answered WORKER_FAILED. ``disable`` (a user's unload): calls are refused
        MODEL_NOT_READY until the next ``load``, instead of starting the model again."""
        core, sched, d = self.core, self.core.sched, self.dispatch
        if disable:
            core.enabled = False
        if deadline is None:
            deadline = time.perf_counter() + core.settings.workers.stop_timeout_s
        core.state = ModelState.STOPPING
        self._evicting = False  # an eviction under way ends here: the workers stop
        error = ShuttingDown(f"model {self.name!r} {reason}")
        d.fail_waiting(error)
        for i in list(sched.instances):
            batch = sched.take_suspended(i)
            if batch is not None:
                d.lose(i, [batch], error)
        for handle in list(core.workers.values()):
            if handle.residency in (WorkerResidency.STARTING, WorkerResidency.LOADING):  # nothing to finish
                handle.kill(f"model {self.name!r} {reason} while loading")
        if not await core.until(lambda: not any(s.busy for s in sched.instances.values()), deadline):
            log.error("model %s: batches still running at the stop deadline; killing their workers", self.name)
        handles = list(core.workers.values())
        await asyncio.gather(*(h.stop(timeout=max(0.0, deadline - time.perf_counter())) for h in handles))
        for i in list(sched.instances):  # a worker whose exit is not handled yet still owes its batch
            d.lose(i, sched.set_residency(i, InstanceResidency.ABSENT),
                   WorkerFailed(f"model {self.name!r} stopped during the batch"))
        self.instances.clear()
        for i in list(sched.instances):  # the CPUs go back to the node; a load takes them anew
            self.instances.forget(i)
        core.resources.release(self.name)
        core.state = ModelState.UNLOADED
        self._asked = False
        core.ready_event.set()  # a load that was waiting ends (not ready)
        self._report(Report(ReportKind.RELEASED))
        d.kick()

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
        core = self.core
        async with self._evict_lock:
            if not self.begin_eviction():
                return False
            if deadline is None:
                deadline = time.perf_counter() + core.settings.workers.drain_timeout_s
            if not await core.until(lambda: not self._evicting, deadline):
                for i, st in core.sched.instances.items():
                    handle = core.workers.get(i)
                    if handle is not None and st.residency is not InstanceResidency.ABSENT:
                        handle.kill(f"model {self.name!r}: instance {i} did not release its weights by the "
                                    "eviction's deadline")
                await core.until(lambda: not self._evicting, time.perf_counter() + core.settings.workers.stop_timeout_s)
            return True

    def begin_eviction(self, park: bool = False) -> bool:
        """Begin an eviction (``evict`` waits for it): the model turns EVICTED, workers still
        starting or loading are killed, resident instances turn UNLOADING (no new batches)
        and release their weights as soon as their batch is done (with ``park``, keep them
        in page-locked host memory: the next load reloads from there). False if nothing is
        resident or loading."""
        core = self.core
        if not core.running or self._evicting:
            return False
        core.state, self._evicting, self._park = ModelState.EVICTED, True, park
        core.ready_event.set()  # a load that was waiting ends: the model is not resident
        self._report(Report(ReportKind.EVICTING))
        for i, st in list(core.sched.instances.items()):  # a kill may report the exit at once
            handle = core.workers.get(i)
            if handle is None:
                continue
            if st.ready:
                core.sched.set_residency(i, InstanceResidency.UNLOADING)
                self.unload_when_idle(i)
            elif handle.residency in (WorkerResidency.STARTING, WorkerResidency.LOADING):  # nothing to finish
                handle.kill(f"model {self.name!r} was evicted while loading")
        log.info("model %s: evicting (releasing the weights of %d instance(s))", self.name, len(core.workers))
        self.evict_progress()
        return True

    def unload_when_idle(self, i: int) -> None:
        """Send UNLOAD to an UNLOADING instance once no batch runs on it; a batch suspended
        there goes back to its queue first (UNLOAD drops its restore point)."""
        sched = self.core.sched
        st = sched.instances.get(i)
        handle = self.core.workers.get(i)
        if st is None or handle is None or st.residency is not InstanceResidency.UNLOADING or st.running is not None:
            return
        if not handle.ready:
            return  # its UNLOAD is sent already
        batch = sched.take_suspended(i)
        if batch is not None:
            log.info("model %s: preempted batch %d goes back to the queue before instance %d unloads", self.name,
                     batch.batch_id, i)
            self.dispatch.requeue(i, batch)
        handle.send_unload(park=self._park)  # False: gone, and on_exit takes it from here

    def evict_progress(self) -> None:
        """End the eviction once no instance holds or is changing its weights; calls that
        arrived meanwhile load the model again."""
        core = self.core
        if not self._evicting or any(st.residency is not InstanceResidency.ABSENT
                                     for st in core.sched.instances.values()):
            return
        self._evicting = False
        core.stats.evictions += 1
        log.info("model %s: evicted; its weights are released, the next call loads it", self.name)
        if core.settings.memory.evict_drop_cache:
            path = weights_file(core.config, core.record.path, core.settings.cache_path)
            if path is not None:  # off the loop: the kernel may write back or walk many pages
                core.loop.run_in_executor(None, drop_page_cache, path)
        self._report(Report(ReportKind.RELEASED))
        self.dispatch.kick()
        if core.sched.waiting():
            self.ensure_started()
