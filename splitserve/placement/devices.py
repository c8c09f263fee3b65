"""Which GPU a model's worker gets: a model's ``device`` ("cpu", "cuda", "cuda:N") read
strictly, and the node's GPU partitions handed out per instance.

A GPU partition is what one worker may see: a whole GPU whose MIG mode is off, or one MIG
device of a GPU where MIG is on (a GPU with MIG on is never handed out whole: CUDA cannot
run on it, only on its MIG devices). The node lists them through NVML
(``placement.gpus.read_gpus``, read-only) and each worker is started on exactly one, by its
UUID in ``CUDA_VISIBLE_DEVICES``: inside the worker that partition is ``cuda:0``, whatever
its index on the node, and no other GPU of the node is visible to it.

``DeviceAssigner`` is the decider (no I/O: the listing is passed in): ``cuda:N`` is the
node's N-th partition in NVML order (GPU index, then MIG device), ``cuda`` is the partition
holding the fewest instances now (lowest first on a tie), so a model's instances spread
over the node's GPUs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.placement.mig import GpuListing

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d{1,3}))?")
# In the worker the one visible partition is always device 0.
WORKER_DEVICE = "cuda:0"


@dataclass(frozen=True)
class DeviceRequest:
    """A model's ``device`` field: ``kind`` "cpu" or "cuda", and a partition index (None: any)."""

    kind: str
    index: int | None = None

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"


def parse_device(text: str) -> DeviceRequest:
    """``cpu``, ``cuda`` or ``cuda:N``; InvalidInput naming the forms for anything else
    (``cuda:x``, ``cpu:1``, ``gpu``)."""
    m = _DEVICE.fullmatch(text)
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise InvalidInput(f"device {text!r}: use 'cpu', 'cuda' or 'cuda:N'")
    return DeviceRequest(m.group(1), None if m.group(2) is None else int(m.group(2)))


@dataclass(frozen=True)
class GpuPartition:
    """What one worker may be given: a whole GPU (MIG off) or one MIG device."""

    uuid: str  # what CUDA_VISIBLE_DEVICES takes: GPU-… or MIG-…
    gpu: int  # the physical GPU's NVML index
    name: str  # "NVIDIA H200" or "NVIDIA A100 … MIG 3g.20gb"
    mem_bytes: int
    profile: str | None = None  # a MIG device's profile ("3g.20gb"), what its latency profiles are keyed by
    compute_slices: int = 0  # a MIG device's compute slices (0: a whole GPU)


def partitions_of(listing: GpuListing) -> tuple[GpuPartition, ...]:
    """The listing's partitions in NVML order: a GPU with MIG on gives its MIG devices, one
    with MIG off (or without MIG) gives itself."""
    out: list[GpuPartition] = []
    for g in listing.gpus:
        if g.mig:
            out += [GpuPartition(s.uuid, g.index, f"{g.name} MIG {s.profile}", s.mem_bytes, s.profile,
                                 s.compute_slices) for s in g.slices]
        else:
            out.append(GpuPartition(g.uuid, g.index, g.name, g.mem_bytes))
    return tuple(out)


@dataclass(frozen=True)
class DeviceAssignment:
    """Where an instance runs: the partition, and the device its worker uses (``cuda:0``)."""

    partition: GpuPartition
    torch_device: str = WORKER_DEVICE

    @property
    def visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` for the worker: only this partition."""
        return self.partition.uuid


class DeviceAssigner:
    """Hands each GPU instance a partition of the node (see the module doc).

    ``listing`` returns the node's current GPU listing (``server.gpus.GpuInventory.current``);
    assignments last until ``release``; ``assign`` of an instance that holds one returns it
    again, so a worker restarted for the same instance lands on the same GPU."""

    def __init__(self, listing: Callable[[], GpuListing]) -> None:
        self.listing = listing
        self._held: dict[tuple[str, int], GpuPartition] = {}
        self._tokens: dict[str, int] = {}  # partition UUID -> its claim token (see ``claim``)

    def assign(self, owner: str, instance: int, device: str) -> DeviceAssignment | None:
        """The partition for instance ``instance`` of model ``owner`` on ``device`` (None for
        "cpu"); InvalidInput when the node has no such GPU, saying which it has or why none."""
        req = parse_device(device)
        if not req.cuda:
            return None
        held = self._held.get((owner, instance))
        if held is not None:
            return DeviceAssignment(held)
        chosen = self._choose(owner, device, req)
        self._held[(owner, instance)] = chosen
        return DeviceAssignment(chosen)

    def expected(self, owner: str, instance: int, device: str) -> str | None:
        """The UUID of the partition ``assign`` would hand this instance now, without taking
        it (what the memory manager charges a load before its workers bind); None on the
        CPU or when the node has no such GPU (its load will fail and say why)."""
        req = parse_device(device)
        if not req.cuda:
            return None
        held = self._held.get((owner, instance))
        if held is not None:
            return held.uuid
        try:
            return self._choose(owner, device, req).uuid
        except InvalidInput:
            return None

    def _choose(self, owner: str, device: str, req: DeviceRequest) -> GpuPartition:
        listing = self.listing()
        parts = partitions_of(listing)
        if not parts:
            raise InvalidInput(f"model {owner!r} asks for device {device!r}, but this node has "
                               f"{listing.reason or 'no GPUs'}")
        if req.index is not None:
            if req.index >= len(parts):
                names = ", ".join(f"cuda:{k} ({p.name})" for k, p in enumerate(parts))
                raise InvalidInput(f"model {owner!r} asks for device {device!r}; this node has {names}")
            chosen = parts[req.index]
        else:
            load = Counter(p.uuid for p in self._held.values())
            chosen = min(parts, key=lambda p: load[p.uuid])  # min keeps the first of equals: NVML order
        return chosen

    def release(self, owner: str, instance: int | None = None) -> None:
        """Forget one instance's partition, or (``instance`` None) all of ``owner``'s."""
        for key in [k for k in self._held if k[0] == owner and instance in (None, k[1])]:
            del self._held[key]

    def owners_on(self, uuids: Collection[str]) -> set[str]:
        """The models with an instance on any of the partitions ``uuids``."""
        return {owner for (owner, _), p in self._held.items() if p.uuid in uuids}

    def held_by(self, owner: str, instance: int) -> str | None:
        """The UUID of the partition instance ``instance`` of ``owner`` holds (None: none)."""
        p = self._held.get((owner, instance))
        return None if p is None else p.uuid

    def claim(self, owner: str, instance: int) -> frozenset[int]:
        """What instance ``instance`` of ``owner`` runs on besides its CPUs, in the node's
        REEF view (``scheduler.priority.InstanceView.cpus``): its GPU partition as one
        negative number, the same for every instance on that partition, so instances
        sharing a GPU interfere there as instances sharing a CPU do (real-time work on one
        preempts best-effort work on the other instead of padding beside it). Empty when
        it holds none."""
        p = self._held.get((owner, instance))
        if p is None:
            return frozenset()
        return frozenset((self._tokens.setdefault(p.uuid, -1 - len(self._tokens)),))

    def held(self) -> dict[str, int]:
        """Instances per partition UUID now (for listings)."""
        return dict(Counter(p.uuid for p in self._held.values()))
