"""PROTEAN's geometry family: ``Geometry`` (partition sizes in MIG "g" units, Table 2), and
on a CPU node ``cpu_unit``/``carve``, which turn a geometry into disjoint CPU sets (one "1g"
is ⌊worker cores / 7⌋ cores), and ``geometry_slots``, a geometry's empty partitions as
Algorithm 1 sees them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.placement.topology import Core, allocate
from splitserve.protean.distributor import Slot

# --------------------------------------------------------------------------- geometries

# Table 2 (A100): how many of each profile one GPU can hold, by compute units ("g").
MIG_MAX_COUNT: dict[int, int] = {1: 7, 2: 3, 3: 2, 4: 1, 7: 1}
# Table 2 (A100 40GB): memory slices (of 8, 5 GB each) per profile. A 3g gets as much memory as
# a 4g, which is what lets Algorithm 2's second small set [3g] hold more than [1g, 2g].
MIG_A100_MEM_UNITS: dict[int, int] = {1: 1, 2: 2, 3: 4, 4: 4, 7: 8}
COMPUTE_UNITS = 7  # MIG: at most 7 compute slices per GPU (§2.2)


@dataclass(frozen=True)
class Geometry:
    """Partition sizes in "g" units (PROTEAN's MIG profiles), largest first: (4, 2, 1) is
    (4g, 2g, 1g). Built in normal order whatever order ``units`` come in, and valid by
    construction (``validate``)."""

    units: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(sorted((int(u) for u in self.units), reverse=True)))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidInput unless this is a geometry a MIG GPU allows (Table 2): profiles
        1g/2g/3g/4g/7g within their counts (so at most one 4g) and at most 7 compute units."""
        if not self.units:
            raise InvalidInput("a geometry needs at least one partition")
        for u in set(self.units):
            if u not in MIG_MAX_COUNT:
                raise InvalidInput(f"{u}g is not a MIG profile; use sizes of {sorted(MIG_MAX_COUNT)} units")
            if self.units.count(u) > MIG_MAX_COUNT[u]:
                raise InvalidInput(f"geometry {self} has {self.units.count(u)}× {u}g; a GPU holds at most "
                                   f"{MIG_MAX_COUNT[u]}")
        if sum(self.units) > COMPUTE_UNITS:
            raise InvalidInput(f"geometry {self} needs {sum(self.units)} compute units; a GPU has {COMPUTE_UNITS}")

    def __str__(self) -> str:
        return "(" + ",".join(f"{u}g" for u in self.units) + ")"


INITIAL_GEOMETRY = Geometry((4, 2, 1))  # every group starts here (§6.1.1 Demonstration)
FALLBACK_GEOMETRY = Geometry((4, 3))  # Alg. 2 line 20 ⑭
SMALL_SETS: tuple[tuple[int, ...], ...] = ((1, 2), (3,))  # Alg. 2 line 10, tried in this order
LARGE_UNITS = 4  # Alg. 2 line 23: the 4g added to a chosen small set


def cpu_unit(worker_cores: int) -> int | None:
    """Cores of one "1g" on a CPU node: ⌊worker_cores / 7⌋, so the paper's geometries carry
    over unchanged; None below 7 cores, where only static geometries exist."""
    unit = worker_cores // COMPUTE_UNITS
    return unit if unit >= 1 else None


def carve(geometry: Geometry, cpus: Sequence[int] | Sequence[Core], unit: int) -> list[tuple[int, ...]]:
    """Disjoint CPU sets, one per partition in geometry order: a ``u``g partition gets
    ``u × unit`` CPUs, through the node's allocator (``topology.allocate``: one socket per
    partition where it fits, neighbouring cores). ``cpus`` are plain ids (taken as one socket,
    in id order) or ``Core`` records with their topology.

    CPUs beyond 7 units (worker cores not divisible by 7) go to the largest partition, so no
    worker core idles and the strict partition gets the most (not given: splitserve's choice).
    Raises InvalidInput when ``unit`` is below 1 or the geometry needs more CPUs than given.
    """
    if unit < 1:
        raise InvalidInput(f"unit={unit}: a 1g partition needs at least one CPU")
    cores = [c if isinstance(c, Core) else Core(cpu=c, core=c, socket=0) for c in cpus]
    if len({c.cpu for c in cores}) != len(cores):
        raise InvalidInput(f"carve was given duplicate CPUs: {sorted(c.cpu for c in cores)}")
    counts = [u * unit for u in geometry.units]
    if sum(counts) > len(cores):
        raise InvalidInput(f"geometry {geometry} at {unit} CPUs per unit needs {sum(counts)} CPUs; "
                           f"only {len(cores)} are given")
    counts[0] += len(cores) - sum(counts)
    return [tuple(p) for p in allocate(counts, cores)]


def geometry_slots(
    geometry: Geometry, unit_cores: int, unit_mem: int, mem_units: Mapping[int, int] | None = None
) -> list[Slot]:
    """Empty slots for ``geometry``, ids in geometry order: ``u × unit_cores`` cores and
    ``mem_units[u] × unit_mem`` bytes each (``mem_units`` None: memory in proportion to
    compute, the CPU node's budget)."""
    return [
        Slot(id=i, cores=u * unit_cores, mem_bytes=(mem_units[u] if mem_units else u) * unit_mem)
        for i, u in enumerate(geometry.units)
    ]


# --------------------------------------------------------------------------- Algorithm 2
