"""How one model's instances get their CPUs: the narrow interface a runtime calls.

A ``Placer`` is a model's placement decider. It asks the node's ``ResourceManager`` for the
model's partitions and says where each instance sits in them; the runtime applies what it
says (it places instances, starts their workers, and hands changes to the node's placement
applier) and never looks inside. Two kinds:

- ``FixedPlacer``: the config's ``instances`` × ``threads``. Without ``cpus``, one partition
  per instance (``SharedCpus`` from the pool fixed models share, or ``Cpus`` of its own when
  the node says ``fixed_cpus_shared = false``); with ``cpus``, one ``ExactCpus`` partition (shared when the config
  says ``share_cpus``) that the instances take in turn, wrapping around.
- ``PackratPlacer``: one budget of cores (``CoreBudget(placement.threads)``, or the config's
  ``cpus``) inside which Packrat's controller plans ⟨instances, threads, batch⟩; it owns the
  model's batching policy (Packrat's aggregation) and moves its target when a plan switches.
- ``PartitionPlacer``: with ``ServerConfig.protean.partitioning`` other than none, every model's: its
  instances sit on the node's partitions (``OnPartition``), warm ones on each, beside the
  other models' (PROTEAN's co-location on a slice); threads = the partition's cores.

Who calls what, and when: ``place`` when the model loads; ``resize`` when a user changes the
instance count; ``observe`` and ``propose`` on every scheduling pass (Packrat's adaptive B);
``settle`` once a change of placement has switched (or failed), with what serves then.
Pure: no clock of its own (``now`` is passed in), no processes.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.packrat import PackratConfig, PackratController, PlacementKind
from splitserve.placement.partition import (
    CoreBudget, Cpus, CpuRequest, ExactCpus, InstancePlacement, NodePartition, OnPartition, Partition, Partitioning,
    PartitionSource, SharedCpus,
)
from splitserve.placement.resources import ResourceManager
from splitserve.scheduler.policy import BatchingPolicy, PackratAggregate

log = logging.getLogger(__name__)


class Placer(ABC):
    """One model's placement decider (see the module doc for who calls it and when)."""

    kind: PlacementKind | Partitioning

    def __init__(self, owner: str, config: ModelConfig) -> None:
        self.owner = owner
        self.config = config
        self.instances: int | None = None  # a user's resize of a model that is not placed: used at its next place

    @abstractmethod
    def place(self, rm: ResourceManager) -> list[InstancePlacement]:
        """Allocate the model's partitions (at load) and return where its instances sit.
        Raises ResourcesUnavailable, naming what is in use, and then holds nothing."""

    @abstractmethod
    def resize(self, rm: ResourceManager, serving: Sequence[InstancePlacement],
               instances: int) -> list[InstancePlacement]:
        """The placements of ``instances`` instances, given those ``serving`` now (in instance
        order, kept where they can be); allocates what added instances need. Partitions that
        end up holding no instance go back with ``ResourceManager.release_unused``."""

    @property
    def per_instance_batch(self) -> bool:
        """Whether each instance has its own batch limit (Packrat's b) rather than the model's."""
        return False

    def policy(self) -> BatchingPolicy | None:
        """The batching policy this placement imposes on the model (None: the config's)."""
        return None

    def plan_for(self, batch: int) -> list[InstancePlacement]:
        """The placements of a plan for a batch of ``batch`` (Packrat's repack)."""
        raise InvalidInput(f"model {self.owner!r} uses {self.kind.value} placement: only packrat plans for a batch size")

    def observe(self, queue_depth: int, now: float) -> None:
        """A request was queued; ``queue_depth`` requests wait now."""

    def propose(self, now: float) -> list[InstancePlacement] | None:
        """A new placement this decider wants now (a repack), or None."""
        return None

    def settle(self, serving: Sequence[InstancePlacement]) -> None:
        """A change of placement switched, or failed: ``serving`` is what serves now."""

    def describe(self) -> dict[str, Any]:
        """The decider's part of ``/v2/models/{name}/placement``."""
        return {"placement": self.kind.value}

    def _allocate_all(self, rm: ResourceManager, requests: Sequence[CpuRequest]) -> list[Partition]:
        """Partitions for ``requests``, all or none."""
        out: list[Partition] = []
        try:
            for r in requests:
                out.append(rm.allocate(self.owner, r))
        except Exception:
            for p in out:
                rm.release_partition(p.id)
            raise
        return out


