"""The node's composition root: ``Server`` builds every part of a splitserve node, hands
each one only the interface it needs (declared next to the part that drives it, or in
``server/ports.py``), and starts and stops them.

Nothing below this module imports it. The parts: the fast-path transports and the HTTP
and gRPC front ends (each a ``FrontEnd``), the intake and the monitor, one
``ModelRuntime`` per model (``server/model/``: created on first use, given a ``RuntimeEnv``
and what it reads from disk, read off the loop), the
``Coordinator`` (the runtimes' ``NodeScheduler``), the node's one ``ResourceManager`` (its
CPUs) with the ``PlacementApplier`` that carries out changes of placement, the
``MemoryManager`` (the runtimes' ``ResidencyBroker``: which models hold memory), the
``ModelManager``, and the clients' system shared-memory regions (``SystemSharedMemory``).
``docs/node.md`` draws them. ``Server.infer`` is the one request path that the decoded front ends (HTTP,
gRPC, in-process) share with the fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from splitserve.config import ServerConfig
from splitserve.errors import ShuttingDown, SplitServeError, UnknownModel
from splitserve.memory.footprints import RegistryFootprints
from splitserve.memory.manager import MemoryManager
from splitserve.memory.preload import Candidate, plan_preload
from splitserve.types import TensorSpec, batch_of
from splitserve.placement.devices import DeviceAssigner, partitions_of
from splitserve.placement.gpus import MigDriver
from splitserve.server.mig_geometry import MigGeometry
from splitserve.placement.partition import Partitioning
from splitserve.placement.profiler import ModelProfile, load_profile
from splitserve.placement.resources import ResourceManager
from splitserve.placement.topology import read_topology
from splitserve.protocol.header import RequestClass
from splitserve.protocol.requests import call_class
from splitserve.registry import ModelRecord, Registry, private_dir
from splitserve.scheduler.priority import PriorityMode
from splitserve.server.blocking import OffLoop
from splitserve.server.applier import PlacementApplier
from splitserve.server.coordinator import Coordinator
from splitserve.server.direct_watch import LookPeriod
from splitserve.server.fastpath import StreamListener
from splitserve.server.frontends import CodecPool
from splitserve.server.gpus import GpuInventory
from splitserve.server.grpc_server import GrpcFrontEnd, NodeServicer
from splitserve.server.http import HttpFrontEnd, create_app
from splitserve.server.http.torchserve import torchserve_inference_app, torchserve_management_app
from splitserve.server.intake import Intake
from splitserve.server.log_settings import LogSettings
from splitserve.server.management import UPLOAD_DIR, ModelManager, exposure_warning
from splitserve.server.metrics import Metrics
from splitserve.server.monitor import Call, CallState, InferenceMonitor
from splitserve.protean.mig_slots import MigBatchChooser
from splitserve.protean.partitions import PartitionManager
from splitserve.protean.profiles import ProteanProfiles
from splitserve.server.model.env import InstanceWorker, RuntimeEnv, WorkerFactory
from splitserve.server.ports import FrontEnd, InferOutcome, ModelPort, ModelState
from splitserve.server.model.runtime import ModelRuntime
from splitserve.server.shm import SystemSharedMemory
from splitserve.server.tracing import CallTracer
from splitserve.server.udp import UdpListener
from splitserve.worker.forkserver import ForkServer
from splitserve.worker.pool import WorkerHandle, worker_env
from splitserve.worker.spares import SparePool

log = logging.getLogger(__name__)


def _partition_memory(config: ServerConfig) -> int:
    """The bytes the node's partitions share by cores: ``partition_memory_bytes``, else the
    memory budget, else the machine's physical memory."""
    if config.protean.partition_memory_bytes is not None:
        return config.protean.partition_memory_bytes
    if config.memory.memory_budget_bytes is not None:
        return config.memory.memory_budget_bytes
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _FutureSink:
    """Sink for in-process callers: copies the outputs out of the slots into a future."""

    def __init__(self, future: asyncio.Future, outputs: Sequence[TensorSpec]) -> None:
        self.future = future
        self.outputs = outputs

    def deliver(self, call: Call) -> None:
        views = call.runtime.output_views(call.cls, call.seq, call.count)
        outs = [np.frombuffer(v, dtype=spec.dtype).reshape((call.count, *spec.shape)).copy()
                for v, spec in zip(views, self.outputs)]
        if not self.future.done():
            self.future.set_result(InferOutcome(outs, call.queue_us, call.compute_ns // 1000, call.total_us))

    def fail(self, call: Call, error: SplitServeError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class Server:
    """A splitserve node. ``await start()``, then ``await stop()`` (or ``serve_forever``).

    It is the transports' ``FastPathHost``, the decoded front ends' ``ServingAPI`` and
    management's ``ModelDirectory``; ``start_worker`` makes the worker of one instance
    (a process by default)."""

    def __init__(self, config: ServerConfig, start_worker: WorkerFactory | None = None) -> None:
        if config.reef.preemption is PriorityMode.SEQ and config.transports.fast_direct:
            # seq runs one batch on the node at a time, so its scheduler must see every batch;
            # a worker serving its own direct calls cannot know of the others' (on DISB C over
            # the direct path seq ran as concurrent: real-time p99 959x rt-only's)
            log.info("preemption seq: calls go through the front end (the direct path is off)")
            config = config.replaced(fast_direct=False)
        self.config = config
        self.metrics = Metrics()
        # Triton's trace extension (off until a trace setting turns it on) and logging extension
        self.tracer = CallTracer(config.data_dir, config.frontends.otlp_endpoint)
        self.logs = LogSettings(logging.getLogger("splitserve"))
        self.monitor = InferenceMonitor(self.metrics, stage_trace=config.transports.fast_stage_trace,
                                        traced=self.tracer.closed)
        self.runtimes: dict[str, ModelRuntime] = {}
        self.resources = ResourceManager(read_topology())  # the one owner of the node's CPUs
        self.applier = PlacementApplier(self.resources, lambda name: self.runtimes[name].placements)
        # PROTEAN's partitions, per-batch placement, autoscaler and geometry controller (partitioning set)
        self.partitions: PartitionManager | None = None
        if config.protean.partitioning is not Partitioning.NONE:
            self.partitions = PartitionManager(config, self.resources, self.applier,
                                               lambda: [rt.placements for rt in self.runtimes.values()],
                                               lambda: self.coordinator.view(), self.metrics, _partition_memory(config),
                                               mig_geometry=MigGeometry(MigDriver(
                                                   admin=config.gpu.gpu_admin,
                                                   timeout_s=config.gpu.gpu_command_timeout_s),
                                                   self._drain_gpu_partitions))
        self.coordinator = Coordinator(lambda: [rt.dispatch for rt in self.runtimes.values()], config.reef.preemption,
                                       config.batching.coordinator_events,
                                       class_order=config.reef.class_order, placement=self.partitions,
                                       partition_of=self.partitions.partition_of if self.partitions else None)
        self.records: dict[str, ModelRecord] = {}
        # per model not built yet: its stored profile, read off the loop
        self._profiles: dict[str, ModelProfile | None] = {}
        self.by_func: dict[int, str] = {}
        self.intake = Intake(config.transports)  # requests still arriving on the fast path
        self.frontends: list[FrontEnd] = []
        self.ports: dict[str, Any] = {}
        self.stopping = False
        self._stopped = False
        self.preloaded: tuple[str, ...] | None = None  # the start-up models loaded (None: not decided yet)
        # workers fork from here (``worker/forkserver.py``), started in ``_start`` or with the first worker
        self.forks = ForkServer(worker_env(config.omp_wait_policy), str(config.data_dir)) \
            if config.workers.fork_workers else None
        self._start_worker = start_worker or functools.partial(
            WorkerHandle, reap_timeout_s=config.workers.worker_reap_timeout_s, omp_wait_policy=config.omp_wait_policy,
            forks=self.forks)
        self._codec: CodecPool | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._direct_watch: asyncio.TimerHandle | None = None
        self._look = LookPeriod(config.transports.direct_poll_s, config.transports.direct_idle_poll_s)
        self.memory = MemoryManager(config.memory, self.metrics, self.coordinator.note, self._spares)
        # client regions of Triton's system shared-memory extension (HTTP and gRPC)
        self.shm = SystemSharedMemory(config.frontends.shm_max_regions, config.frontends.shm_max_bytes)
        # the node's GPUs and MIG slices, read-only (GET /v2/partitions' gpus)
        self.gpus = GpuInventory(MigDriver().list, config.gpu.gpu_listing_max_age_s)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open every front end and load the start-up models; on failure, undo what started."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._watchdog = self.loop.call_later(self.config.batching.watchdog_period_s, self._sweep)
        cfg = self.config
        private_dir(cfg.data_dir)
        if cfg.transports.fast_direct:
            private_dir(cfg.direct_dir)
            # the workers' pages: direct use (memory manager, Packrat) and REEF across the direct path
            self._direct_watch = self.loop.call_later(self._look.wait_s, self._watch_direct)
            self.coordinator.hurry = self._hurry_direct_watch
        if self.forks is not None and (cfg.load or cfg.memory.spare_workers):
            self.forks.start(self.loop)  # workers are needed at start-up: torch's import overlaps the rest of it
        if (exposed := exposure_warning(cfg)) is not None:
            log.warning("%s", exposed)
        cfg.cache_path.mkdir(parents=True, exist_ok=True)
        self.registry = await asyncio.to_thread(Registry, cfg.data_dir)
        self.footprints = RegistryFootprints(self.registry, cfg.cache_path)
        # PROTEAN's solo times, FBRs and batch memory (its placement reads them per batch)
        self.protean_profiles = ProteanProfiles(self.registry)
        if self.partitions is not None:
            self.partitions.profiles = self.protean_profiles
        if cfg.reef.preemption is PriorityMode.IDLE:  # idle pads best-effort work by the same FBRs
            self.coordinator.fbr = self.protean_profiles.fbr
        self.pool: SparePool[InstanceWorker] = SparePool(cfg, self.loop, self._start_worker, lambda: self.stopping)
        self.pool.start()
        devices = DeviceAssigner(self.gpus.current)
        if self.partitions is not None:  # η placement on the MIG devices GPU models' instances hold
            self.partitions.mig = MigBatchChooser(devices, lambda: partitions_of(self.gpus.current()),
                                                  self.protean_profiles, cfg.protean.protean_unknown_fbr)
        self.env = RuntimeEnv(loop=self.loop, config=cfg, node=self.coordinator, metrics=self.metrics,
                              resources=self.resources, placements=self.applier,
                              stopping=lambda: self.stopping, workers=self.pool,
                              footprints=self.footprints, memory=self.memory, off_loop=OffLoop(self.loop),
                              partitions=self.partitions, devices=devices)
        self.management = ModelManager(cfg, self.registry, self, self.coordinator, self.resources, self.memory,
                                       self.partitions, self.gpus)
        self.gpus.start()
        if self.partitions is not None:
            self.partitions.start(self.loop)
        # uploads that a crash left half-written are never resumed
        await asyncio.to_thread(shutil.rmtree, cfg.data_dir / UPLOAD_DIR, True)
        for rec in await asyncio.to_thread(self.registry.sync, cfg.repository, cfg.gpu.zoo_device):
            await self.remember(rec)
        if cfg.frontends.http_port is not None or cfg.frontends.grpc_port is not None \
                or cfg.frontends.ts_management_port is not None:
            await asyncio.to_thread(self.management.ensure_token)
        for fe in self._frontends():
            self.frontends.append(fe)  # before it starts, so that stop() undoes a half-started one
            self.ports.update(await fe.start())
        self.preloaded = await self._preload(cfg.load)
        self._write_server_file()
        log.info("splitserve ready: %s (data dir %s)", self.ports, cfg.data_dir)

    async def _preload(self, names: Sequence[str]) -> tuple[str, ...]:
        """Load the start-up models ``names`` (``*``: every registered model, in registration
        order) that fit the node's budgets together (``memory.preload.plan_preload``), one
        after another; log each one skipped and why (it loads on its first call). Returns the
        models loaded."""
        if "*" in names:
            names = [*(n for n in names if n != "*"),
                     *(r.name for r in sorted(self.records.values(), key=lambda r: r.func_id))]
        runtimes = [self.runtime(n) for n in dict.fromkeys(names)]
        if not runtimes:
            return ()
        await asyncio.gather(*(rt.residency.read_footprint() for rt in runtimes))
        wanted = [Candidate(rt.name, rt.residency.charge(), rt.residency.device_charge(at_least_weights=True),
                            rt.residency.footprint.measured and (rt.residency.footprint.device_bytes > 0
                                                                 or not rt.config.device.startswith("cuda")))
                  for rt in runtimes]
        mem = self.config.memory
        gpus = partitions_of(self.gpus.current()) if any(c.device_bytes for c in wanted) else ()
        plan = plan_preload(wanted, mem.memory_budget_bytes, mem.device_budget_bytes,
                            {p.uuid: p.mem_bytes for p in gpus}, mem.max_resident_models)
        for name, why in plan.skipped:
            log.warning("start-up model %s not preloaded: %s; it loads on its first call", name, why)
        for name in plan.load:
            await self.runtime(name).wait_ready()
        return plan.load

    def _drain_gpu_partitions(self, uuids: frozenset[str]) -> bool:
        """Unload every model with an instance on the GPU partitions ``uuids`` (their calls
        answered, their workers stopped, so no process holds a context there) and forget
        their partitions, so their next load lands on what the GPUs then hold; whether none
        is left there. Blocking: called off the loop, by the MIG geometry change."""
        return asyncio.run_coroutine_threadsafe(self._unload_on(uuids), self.loop).result()

    async def _unload_on(self, uuids: frozenset[str]) -> bool:
        devices = self.env.devices
        assert devices is not None  # the root always hands the node's partitions out
        names = [n for n in devices.owners_on(uuids) if n in self.runtimes]
        if names:
            log.warning("draining %s off GPU partitions %s before their geometry changes",
                        ", ".join(names), ", ".join(sorted(uuids)))
        await asyncio.gather(*(self.runtimes[n].unload(reason="its GPU partition is being re-carved")
                               for n in names))
        for n in names:
            devices.release(n)
        return not devices.owners_on(uuids)

    def _frontends(self) -> list[FrontEnd]:
        """The front ends ``config`` turns on, in start order."""
        cfg = self.config
        out: list[FrontEnd] = []
        if cfg.transports.fast_port is not None:
            out.append(StreamListener(self, (cfg.host, cfg.transports.fast_port)))
        if cfg.transports.unix_path is not None or cfg.transports.fast_port is not None:
            out.append(StreamListener(self, cfg.unix_socket))
        if cfg.transports.udp_port is not None:
            out.append(UdpListener(self, (cfg.host, cfg.transports.udp_port)))
        if cfg.frontends.http_port is not None or cfg.frontends.grpc_port is not None:
            self._codec = CodecPool.from_config(cfg)
            if cfg.frontends.http_port is not None:
                out.append(HttpFrontEnd(create_app(self, self.management, self._codec, cfg, self.shm,
                                                   self.tracer.sampler, self.logs), cfg))
            if cfg.frontends.grpc_port is not None:
                out.append(GrpcFrontEnd(NodeServicer(self, self.management, self._codec, cfg, self.shm,
                                                     self.tracer.sampler, self.logs), cfg))
        if cfg.frontends.ts_inference_port is not None:
            self._codec = self._codec or CodecPool.from_config(cfg)
            out.append(HttpFrontEnd(torchserve_inference_app(self, self.management, self._codec, cfg), cfg,
                                    cfg.frontends.ts_inference_port, "ts_inference_port"))
        if cfg.frontends.ts_management_port is not None:
            out.append(HttpFrontEnd(torchserve_management_app(self.management, cfg), cfg,
                                    cfg.frontends.ts_management_port, "ts_management_port"))
        return out

    def _spares(self) -> tuple[int, int]:
        """Worker processes bound to no model, up and still starting (the node's pool, once it started)."""
        return (self.pool.spares, len(self.pool.starting)) if hasattr(self, "pool") else (0, 0)

    def _profile(self, name: str) -> ModelProfile | None:
        return load_profile(self.registry, name)


    def _write_server_file(self) -> None:
        info = {"pid": os.getpid(), "host": self.config.host, **self.ports}
        tmp = self.config.data_dir / "server.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.config.data_dir / "server.json")

    def _sweep(self) -> None:
        """The watchdog: answer calls nothing answered within max_call_age_s (see monitor)."""
        self.monitor.sweep(time.perf_counter(), self.config.batching.max_call_age_s)
        self._watchdog = self.loop.call_later(self.config.batching.watchdog_period_s, self._sweep)

    def _watch_direct(self) -> None:
        self._direct_watch = self.loop.call_later(self._look.next(self.coordinator.watch_direct()),
                                                  self._watch_direct)

    def _hurry_direct_watch(self) -> None:
        """The next look at the workers' pages within ``direct_poll_s``, where it waits longer now."""
        if self._look.backed_off and self._direct_watch is not None:
            self._direct_watch.cancel()
            self._look.hurry()
            self._direct_watch = self.loop.call_later(self._look.wait_s, self._watch_direct)

    async def _stop_frontends(self, deadline: float) -> None:
        """Every front end stops taking requests; HTTP and gRPC calls in flight get stop_grace_s."""
        async def stop_one(fe: FrontEnd) -> None:
            try:
                await fe.stop(self.config.frontends.stop_grace_s)
            except Exception:
                log.exception("stopping front end %s failed", type(fe).__name__)

        try:
            await asyncio.wait_for(asyncio.gather(*(stop_one(fe) for fe in self.frontends)),
                                   max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            log.error("front ends still stopping at the stop deadline; going on")

    async def stop(self) -> None:
        """Refuse new work, let running batches finish, stop workers, free memory.

        Ends within stop_timeout_s: then calls still waiting are answered SHUTTING_DOWN
        and workers still running a batch are killed (their batches: WORKER_FAILED)."""
        if self._stopped:
            return
        self._stopped = self.stopping = True
        deadline = time.perf_counter() + self.config.workers.stop_timeout_s
        if self.partitions is not None:
            await self.partitions.stop()  # no autoscaling or geometry change while the models stop
        await self._stop_frontends(deadline)
        await self.gpus.stop()
        runtimes = list(self.runtimes.values())
        results = await asyncio.gather(*(rt.unload(deadline, "was stopped: the server is shutting down")
                                         for rt in runtimes), return_exceptions=True)
        for rt, r in zip(runtimes, results):
            if isinstance(r, BaseException):
                log.error("model %s: unload at shutdown failed", rt.name, exc_info=r)
        if hasattr(self, "pool"):
            await self.pool.stop()
        if self.forks is not None:
            await self.forks.stop()
        for call in self.monitor.open_calls():  # none should be left; if one is, it still gets its answer
            if call.state is CallState.RX_COMPLETE:
                log.error("model %s: call %d still open after its model stopped", call.runtime.name, call.req_id)
                try:
                    call.answer(ShuttingDown("the server is shutting down"))
                except Exception:  # one broken sink must not stop the rest of the shutdown
                    log.exception("model %s: answering call %d at shutdown failed", call.runtime.name, call.req_id)
        for fe in self.frontends:
            fe.close()
        self.frontends.clear()
        if self._codec is not None:
            self._codec.close()
        self.shm.unregister()
        self.shm.cuda_unregister()
        self.intake.close()
        for rt in runtimes:
            try:
                rt.close()
            except Exception:
                log.exception("model %s: releasing its tensor queues failed", rt.name)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._direct_watch is not None:
            self._direct_watch.cancel()
        await asyncio.to_thread(self.tracer.close)  # the spans held are exported, trace files written
        if hasattr(self, "registry"):
            await self.footprints.flush()
            await asyncio.to_thread(self.registry.close)
        try:
            (self.config.data_dir / "server.json").unlink()
        except FileNotFoundError:
            pass

    async def serve_forever(self) -> None:
        """Start, run until SIGINT/SIGTERM, stop. The handlers are in place before start-up,
        so a signal during a long ``--load`` stops cleanly; a second signal exits at once."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                log.warning("%s again: exiting now without draining", sig.name)
                self._kill_workers()
                os._exit(128 + sig)
            log.info("%s: shutting down (send it again to exit at once)", sig.name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        # The imports' objects (~90,000) live as long as the process: frozen, they are out of every
        # full collection, which took ≈ 70 ms over them with the loop stalled. Frozen before any
        # model is set up, so what a dropped model leaves is still collected.
        gc.freeze()
        starting = asyncio.ensure_future(self._start())
        signalled = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                log.info("stopping during start-up")
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
            else:
                starting.result()  # a start-up error ends here
                await signalled
        finally:
            signalled.cancel()
            await self.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _kill_workers(self) -> None:
        for rt in self.runtimes.values():
            rt.kill_workers("the server is exiting without draining")
        if hasattr(self, "pool"):
            self.pool.kill_all("the server is exiting without draining")

    # -- the node's models (ModelDirectory) ----------------------------------------------

    async def remember(self, rec: ModelRecord) -> None:
        """Make a (newly registered) model known to every front end, once its stored profile
        is read off the loop: its first call then builds its runtime without I/O."""
        profile = await asyncio.to_thread(self._profile, rec.name)
        self._profiles[rec.name] = profile
        self.records[rec.name] = rec
        self.by_func[rec.func_id] = rec.name

    def forget(self, name: str) -> None:
        """Drop a model from the name and func_id maps (its runtime must be gone)."""
        self._profiles.pop(name, None)
        rec = self.records.pop(name, None)
        if rec is not None and self.by_func.get(rec.func_id) == name:
            del self.by_func[rec.func_id]

    def runtime(self, name: str) -> ModelRuntime:
        """The runtime of a registered model (created on first use; workers start lazily)."""
        rt = self.runtimes.get(name)
        if rt is not None:
            return rt
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        rec = self.records.get(name)
        if rec is None:
            raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(sorted(self.records)) or 'none'}")
        rt = self.runtimes[name] = ModelRuntime(self.env, rec, self._profiles.get(name))
        return rt

    def loaded(self, name: str) -> ModelRuntime | None:
        return self.runtimes.get(name)

    async def drop(self, name: str) -> None:
        rt = self.runtimes.pop(name, None)
        if rt is not None:
            await rt.unload(disable=True)
            rt.close()
        self.memory.forget(name)
        self.tracer.sampler.forget(name)
        self.forget(name)

    # -- FastPathHost ------------------------------------------------------------------

    def model(self, name: str) -> ModelPort:
        return self.runtime(name)

    def model_by_func(self, func_id: int) -> ModelPort:
        name = self.by_func.get(func_id)
        if name is None:
            raise UnknownModel(f"unknown func_id {func_id}; look the model up by name first")
        return self.runtime(name)

    def request_class(self, port: ModelPort, cls: int) -> RequestClass:
        """The class a call runs in: its own, or the model's default; policy may refuse BE."""
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        return call_class(cls, port.default_class, self.config.reef.preemption is PriorityMode.RT_ONLY)

    # -- ServingAPI: the shared request path for decoded front ends --------------------------

    def model_state(self, name: str) -> ModelState:
        rt = self.runtimes.get(name)
        if rt is not None:
            return rt.state
        return ModelState.UNLOADED if name in self.records else ModelState.UNKNOWN

    def model_ready(self, name: str) -> bool:
        """Whether a call to ``name`` would be served without an explicit load: it is enabled
        and not failed or stopping, resident or not (one that is not loads on the call)."""
        if self.stopping or name not in self.records:
            return False
        rt = self.runtimes.get(name)
        return rt is None or rt.will_serve()

    def ready(self) -> bool:
        """Ready (HTTP and gRPC alike): not stopping, and every start-up (``--load``) model the
        node preloaded (those that fit its budgets) is ready, or evicted on purpose (it takes
        calls and loads on the next); other models load on first use, so they do not count."""
        if self.preloaded is None:  # the start-up models are still loading (or none are named)
            return not self.stopping and not self.config.load
        return not self.stopping and all(self.model_state(m) in (ModelState.READY, ModelState.EVICTED)
                                          for m in self.preloaded)

    def stage_trace(self) -> dict[str, Any]:
        stages = self.monitor.stages
        return {"enabled": stages is not None, "now": time.perf_counter(),
                "calls": stages.snapshot() if stages is not None else []}

    def metrics_text(self) -> bytes:
        self.metrics.refresh(rt.gauges() for rt in self.runtimes.values())
        self.memory.refresh_metrics()
        return self.metrics.render()

    async def infer(self, name: str, inputs: Sequence[np.ndarray], cls: "str | int | None" = None,
                    deadline_s: float | None = None, slo_s: float | None = None) -> InferOutcome:
        """Run one call: inputs in declared order, each shaped ``(n, *shape)``."""
        port = self.model(name)
        cfg = port.config
        count = batch_of(name, cfg.inputs, inputs)
        c = self.request_class(port, int(RequestClass.parse(cls)))
        seq = self.intake.alloc(port, c, count)
        fut = self.loop.create_future()
        now = time.perf_counter()
        call = Call(self.monitor, port, 0, c, seq, count, _FutureSink(fut, cfg.outputs),
                    now + deadline_s if deadline_s else None, slo=now + slo_s if slo_s else None)
        for view, spec, arr in zip(port.input_views(c, seq, count), cfg.inputs, inputs):
            np.copyto(np.frombuffer(view, dtype=spec.dtype).reshape((count, *spec.shape)), arr)
        port.submit(call)
        return await fut
