"""The seams of a splitserve node: what each part needs from the others, and nothing more.

``server.app.Server`` is the node's composition root. It builds every part and hands each
one only the interface below that it needs; no part imports ``app`` or names ``Server``.
``docs/node.md`` draws who calls whom. In short:

* a **transport** (``fastpath``, ``udp``) reaches the node through ``FastPathHost`` and a
  model through ``ModelPort``;
* the decoded **front ends** (``http``, ``grpc_server``) use ``ServingAPI`` for inference,
  ``SharedMemoryRegions`` for the tensors clients keep in shared memory and a
  ``management.ModelManager`` for everything else; every front end, fast path included,
  is a ``FrontEnd`` the root starts and stops. HTTP's inference routes and gRPC's
  ``InferenceServicer`` need only ``InferenceAPI`` and ``ModelCatalog``, which a cluster
  gateway implements too;
* a **runtime** (``runtime.ModelRuntime``) gets its node through ``RuntimeEnv``: the
  ``NodeScheduler`` it asks for batches, metrics, the node's ``ResourceManager`` (CPUs), the
  ``PlacementChanger`` that carries out its changes of placement, profiles and a worker
  factory; it drives ``InstanceWorker`` handles;
* the **placement applier** (``applier.PlacementApplier``) drives each model it changes as a
  ``PlacedModel``;
* the **coordinator** sees each runtime as a ``ScheduledModel``;
* the **memory manager** (``memory.MemoryManager``) is each runtime's ``ResidencyBroker`` and
  drives each model as a ``ResidentModel``;
* **management** sees the node's models through ``ModelDirectory`` and each one as a
  ``ManagedModel``.

These are also the interfaces a remote node implements: a cluster gateway forwards to a
model through ``ModelPort``/``ServingAPI`` as the local transports do. So they carry
descriptors, views and typed records, never a process, a socket or a registry handle.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from splitserve.config import ServerConfig
from splitserve.modelconfig import BatchingConfig, ModelConfig
from splitserve.placement.partition import InstancePlacement, NodePartition, PartitionSource
from splitserve.placement.plans import Wanted
from splitserve.placement.profiler import ModelProfile
from splitserve.placement.resources import ResourceManager
from splitserve.protocol.header import RequestClass
from splitserve.protocol.v2 import ShmRef
from splitserve.registry import ModelRecord
from splitserve.scheduler.model_scheduler import ClassOrder
from splitserve.scheduler.priority import InstanceView, PriorityMode
from splitserve.scheduler.request import Batch
from splitserve.server.intake import Intake, RingPort
from splitserve.server.metrics import Metrics
from splitserve.server.monitor import InferenceMonitor
from splitserve.slo import SloOutcome
from splitserve.types import TensorSpec
from splitserve.worker.counters import DirectCounts
from splitserve.worker.messages import RunMsg
from splitserve.worker.pool import Residency, WorkerOwner
from splitserve.worker.spec import BindSpec, WorkerSpec

# -- records that cross the seams -------------------------------------------------------------


class ModelState(StrEnum):
    """A served model's life: UNLOADED → LOADING → READY → STOPPING → UNLOADED, and FAILED
    when its load failed (calls are refused until a retry, after ``load_retry_s``).
    READY → EVICTED when its weights are released (``evict``) while it stays registered
    and takes calls: they queue, and the first one loads it again (EVICTED → LOADING)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    EVICTED = "evicted"
    UNKNOWN = "unknown"  # no model of that name is registered (``ServingAPI.model_state`` only)


@dataclass
class ModelStats:
    """Cumulative per-model counters (Open Inference Protocol statistics extension)."""

    success: int = 0
    failure: int = 0
    inference_count: int = 0  # samples
    execution_count: int = 0  # batches
    queue_ns: int = 0
    compute_ns: int = 0
    request_ns: int = 0  # successful calls, header to answer
    failure_ns: int = 0  # failed calls, header to answer
    preemptions: int = 0
    last_inference_ms: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    loads: int = 0  # instances that loaded the weights (LOADED)
    load_ns: int = 0  # their load times, as the workers measured them
    evictions: int = 0  # completed evictions (every instance released its weights)
    weights_bytes: int = 0  # not cumulative: what the resident instances' weights take now
    # Soft SLOs of its real-time calls: met, missed, dropped (``Metrics.slo_tally``, live)
    slo: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in SloOutcome})


