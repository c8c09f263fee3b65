"""The node's one applier of placement changes: any decider's wanted placement, made real.

A decider (a user's resize, Packrat's repack, later PROTEAN across models) says what the
models it changes should run; ``placement.plans.plan_change`` orders that into waves against
the node's ``ResourceManager``; this applier carries the waves out through each model's
``PlacedModel`` seam, one change at a time for the whole node (so two deciders never plan on
the same free CPUs). Per wave: start the new instances as standby and wait until every one
is up; switch; drain the retired ones (which unplaces them). If a start fails, the wave's
standby instances are drained and the change stops: what served still serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from splitserve.placement.partition import InstancePlacement
from splitserve.placement.plans import Wanted, Wave, plan_change
from splitserve.placement.resources import ResourceManager

log = logging.getLogger(__name__)


class PlacedModel(Protocol):
    """One model as the node's placement applier drives it through a change (start the new
    set as standby, switch, drain the old). A model's
    ``placements`` (``server.model.placement.ModelPlacement``) implements it."""

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


class PlacementApplier:
    """Carries out changes of placement for the node (the runtimes' ``PlacementChanger``).

    ``models(name)`` finds a model being changed; ``clock`` stamps the records (perf_counter
    seconds, the clock ``/v2/models/{name}/placement`` reports).
    """

    def __init__(self, resources: ResourceManager, models: Callable[[str], PlacedModel],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.resources = resources
        self.models = models
        self.clock = clock
        self._lock = asyncio.Lock()

    async def apply(self, decide: Callable[[], Wanted]) -> dict[str, dict[str, Any]]:
        """See ``PlacementChanger.apply``."""
        async with self._lock:
            rm = self.resources
            wanted = decide()
            if not wanted:
                return {}
            t0 = self.clock()
            try:
                waves = plan_change(rm.placement(), wanted, rm.idle_cpus(wanted))
            except Exception:
                for m in wanted:
                    rm.release_unused(m)
                raise
            models = {m: self.models(m) for m in wanted}
            ids: dict[str, dict[int, int]] = {m: {} for m in wanted}  # wanted index -> instance id
            times: dict[str, float] = {}  # model -> when its final switch happened
            error: BaseException | None = None
            try:
                for wave in waves:
                    await self._wave(wave, models, ids, times)
            except BaseException as e:
                error = e
                raise
            finally:
                for m in wanted:
                    rm.release_unused(m)  # partitions made for instances that never started
                records = {m: self._record(wanted[m], len(waves), t0, times.get(m), error) for m in wanted}
                for m, model in models.items():
                    model.changed(records[m])
            return records

    async def _wave(self, wave: Wave, models: dict[str, PlacedModel], ids: dict[str, dict[int, int]],
                    times: dict[str, float]) -> None:
        started: dict[str, list[int]] = {}
        try:
            for m in dict.fromkeys(s.model for s in wave.start):
                steps = [s for s in wave.start if s.model == m]
                started[m] = models[m].add_standby([s.placement for s in steps])
                ids[m].update(zip((s.index for s in steps), started[m]))
            results = await asyncio.gather(*(models[m].until_ready(new) for m, new in started.items()),
                                           return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException:
            log.warning("placement change: new instances did not start; draining this wave's standby set")
            await self._retire_all(models, started.items())
            raise
        for sw in wave.switch:
            models[sw.model].switch([ids[sw.model][i] for i in sw.activate], sw.retire, sw.final)
            if sw.final:
                times[sw.model] = self.clock()
        await self._retire_all(models, ((d.model, d.instances) for d in wave.drain))

    @staticmethod
    async def _retire_all(models: dict[str, PlacedModel], what: Any) -> None:
        results = await asyncio.gather(*(models[m].retire(list(ids)) for m, ids in what), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("placement change: draining retired instances failed", exc_info=r)

    def _record(self, wanted: Sequence[Any], waves: int, t0: float, switched_at: float | None,
                error: BaseException | None) -> dict[str, Any]:
        end = self.clock()
        if switched_at is None and error is None:  # nothing to switch: the wanted set already serves
            switched_at = end
        out: dict[str, Any] = {
            "ok": error is None, "shapes": [(p.threads, p.batch) for p in wanted],
            "cpus": [sorted(p.cpus) for p in wanted], "waves": waves,
            "start_s": (switched_at or end) - t0, "drain_s": end - (switched_at or end), "switched_at": switched_at,
        }
        if error is not None:
            out["error"] = str(error) or type(error).__name__
        return out
