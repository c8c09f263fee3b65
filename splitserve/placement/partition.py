"""The vocabulary of the node's resources: partitions, what an owner may ask for, and where
one instance sits.

A ``Partition`` is a piece of the node handed to one owner (a model) by the
``ResourceManager`` (``placement.resources``), which alone carves them. An owner asks with
one of three requests:

- ``Cpus(n)``: ``n`` CPUs for one instance (fixed placement without configured cpus);
- ``ExactCpus(cpus, share)``: exactly these CPUs (a model config's ``cpus``);
- ``CoreBudget(n)``: ``n`` CPUs that the owner divides among its instances itself (Packrat);
- ``Carved(cpus)``: one of the node's own partitions (PROTEAN's slices: ``partitioning`` other
  than none), which models then join with ``OnPartition(id)`` to co-locate their instances.

An ``InstancePlacement`` is one instance's shape inside a partition: ⟨threads, batch, cpus⟩.
Everything here is an immutable value; nothing reads the machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from splitserve.errors import InvalidInput
from splitserve.types import Choice


class Partitioning(Choice, what="partitioning"):
    """How the node carves its worker cores into partitions (``ServerConfig.protean.partitioning``)."""

    NONE = "none"  # no partitions: each model is placed by its own placer (fixed or Packrat)
    STATIC = "static"  # ``geometry`` core counts, fixed for the node's life unless an operator changes it
    COLOCATE = "colocate"  # one partition of every worker core, shared by all models (INFless/Llama, Molecule)
    PROTEAN = "protean"  # PROTEAN's geometries (4g,2g,1g)/(4g,3g) with >= 7 worker cores, else a static split


class StrictPlacement(Choice, what="strict_placement"):
    """Which partition a batch goes to (``ServerConfig.protean.strict_placement``)."""

    AUTO = "auto"  # eta under protean, balanced under static and colocate
    ETA = "eta"  # PROTEAN's Algorithm 1: rt to the least predicted slowdown among partitions not taken by be
    LARGEST = "largest"  # the smart-static straw man: rt always on the largest partition, be on the others
    BALANCED = "balanced"  # naive slicing: the partition with the most free memory, whatever the class

    def resolve(self, partitioning: Partitioning) -> "StrictPlacement":
        """The policy ``auto`` stands for under ``partitioning``."""
        if self is not StrictPlacement.AUTO:
            return self
        return StrictPlacement.ETA if partitioning is Partitioning.PROTEAN else StrictPlacement.BALANCED


class PartitionKind(str, Enum):
    """What a partition of the ``ResourceManager`` is made of. Only CPU sets are handed out
    today; a node's GPUs and MIG slices are listed read-only (``placement.mig``,
    ``GET /v2/partitions``' ``gpus``) and become kinds of their own when workers are placed
    on them (``CUDA_VISIBLE_DEVICES`` per partition)."""

    CPUS = "cpus"


def cpu_list(cpus: Iterable[int]) -> str:
    """CPU ids in the kernel's list form (``0-3,8``), as ``Cpus_allowed_list`` writes them."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out) or "none"


