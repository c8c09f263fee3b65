"""The node's partitions as PROTEAN sees them, and the per-batch choice of one. Pure.

With ``ServerConfig.protean.partitioning`` other than none the node carves its worker cores into
partitions (a partition is PROTEAN's GPU slice: a set of cores with a memory budget), and
every model keeps warm instances on each of them. This module decides, without touching the
machine:

- the layout at start (``initial_layout``): which CPU sets, from ``partitioning``,
  ``geometry`` and the worker cores (PROTEAN's CPU family of ``protean.geometry`` with at
  least 7 worker cores, else a static split);
- each partition's memory budget (``split_memory``: proportional to cores);
- which partition one batch goes to (``BatchChooser``): PROTEAN's Algorithm 1 (``eta``), the
  smart-static straw man (``largest``) or naive slicing (``balanced``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from splitserve.errors import InvalidInput
from splitserve.placement.partition import NodePartition, Partitioning, StrictPlacement
from splitserve.protean.distributor import Job, JobDistributor, Placement, Slot, tag_partitions
from splitserve.protean.geometry import INITIAL_GEOMETRY, Geometry, carve, cpu_unit

# A default static split gives each partition one core up to this many partitions; more cores
# are shared out among that many (a few mid-sized partitions serve better than dozens of 1-core ones).
MAX_DEFAULT_PARTITIONS = 4


@dataclass(frozen=True)
class Layout:
    """The CPU sets to carve, largest first; ``geometry`` and ``unit`` are set when they come
    from PROTEAN's CPU family (a geometry controller can change them), else None."""

    cpu_sets: tuple[tuple[int, ...], ...]
    geometry: Geometry | None = None
    unit: int | None = None


def worker_cpus(cpus: Sequence[int]) -> list[int]:
    """The CPUs partitions are carved from: all of them on a node of two CPUs or fewer (the
    front end then shares them with the workers), else all but the first, which the front end
    and its loop keep."""
    ids = sorted(cpus)
    return ids if len(ids) <= 2 else ids[1:]


def parse_geometry(text: str) -> tuple[int, ...]:
    """A static geometry as written (``"4,2,1"``: core counts), largest first."""
    try:
        sizes = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise InvalidInput(f"geometry {text!r}: write partition core counts separated by commas, e.g. 1,1 or 4,2,1") \
            from None
    if not sizes or min(sizes) < 1:
        raise InvalidInput(f"geometry {text!r}: give at least one partition, each of at least one core")
    return tuple(sorted(sizes, reverse=True))