@dataclass(frozen=True, slots=True)
class MemoryFootprint:
    """What one residency of a model takes in the node's memory: its weights once (mapped
    from one file, so its instances share them) plus what each instance adds on top
    (activations at the largest batch, the runtime's own allocations)."""

    weights_bytes: int = 0
    private_bytes: int = 0  # per instance
    measured: bool = False  # False: from the weights file's header (or nothing known yet), not a LOADED report

    def charge(self, instances: int) -> int:
        """Bytes a residency with ``instances`` instances holds."""
        return self.weights_bytes + self.private_bytes * instances


@dataclass
class InferOutcome:
    """Outputs (fresh arrays, in declared order) and the server's timings of one call."""

    outputs: list[np.ndarray]
    queue_us: int
    compute_us: int
    total_us: int


@dataclass(frozen=True, slots=True)
class Event:
    """One step in the life of a batch, on the server's perf_counter clock."""

    t: float
    kind: str  # start | resume | preempt | preempted | done | failed; load_start | load_done | evict_start | evict_done
    model: str
    instance: int
    batch: int
    cls: str
    segment: int = 0  # preempted: the restore point; resume: where it resumes
    latency_ns: int = 0  # preempted: flag raised -> worker stopped
    partition: int = -1  # the node partition the instance sits on (-1: none, or not an instance's event)
    tag: float | None = None  # the batch's ``Batch.tag``: its partition's tag when placed (None: not by tags)


# -- transports -------------------------------------------------------------------------------


class ModelPort(RingPort, Protocol):
    """One served model as a transport sees it.

    Called by the fast-path transports and ``Server.infer`` for every request: ``alloc``
    the slots (raises why the model refuses the call), receive into ``input_views``,
    ``submit`` the call once its payload is in; the model answers it exactly once through
    the call's sink, whose ``output_views`` hold the outputs. A lookup reads ``describe``.
    """

    config: ModelConfig
    default_class: RequestClass  # the class of a call that names none

    def describe(self) -> dict[str, Any]:
        """A lookup reply's JSON body: name, func_id, tensors, state, instances."""


class FastPathHost(Protocol):
    """What the fast-path transports (``FastPathConnection``, ``StreamListener``,
    ``UdpEndpoint``) need from the node, for every frame they read."""

    loop: asyncio.AbstractEventLoop
    config: ServerConfig
    intake: Intake  # slot allocation for requests still arriving; the frame-timeout sweep
    monitor: InferenceMonitor

    def model(self, name: str) -> ModelPort:
        """A registered model by name (a lookup); never starts its workers. Raises UnknownModel."""

    def model_by_func(self, func_id: int) -> ModelPort:
        """The model a request's func_id names. Raises UnknownModel."""

    def request_class(self, port: ModelPort, cls: int) -> RequestClass:
        """The class a call runs in (its own, or the model's default); raises when the node
        refuses it (stopping, or best-effort work on an rt-only node)."""


class FrontEnd(ABC):
    """Something that takes requests from outside: a fast-path listener (TCP, Unix, UDP),
    HTTP, gRPC. The composition root starts them all, then stops them all, through this."""

    @abstractmethod
    async def start(self) -> dict[str, Any]:
        """Bind and start serving; returns what was bound (e.g. ``{"http_port": 8000}``)."""

    @abstractmethod
    async def stop(self, grace_s: float) -> None:
        """Stop taking requests; requests in flight may finish within ``grace_s``. Called
        before the node stops its models."""

    def close(self) -> None:
        """Let go of what is left (e.g. idle connections). Called after the models stopped,
        so answers to calls that were running could still go out."""


# -- the decoded front ends -------------------------------------------------------------------


class InferenceAPI(Protocol):
    """What the inference half of a decoded front end (``http.inference_routes``,
    ``grpc_server.InferenceServicer``) calls per request: the node (``Server``), or a cluster
    gateway that forwards each call to a node."""

    def infer(self, name: str, inputs: Sequence[np.ndarray], cls: str | int | None = None,
              deadline_s: float | None = None, slo_s: float | None = None) -> Awaitable[InferOutcome]:
        """Run one call: inputs in declared order, each shaped ``(n, *shape)``; ``deadline_s``
        is hard (queued past it, the call fails), ``slo_s`` soft (a real-time call is served
        late and counted missed), both from now."""

    def model_ready(self, name: str) -> bool:
        """The model would serve a call without an explicit load (resident or not)."""

    def ready(self) -> bool:
        """Not stopping, and every start-up (``--load``) model is ready."""