class FixedPlacer(Placer):
    """The config's instances and threads, on CPUs of the node or on the config's ``cpus``."""

    kind = PlacementKind.FIXED

    def __init__(self, owner: str, config: ModelConfig, shared_pool: bool) -> None:
        super().__init__(owner, config)
        self.shared_pool = shared_pool

    def place(self, rm: ResourceManager) -> list[InstancePlacement]:
        return self._placements(rm, [], self.instances or self.config.instances)

    def resize(self, rm: ResourceManager, serving: Sequence[InstancePlacement],
               instances: int) -> list[InstancePlacement]:
        return self._placements(rm, serving, instances)

    def _placements(self, rm: ResourceManager, kept: Sequence[InstancePlacement],
                    instances: int) -> list[InstancePlacement]:
        cfg = self.config
        threads, batch = cfg.threads, cfg.max_batch_size
        if cfg.cpus:
            part = next(iter(rm.partitions(self.owner)), None)
            if part is None:
                part = rm.allocate(self.owner, ExactCpus(frozenset(cfg.cpus), cfg.share_cpus))
            # Instance n takes the next ``threads`` of the config's CPUs, wrapping: instances
            # that wrap onto each other's CPUs share them (so do those of a shared partition).
            shared = part.shared or instances * threads > len(cfg.cpus)
            return [InstancePlacement(threads, batch, frozenset(cfg.cpus[(n * threads + k) % len(cfg.cpus)]
                                                                for k in range(threads)), shared)
                    for n in range(instances)]
        kept = list(kept[:instances])
        request = SharedCpus(threads) if self.shared_pool else Cpus(threads)
        added = self._allocate_all(rm, [request] * (instances - len(kept)))
        return kept + [InstancePlacement(threads, batch, p.cpus, p.shared) for p in added]


class PackratPlacer(Placer):
    """Packrat inside one budget of cores, and the aggregation policy that goes with its plan.

    The budget is ``placement.threads`` cores (``CoreBudget``), or exactly the config's
    ``cpus`` (``ExactCpus``, shared with ``share_cpus``). A config that gives neither asks for
    ``default_share`` of the CPUs free when it loads (rounded up, at least one, at most the
    profile's largest thread count): never the whole node while other models may still come,
    and always something while a CPU is free. Name ``threads`` to get exactly that many.
    """

    kind = PlacementKind.PACKRAT

    def __init__(self, owner: str, config: ModelConfig, pcfg: PackratConfig, profile: LatencyProfile,
                 default_share: float) -> None:
        super().__init__(owner, config)
        self.pcfg = pcfg
        self.profile = profile
        self.default_share = default_share
        self._policy = PackratAggregate(pcfg.batch, pcfg.timeout_ms / 1000)
        self._shared = False
        self.controller: PackratController | None = None  # made at place, inside the granted budget

    @property
    def per_instance_batch(self) -> bool:
        return True

    def policy(self) -> BatchingPolicy:
        return self._policy

    def _budget(self, rm: ResourceManager) -> CpuRequest:
        if self.config.cpus:
            return ExactCpus(frozenset(self.config.cpus), self.config.share_cpus)
        if self.pcfg.threads is not None:
            return CoreBudget(self.pcfg.threads)
        share = math.ceil(len(rm.free_cpus()) * self.default_share)
        return CoreBudget(max(1, min(share, self.profile.max_threads)))

    def place(self, rm: ResourceManager) -> list[InstancePlacement]:
        part = rm.allocate(self.owner, self._budget(rm))
        self._shared = part.shared
        try:
            pk = self.controller = PackratController(self.pcfg, self.profile, self.config.max_batch_size,
                                                     rm.cores_of(part.id))
            plan = pk.resize_plan(self.instances) if self.instances else pk.plan()
        except Exception:
            rm.release_partition(part.id)
            raise
        placements = pk.placements(plan, self._shared)
        self.settle(placements)
        return placements

    def resize(self, rm: ResourceManager, serving: Sequence[InstancePlacement],
               instances: int) -> list[InstancePlacement]:
        pk = self._placed()
        return pk.placements(pk.resize_plan(instances), self._shared)

    def observe(self, queue_depth: int, now: float) -> None:
        if self.controller is not None:
            self.controller.observe(queue_depth, now)

    def propose(self, now: float) -> list[InstancePlacement] | None:
        pk = self.controller
        batch = pk.next_batch(now) if pk is not None else None
        if pk is None or batch is None:
            return None
        log.info("model %s: queue depth suggests batch %d; repacking", self.owner, batch)
        pk.switched(batch, now)  # the estimator waits its timeout from here, whatever the change does
        return self.plan_for(batch)

    def plan_for(self, batch: int) -> list[InstancePlacement]:
        """The placements of the optimizer's plan for a batch of ``batch`` in the budget."""
        pk = self._placed()
        return pk.placements(pk.plan(batch), self._shared)

    def settle(self, serving: Sequence[InstancePlacement]) -> None:
        # The aggregation target is what the serving instances take together: B of the plan
        # that switched, or of what still serves when a change stopped half-way.
        total = sum(p.batch for p in serving)
        if total:
            self._policy.retarget(total)
            if self.controller is not None:
                self.controller.batch = total

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"placement": self.kind.value, "batch": self._policy.total}
        if self.controller is not None:
            out["plan"] = self.controller.plan().to_dict()
            out["threads_budget"] = self.controller.threads
        return out

    def _placed(self) -> PackratController:
        if self.controller is None:
            raise AssertionError(f"packrat for {self.owner!r} asked to plan before it was placed")
        return self.controller


