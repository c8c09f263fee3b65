"""A model's instances: the worker process of each, from spawn to exit.

Workers start bound to nothing and are bound by a LOAD, always: a fresh process and a
spare from the node's pool (``RuntimeEnv.workers``; an eviction gives its processes back
to it) take the same path, so there is one way to load, one timeout
(``worker_start_timeout_s``, for the start and again for the LOAD), and one way a load
fails (``on_load_failed``, with the process left up and reusable). Each instance's
residency is the scheduler's (``scheduler.model_scheduler.Residency``): an instance whose
process is starting or loading is LOADING, one releasing its weights UNLOADING, and
neither is given a batch. ``Instances`` is the ``WorkerOwner`` its handles report to; it
restarts what crashed (with backoff) and keeps each worker's direct endpoint and counters.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from splitserve.errors import InvalidInput, ModelNotReady, Refused, WorkerFailed
from splitserve.placement.partition import InstancePlacement
from splitserve.scheduler.model_scheduler import Residency
from splitserve.scheduler.policy import PackratAggregate
from splitserve.scheduler.priority import PriorityMode
from splitserve.server.model.core import ModelCore
from splitserve.server.model.dispatch import Dispatch
from splitserve.server.model.gpu_stats import GpuStats
from splitserve.server.model.queues import ModelQueues
from splitserve.memory.footprints import MemoryFootprint
from splitserve.server.model.env import InstanceWorker
from splitserve.server.ports import ModelState
from splitserve.worker.counters import DirectTally
from splitserve.worker.messages import DoneMsg, LoadedMsg, UnloadedMsg
from splitserve.worker.pool import Residency as WorkerResidency
from splitserve.worker.spec import BindSpec, DirectSpec

log = logging.getLogger(__name__)


class Instances:
    """The model's worker handles (their ``WorkerOwner``).

    What it tells residency comes as callables from the facade: ``loaded(instance)`` (an
    instance holds the weights now), ``fail(reason)`` (the model cannot load),
    ``evict_progress()`` (an instance released its weights or is gone) and
    ``unload_when_idle(instance)``."""

    def __init__(self, core: ModelCore, queues: ModelQueues, dispatch: Dispatch, loaded: Callable[[int], None],
                 fail: Callable[[str], None], evict_progress: Callable[[], None],
                 unload_when_idle: Callable[[int], None]) -> None:
        self.core = core
        self.name = core.name
        self.queues = queues
        self.dispatch = dispatch
        self.workers = core.workers
        self._loaded, self._fail = loaded, fail
        self._evict_progress, self._unload_when_idle = evict_progress, unload_when_idle
        self._backoff: dict[int, float] = {}
        self.start_failures: dict[int, int] = {}  # consecutive failed starts per instance
        self._weights: dict[int, int] = {}  # bytes of the weights each resident instance holds
        # Direct calls (ServerConfig.transports.fast_direct) counted by workers this model no longer
        # holds; the live ones are read from their pages.
        self._direct_past = DirectTally()
        # a GPU model's copy counts and partitions (None on the CPU)
        self.gpu = GpuStats() if core.config.device.startswith("cuda") else None
        # instance -> the port of its worker's TCP direct endpoint (from LOADED; the OS picks it)
        self._direct_tcp_ports: dict[int, int] = {}

    # -- instances placed and forgotten ----------------------------------------------------

    def add(self, placement: InstancePlacement, standby: bool = False) -> int:
        """A new instance at ``placement`` (no worker yet); its id."""
        core = self.core
        batch = placement.batch if core.placer.per_instance_batch else None
        # under idle, the real-time instances first: a new one is best-effort once those are all there
        cfg = core.config
        rt_live = sum(1 for s in core.sched.instances.values() if not s.draining and not s.best_effort)
        best_effort = core.settings.reef.preemption is PriorityMode.IDLE and cfg.be_instances > 0 and \
            rt_live >= cfg.instances - cfg.be_instances
        iid = core.sched.add_instance(max_batch=batch, standby=standby, best_effort=best_effort)
        try:
            core.resources.place(self.name, iid, placement)
        except BaseException:
            core.sched.remove(iid)
            raise
        self._backoff[iid] = core.settings.workers.worker_restart_backoff_s
        self.start_failures[iid] = 0
        return iid

    def forget(self, iid: int) -> None:
        """Instance ``iid`` is gone: unplace it and drop what was kept of it."""
        self.core.sched.remove(iid)
        self.core.resources.unplace(self.name, iid)
        if self.core.env.devices is not None:
            self.core.env.devices.release(self.name, iid)
        parked = self.workers.get(iid)
        if parked is not None and parked.alive and parked.residency is WorkerResidency.PARKED:
            # nobody would reload or release it now
            parked.kill(f"model {self.name!r}: instance {iid} was removed while its weights were parked")
        for d in (self.workers, self._backoff, self.start_failures, self._weights):
            d.pop(iid, None)
        self._weights_changed()

    def clear(self) -> None:
        """Every worker is gone (the model stopped)."""
        self.workers.clear()
        self._weights.clear()
        self._weights_changed()

    async def wait_up(self, ids: list[int]) -> None:
        """Until the instances ``ids`` are up; ModelNotReady if one gave up starting (or
        the model stopped trying). Bounded: every start attempt is (worker_start_timeout_s)."""
        core = self.core
        cfg = core.settings
        attempts = cfg.workers.worker_start_attempts

        def up() -> bool:
            return all(core.sched.instances[i].ready for i in ids if i in core.sched.instances)

        def settled() -> bool:
            gave_up = any(self.start_failures.get(i, 0) >= attempts for i in ids)
            return up() or gave_up or not core.running

        deadline = time.perf_counter() + attempts * (cfg.workers.worker_start_timeout_s + cfg.workers.worker_restart_backoff_max_s)
        await core.until(settled, deadline)
        if not up():
            raise ModelNotReady(f"model {self.name!r}: new instances did not start: {core.error or 'timed out'}")

    # -- starting and binding workers ------------------------------------------------------

    def start_missing(self) -> None:
        """Bring up every serving instance that is not resident (a fresh count of failed
        starts): spawn a worker where there is none, LOAD into one bound to nothing."""
        for i in self.core.sched.serving():
            handle = self.workers.get(i)
            if handle is None:
                self.start_failures[i] = 0
                self.spawn(i)
            elif handle.residency in (WorkerResidency.UNBOUND, WorkerResidency.PARKED):
                self.start_failures[i] = 0
                self.bind(i)

    def spawn(self, i: int) -> None:
        """Get instance ``i`` a process from the node's pool: a spare that is up gets the
        LOAD now; one that is starting gets it from ``on_ready``."""
        core = self.core
        self.workers[i] = handle = core.env.workers.take(self, i)
        core.sched.set_residency(i, Residency.LOADING)
        if handle.residency is WorkerResidency.UNBOUND:
            log.info("model %s: instance %d binds spare worker %s", self.name, i, handle.pid)
            self.bind(i)
            return
        timeout = core.settings.workers.worker_start_timeout_s
        core.loop.call_later(timeout, self._start_timed_out, handle, timeout)
        log.info("model %s: instance %d waits for worker %s to start", self.name, i, handle.pid)

    @staticmethod
    def _start_timed_out(handle: InstanceWorker, timeout: float) -> None:
        if handle.alive and not handle.started:
            handle.kill(f"worker (pid {handle.pid}) was not ready within worker_start_timeout_s={timeout:g}s")

    def bind_spec(self, i: int) -> BindSpec:
        """What binds instance ``i``'s worker to this model: config, artifact, queues, the
        stored profile's segment times for its thread count, its CPUs and threads, and
        whether to measure its memory (only while the model's size is not measured)."""
        core = self.core
        placed = core.resources.placed(self.name, i)
        assert placed is not None, "an instance is placed before its worker binds"
        segments = [] if core.profile is None else core.profile.segment_times_ns(placed.threads)
        return BindSpec(
            core.config.to_dict(), str(core.record.path) if core.record.path else None, self.queues.fds(),
            core.config.capacity, segments, cpus=sorted(placed.cpus), threads=placed.threads,
            measure=not core.footprint.measured, direct=self._direct_spec(i, placed.batch),
            visible_devices=self._gpu(i),
            idle=core.settings.reef.preemption is PriorityMode.IDLE and (
                core.sched.instances[i].best_effort if core.config.be_instances else core.config.default_class == "be"))

    def _gpu(self, i: int) -> str | None:
        """Instance ``i``'s GPU partition (``CUDA_VISIBLE_DEVICES``), None on the CPU;
        InvalidInput when the node has no GPU the model's ``device`` names."""
        devices = self.core.env.devices
        if not self.core.config.device.startswith("cuda"):
            return None
        if devices is None:
            raise InvalidInput(f"model {self.name!r} asks for device {self.core.config.device!r}, "
                               "but this node hands out no GPUs")
        got = devices.assign(self.name, i, self.core.config.device)
        return None if got is None else got.visible_devices

    def _direct_spec(self, i: int, batch: int) -> DirectSpec | None:
        """Instance ``i``'s direct endpoint, with the front end's stream limits and the
        instance's batch (and Packrat's aggregation timeout) (None: off)."""
        s = self.core.settings
        if not s.transports.fast_direct:
            return None
        slo_s = self.core.slo_s
        policy = self.core.placer.policy()
        aggregate_s = policy.timeout_s if isinstance(policy, PackratAggregate) else None
        return DirectSpec(
            str(self._direct_path(i)), self.core.func_id, s.transports.direct_max_connections, s.transports.fast_max_in_flight,
            s.transports.fast_out_high_water, s.transports.fast_out_low_water, s.transports.fast_max_pending_out, s.transports.frame_timeout_s,
            s.transports.fast_reads_per_wakeup, s.reef.preemption is PriorityMode.RT_ONLY, s.transports.direct_suspend_poll_s,
            s.transports.direct_stage_bytes, int(slo_s * 1e6) if slo_s else 0, s.direct_tcp_host, s.transports.direct_spin_us,
            s.transports.direct_compiled, batch, aggregate_s, s.batching.max_call_age_s, s.transports.front_end_spin_us)

    def bind(self, i: int) -> None:
        """LOAD this model into instance ``i``'s worker (up, bound to nothing), or RELOAD it
        where the worker parked it (its weights in page-locked host memory: the first batch
        copies them back as it runs); the instance is LOADING, never dispatched to, until
        ``on_loaded``. A failed reload leaves the worker unbound, and the retry loads anew."""
        core = self.core
        handle = self.workers[i]
        if core.settings.transports.fast_direct:
            handle.counters.set_admit(core.settings.transports.direct_admit)
        if handle.residency is WorkerResidency.PARKED:
            log.info("model %s: instance %d reloads its weights from page-locked host memory", self.name, i)
            sent = handle.send_reload()
        else:
            try:
                spec = self.bind_spec(i)
            except InvalidInput as e:  # no GPU for it here: the model cannot load, and says why
                self._fail(str(e))
                return
            sent = handle.send_load(spec)
        if not sent:
            return  # gone: its exit is handled as any other
        core.sched.set_residency(i, Residency.LOADING)
        timeout = core.settings.workers.worker_start_timeout_s
        core.loop.call_later(timeout, self._load_timed_out, handle, handle.binding, timeout)

    @staticmethod
    def _load_timed_out(handle: InstanceWorker, binding: int | None, timeout: float) -> None:
        if handle.alive and handle.residency is WorkerResidency.LOADING and handle.binding == binding:
            handle.kill(f"worker (pid {handle.pid}) did not load the model within worker_start_timeout_s={timeout:g}s")

    def kill_all(self, reason: str) -> None:
        for handle in list(self.workers.values()):
            handle.kill(reason)

    # -- direct endpoints --------------------------------------------------------------------

    def _direct_path(self, i: int) -> Path:
        return self.core.settings.direct_dir / f"{self.core.func_id}-{i}.sock"

    def _direct_instances(self, tcp: bool = False) -> list[int]:
        """Instances whose direct endpoints take calls now (bound, not retiring); ``tcp``:
        those with a TCP endpoint (none without ``direct_tcp_host``)."""
        core = self.core
        if not core.settings.transports.fast_direct or core.state is not ModelState.READY or (
                tcp and core.settings.direct_tcp_host is None):
            return []
        return [i for i in core.sched.serving()
                if core.sched.instances[i].ready and not core.sched.instances[i].draining
                and (h := self.workers.get(i)) is not None and h.ready and (not tcp or i in self._direct_tcp_ports)]

    def direct_endpoints(self, tcp: bool = False) -> list[str]:
        """The URLs of the direct endpoints of instances that serve now: what a LOOKUP gives a
        client that sends its calls straight to the workers. ``unix://`` ones, or with ``tcp``
        the same instances' ``tcp://`` ones (none without ``ServerConfig.direct_tcp_host``):
        their host is the address they bind, the fast path's, and a client reaches them at
        the host it reached the front end at."""
        if not tcp:
            return [f"unix://{self._direct_path(i)}" for i in self._direct_instances()]
        host = self.core.settings.direct_tcp_host
        netloc = f"[{host}]" if host is not None and ":" in host else host
        return [f"tcp://{netloc}:{self._direct_tcp_ports[i]}" for i in self._direct_instances(tcp=True)]

    def direct_classes(self, tcp: bool = False) -> list[str]:
        """The class each of ``direct_endpoints(tcp)`` serves, in their order: ``be`` for an
        instance kept for best-effort work (``be_instances`` under preemption ``idle``: its
        worker runs under SCHED_IDLE), ``rt`` for the others. A client sends each call to an
        endpoint of its class, so a real-time call never waits behind a best-effort batch in
        a worker the kernel ranks below everything."""
        instances = self.core.sched.instances
        return ["be" if instances[i].best_effort else "rt" for i in self._direct_instances(tcp)]

    def hand_off(self, endpoint: tuple[str, int | str], sock: socket.socket, req_id: int) -> None:
        """Hand a client's connection to the instance whose direct endpoint is ``endpoint``
        (``protocol.handoff.endpoint_key``): it serves the connection from now on, and the
        caller closes only its own descriptor. Raises Refused where no instance that serves
        now has that endpoint, or its worker cannot take it (the caller still has it then)."""
        scheme, where = endpoint
        for i in self._direct_instances(tcp=scheme == "tcp"):
            if where == (self._direct_tcp_ports.get(i) if scheme == "tcp" else str(self._direct_path(i))):
                if self.workers[i].send_adopt(sock, req_id):
                    self.core.env.metrics.handoffs.labels(self.name).inc()
                    return
                break
        raise Refused(f"no direct endpoint {scheme}:{where} of model {self.name!r} serves now; "
                      "look the model up again, or call through the front end")

    def direct_tally(self) -> DirectTally:
        """Direct calls of this model so far: workers gone, plus the live ones' pages (all
        zero while the direct path is off). Their SLO outcomes join the model's SLO metric
        and statistics here, so every read of the statistics or the metrics sees them."""
        total = self._direct_past
        if not self.core.settings.transports.fast_direct:
            return total
        for handle in self.workers.values():
            total = total + handle.counters.tally()
        self.core.env.metrics.count_direct_slo(self.name, total.counts.slo())
        return total

    def gpu_stats(self) -> dict | None:
        """A GPU model's partitions and copies (``gpu_stats.GpuStats``); None on the CPU."""
        if self.gpu is None:
            return None
        devices = self.core.env.devices
        serving = self.core.sched.serving()
        parts = [devices.held_by(self.name, i) if devices is not None else None for i in serving]
        return self.gpu.snapshot([self.workers[i] for i in serving if i in self.workers], parts)

    def _harvest_direct(self, instance: int, handle: InstanceWorker) -> None:
        """A worker leaves this model (unloaded or gone): keep what its page counted; its
        TCP endpoint is gone."""
        self._direct_tcp_ports.pop(instance, None)
        if self.core.settings.transports.fast_direct:
            self._direct_past = self._direct_past + handle.counters.tally().finished()

    # -- WorkerOwner (the worker handles) ----------------------------------------------------

    def on_ready(self, instance: int, info: dict) -> None:
        if instance not in self.core.sched.instances or not self.core.running:
            return  # a model that failed, is stopping or was evicted has asked this worker to go
        self.bind(instance)

    def on_loaded(self, instance: int, msg: LoadedMsg) -> None:
        core = self.core
        if instance not in core.sched.instances or not core.running:
            return  # evicted, failed or stopping while it loaded: the worker is being killed or stopped
        core.sched.set_residency(instance, Residency.RESIDENT)
        self._weights[instance] = msg.nbytes
        if msg.direct_tcp_port is not None:
            self._direct_tcp_ports[instance] = msg.direct_tcp_port
        self._weights_changed()
        if msg.private_bytes is None:
            core.footprint = replace(core.footprint, weights_bytes=msg.nbytes)
        else:  # measured: kept across restarts
            core.footprint = MemoryFootprint(msg.nbytes, msg.private_bytes, measured=True,
                                             device_bytes=msg.device_bytes or 0)
            core.env.footprints.save(core.record, core.footprint, msg.load_ns / 1e6)
        core.stats.loads += 1
        core.stats.load_ns += msg.load_ns
        self._backoff[instance] = core.settings.workers.worker_restart_backoff_s
        self.start_failures[instance] = 0
        self._loaded(instance)
        log.info("model %s: instance %d loaded (%d segments, %d B of weights in %.0f ms)", self.name, instance,
                 msg.segments, msg.nbytes, msg.load_ns / 1e6)
        self.dispatch.kick()

    def on_load_failed(self, instance: int, binding: int, text: str) -> None:
        """The worker could not load the model; it stays up, bound to nothing, and is
        reused by a retry. Handled as a failed start that the worker explained."""
        log.error("model %s: instance %d failed to load: %s", self.name, instance, text)
        if instance not in self.core.sched.instances:
            return
        self.core.sched.set_residency(instance, Residency.ABSENT)
        self.dispatch.kick()
        handle = self.workers.get(instance)
        if self.core.running and handle is not None and handle.reloading:
            log.warning("model %s: instance %d loads its weights anew", self.name, instance)
            self.bind(instance)  # the worker is unbound and usable: the parked copy was all that failed
        elif self.core.running:
            self._start_failed(instance, text, explained=True)

    def on_unloaded(self, instance: int, msg: UnloadedMsg) -> None:
        """The worker released the model: its process goes back to the node's pool (kept as
        a spare if its memory came back, else stopped); the next load takes one anew. A
        worker that parked the model stays the instance's (the next load reloads it)."""
        parked = msg.parked_bytes > 0
        handle = self.workers.get(instance) if parked else self.workers.pop(instance, None)
        if handle is not None and not parked:
            self._harvest_direct(instance, handle)
            if self.gpu is not None:
                self.gpu.harvest(handle)
            self.core.env.workers.give_back(handle, msg.rss_anon)
        if instance not in self.core.sched.instances:
            return
        self.core.sched.set_residency(instance, Residency.ABSENT)
        self._weights.pop(instance, None)
        self._weights_changed()
        log.info("model %s: instance %d released its weights (binding %s%s)", self.name, instance, msg.binding,
                 f"; {msg.parked_bytes} B parked in page-locked host memory" if parked else "")
        self._evict_progress()
        if self.core.running and not parked and instance in self.core.sched.serving():
            self.start_missing()  # released from the tier while a load waited for it: load anew
        self.dispatch.kick()

    def on_done(self, instance: int, msg: DoneMsg) -> None:
        self.dispatch.done(instance, msg)

    def on_failed(self, instance: int, batch_id: int, text: str) -> None:
        if batch_id == 0:  # the worker could not start; it exits now and on_exit decides
            log.error("model %s: instance %d failed to start: %s", self.name, instance, text)
            return
        self.dispatch.failed(instance, batch_id, text)

    def on_direct(self, instance: int) -> None:
        """Instance ``instance``'s direct real-time batch began or ended (its doorbell)."""
        self.core.env.node.direct_changed()

    def on_exit(self, instance: int, handle: InstanceWorker) -> None:
        if self.workers.get(instance) is handle:
            del self.workers[instance]
            self._harvest_direct(instance, handle)
            if self.gpu is not None:
                self.gpu.harvest(handle)
            self._worker_gone(instance, handle)
            self._evict_progress()
        self.dispatch.kick()

    # -- failures and restarts ---------------------------------------------------------------

    def _weights_changed(self) -> None:
        self.core.stats.weights_bytes = sum(self._weights.values())

    def _worker_gone(self, instance: int, handle: InstanceWorker) -> None:
        core = self.core
        st = core.sched.instances.get(instance)
        if st is None:
            return
        was = st.residency
        self.dispatch.lose(instance, core.sched.set_residency(instance, Residency.ABSENT),
                           WorkerFailed(f"worker of {self.name!r} (pid {handle.pid}) died during the batch"))
        if self._weights.pop(instance, None) is not None:
            self._weights_changed()
        if st.draining:
            self.forget(instance)
            return
        if not core.running or handle.stopping:
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
        core = self.core
        self.start_failures[instance] += 1
        attempts = core.settings.workers.worker_start_attempts
        others = any(core.sched.instances[i].ready for i in core.sched.serving() if i != instance)
        given_up = self.start_failures[instance] >= attempts
        if others:
            if given_up:
                core.error = reason
                log.error("model %s: instance %d did not start %d times (%s); the others keep serving, "
                          "a load retries it", self.name, instance, attempts, reason)
                core.ready_event.set()  # a load waiting for it ends with what serves
            else:
                self._restart_later(instance, reason)
        elif given_up or explained:
            self._fail(reason)
        else:
            self._restart_later(instance, reason)

    def _restart_later(self, instance: int, why: str) -> None:
        delay = self._backoff[instance]
        self._backoff[instance] = min(delay * 2, self.core.settings.workers.worker_restart_backoff_max_s)
        log.warning("model %s: %s; restarting in %.1fs", self.name, why, delay)
        self.core.loop.call_later(delay, self._restart, instance)

    def _restart(self, instance: int) -> None:
        st = self.core.sched.instances.get(instance)
        if not self.core.running or st is None or st.draining:
            return
        handle = self.workers.get(instance)
        if handle is None:
            self.spawn(instance)
        elif handle.residency is WorkerResidency.UNBOUND:  # its LOAD failed: the same process tries again
            self.bind(instance)