class ServingAPI(InferenceAPI, Protocol):
    """What HTTP and gRPC need from the node to serve (management is ``ModelManager``)."""

    def model_state(self, name: str) -> ModelState:
        """The state of a registered model (UNLOADED before its first use), else UNKNOWN."""

    def metrics_text(self) -> bytes:
        """Prometheus text exposition, gauges refreshed now."""

    def stage_trace(self) -> dict[str, Any]:
        """``GET /v2/debug/stages``: ``enabled``, the clock ``now`` and the kept calls' stamps."""


class ModelSignature(Protocol):
    """A model's tensors, as a decoded front end checks a call against them and names its
    outputs: the node's ``ModelConfig``, or a node's lookup reply (``client.common.ModelInfo``)
    at a cluster gateway."""

    @property
    def name(self) -> str: ...

    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...

    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...

    @property
    def max_batch_size(self) -> int: ...


class ModelCatalog(Protocol):
    """The models the inference half of a decoded front end serves (``http.inference_routes``,
    ``grpc_server.InferenceServicer``, per request): ``management.ModelManager`` on a node,
    the routes' models at a cluster gateway."""

    def version(self, name: str, version: str | None = None) -> str:
        """The version ``name`` serves; raises UnknownModel for an unknown model, or when
        ``version`` is given (not empty) and is not that one."""

    def model_config(self, name: str) -> ModelSignature:
        """The model's tensors and largest batch as served now."""

    def model_metadata(self, name: str) -> dict[str, Any]:
        """v2 model metadata (``v2.model_metadata``)."""


class RegisteredModel(Protocol):
    """What a registration answers with: the node's ``registry.ModelRecord``, or the cluster's
    func id for the model at a gateway."""

    @property
    def name(self) -> str: ...

    @property
    def func_id(self) -> int: ...

    @property
    def version(self) -> int: ...


class ModelRegistrar(Protocol):
    """The repository routes' side (``http.repository_routes``: register, unregister, index),
    per call: ``management.ModelManager`` on a node, a cluster gateway's
    ``cluster/dataplane.py::GatewayRegistrar`` (which forwards to the cluster's controller)."""

    def check_token(self, authorization: str | None) -> None:
        """Accept ``Bearer <management token>``; raise Unauthorized otherwise."""

    def register(self, config_toml: str, artifact: bytes | None, labels: str | None) -> Awaitable[RegisteredModel]:
        """Register the model ``config_toml`` names and return once it serves (InvalidInput
        when it is already registered, or is refused; nothing stays registered then)."""

    def unregister(self, name: str) -> Awaitable[None]:
        """Stop serving a model registered at run time and forget it (UnknownModel when there
        is none; InvalidInput for one that was not registered at run time)."""

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """The v2 repository extension's index: ``name``, ``version``, ``state``, ``reason`` per model."""


@dataclass(frozen=True, slots=True)
class RegionStatus:
    """One registered system shared-memory region, as the extension's status reports it."""

    name: str
    key: str  # the shared-memory object's key ("/name")
    offset: int  # where the region starts inside the object
    byte_size: int