def spread(parts: Sequence[NodePartition], count: int, warm: int, kept: Sequence[InstancePlacement],
           batch: int) -> list[InstancePlacement]:
    """Placements of ``count`` instances of one model (at least ``warm`` per partition): those
    ``kept`` that sit on one of ``parts`` stay (up to ``count``), the rest go one at a time to
    the partition with fewest (ties: the larger one). Each instance has one thread per core of
    its partition and is shared: instances of every model co-locate on a partition."""
    ids = {p.id for p in parts}
    count = max(count, warm * len(parts))
    keep = [k for k in kept if k.partition in ids]
    on = Counter(k.partition for k in keep)
    def short() -> int:  # instances still owed to partitions below ``warm``
        return sum(max(0, warm - on[p.id]) for p in parts)

    # Shrinking: drop from the partitions with most, never below ``warm`` on any.
    while len(keep) + short() > count:
        most = max(parts, key=lambda p: (on[p.id], -p.cores, p.id))
        if on[most.id] <= warm:
            break
        del keep[max(i for i, k in enumerate(keep) if k.partition == most.id)]
        on[most.id] -= 1
    out = list(keep)
    while len(out) < count:
        p = min(parts, key=lambda q: (on[q.id], -q.cores, q.id))
        out.append(InstancePlacement(p.cores, batch, p.cpus, shared=True, partition=p.id))
        on[p.id] += 1
    return out


class PartitionPlacer(Placer):
    """A model's instances on the node's partitions: ``max(instances, warm × partitions)`` of
    them, warm ones on every partition so that any partition can take any model's batch
    without a cold start, added ones on the partitions with fewest. A place on a partition is
    the model's ``OnPartition`` partition of the ``ResourceManager``."""

    def __init__(self, owner: str, config: ModelConfig, partitions: PartitionSource) -> None:
        super().__init__(owner, config)
        self.partitions = partitions
        self.kind = partitions.partitioning

    def place(self, rm: ResourceManager) -> list[InstancePlacement]:
        parts = self.partitions.current()
        self._join(rm, parts)
        return spread(parts, self.instances or 0, self.partitions.warm, (), self.config.max_batch_size)

    def resize(self, rm: ResourceManager, serving: Sequence[InstancePlacement],
               instances: int) -> list[InstancePlacement]:
        parts = self.partitions.current()
        self._join(rm, parts)
        return spread(parts, instances, self.partitions.warm, serving, self.config.max_batch_size)

    def move(self, rm: ResourceManager, serving: Sequence[InstancePlacement],
             parts: Sequence[NodePartition]) -> list[InstancePlacement]:
        """As many instances as serve now, on the partitions ``parts`` (a geometry change)."""
        self._join(rm, parts)
        return spread(parts, len(serving), self.partitions.warm, (), self.config.max_batch_size)

    def _join(self, rm: ResourceManager, parts: Sequence[NodePartition]) -> None:
        """Take a place on each of ``parts`` the model has none on yet."""
        have = {p.request.partition for p in rm.partitions(self.owner) if isinstance(p.request, OnPartition)}
        self._allocate_all(rm, [OnPartition(p.id) for p in parts if p.id not in have])

    def describe(self) -> dict[str, Any]:
        return {"placement": self.kind.value, "partitions": [p.id for p in self.partitions.current()],
                "warm_per_partition": self.partitions.warm}


def make_placer(owner: str, config: ModelConfig, default_kind: PlacementKind, profile: LatencyProfile | None,
                default_share: float, fixed_shared: bool, partitions: PartitionSource | None = None) -> Placer:
    """The placer a model's config asks for; on a partitioned node (``partitions``), every
    model's instances go on the node's partitions, whatever its config says (logged when it
    names CPUs or Packrat). A Packrat model that was never profiled on this machine is served
    with fixed placement (logged): its optimizer has nothing to plan from."""
    pcfg = PackratConfig.parse(config.placement, config.max_batch_size, default_kind)
    if partitions is not None and partitions.partitioning is not Partitioning.NONE:
        if config.cpus or pcfg is not None:
            log.warning("model %s: the node is partitioned (%s); its instances go on the node's partitions, "
                        "not on its configured cpus or Packrat plan", owner, partitions.partitioning.value)
        return PartitionPlacer(owner, config, partitions)
    if pcfg is None:
        return FixedPlacer(owner, config, fixed_shared)
    if profile is None:
        log.warning("model %s: placement is packrat but it was never profiled on this machine "
                    "(run `splitserve profile %s`); serving with fixed placement", owner, owner)
        return FixedPlacer(owner, config, fixed_shared)
    return PackratPlacer(owner, config, pcfg, profile, default_share)
