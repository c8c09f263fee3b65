"""The node's one owner of resources: the ``ResourceManager`` alone hands out partitions.

Fixed placement, Packrat's budgets, resizes and REEF's claims all go through one manager per
node, so two owners never pin onto the same CPU unless both asked to share it (the rule is
on ``partition.ExactCpus``). Pure bookkeeping: the node's CPUs come in as a list of
``topology.Core`` (``read_topology()`` on a real node, a synthetic list in tests); nothing
here reads the machine, pins a process or awaits.

Who calls it, and when:

- the node (composition root) builds one manager from ``read_topology()`` at start and hands
  it to the runtimes, the coordinator and the HTTP front end;
- a runtime's ``placer.Placer``, when the model loads: ``allocate`` one ``SharedCpus(threads)``
  (or ``Cpus(threads)``) per instance (fixed placement),
  one ``ExactCpus`` (a config's ``cpus``) or one ``CoreBudget(T)`` (Packrat, whose controller
  then places its instances inside ``cores_of(partition)``); ``place`` each instance as it is
  added and ``unplace`` it when it has drained; ``release`` everything when it unloads;
- the placement applier (``server.applier``, planning with ``placement.plans``) asks for ``placement()`` and ``idle_cpus()`` to
  plan a change, and allocates or releases partitions as the change needs;
- the coordinator asks ``instance_cpus`` for the CPUs REEF's claims cover;
- with ``partitioning`` other than none, the node's partition manager (``protean.partitions``)
  ``allocate``s one ``Carved`` partition per node partition, and each model's
  ``PartitionPlacer`` joins them with ``OnPartition``: its instances sit there, beside other
  models' (all shared);
- ``GET /v2/placement`` and ``/v2/models/{name}/placement`` return ``snapshot()``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.errors import InvalidInput, ResourcesUnavailable
from splitserve.placement.partition import (
    Carved,
    CoreBudget,
    CpuRequest,
    ExactCpus,
    InstancePlacement,
    OnPartition,
    Partition,
    PartitionKind,
    SharedCpus,
    cpu_list,
)
from splitserve.placement.topology import Core, take_cpus


@dataclass(frozen=True)
class _Placed:
    """An instance as the manager records it: the partition it sits in, and its shape."""

    partition: int
    placement: InstancePlacement


class ResourceManager:
    """Hands out the node's CPUs as partitions, and records which instance sits where."""

    def __init__(self, cores: Sequence[Core]) -> None:
        if not cores:
            raise InvalidInput("a node needs at least one CPU")
        ids = [c.cpu for c in cores]
        if len(set(ids)) != len(ids):
            raise InvalidInput(f"the topology lists a CPU twice: {sorted(ids)}")
        self._cores = {c.cpu: c for c in cores}
        self._partitions: dict[int, Partition] = {}
        self._instances: dict[tuple[str, int], _Placed] = {}
        self._ids = itertools.count(1)

    # -- partitions ------------------------------------------------------------------------

    @property
    def cpus(self) -> frozenset[int]:
        """Every CPU the node may use."""
        return frozenset(self._cores)

    def free_cpus(self) -> frozenset[int]:
        """CPUs no partition holds: what ``Cpus`` and ``CoreBudget`` requests are served from."""
        return self.cpus - {c for p in self._partitions.values() for c in p.cpus}

    def allocate(self, owner: str, request: CpuRequest) -> Partition:
        """A new partition for ``owner``, or ResourcesUnavailable naming what is in use and
        by whom (InvalidInput for CPUs the node does not have)."""
        if isinstance(request, ExactCpus):
            cpus = self._exact(owner, request)
        elif isinstance(request, Carved):
            cpus = self._carved(owner, request)
        elif isinstance(request, OnPartition):
            node_part = self._partition(request.partition)
            if not isinstance(node_part.request, Carved):
                raise InvalidInput(f"{owner!r} asks for a place on partition {request.partition}, "
                                   "which is not one of the node's partitions")
            cpus = node_part.cpus
        elif isinstance(request, SharedCpus):
            cpus = self._shared(owner, request)
        else:
            free = self.free_cpus()
            if request.count > len(free):
                raise ResourcesUnavailable(
                    f"{owner!r} asks for {request.describe()} but only {len(free)} are free "
                    f"({cpu_list(free)}); in use: {self._holders()}"
                )
            what = f"{owner!r}'s {request.describe()}"
            cpus = frozenset(take_cpus(request.count, [self._cores[c] for c in free], what))
        part = Partition(id=next(self._ids), owner=owner, kind=PartitionKind.CPUS, cpus=cpus, request=request)
        self._partitions[part.id] = part
        return part

    def _exact(self, owner: str, request: ExactCpus) -> frozenset[int]:
        unknown = request.cpus - self.cpus
        if unknown:
            raise InvalidInput(
                f"{owner!r} asks for CPUs {cpu_list(unknown)}, which this node does not have "
                f"(it has {cpu_list(self.cpus)})"
            )
        blocking = [
            p for p in self._partitions.values()
            if p.cpus & request.cpus and not (request.share and p.shared)
        ]
        if blocking:
            held = "; ".join(
                f"{cpu_list(p.cpus & request.cpus)} held by {p.owner!r} ({p.request.describe()}"
                f"{'' if p.shared else ', not shared'})"
                for p in blocking
            )
            hint = "" if request.share else "; to share CPUs with another model, both must ask to share"
            raise ResourcesUnavailable(f"{owner!r} asks for {request.describe()} but finds {held}{hint}")
        return request.cpus

    def _carved(self, owner: str, request: Carved) -> frozenset[int]:
        unknown = request.cpus - self.cpus
        if unknown:
            raise InvalidInput(f"a node partition on CPUs {cpu_list(unknown)}, which this node does not have "
                               f"(it has {cpu_list(self.cpus)})")
        # Only other node partitions and the models' places on them may overlap: the old and
        # the new geometry run side by side while a change switches over.
        blocking = [p for p in self._partitions.values()
                    if p.cpus & request.cpus and not isinstance(p.request, (Carved, OnPartition))]
        if blocking:
            held = "; ".join(f"{cpu_list(p.cpus & request.cpus)} held by {p.owner!r} ({p.request.describe()})"
                             for p in blocking)
            raise ResourcesUnavailable(f"{owner!r} cannot carve {request.describe()}: {held}")
        return request.cpus

    def _shared(self, owner: str, request: SharedCpus) -> frozenset[int]:
        pool = self.cpus - {c for p in self._partitions.values() if not p.shared for c in p.cpus}
        if request.count > len(pool):
            raise ResourcesUnavailable(
                f"{owner!r} asks for {request.describe()} but only {len(pool)} CPUs may be shared "
                f"({cpu_list(pool)}); in use: {self._holders()}"
            )
        load = Counter(c for p in self._partitions.values() if p.shared for c in p.cpus)
        return frozenset(sorted(pool, key=lambda c: (load[c], c))[:request.count])

    def release(self, owner: str) -> list[Partition]:
        """Return every partition of ``owner`` (and forget its instances); what was released."""
        gone = [p for p in self._partitions.values() if p.owner == owner]
        for p in gone:
            self.release_partition(p.id)
        return gone

    def release_partition(self, partition_id: int) -> Partition:
        """Return one partition, forgetting the instances placed in it (an applier releases
        a retired instance's partition once the instance has drained)."""
        part = self._partition(partition_id)
        del self._partitions[partition_id]
        for key in [k for k, v in self._instances.items() if v.partition == partition_id]:
            del self._instances[key]
        return part

    def release_unused(self, owner: str) -> list[Partition]:
        """Return ``owner``'s per-instance (``Cpus``, ``SharedCpus``) partitions that no instance sits in: those
        allocated for instances that never started (a refused or failed change)."""
        used = {v.partition for v in self._instances.values()}
        return [self.release_partition(p.id) for p in self.partitions(owner)
                if p.per_instance and p.id not in used]

    def partitions(self, owner: str | None = None) -> list[Partition]:
        """The partitions of ``owner`` (every partition when None), in the order they were made."""
        return [p for p in self._partitions.values() if owner is None or p.owner == owner]

    def cores_of(self, partition_id: int) -> list[Core]:
        """The topology of a partition's CPUs: what Packrat places its instances inside."""
        return [self._cores[c] for c in sorted(self._partition(partition_id).cpus)]

    def _partition(self, partition_id: int) -> Partition:
        try:
            return self._partitions[partition_id]
        except KeyError:
            raise InvalidInput(f"no partition {partition_id} on this node") from None

    # -- instances ---------------------------------------------------------------------------

    def place(self, owner: str, instance: int, placement: InstancePlacement) -> Partition:
        """Record that ``owner``'s ``instance`` runs as ``placement``, in the owner's partition
        that holds all its CPUs (returned); the runtime or the applier calls it before the
        instance's worker starts.

        Refused when no partition of the owner holds all the CPUs (InvalidInput), or when
        another instance of that partition holds one of them and the two do not both share
        (ResourcesUnavailable: an applier must drain that one first).
        """
        part = next((p for p in self._partitions.values() if p.owner == owner and placement.cpus <= p.cpus
                     and (placement.partition < 0
                          or isinstance(p.request, OnPartition) and p.request.partition == placement.partition)),
                    None)
        if part is None:
            mine = "; ".join(cpu_list(p.cpus) for p in self.partitions(owner)) or "none"
            raise InvalidInput(
                f"{owner!r} instance {instance}: CPUs {cpu_list(placement.cpus)} are outside its partitions ({mine})"
            )
        for (o, i), placed in self._instances.items():
            if placed.partition == part.id and (o, i) != (owner, instance):
                clash = placement.clashes(placed.placement)
                if clash:
                    raise ResourcesUnavailable(
                        f"{owner!r} instance {instance} wants CPUs {cpu_list(clash)}, which its instance {i} "
                        "still holds; drain that instance first"
                    )
        self._instances[(owner, instance)] = _Placed(part.id, placement)
        return part

    def unplace(self, owner: str, instance: int) -> Partition | None:
        """Forget an instance whose worker has stopped (the applier's drain step calls it).

        A ``Cpus`` or ``SharedCpus`` partition, made for one instance, goes back to the node once no instance
        sits in it, and is returned; a budget or an ``ExactCpus`` partition stays with its
        owner, which places other instances there or releases it at unload.
        """
        placed = self._instances.pop((owner, instance), None)
        if placed is None:
            return None
        part = self._partitions[placed.partition]
        if part.per_instance and not any(v.partition == part.id for v in self._instances.values()):
            return self.release_partition(part.id)
        return None

    def placed(self, owner: str, instance: int) -> InstancePlacement | None:
        """Where an instance sits (None when it is not placed): what its worker is pinned to."""
        placed = self._instances.get((owner, instance))
        return placed.placement if placed else None

    def instance_cpus(self, owner: str, instance: int) -> frozenset[int]:
        """The CPUs an instance holds (empty when it is not placed): what REEF's claims cover."""
        placed = self._instances.get((owner, instance))
        return placed.placement.cpus if placed else frozenset()

    def partition_of(self, owner: str, instance: int) -> Partition | None:
        """The partition an instance sits in, or None when it is not placed."""
        placed = self._instances.get((owner, instance))
        return self._partitions[placed.partition] if placed else None

    def placement(self) -> dict[str, dict[int, InstancePlacement]]:
        """Every placed instance, per owner: the ``current`` a placement change starts from."""
        out: dict[str, dict[int, InstancePlacement]] = {}
        for (owner, i), placed in sorted(self._instances.items()):
            out.setdefault(owner, {})[i] = placed.placement
        return out

    def idle_cpus(self, owners: Iterable[str]) -> frozenset[int]:
        """CPUs in the partitions of ``owners`` that no instance holds: the ``free`` a change of
        those owners' placement may start new instances on."""
        wanted = set(owners)
        mine = {c for p in self._partitions.values() if p.owner in wanted for c in p.cpus}
        held = {c for placed in self._instances.values() for c in placed.placement.cpus}
        return frozenset(mine - held)

    # -- views -------------------------------------------------------------------------------

    def _holders(self) -> str:
        by_owner: dict[str, set[int]] = {}
        for p in self._partitions.values():
            by_owner.setdefault(p.owner, set()).update(p.cpus)
        return ", ".join(f"{o!r} holds {cpu_list(c)}" for o, c in sorted(by_owner.items())) or "nothing"

    def snapshot(self, owner: str | None = None) -> dict[str, Any]:
        """JSON-safe view for ``GET /v2/placement`` (every partition) and
        ``/v2/models/{name}/placement`` (``owner``'s): each partition with its instances."""
        parts = []
        for p in self.partitions(owner):
            instances = [
                {"instance": i, **placed.placement.to_dict()}
                for (o, i), placed in sorted(self._instances.items())
                if placed.partition == p.id
            ]
            parts.append({
                "id": p.id, "owner": p.owner, "kind": p.kind.value, "request": p.request.describe(),
                "cpus": sorted(p.cpus), "shared": p.shared, "instances": instances,
            })
        return {"cpus": sorted(self.cpus), "free": sorted(self.free_cpus()), "partitions": parts}
