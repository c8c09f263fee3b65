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
* **management** sees the node's models through ``ModelDirectory`` and each one as a
  ``ManagedModel``.

The seams a node-level part drives live next to that part, each handed only one piece of a
model (``server/model/``): the coordinator's ``ScheduledModel`` and ``NodeScheduler``
(``server/coordinator.py``), the memory manager's ``ResidentModel`` and ``ResidencyBroker``
(``memory/manager.py``), the placement applier's ``PlacedModel`` and ``PlacementChanger``
(``server/applier.py``), the partition manager's ``PartitionedModel``
(``protean/partitions.py``); what a model needs from its node and its workers is
``server/model/env.py``'s ``RuntimeEnv`` and ``InstanceWorker``.

These are also the interfaces a remote node implements: a cluster gateway forwards to a
model through ``ModelPort``/``ServingAPI`` as the local transports do. So they carry
descriptors, views and typed records, never a process, a socket or a registry handle.
"""

from __future__ import annotations

import asyncio
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from splitserve.config import ServerConfig
from splitserve.modelconfig import BatchingConfig, ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.protocol.v2 import ShmRef
from splitserve.registry import ModelRecord
from splitserve.scheduler.model_scheduler import ClassOrder
from splitserve.scheduler.priority import PriorityMode
from splitserve.server.coordinator import Event
from splitserve.server.intake import Intake, RingPort
from splitserve.server.monitor import InferenceMonitor
from splitserve.slo import SloOutcome
from splitserve.types import TensorSpec
from splitserve.worker.counters import DirectTally

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
class BatchTimes:
    """Batches of one size: how many ran, and their workers' input copy, model and output
    copy times summed (Triton's ``batch_stats``)."""

    count: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0

    def add(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.count += 1
        self.input_ns += input_ns
        self.infer_ns += infer_ns
        self.output_ns += output_ns


@dataclass
class ModelStats:
    """Cumulative per-model counters (Open Inference Protocol statistics extension)."""

    success: int = 0
    failure: int = 0
    inference_count: int = 0  # samples
    execution_count: int = 0  # batches
    queue_ns: int = 0
    # Successful calls, each with its batch's times (as Triton counts them): input copy,
    # model, output copy, measured in the worker.
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    request_ns: int = 0  # successful calls, header to answer
    failure_ns: int = 0  # failed calls, header to answer
    preemptions: int = 0
    last_inference_ms: int = 0
    batches: dict[int, BatchTimes] = field(default_factory=dict)  # by batch size
    loads: int = 0  # instances that loaded the weights (LOADED)
    load_ns: int = 0  # their load times, as the workers measured them
    evictions: int = 0  # completed evictions (every instance released its weights)
    weights_bytes: int = 0  # not cumulative: what the resident instances' weights take now
    # Soft SLOs of its real-time calls: met, missed, dropped (``Metrics.slo_tally``, live)
    slo: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in SloOutcome})


@dataclass
class InferOutcome:
    """Outputs (fresh arrays, in declared order) and the server's timings of one call."""

    outputs: list[np.ndarray]
    queue_us: int
    compute_us: int
    total_us: int


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

    def hand_off(self, endpoint: tuple[str, int | str], sock: socket.socket, req_id: int) -> None:
        """Hand a client's connection (its HANDOFF frame's ``req_id``) to the instance whose
        direct endpoint is ``endpoint`` (``protocol.handoff.endpoint_key``), which serves it
        from now on; raises Refused where none that serves now has it."""


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
    ``cluster/gateway/dataplane.py::GatewayRegistrar`` (which forwards to the cluster's controller)."""

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


@dataclass(frozen=True, slots=True)
class CudaRegionStatus:
    """One registered CUDA shared-memory region, as the extension's status reports it."""

    name: str
    device_id: int  # the client's CUDA device the allocation lives on
    byte_size: int


class SharedMemoryRegions(Protocol):
    """The node's registered shared-memory regions, system and CUDA (``shm.SystemSharedMemory``,
    built by the root; one namespace of names for both, as Triton's). HTTP and gRPC call
    ``register``/``unregister``/``status`` and their ``cuda_`` twins for the extensions' calls
    on the loop, and ``view``/``writer`` (in codec threads too) for every tensor of an
    inference call that names a region; the call keeps its views and writers until it is
    answered, so a region unregistered meanwhile stays mapped (or open) until then."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes from ``offset`` of the object ``key`` as region ``name``.
        Raises InvalidInput (bad key or name, too small), NotFound (no such object) or Refused (caps)."""

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name`` (None: every region); a name not registered is no error."""

    def status(self, name: str | None = None) -> list[RegionStatus]:
        """Every region, or the one named (NotFound when it is not registered)."""

    def cuda_register(self, name: str, handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the CUDA IPC ``handle`` of ``byte_size`` bytes on ``device_id`` as region ``name``.
        Raises InvalidInput (bad handle or name, no CUDA) or Refused (caps)."""

    def cuda_unregister(self, name: str | None = None) -> None:
        """Forget CUDA region ``name`` (None: every CUDA region); not registered is no error."""

    def cuda_status(self, name: str | None = None) -> list[CudaRegionStatus]:
        """Every CUDA region, or the one named (NotFound when it is not registered)."""

    def view(self, ref: ShmRef, what: str) -> memoryview:
        """The bytes ``ref`` names (a system region's mapping; a CUDA region's bytes copied to
        the host), checked to lie inside its region; InvalidInput naming ``what`` and the
        region when it is not registered or ``ref`` runs past it."""

    def writer(self, ref: ShmRef, what: str) -> Callable[[memoryview], None]:
        """Checks ``ref`` as ``view`` does; the function that writes an output's bytes there."""


# -- partitions and GPUs, as management reads them ---------------------------------------------


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


# -- management ---------------------------------------------------------------------------------


class ManagedModel(Protocol):
    """A served model as management drives and reports it (``server.model.runtime.ModelRuntime``)."""

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

    def direct_tally(self) -> DirectTally:
        """What its workers did on the direct path (``fast_direct``; zero while off): their
        counters, batches by size and answered calls; their SLO outcomes are in ``stats.slo``
        (and the SLO metric) once this returns."""

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

    def loaded(self, name: str) -> ManagedModel | None:
        """The served model if it was created, else None (never creates one)."""

    async def remember(self, rec: ModelRecord) -> None:
        """Make a newly registered model known to every front end (its stored profile read
        off the loop first)."""

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