class SharedMemoryRegions(Protocol):
    """The node's registered system shared-memory regions (``shm.SystemSharedMemory``, built
    by the root). HTTP and gRPC call ``register``/``unregister``/``status`` for the
    extension's calls on the loop, and ``view`` (in codec threads too) for every tensor of
    an inference call that names a region; the call keeps its views until it is answered, so
    a region unregistered meanwhile stays mapped until then."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes from ``offset`` of the object ``key`` as region ``name``.
        Raises InvalidInput (bad key or name, too small), NotFound (no such object) or Refused (caps)."""

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name`` (None: every region); a name not registered is no error."""

    def status(self, name: str | None = None) -> list[RegionStatus]:
        """Every region, or the one named (NotFound when it is not registered)."""

    def view(self, ref: ShmRef, what: str) -> memoryview:
        """The writable bytes ``ref`` names, checked to lie inside its region; InvalidInput
        naming ``what`` and the region when it is not registered or ``ref`` runs past it."""


# -- runtime and coordinator ---------------------------------------------------------------------


class ScheduledModel(Protocol):
    """One model as the coordinator sees it. Its runtime calls the coordinator
    (``NodeScheduler``) from its scheduling pass; the coordinator answers with these calls."""

    name: str

    def instance_views(self, preempt_raised: Callable[[int, int], bool]) -> list[InstanceView]:
        """Each instance: CPUs, what it runs, when that should end. ``preempt_raised(instance,
        batch_id)`` says whether the coordinator has already asked that batch to stop."""

    def rt_waiting(self) -> int:
        """Real-time requests waiting for a batch."""

    def start_batches(self, now: float, classes: Sequence[RequestClass],
                      may_start: Callable[[int, RequestClass], bool] | None,
                      pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None = None) -> list[Batch]:
        """Take the batches that may start now (only ``classes``, only where ``may_start``);
        ``pick(cls, batch_size, idle_ids)`` chooses the instance of each batch (None: it waits)."""

    def preempt(self, instance: int, batch_id: int) -> Batch | None:
        """Ask ``batch_id`` on ``instance`` to stop at its next segment boundary; the batch,
        or None if that instance runs no worker."""

    def clear_preempt(self, instance: int, batch_id: int) -> None:
        """Lower the instance's preemption flag for ``batch_id`` (it finished first), or for
        ``DIRECT_BATCH`` let its worker's direct best-effort batches go; either leaves the other."""

    def pad(self, deadlines: Mapping[int, float]) -> None:
        """Padding deadlines (perf_counter seconds) per instance; an instance left out, or
        0.0, runs without one."""

    def kick(self) -> None:
        """Run a scheduling pass soon (something elsewhere on the node changed)."""

    def direct_activity(self) -> tuple[bool, bool, bool]:
        """(real-time work, best-effort work, a direct real-time batch running) of the model
        now, through the front end or on its workers' direct paths (``fast_direct``)."""

    def set_direct_bell(self, on: bool) -> None:
        """Ask its workers to ring the coordinator when a direct real-time batch begins or ends."""


@dataclass(frozen=True, slots=True)
class Chosen:
    """``BatchPlacement.choose``'s answer: the instance that takes the batch, and its
    partition's tag at that decision (None: the placement policy does not use tags)."""

    instance: int
    tag: float | None = None


class BatchPlacement(Protocol):
    """The node's per-batch choice of a partition (``partitions.PartitionManager``), called by
    the coordinator for every batch a model could start."""

    def choose(self, model: str, cls: RequestClass, batch_size: int, idle: Sequence[int],
               node: Sequence[InstanceView]) -> Chosen | None:
        """Which of ``model``'s ``idle`` instances takes a batch of ``batch_size`` of ``cls``
        (its partition chosen under ``strict_placement``), given the whole node; None: the
        batch waits (best effort that fits no partition, or rt whose partition is busy)."""


class NodeScheduler(Protocol):
    """Node-wide scheduling (``coordinator.Coordinator``), called by every runtime."""

    def schedule(self, model: ScheduledModel, now: float) -> list[Batch]:
        """The batches ``model`` may start now; may preempt or pad other models' work."""

    def started(self, model: ScheduledModel, batch: Batch) -> None:
        """``batch`` (new, or resuming) was sent to its worker."""

    def finished(self, model: ScheduledModel, instance: int, batch: Batch, ok: bool) -> None:
        """``batch`` ended: done, failed, or handed back to the queue."""

    def preempted(self, model: ScheduledModel, instance: int, batch: Batch, restore: int, latency_ns: int) -> None:
        """``batch`` stopped at segment ``restore`` and waits, suspended, on ``instance``."""

    def direct_changed(self) -> None:
        """A worker's direct real-time work began or ended (its doorbell): look at the node again."""


class PreemptPage(Protocol):
    """A worker's shared preemption page (``worker.preempt_flag.PreemptFlag``)."""

    def raise_for(self, batch_id: int) -> None: ...
    def clear(self) -> None: ...
    def hold_direct(self, held: bool) -> None: ...
    def set_padding_deadline(self, deadline_ns: int) -> None: ...


