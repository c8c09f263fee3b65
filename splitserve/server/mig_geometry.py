"""Algorithm 2's geometry changes carried to the node's MIG GPUs.

PROTEAN's controller re-carves the worker cores when it changes the geometry; on a node with
MIG GPUs the same geometry is planned for each of them (``placement.mig.plan_node_geometry``)
and handed to ``placement.gpus.MigDriver.apply``, which runs the ``nvidia-smi`` commands only
when an administrator started splitserve with ``--gpu-admin`` and otherwise logs them.
Before a plan that destroys slices (or resets a GPU) runs, the work on them is drained:
``drain`` takes the partitions' UUIDs, moves or stops every instance placed there (its
calls answered), and says whether none is left; a plan whose partitions could not be
drained is not run (a destroy would fail on a slice in use, or kill its workers' calls).
A plan that fails stops at the failing command and is logged; the GPUs' slices are read
again from NVML at the next listing, so instances land on what exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from splitserve.placement.gpus import Applied, MigDriver
from splitserve.placement.mig import GpuListing, MigPlan, plan_node_geometry

log = logging.getLogger(__name__)


class MigGeometry:
    """Plans (and, with the administrator's flag, applies) a geometry on every MIG GPU.
    Blocking (NVML, ``nvidia-smi``): call it off the loop."""

    def __init__(self, driver: MigDriver, drain: Callable[[frozenset[str]], bool],
                 listing: Callable[[], GpuListing] | None = None) -> None:
        self.driver = driver
        self.drain = drain
        self.listing = listing or driver.list  # read afresh: the plan starts from what the GPUs hold now
        self.last: list[Applied] = []

    def __call__(self, units: Sequence[int]) -> list[Applied]:
        plans, skipped = plan_node_geometry(self.listing(), units)
        for why in skipped:
            log.debug("MIG geometry %s not planned: %s", tuple(units), why)
        self.last = [self._apply(plan) for plan in plans]
        for applied in self.last:
            if applied.failed is not None:
                log.error("GPU %d: MIG geometry change failed: %s", applied.plan.gpu, applied.failed)
        return self.last

    def _apply(self, plan: MigPlan) -> Applied:
        if self.driver.admin and plan.destroys and not self.drain(frozenset(plan.destroys)):
            return Applied(plan, False, (), f"the work on {', '.join(plan.destroys)} could not be drained; "
                                            "nothing was run")
        return self.driver.apply(plan)
