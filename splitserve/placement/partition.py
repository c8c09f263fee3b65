"""The vocabulary of the node's resources: partitions, what an owner may ask for, and where
one instance sits.

A ``Partition`` is a piece of the node handed to one owner (a model) by the
``ResourceManager`` (``placement.resources``), which alone carves them. An owner asks with
one of three requests:

- ``Cpus(n)``: ``n`` CPUs for one instance (fixed placement without configured cpus);
- ``ExactCpus(cpus, share)``: exactly these CPUs (a model config's ``cpus``);
- ``CoreBudget(n)``: ``n`` CPUs that the owner divides among its instances itself (Packrat).

An ``InstancePlacement`` is one instance's shape inside a partition: ⟨threads, batch, cpus⟩.
Everything here is an immutable value; nothing reads the machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from splitserve.errors import InvalidInput


class PartitionKind(str, Enum):
    """What a partition is made of. Only CPU sets exist today; a whole GPU and an existing
    GPU slice (a MIG device) become kinds of their own when the GPU allocator arrives."""

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
    shared one (fixed placement's default, ``ServerConfig.fixed_cpus_shared``: small models
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


CpuRequest = Cpus | SharedCpus | CoreBudget | ExactCpus


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
    has its CPUs to itself.
    """

    threads: int
    batch: int
    cpus: frozenset[int]
    shared: bool = False

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
        return {"threads": self.threads, "batch": self.batch, "cpus": sorted(self.cpus), "shared": self.shared}