def default_static(cores: int) -> tuple[int, ...]:
    """One partition per core up to ``MAX_DEFAULT_PARTITIONS``, then that many, as even as can be."""
    parts = min(cores, MAX_DEFAULT_PARTITIONS)
    base, extra = divmod(cores, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def slice_cpus(sizes: Sequence[int], cpus: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive runs of ``cpus`` (sorted), one per size; InvalidInput when they do not fit."""
    ids = sorted(cpus)
    if sum(sizes) > len(ids):
        raise InvalidInput(f"geometry {','.join(map(str, sizes))} needs {sum(sizes)} cores; the node's partitions "
                           f"have {len(ids)} ({ids})")
    out, at = [], 0
    for n in sizes:
        out.append(tuple(ids[at:at + n]))
        at += n
    return out


def initial_layout(partitioning: Partitioning, geometry: str, cpus: Sequence[int]) -> Layout:
    """The partitions a node starts with (see the module doc); ``cpus`` are the worker cores."""
    if partitioning is Partitioning.NONE:
        return Layout(())
    if geometry:
        return Layout(tuple(slice_cpus(parse_geometry(geometry), cpus)))
    if partitioning is Partitioning.COLOCATE:
        return Layout((tuple(sorted(cpus)),))
    unit = cpu_unit(len(cpus)) if partitioning is Partitioning.PROTEAN else None
    if unit is not None:
        return Layout(tuple(carve(INITIAL_GEOMETRY, sorted(cpus), unit)), INITIAL_GEOMETRY, unit)
    return Layout(tuple(slice_cpus(default_static(len(cpus)), cpus)))


def split_memory(total: int, cpu_sets: Sequence[Collection[int]]) -> list[int]:
    """Each partition's memory budget: ``total`` shared out in proportion to cores (the CPU
    analogue of a MIG profile's memory, which grows with its compute)."""
    cores = sum(len(s) for s in cpu_sets)
    return [total * len(s) // cores for s in cpu_sets] if cores else []


def slots_of(parts: Sequence[NodePartition], running: Sequence[tuple[int, Job]]) -> list[Slot]:
    """Algorithm 1's view of the partitions: each with the jobs running on it now."""
    by_part: dict[int, list[Job]] = {}
    for pid, job in running:
        by_part.setdefault(pid, []).append(job)
    return [Slot(p.id, p.cores, p.mem_bytes, tuple(by_part.get(p.id, ()))) for p in parts]


def free_mem(slot: Slot) -> int:
    """What a partition's budget leaves after the batches running on it."""
    return slot.mem_bytes - sum(j.mem_bytes for j in slot.running)


class BatchChooser:
    """Which partition one batch goes to, under the node's ``strict_placement`` (resolved:
    never ``auto``). ``distributor`` is Algorithm 1's, needed only for ``eta``."""

    def __init__(self, policy: StrictPlacement, distributor: JobDistributor | None) -> None:
        if policy is StrictPlacement.AUTO:
            raise InvalidInput("strict_placement auto must be resolved against the node's partitioning first")
        if policy is StrictPlacement.ETA and distributor is None:
            raise InvalidInput("strict_placement eta needs the slowdown model's job distributor")
        self.policy = policy
        self.distributor = distributor

    def tags(self, slots: Sequence[Slot], be_mem: int) -> dict[int, float]:
        """Algorithm 1's tags (how much of each partition best-effort work is expected to take)."""
        return tag_partitions(slots, be_mem)

    def place(self, job: Job, slots: Sequence[Slot], eligible: Collection[int], be_mem: int,
              be_models: Sequence[str] = (), now: float = 0.0, placed: Collection[int] | None = None) -> Placement:
        """Where ``job`` runs among ``eligible`` (the partitions with an idle instance of its
        model), or ``slot`` None: it waits for a partition to free up (under ``eta`` it may
        name the one it waits for, see ``JobDistributor.place``; ``placed``: the partitions
        its model has instances on, ``now`` the decider's clock). Under ``eta`` the answer
        carries the chosen slot's tag in this decision (``Placement.tag``)."""
        if self.policy is StrictPlacement.ETA:
            assert self.distributor is not None
            tags = self.tags(slots, be_mem)
            plan = self.distributor.place(job, slots, tags, eligible, now, be_models, placed)
            return plan if plan.slot is None else replace(plan, tag=tags.get(plan.slot, 0.0))
        if not eligible:
            return Placement(None)
        candidates = [s for s in slots if s.id in eligible]
        if self.policy is StrictPlacement.LARGEST:
            largest = max(slots, key=lambda s: (s.cores, s.mem_bytes, -s.id))
            if job.strict:
                return Placement(largest.id if largest.id in eligible else None)
            # best effort keeps off the largest partition while there is another one
            others = [s for s in candidates if s.id != largest.id] if len(slots) > 1 else candidates
            fits = sorted((s for s in others if free_mem(s) >= job.mem_bytes), key=lambda s: (s.cores, s.mem_bytes))
            return Placement(fits[0].id if fits else None)
        # balanced: the most free memory, whatever the class; ties go to the larger partition
        best = max(candidates, key=lambda s: (free_mem(s), s.cores, -s.id), default=None)
        return Placement(best.id if best is not None else None)