class DirectCounters(Protocol):
    """A worker's direct-path counters (``worker.counters.WorkerCounters``): what the front
    end reads for its view of calls that never pass through it, and the admission limit it
    sets for them."""

    def snapshot(self) -> DirectCounts: ...
    def set_admit(self, calls: int) -> None: ...
    def set_bell(self, on: bool) -> None: ...


class InstanceWorker(Protocol):
    """The process serving one instance (``worker.pool.WorkerHandle``), as its runtime
    drives it. It reports back through the runtime's ``WorkerOwner`` callbacks."""

    pid: int
    alive: bool
    started: bool  # it reported READY once
    stopping: bool  # asked to exit: no restart
    start_error: str | None  # its own report of why it could not start
    killed_for: str | None
    flag: PreemptPage
    counters: DirectCounters  # its direct path's counters and admission limit (in the same page)
    residency: Residency  # where it is in the bind cycle
    binding: int | None  # the binding it holds or is loading
    rss_anon_at_start: int | None  # its anonymous RSS when it reported READY (the level a recycled worker returns to)

    @property
    def ready(self) -> bool:
        """Alive with a model bound: a RUN would be served."""

    def send_run(self, msg: RunMsg) -> bool:
        """Send a batch descriptor; False if the worker is gone."""

    def send_load(self, bind: BindSpec) -> bool:
        """Bind the (unbound) worker to a model; answered by ``on_loaded`` or
        ``on_load_failed``. False if the worker is gone."""

    def send_unload(self) -> bool:
        """Release the bound model (send it with no batch running); answered by
        ``on_unloaded``. False if the worker is gone."""

    def kill(self, reason: str) -> None:
        """Kill it now; its exit is reported as any other."""

    async def stop(self, timeout: float = ...) -> None:
        """Ask it to exit, killing it after ``timeout``."""

    def adopt(self, owner: WorkerOwner, instance: int) -> None:
        """Report to ``owner`` as ``instance`` from now on (only while bound to nothing)."""


class WorkerPool(Protocol):
    """Where a runtime gets the process of an instance and where it returns it: the node's
    pool of spare processes (``worker.spares.SparePool``), built and stopped by the root."""

    def take(self, owner: WorkerOwner, instance: int) -> InstanceWorker:
        """A process for ``instance``, reporting to ``owner`` from now on: a spare that is
        up (``residency`` UNBOUND: send the LOAD now), or one starting (it reports
        ``on_ready``). Called when an instance needs a process."""

    def give_back(self, handle: InstanceWorker, rss_anon: int) -> bool:
        """The runtime is done with ``handle``, unloaded (``rss_anon``: its anonymous RSS
        after the UNLOAD): the pool keeps it as a spare or stops it (True: kept)."""

    @property
    def spares(self) -> int:
        """Spare processes ready to be bound now."""


class FootprintStore(Protocol):
    """What a model's residency takes, kept across restarts (``footprints.RegistryFootprints``,
    over the registry's ``kind="memory"`` profiles). A runtime reads its model's when it is
    built and saves every new measurement."""

    def footprint(self, record: ModelRecord) -> MemoryFootprint:
        """The stored measurement for this version of the model, else its weights file's
        header bytes (private bytes unknown: 0), else nothing known (0, 0)."""

    def save(self, record: ModelRecord, footprint: MemoryFootprint, load_ms: float) -> None:
        """Persist a measured footprint and load time (off the loop; returns at once)."""


class ProteanProfileSource(Protocol):
    """What PROTEAN's deciders read of the node's stored profiles (``protean_profiles.ProteanProfiles``,
    over the registry): the slowdown model's solo times and FBRs and Algorithm 1's batch
    memory. Built once by the root; read on the loop (each model's profiles are read once,
    then kept until ``forget``). None means "not profiled here": never a made-up number."""

    def solo(self, model: str, cores: int, batch: int) -> float | None:
        """Seconds one batch of ``batch`` takes alone on a partition of ``cores`` cores
        (the stored L[cores, batch]); None without a profile with that many threads."""

    def fbr(self, model: str) -> float | None:
        """The model's fitted FBR; None when never fitted or unidentified."""

    def footprint(self, model: str, batch: int) -> int | None:
        """Bytes a batch of ``batch`` takes: the per-batch footprint, else the private bytes
        the model's load measured (``kind="memory"``), else None."""

    def forget(self, model: str | None = None) -> None:
        """Read ``model``'s (every model's: None) profiles again on next use, e.g. after
        ``splitserve profile`` stored new ones."""


