"""What every part of a served model reads: its identity, its node and its shared state.

Identity (record, func_id, scheduler with its queued calls, statistics) lives as long as
the model is registered; residency (worker processes holding its weights) comes and goes.
``ModelCore`` holds both, with no behaviour beyond waiting for a condition: each part
(``dispatch``, ``instances``, ``residency``, ``placement``) changes it in its own role.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from splitserve.placement.partition import InstancePlacement
from splitserve.placement.placer import make_placer
from splitserve.placement.profiler import ModelProfile
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord
from splitserve.scheduler.model_scheduler import ModelScheduler
from splitserve.scheduler.policy import make_policy
from splitserve.memory.footprints import MemoryFootprint
from splitserve.server.model.env import InstanceWorker, RuntimeEnv
from splitserve.server.ports import ModelState, ModelStats
from splitserve.tensorqueue import ring_slots

log = logging.getLogger(__name__)

RUNNING = (ModelState.LOADING, ModelState.READY)


class ModelCore:
    """One model's identity and state, shared by its parts (all on the node's loop).

    ``profile`` was read off the loop before the model was built (``app.Server.prepare``);
    ``footprint`` is read off the loop by the residency before its first request."""

    def __init__(self, env: RuntimeEnv, record: ModelRecord, profile: ModelProfile | None) -> None:
        self.env = env
        self.settings = env.config
        self.loop = env.loop
        self.resources = env.resources
        self.record = record
        self.config = record.config
        self.name = record.name
        self.func_id = record.func_id
        cfg = self.config
        sizes = [t.nbytes for t in cfg.inputs + cfg.outputs]
        self.nslots = ring_slots(sizes, max(cfg.queue_slots or self.settings.batching.queue_slots, 2 * cfg.max_batch_size))
        self.sched = ModelScheduler(self.name, make_policy(cfg.batching), cfg.max_batch_size, queue_limit=self.nslots,
                                    rt_policy=self.settings.reef.rt_policy, class_order=self.settings.reef.class_order)
        # Per instance id: its worker. Where each instance sits (threads, batch, CPUs) is the
        # node's ResourceManager's record; instances exist while the model holds its CPUs
        # (from a load until its unload gives them back).
        self.workers: dict[int, InstanceWorker] = {}
        # What a residency of this model takes, for the node's memory budget: stored from an
        # earlier run, else the weights file's header (read before the first request for
        # residency); updated by every LOADED, so the next load is charged what the last measured.
        self.footprint = MemoryFootprint()
        # One stored profile feeds Packrat's optimizer and the workers' padding budgets.
        self.profile = profile
        self.placer = make_placer(self.name, cfg, self.settings.packrat.placement, profile.latency if profile else None,
                                  self.settings.packrat.packrat_default_share, self.settings.packrat.fixed_cpus_shared,
                                  env.partitions)
        if (policy := self.placer.policy()) is not None:
            self.sched.policy = policy
        self.stats = ModelStats(slo=env.metrics.slo_tally(self.name))
        self.slo_s = self._model_slo()  # the SLO of its real-time calls that name none (None: no SLO)
        self.state = ModelState.UNLOADED
        self.error: str | None = None  # why the last load failed
        self.retry_at = 0.0  # FAILED: when a request may retry the load (perf_counter)
        # False after a user's unload: requests are refused (MODEL_NOT_READY) until a load;
        # a model that was never unloaded still starts lazily on first use.
        self.enabled = True
        # The memory manager never evicts it (an operator's evict still does); an explicit load may set it.
        self.keep_resident = cfg.memory.keep_resident
        self.reconfiguring = 0  # placement changes under way: not evictable meanwhile
        self.ready_event = asyncio.Event()  # set when a load ends (READY or FAILED) or is abandoned
        self.changed = asyncio.Event()  # set on every kick: waits re-check their condition
        self.default_class = RequestClass.RT if cfg.default_class == "rt" else RequestClass.BE

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

    @property
    def running(self) -> bool:
        """Loading or ready: its instances are wanted up."""
        return self.state in RUNNING

    def serving_placements(self) -> list[InstancePlacement]:
        """Where the serving instances sit now (``InstancePlacement`` each)."""
        return [p for i in self.sched.serving() if (p := self.resources.placed(self.name, i)) is not None]

    async def until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``done()`` (re-checked at every kick) or ``deadline``; returns done()."""
        while not done():
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass
        return True
