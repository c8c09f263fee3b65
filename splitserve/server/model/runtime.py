"""A served model inside the front end: the facade that composes its parts.

Everything here runs on the front end's event loop. A ``ModelRuntime`` is the ``ModelPort``
of the transports and the ``ManagedModel`` of management; the node's other parts are each
handed only the piece they drive: the coordinator ``dispatch``, the memory manager
``residency``, the placement applier and the partition manager ``placements``; the worker
handles report to ``instances``. The parts (``server/model/``) share one ``ModelCore``.

A runtime does no I/O on the loop: its node reads the stored profile off the loop before
building it (``app.Server.prepare``, and at start-up), and its residency reads the model's
footprint through ``RuntimeEnv.off_loop`` before asking for memory.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.memory.footprints import MemoryFootprint
from splitserve.modelconfig import BatchingConfig, ModelConfig
from splitserve.placement.profiler import ModelProfile
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord
from splitserve.scheduler.policy import make_policy
from splitserve.server.metrics import ModelGauges
from splitserve.server.model.core import ModelCore
from splitserve.server.model.dispatch import Dispatch
from splitserve.server.model.instances import Instances
from splitserve.server.model.placement import ModelPlacement
from splitserve.server.model.queues import ModelQueues
from splitserve.server.model.residency import ModelResidency
from splitserve.server.monitor import Call
from splitserve.server.model.env import RuntimeEnv
from splitserve.server.ports import ModelState, ModelStats
from splitserve.worker.counters import DirectTally


class ModelRuntime:
    """One model as served: queues per class, a scheduler, one worker per instance."""

    def __init__(self, env: RuntimeEnv, record: ModelRecord, profile: ModelProfile | None = None) -> None:
        """``profile``: the model's stored profile, as the node read it off the loop."""
        self.core = core = ModelCore(env, record, profile)
        self.name = core.name
        self.func_id = core.func_id
        self.record = record
        self.sched = core.sched
        self.workers = core.workers
        self.resources = core.resources
        self.default_class: RequestClass = core.default_class
        self.queues = ModelQueues(core.config, core.nslots, core.name)
        self.dispatch = Dispatch(core, ensure_started=lambda: self.residency.ensure_started(),
                                 unload_when_idle=lambda i: self.residency.unload_when_idle(i),
                                 repack=lambda now: self.placements.propose(now))
        self.instances = Instances(core, self.queues, self.dispatch, loaded=lambda i: self.residency.loaded(i),
                                   fail=lambda reason: self.residency.fail(reason),
                                   evict_progress=lambda: self.residency.evict_progress(),
                                   unload_when_idle=lambda i: self.residency.unload_when_idle(i))
        self.residency = ModelResidency(core, self.instances, self.dispatch)
        self.placements = ModelPlacement(core, self.instances, self.dispatch)

    # -- state as management reads it --------------------------------------------------------

    @property
    def config(self) -> ModelConfig:
        return self.core.config

    @property
    def state(self) -> ModelState:
        return self.core.state

    @property
    def error(self) -> str | None:
        return self.core.error

    @property
    def enabled(self) -> bool:
        return self.core.enabled

    @property
    def keep_resident(self) -> bool:
        return self.core.keep_resident

    @keep_resident.setter
    def keep_resident(self, keep: bool) -> None:
        self.core.keep_resident = keep

    @property
    def stats(self) -> ModelStats:
        return self.core.stats

    @property
    def footprint(self) -> MemoryFootprint:
        return self.core.footprint

    @property
    def slo_s(self) -> float | None:
        return self.core.slo_s

    @property
    def instance_count(self) -> int:
        return self.placements.instance_count

    @property
    def dispatch_max_batch(self) -> int:
        return self.placements.dispatch_max_batch

    # -- ModelPort (transports) ----------------------------------------------------------------

    def will_serve(self) -> bool:
        """A call would be served without an explicit load (resident or not: one that is
        not loads on the call)."""
        return self.dispatch.refusal(time.perf_counter()) is None

    def alloc(self, cls: RequestClass, count: int) -> int:
        refused = self.dispatch.refusal(time.perf_counter())
        if refused is not None:
            raise refused
        return self.queues.alloc(cls, count)

    def input_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return self.queues.input_views(cls, seq, count)

    def output_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return self.queues.output_views(cls, seq, count)

    def plan_room(self, cls: RequestClass, count: int, movable: dict[int, int]) -> list[int] | None:
        return self.queues.plan_room(cls, count, movable)

    def release(self, call: Call) -> None:
        self.queues.release(call.cls, call.seq, call.count)

    def submit(self, call: Call) -> None:
        self.dispatch.submit(call)

    def hand_off(self, endpoint: tuple[str, int | str], sock: socket.socket, req_id: int) -> None:
        self.instances.hand_off(endpoint, sock, req_id)

    def describe(self) -> dict[str, Any]:
        core = self.core
        cfg, sched, inst = core.config, core.sched, self.instances
        serving = sched.serving()
        placed = [core.resources.placed(self.name, i) for i in serving]
        return {
            "name": self.name, "func_id": self.func_id, "version": cfg.version, "state": core.state,
            "inputs": [t.to_dict() for t in cfg.inputs], "outputs": [t.to_dict() for t in cfg.outputs],
            "max_batch_size": cfg.max_batch_size, "default_class": cfg.default_class,
            "slo_s": core.slo_s,  # real-time calls that name no SLO get this one (a cluster gateway counts by it)
            "instances": self.instance_count,
            "threads": [p.threads if p else 0 for p in placed],
            "cpus": [sorted(p.cpus) if p else [] for p in placed],
            "pids": [core.workers[i].pid if i in core.workers else None for i in serving],
            "partitions": [p.partition if p else -1 for p in placed],
            # Residency: ``enabled`` says calls are taken (a model that is not resident
            # loads on the next one); ``residency`` is each serving instance's.
            "enabled": core.enabled,
            "residency": [sched.instances[i].residency.value for i in serving],
            "weights_bytes": core.stats.weights_bytes,
            # The workers' own endpoints (ServerConfig.transports.fast_direct; empty: send calls here),
            # and the calls they took directly.
            "direct": inst.direct_endpoints(),
            # the same workers' TCP endpoints, for clients that reach the node over TCP (a
            # key of its own: clients that know only ``direct`` keep using the Unix ones)
            "direct_tcp": inst.direct_endpoints(tcp=True),
            # the class each of them serves (rt / be), in their orders: a client picks by its call's
            "direct_classes": inst.direct_classes(), "direct_tcp_classes": inst.direct_classes(tcp=True),
            "direct_counts": inst.direct_tally().counts.to_dict(),
            # a GPU model's partitions and copies per batch (None on the CPU)
            "gpu": inst.gpu_stats(),
        }

    # -- ManagedModel (management) ---------------------------------------------------------------

    async def load(self) -> None:
        await self.residency.load()

    async def wait_ready(self) -> None:
        await self.residency.wait_ready()

    async def unload(self, deadline: float | None = None, reason: str = "was unloaded", *,
                     disable: bool = False) -> None:
        await self.residency.unload(deadline, reason, disable=disable)

    async def evict(self, deadline: float | None = None) -> bool:
        return await self.residency.evict(deadline)

    async def resize(self, instances: int) -> None:
        await self.placements.resize(instances)

    async def repack(self, batch: int) -> dict:
        return await self.placements.repack(batch)

    def set_batching(self, batching: BatchingConfig, max_batch: int | None) -> None:
        """Swap the batching policy (and the dispatch limit, at most ``max_batch_size``, which
        the queues were sized for) in place; queued requests stay."""
        core = self.core
        if core.placer.policy() is not None:
            raise InvalidInput(f"model {self.name!r} uses {core.placer.kind.value} placement: its batching follows "
                               "its plan")
        if max_batch is not None and not 1 <= max_batch <= core.config.max_batch_size:
            raise InvalidInput(f"max_batch_size must be 1..{core.config.max_batch_size} for {self.name!r} "
                               "(the tensor queues were sized for that; register a new version to raise it)")
        core.sched.policy = make_policy(batching)
        if max_batch is not None:
            core.sched.max_batch = max_batch
        core.config = core.config.with_changes(batching=asdict(batching))
        self.dispatch.kick()

    def placement(self) -> dict[str, Any]:
        return self.placements.describe()

    def direct_tally(self) -> DirectTally:
        return self.instances.direct_tally()

    def gauges(self) -> ModelGauges:
        """Live state for the metrics' gauges."""
        core = self.core
        return ModelGauges(
            self.name, {c: len(q) for c, q in core.sched.queues.items()},
            sum(1 for st in core.sched.instances.values() if st.ready and not st.draining),
            core.state is ModelState.FAILED, self.direct_tally() if core.settings.transports.fast_direct else None)

    def kill_workers(self, reason: str) -> None:
        """Kill every worker now (the node exits without draining)."""
        self.instances.kill_all(reason)

    def close(self) -> None:
        """Release the shared memory (after unload)."""
        self.queues.close()