class PlacedModel(Protocol):
    """One model as the node's placement applier drives it through a change (start the new
    set as standby, switch, drain the old). ``runtime.ModelRuntime`` implements it."""

    name: str

    def add_standby(self, placements: Sequence[InstancePlacement]) -> list[int]:
        """Add instances at ``placements`` (placed with the node's ``ResourceManager``), not yet
        dispatched to, and start their workers if the model runs; their ids. All or none."""

    async def until_ready(self, instances: Sequence[int]) -> None:
        """Until those instances are up (at once if the model is not running); ModelNotReady
        when one gave up starting. Bounded by the worker start timeouts."""

    def switch(self, activate: Sequence[int], retire: Sequence[int], final: bool) -> None:
        """Dispatch to ``activate`` and no longer to ``retire``. On the ``final`` switch the
        model's placement decider settles on what serves (Packrat's aggregation target)."""

    async def retire(self, instances: Sequence[int]) -> None:
        """Drain those instances (each gets drain_timeout_s), stop their workers and unplace them."""

    def changed(self, record: Mapping[str, Any]) -> None:
        """The change ended (``record["ok"]`` says whether it was made): remember it, and let
        the decider settle on what serves now."""


class PlacementChanger(Protocol):
    """The node's one applier of placement changes (``applier.PlacementApplier``), called by a
    runtime's resize and repack (and later by node-wide deciders such as PROTEAN)."""

    async def apply(self, decide: Callable[[], Wanted]) -> dict[str, dict[str, Any]]:
        """Under the node-wide placement lock: ``decide()`` says what the models it names should
        run (it may allocate partitions for new instances), then the change is carried out.
        Returns a record per model changed. Raises ResourcesUnavailable when the change cannot
        be made without double-booking a CPU or a pause in service (nothing changed then), and
        ModelNotReady when new instances did not start (what served still serves)."""


class ResidentModel(Protocol):
    """One model as the memory manager drives it (``runtime.ModelRuntime``)."""

    name: str
    enabled: bool  # False after an operator's unload: it waits for no load
    keep_resident: bool  # never chosen as a victim
    footprint: MemoryFootprint  # what its last load measured (or nothing yet)

    @property
    def instance_count(self) -> int: ...

    def charge(self) -> int:
        """Bytes a residency of it takes now (weights once, private bytes per instance; 0 when unknown)."""

    def pinned(self) -> bool:
        """Not evictable now: a batch runs or is suspended on it, or its placement is changing."""

    def holds_memory(self) -> bool:
        """Its weights are resident, loading, or being released."""

    def begin_load(self) -> None:
        """Load it now (the manager reserved its bytes); ends in the broker's ``loaded`` or ``load_failed``."""

    def release_residency(self) -> bool:
        """Start releasing its weights (calls keep queueing); ends in the broker's ``released``.
        False if nothing was resident or loading, or it is being released already."""

    def refuse_load(self, reason: str) -> None:
        """It can never fit: fail it (its waiting calls get MODEL_NOT_READY with ``reason``)."""


class ResidencyBroker(Protocol):
    """The node's memory manager (``memory.MemoryManager``) as a runtime calls it: it asks
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


# ``WorkerHandle(owner, instance, make_spec(ctrl_fd, flag_fd), loop)`` or a fake: how the
# root's worker pool starts a process.
WorkerFactory = Callable[[WorkerOwner, int, Callable[[int, int], WorkerSpec], asyncio.AbstractEventLoop],
                         InstanceWorker]


class PartitionedModel(Protocol):
    """One model as the node's partition manager drives it (``runtime.ModelRuntime``): its
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


class PartitionControl(Protocol):
    """The node's partitions as management reads and changes them (``GET``/``POST /v2/partitions``)."""

    def snapshot(self) -> dict[str, Any]:
        """Partitions (id, cpus, memory, tag, instances per model), geometry, the controller's
        last tick, cold starts."""

    async def set_geometry(self, geometry: str) -> dict[str, Any]:
        """Re-carve the partitions to ``geometry`` (core counts, ``"1,1"``) through the node's
        applier, every model's instances moving without a request lost; the new snapshot."""


