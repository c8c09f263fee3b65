"""PROTEAN's view of a node's MIG devices: Algorithm 1's slots, the slowdown model that
ranks them by each MIG profile's own measurements, and the per-batch choice of an instance
by the device it holds (``MigBatchChooser``). Pure: the partitions, the devices the
instances hold and the profile source come in.

A MIG device is a slot whose ``shape`` is its MIG profile (``"1g.18gb"``): its solo times are
that profile's latency profile, its FBRs those fitted from co-location runs on that profile
(``placement.mig_profiler``), and its RDF is relative to the fastest profile the node has
(``SlowdownModel``). Its ``cores`` are its compute slices, which is what "ascending order of
resources" (Alg. 1 line 2) sorts a MIG GPU's slices by; its memory is the device's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from splitserve.placement.devices import GpuPartition
from splitserve.protean.distributor import Job, JobDistributor, Slot, tag_partitions
from splitserve.protean.slowdown import Shape, SlowdownModel
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import InstanceView
from splitserve.server.coordinator import Chosen


class MigProfiles(Protocol):
    """What MIG placement reads of the node's profiles (``protean.profiles.ProteanProfiles``)."""

    def solo(self, model: str, shape: Shape, batch: int) -> float | None:
        """Seconds one batch takes alone on a partition of ``shape`` (None: not profiled)."""

    def fbr(self, model: str, mig: str | None = None) -> float | None:
        """The model's fitted FBR on the MIG profile ``mig`` (None: not fitted)."""


def mig_slots(parts: Sequence[GpuPartition], running: Mapping[str, Sequence[Job]] | None = None) -> list[Slot]:
    """One slot per MIG device of ``parts`` (the node's partitions in NVML order, as
    ``devices.partitions_of`` lists them): its id is its index there (the ``N`` of
    ``cuda:N``), with the batches ``running`` on it (by device UUID). Whole GPUs are left
    out: they are not slices."""
    running = running or {}
    return [Slot(i, p.compute_slices, p.mem_bytes, tuple(running.get(p.uuid, ())), p.profile)
            for i, p in enumerate(parts) if p.profile is not None]


def mig_slowdown_model(profiles: MigProfiles, models: Iterable[str], parts: Sequence[GpuPartition],
                       unknown_fbr: float = 1.0) -> SlowdownModel:
    """Eq. 1 and 2 over the MIG devices of ``parts``: every model's stored solo times and FBRs
    per MIG profile there (a pair never fitted gets ``unknown_fbr``). It ranks MIG slots
    only; a core count given to it reads the CPU profiles as ``SlowdownModel`` does, over one
    core (a MIG node's PROTEAN does not place on core sets)."""
    profile_names = list(dict.fromkeys(p.profile for p in parts if p.profile is not None))
    fbr: dict[tuple[str, str], float] = {}
    for m in dict.fromkeys(models):
        for name in profile_names:
            value = profiles.fbr(m, name)
            if value is not None:
                fbr[(m, name)] = value
    return SlowdownModel(profiles.solo, {}, 1, unknown_fbr, mig_fbr=fbr, mig_profiles=profile_names)


class DeviceHolder(Protocol):
    """Which GPU partition an instance holds (``placement.devices.DeviceAssigner``)."""

    def held_by(self, owner: str, instance: int) -> str | None:
        """The UUID of the partition instance ``instance`` of ``owner`` holds (None: none)."""


class MigBatchChooser:
    """Algorithm 1 (η placement) over the node's MIG devices, for the batches of a model whose
    instances sit on them: the ``PartitionManager`` asks it first, and keeps the CPU
    partitions' choice for every other model.

    ``devices`` says which device each instance holds, ``partitions()`` lists the node's GPU
    partitions now (``devices.partitions_of`` over the inventory's listing), ``profiles``
    gives solo times and FBRs per MIG profile. The slowdown model is built per decision from
    the profile source's kept rows (dictionary reads), so a fit stored while the node runs is
    used once the source forgets the old rows. A strict batch never waits here for a busy
    device: on MIG co-located batches run side by side on their slices, and a device's
    instance being busy is what the autoscaler answers (the paper's choice, not the CPU
    node's wait-for-free)."""

    def __init__(self, devices: DeviceHolder, partitions: Callable[[], Sequence[GpuPartition]],
                 profiles: MigProfiles, unknown_fbr: float = 1.0) -> None:
        self.devices = devices
        self.partitions = partitions
        self.profiles = profiles
        self.unknown_fbr = unknown_fbr

    def _mig(self, parts: Sequence[GpuPartition]) -> dict[str, int]:
        """Slot id (index in ``parts``) by UUID, MIG devices only."""
        return {p.uuid: i for i, p in enumerate(parts) if p.profile is not None}

    def serves(self, model: str, instances: Iterable[int]) -> bool:
        """Whether one of ``model``'s ``instances`` holds a MIG device (a CPU model's hold
        nothing: the node's GPU listing is not read for them)."""
        held = {u for i in instances if (u := self.devices.held_by(model, i)) is not None}
        return bool(held) and not held.isdisjoint(self._mig(self.partitions()))

    def choose(self, job: Job, idle: Sequence[int], node: Sequence[InstanceView], be_mem: int,
               be_models: Sequence[str], mem: Callable[[str, int], int]) -> Chosen | None:
        """Which of ``job``'s model's ``idle`` instances takes it: the one on the MIG device
        Algorithm 1 picks among those they hold (η for a strict batch, first fit for a BE one),
        the batches ``node`` runs on each device counted (each at ``mem(model, batch)``
        bytes), tagged by the BE demand ``be_mem``; None: it waits."""
        parts = self.partitions()
        mig = self._mig(parts)
        running: dict[str, list[Job]] = {}
        for v in node:
            uuid = self.devices.held_by(v.model, v.instance) if v.running_cls is not None else None
            if uuid in mig:
                running.setdefault(uuid, []).append(Job(v.model, v.running_count, v.running_cls == RequestClass.RT,
                                                        mem(v.model, v.running_count), started=v.started))
        where = {i: mig[u] for i in idle if (u := self.devices.held_by(job.model, i)) in mig}
        if not where:
            return None
        slots = mig_slots(parts, running)
        models = {job.model, *be_models, *(r.model for jobs in running.values() for r in jobs)}
        distributor = JobDistributor(mig_slowdown_model(self.profiles, sorted(models), parts, self.unknown_fbr))
        tags = tag_partitions(slots, be_mem)
        slot = distributor.choose(job, slots, tags, set(where.values()), be_models)
        instance = next((i for i in idle if where.get(i) == slot), None)
        return Chosen(instance, tags.get(slot, 0.0)) if instance is not None and slot is not None else None
