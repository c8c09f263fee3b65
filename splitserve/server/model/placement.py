"""A model's placement: where its instances sit, and every change of that.

This is the piece of a model the node's placement applier (``PlacedModel``) and partition
manager (``PartitionedModel``) drive. A user's resize and Packrat's repack decide here and
hand the change to the node's applier (``RuntimeEnv.placements``), which carries it out
through this same piece: start the new set as standby, switch, drain the old.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from splitserve.errors import InvalidInput, ModelNotReady
from splitserve.memory.footprints import MemoryFootprint
from splitserve.placement.partition import InstancePlacement, NodePartition
from splitserve.placement.placer import PartitionPlacer
from splitserve.protocol.header import RequestClass
from splitserve.server.model.core import ModelCore
from splitserve.server.model.dispatch import Dispatch
from splitserve.server.model.instances import Instances

log = logging.getLogger(__name__)


class ModelPlacement:
    """The model's instances' places (the applier's ``PlacedModel``, the partition manager's
    ``PartitionedModel``)."""

    def __init__(self, core: ModelCore, instances: Instances, dispatch: Dispatch) -> None:
        self.core = core
        self.name = core.name
        self.instances = instances
        self.dispatch = dispatch
        # What each change of placement cost (bounded: the newest placement_history).
        self.reconfigurations: deque[dict] = deque(maxlen=core.settings.packrat.placement_history)
        self._repack_task: asyncio.Task | None = None

    @property
    def footprint(self) -> MemoryFootprint:
        return self.core.footprint

    @property
    def instance_count(self) -> int:
        return len(self.core.sched.serving())

    @property
    def dispatch_max_batch(self) -> int:
        return self.core.sched.max_batch

    def kick(self) -> None:
        self.dispatch.kick()

    # -- deciding ---------------------------------------------------------------------------

    async def repack(self, batch: int) -> dict:
        """Packrat: serve a batch of ``batch`` with the plan the optimizer picks for it, through
        the node's applier (instances that keep their shape stay; the rest switch without a
        pause in service). ResourcesUnavailable when that cannot be done in the model's budget:
        it stays on its plan then."""
        return await self._change(lambda: self.core.placer.plan_for(batch))

    async def resize(self, instances: int) -> None:
        """Change the instance count without dropping requests. Fixed placement takes CPUs for
        added instances; Packrat splits its budget and B over ``instances``. A model that holds
        no CPUs (not loaded) gets that many at its next load."""
        core = self.core
        core.placer.instances = instances
        if core.sched.instances:
            await self._change(lambda: core.placer.resize(core.resources, core.serving_placements(), instances))

    def propose(self, now: float) -> None:
        """The scheduling pass of a ready model: let its placement decider propose a change
        (Packrat's repack after the load changed); one change at a time."""
        if self._repack_task is not None and not self._repack_task.done():
            return
        wanted = self.core.placer.propose(now)
        if wanted is not None:
            self._repack_task = self.core.loop.create_task(self._change(lambda: wanted))
            self._repack_task.add_done_callback(self._repack_done)

    def _repack_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("model %s: repack not made: %s", self.name, task.exception())

    async def _change(self, decide: Callable[[], list[InstancePlacement]]) -> dict:
        """Hand a change of this model's placement to the node's applier; its record."""
        core = self.core

        def wanted() -> dict[str, list[InstancePlacement]]:
            if not core.sched.instances:
                raise ModelNotReady(f"model {self.name!r} is not loaded: it holds no CPUs to change")
            return {self.name: decide()}

        core.reconfiguring += 1
        try:
            records = await core.env.placements.apply(wanted)
        finally:
            core.reconfiguring -= 1
        core.env.memory.batch_done(self.name)  # it may be a victim again
        return {**records[self.name], **core.placer.describe()}

    # -- PlacedModel (the node's placement applier) ----------------------------------------

    def add_standby(self, placements: Sequence[InstancePlacement]) -> list[int]:
        ids: list[int] = []
        try:
            for p in placements:
                ids.append(self.instances.add(p, standby=True))
        except BaseException:
            for i in ids:
                self.instances.forget(i)
            raise
        if self.core.running:
            for i in ids:
                self.instances.spawn(i)
        return ids

    async def until_ready(self, instances: Sequence[int]) -> None:
        if self.core.running:
            await self.instances.wait_up(list(instances))

    def switch(self, activate: Sequence[int], retire: Sequence[int], final: bool) -> None:
        self.core.sched.activate(list(activate), list(retire))
        if final:
            self.core.placer.settle(self.core.serving_placements())
        self.dispatch.kick()

    async def retire(self, instances: Sequence[int]) -> None:
        """Retire the instances: no new batches; each gets drain_timeout_s."""
        deadline = time.perf_counter() + self.core.settings.workers.drain_timeout_s
        await asyncio.gather(*(self._drain_and_stop(i, deadline) for i in instances))

    def changed(self, record: Mapping[str, Any]) -> None:
        placer = self.core.placer
        placer.settle(self.core.serving_placements())
        if not record["ok"]:
            log.warning("model %s: placement change to %s not made: %s", self.name, record["shapes"],
                        record.get("error"))
            return
        if not record["waves"]:
            return  # the wanted placement is what serves already: nothing happened
        self.reconfigurations.append({**record, **placer.describe()})
        log.info("model %s: placement now %s (new set ready in %.2fs, old drained in %.2fs)", self.name,
                 record["shapes"], record["start_s"], record["drain_s"])

    async def _drain_and_stop(self, i: int, deadline: float) -> None:
        """Let instance ``i`` finish its batches (a suspended one resumes here), then stop it.

        At ``deadline`` a suspended batch is handed back to the queue (it reruns from
        segment 0 elsewhere) and a worker still running its batch is killed, which
        answers that batch WORKER_FAILED."""
        core = self.core
        st = core.sched.instances.get(i)
        if st is None:
            return
        st.draining = True
        self.dispatch.kick()
        if not await core.until(lambda: not st.busy, deadline):
            batch = core.sched.take_suspended(i)
            if batch is not None:
                log.warning("model %s: instance %d could not resume its preempted batch %d before its drain "
                            "deadline; the batch reruns on another instance", self.name, i, batch.batch_id)
                self.dispatch.requeue(i, batch)
        handle = core.workers.get(i)
        if handle is not None:
            await handle.stop(timeout=max(0.0, deadline - time.perf_counter()))
        if i in core.sched.instances:
            self.instances.forget(i)

    # -- PartitionedModel (the node's partition manager) -----------------------------------

    def placed_now(self) -> bool:
        return bool(self.core.sched.instances) and self.core.running

    def waiting_requests(self, cls: RequestClass | None = None) -> int:
        return self.core.sched.waiting(cls)

    def placements_on(self, partitions: Sequence[NodePartition]) -> list[InstancePlacement]:
        core = self.core
        if not isinstance(core.placer, PartitionPlacer):
            raise InvalidInput(f"model {self.name!r} is not placed on the node's partitions")
        return core.placer.move(core.resources, core.serving_placements(), partitions)

    # -- management's view -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """``GET /v2/models/{name}/placement``: serving instances, the plan, reconfigurations."""
        core = self.core
        sched = core.sched
        out: dict[str, Any] = {"model": self.name, **core.placer.describe(), "now": time.perf_counter()}
        out["instances"] = [
            {"id": i, "threads": p.threads, "batch": sched.instances[i].max_batch or core.config.max_batch_size,
             "cpus": sorted(p.cpus), "shared": p.shared, "partition": p.partition, "ready": sched.instances[i].ready,
             "residency": sched.instances[i].residency.value}
            for i in sched.serving() if (p := core.resources.placed(self.name, i)) is not None
        ]
        out["reconfigurations"] = list(self.reconfigurations)
        out["partitions"] = core.resources.snapshot(self.name)["partitions"]
        return out