class GpuView(Protocol):
    """The node's GPUs as management shows them (``GET /v2/partitions``' ``gpus``), read-only."""

    def snapshot(self) -> dict[str, Any]:
        """Each GPU (index, uuid, name, memory, MIG mode, MIG slices, profiles) or the reason
        there is none, and how old the listing is; never waits on NVML."""


@dataclass(frozen=True)
class RuntimeEnv:
    """What a ``ModelRuntime`` needs from its node, built once by the composition root."""

    loop: asyncio.AbstractEventLoop
    config: ServerConfig  # queue slots, RT policy, placement default, start/drain/stop timeouts, cache dir
    node: NodeScheduler
    metrics: Metrics
    resources: ResourceManager  # the node's CPUs: the model's partitions and where its instances sit
    placements: PlacementChanger  # the node's one applier of placement changes (resize, repack)
    profile: Callable[[str], ModelProfile | None]  # a model's stored profile (Packrat, padding budgets)
    stopping: Callable[[], bool]  # the node is shutting down: nothing new starts
    workers: WorkerPool  # the processes of instances: taken at a load, given back after an unload
    footprints: FootprintStore  # measured sizes of models, kept across restarts
    memory: ResidencyBroker  # grants residency: every load goes through it
    partitions: PartitionSource | None = None  # the node's partitions (None: partitioning none)


# -- management ---------------------------------------------------------------------------------


class ManagedModel(Protocol):
    """A served model as management drives and reports it (``runtime.ModelRuntime``)."""

    name: str
    config: ModelConfig  # as served now (batching may differ from the registered one)
    enabled: bool  # False after a user's unload, until a load
    keep_resident: bool  # the memory manager never evicts it (an explicit load may set it)
    error: str | None  # why the last load failed
    stats: ModelStats

    @property
    def state(self) -> ModelState: ...

    @property
    def instance_count(self) -> int: ...

    @property
    def dispatch_max_batch(self) -> int:
        """The largest batch dispatched now (``max_batch_size`` unless changed at run time)."""

    def direct_counts(self) -> DirectCounts:
        """The calls its workers took on the direct path (``fast_direct``; zero while off);
        their SLO outcomes are in ``stats.slo`` (and the SLO metric) once this returns."""

    async def load(self) -> None:
        """An explicit load: serve again after an unload, retry a FAILED load now, wait until ready."""

    async def wait_ready(self) -> None:
        """Start the workers if needed and wait until the model serves (ModelNotReady if not)."""

    async def unload(self, deadline: float | None = None, reason: str = ..., *, disable: bool = False) -> None:
        """Stop the workers; with ``disable``, refuse calls until the next ``load``."""

    async def evict(self, deadline: float | None = None) -> bool:
        """Release the weights but keep serving: calls queue and the next one loads it
        again. False if nothing was resident."""

    async def resize(self, instances: int) -> None:
        """Change the instance count without dropping requests."""

    def set_batching(self, batching: BatchingConfig, max_batch: int | None) -> None:
        """Swap the batching policy (and dispatch batch limit) in place; queued calls stay."""

    def placement(self) -> dict[str, Any]:
        """Serving instances (threads, batch, CPUs), the Packrat plan, reconfigurations."""


class ModelDirectory(Protocol):
    """The node's models, as ``management.ModelManager`` registers and finds them."""

    records: Mapping[str, ModelRecord]  # every registered model by name

    def runtime(self, name: str) -> ManagedModel:
        """The served model (created on first use; workers start lazily). Raises UnknownModel."""

    async def prepare(self, name: str) -> ManagedModel:
        """``runtime(name)``, with what it reads from disk read off the loop first."""

    def loaded(self, name: str) -> ManagedModel | None:
        """The served model if it was created, else None (never creates one)."""

    def remember(self, rec: ModelRecord) -> None:
        """Make a newly registered model known to every front end."""

    async def drop(self, name: str) -> None:
        """Stop the model for good (unregister): unload, free its queues, forget it."""


class MemoryReport(Protocol):
    """The memory manager as management reads it."""

    def status(self) -> dict[str, Any]:
        """``GET /v2/memory``'s body."""


class EventLog(Protocol):
    """The coordinator's bounded log of batch events, read by management, with the
    settings that decided them (so a reader can tell which rules it is looking at)."""

    mode: PriorityMode
    class_order: ClassOrder
    events: Collection[Event]