@dataclass(frozen=True)
class Cpus:
    """``count`` CPUs for one instance: on one socket whenever a socket has that many free,
    else spread over the fullest sockets (logged), never on a CPU another partition holds."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidInput(f"a request for {self.count} CPUs: ask for at least 1")

    def describe(self) -> str:
        """Words for error messages and the snapshot."""
        return f"{self.count} CPUs"


@dataclass(frozen=True)
class SharedCpus:
    """``count`` CPUs for one instance from the node's shared pool: CPUs that no unshared
    partition holds, the least shared first. Such a partition is shared with every other
    shared one (fixed placement's default, ``ServerConfig.packrat.fixed_cpus_shared``: small models
    share cores among themselves, never with Packrat's budgets or an unshared ``ExactCpus``)."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidInput(f"a request for {self.count} CPUs: ask for at least 1")

    def describe(self) -> str:
        """Words for error messages and the snapshot."""
        return f"{self.count} shared CPUs"


@dataclass(frozen=True)
class CoreBudget:
    """``count`` CPUs that the owner places its instances inside (Packrat's T), taken like
    ``Cpus`` so that a budget that fits one socket stays on one socket."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidInput(f"a budget of {self.count} cores: ask for at least 1")

    def describe(self) -> str:
        """Words for error messages and the snapshot."""
        return f"a budget of {self.count} cores"


@dataclass(frozen=True)
class ExactCpus:
    """Exactly ``cpus`` (a model config's ``cpus``).

    The sharing rule: a CPU may sit in two partitions only when *both* asked to share it.
    Without ``share`` the request is refused if any of its CPUs is held by another
    partition; with ``share`` it is refused only if one of them is held by a partition that
    did not ask to share (an owner that wanted its cores to itself is never joined). A shared
    partition's CPUs are never handed out by ``Cpus`` or ``CoreBudget``.
    """

    cpus: frozenset[int]
    share: bool = False

    def __post_init__(self) -> None:
        if not self.cpus:
            raise InvalidInput("a request for an empty set of CPUs: name at least one")
        if min(self.cpus) < 0:
            raise InvalidInput(f"CPUs {cpu_list(self.cpus)}: CPU numbers cannot be negative")

    def describe(self) -> str:
        """Words for error messages and the snapshot."""
        return f"CPUs {cpu_list(self.cpus)}" + (" (shared)" if self.share else "")


@dataclass(frozen=True)
class Carved:
    """One of the node's own partitions (``partitioning`` other than none), carved at start or
    by a geometry change. Its CPUs are nobody else's: ``Cpus``, ``SharedCpus``, ``CoreBudget``
    and ``ExactCpus`` never get them. A new geometry's partitions may overlap the old one's
    while the change switches the instances over (both sets run briefly on the same cores)."""

    cpus: frozenset[int]

    def __post_init__(self) -> None:
        if not self.cpus:
            raise InvalidInput("a partition needs at least one CPU")

    def describe(self) -> str:
        """Words for error messages and the snapshot."""
        return f"node partition on CPUs {cpu_list(self.cpus)}"


@dataclass(frozen=True)
class OnPartition:
    """A model's place on the node partition ``partition`` (a ``Carved`` one, whose CPUs it
    gets): several models join one partition, so their instances co-locate there (PROTEAN's
    MPS-style sharing of a slice)."""

    partition: int

    def describe(self) -> str:
        """Words for error messages and the snapshot."""
        return f"a place on node partition {self.partition}"


CpuRequest = Cpus | SharedCpus | CoreBudget | ExactCpus | Carved | OnPartition


@dataclass(frozen=True)
class Partition:
    """A piece of the node held by one owner until it releases it.

    ``shared`` is true only for a ``SharedCpus`` request and an ``ExactCpus`` request that
    asked to share; every other partition's CPUs belong to it alone.
    """

    id: int
    owner: str
    kind: PartitionKind
    cpus: frozenset[int]
    request: CpuRequest

    @property
    def shared(self) -> bool:
        """Whether another shared partition may hold the same CPUs."""
        return isinstance(self.request, SharedCpus) or (isinstance(self.request, ExactCpus) and self.request.share)

    @property
    def per_instance(self) -> bool:
        """Made for one instance: it goes back to the node when that instance is unplaced."""
        return isinstance(self.request, (Cpus, SharedCpus))


@dataclass(frozen=True)
class InstancePlacement:
    """One model instance's shape: ``threads`` intra-op threads, batches of at most ``batch``,
    pinned to ``cpus``.

    ``shared`` says the instance may sit on a CPU that another shared instance holds: the
    instances of a shared partition, and those a config wraps onto fewer CPUs than its
    instances need (``cpus`` may then hold fewer ids than ``threads``). Every other instance
    has its CPUs to itself. ``partition`` names the node partition (``Carved``) the instance
    sits on, -1 when the node has none: two placements on equal CPUs of different node
    partitions differ, so a geometry change moves every instance onto its new partition.
    """

    threads: int
    batch: int
    cpus: frozenset[int]
    shared: bool = False
    partition: int = -1

    def __post_init__(self) -> None:
        if self.threads < 1 or self.batch < 1 or not self.cpus:
            raise InvalidInput(
                f"an instance needs threads >= 1, batch >= 1 and at least one CPU "
                f"(got threads={self.threads}, batch={self.batch}, cpus {cpu_list(self.cpus)})"
            )

    def clashes(self, other: InstancePlacement) -> frozenset[int]:
        """The CPUs that ``self`` and ``other`` may not both hold at once (empty when both share)."""
        if self.shared and other.shared:
            return frozenset()
        return self.cpus & other.cpus

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        out: dict[str, Any] = {"threads": self.threads, "batch": self.batch, "cpus": sorted(self.cpus),
                               "shared": self.shared}
        if self.partition >= 0:
            out["partition"] = self.partition
        return out


@dataclass(frozen=True)
class NodePartition:
    """One partition of the node: the ``ResourceManager``'s ``Carved`` partition ``id``, its
    CPUs and its memory budget (what Algorithm 1's fits and tags use)."""

    id: int
    cpus: frozenset[int]
    mem_bytes: int

    @property
    def cores(self) -> int:
        return len(self.cpus)


class PartitionSource(Protocol):
    """The node's partitions as a model's ``placer.PartitionPlacer`` reads them when it places
    instances (``protean.partitions.PartitionManager``; a list in tests)."""

    partitioning: Partitioning
    warm: int  # warm instances per partition per model

    def current(self) -> Sequence[NodePartition]:
        """The partitions new instances go on (the newest geometry's)."""
