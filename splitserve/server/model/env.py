"""What a served model needs from its node (``RuntimeEnv``, built once by the composition
root) and from the worker processes of its instances (``InstanceWorker``, ``WorkerPool``).

The worker seams live here, beside the model that drives them, not among the node's
``server/ports.py``: they carry processes and their pages, which no other part of the
node sees.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.config import ServerConfig
from splitserve.memory.footprints import FootprintStore
from splitserve.memory.manager import ResidencyBroker
from splitserve.placement.devices import DeviceAssigner
from splitserve.placement.partition import PartitionSource
from splitserve.placement.resources import ResourceManager
from splitserve.server.applier import PlacementChanger
from splitserve.server.coordinator import NodeScheduler
from splitserve.server.metrics import Metrics
from splitserve.worker.counters import DirectCounts
from splitserve.worker.gpu_counters import GpuCopies
from splitserve.worker.messages import RunMsg
from splitserve.worker.pool import Residency, WorkerOwner
from splitserve.worker.spec import BindSpec, WorkerSpec


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
    def batch_sizes(self) -> dict[int, tuple[int, int]]: ...
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
    reloading: bool  # its LOAD in flight is a RELOAD of parked weights (a failure then loads anew)
    rss_anon_at_start: int | None  # its anonymous RSS when it reported READY (the level a recycled worker returns to)

    @property
    def ready(self) -> bool:
        """Alive with a model bound: a RUN would be served."""

    def send_run(self, msg: RunMsg) -> bool:
        """Send a batch descriptor; False if the worker is gone."""

    def send_adopt(self, sock: socket.socket, req_id: int) -> bool:
        """Hand a client's connection (its HANDOFF frame's ``req_id``) to the bound worker's
        direct endpoint; False if the worker is gone or not bound."""

    def send_load(self, bind: BindSpec) -> bool:
        """Bind the (unbound) worker to a model; answered by ``on_loaded`` or
        ``on_load_failed``. False if the worker is gone."""

    def send_unload(self, park: bool = False) -> bool:
        """Release the bound (or parked) model (send it with no batch running), or with
        ``park`` keep it with its weights in page-locked host memory; answered by
        ``on_unloaded``. False if the worker is gone."""

    def send_reload(self) -> bool:
        """Serve the parked model again; answered by ``on_loaded`` or ``on_load_failed``
        (then unbound). False if the worker is gone."""

    def kill(self, reason: str) -> None:
        """Kill it now; its exit is reported as any other."""

    async def stop(self, timeout: float = ...) -> None:
        """Ask it to exit, killing it after ``timeout``."""

    def adopt(self, owner: WorkerOwner, instance: int) -> None:
        """Report to ``owner`` as ``instance`` from now on (only while bound to nothing)."""

    def gpu_copies(self) -> tuple[GpuCopies, int, int]:
        """What its GPU path copied, its page-locked queues and CUDA graph sizes (its page;
        read for GPU models only)."""


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


# ``WorkerHandle(owner, instance, make_spec(ctrl_fd, flag_fd), loop)`` or a fake: how the
# root's worker pool starts a process.
WorkerFactory = Callable[[WorkerOwner, int, Callable[[int, int], WorkerSpec], asyncio.AbstractEventLoop],
                         InstanceWorker]


@dataclass(frozen=True)
class RuntimeEnv:
    """What a ``ModelRuntime`` needs from its node, built once by the composition root."""

    loop: asyncio.AbstractEventLoop
    config: ServerConfig  # queue slots, RT policy, placement default, start/drain/stop timeouts, cache dir
    node: NodeScheduler
    metrics: Metrics
    resources: ResourceManager  # the node's CPUs: the model's partitions and where its instances sit
    placements: PlacementChanger  # the node's one applier of placement changes (resize, repack)
    stopping: Callable[[], bool]  # the node is shutting down: nothing new starts
    workers: WorkerPool  # the processes of instances: taken at a load, given back after an unload
    footprints: FootprintStore  # measured sizes of models, kept across restarts
    memory: ResidencyBroker  # grants residency: every load goes through it
    # Sync work a model needs (its footprint: SQLite, a weights file's header) run off the loop;
    # ``off_loop(fn, done)`` calls ``done(fn())`` back on the loop (``blocking.OffLoop``).
    off_loop: Callable[[Callable[[], Any], Callable[[Any], None]], None]
    partitions: PartitionSource | None = None  # the node's partitions (None: partitioning none)
    devices: DeviceAssigner | None = None  # the node's GPU partitions per instance (None: no GPU models)
