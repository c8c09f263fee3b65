"""PROTEAN's view of a node's MIG devices: Algorithm 1's slots, and the slowdown model that
ranks them by each MIG profile's own measurements. Pure: the partitions and the profile
source come in.

A MIG device is a slot whose ``shape`` is its MIG profile (``"1g.18gb"``): its solo times are
that profile's latency profile, its FBRs those fitted from co-location runs on that profile
(``placement.mig_profiler``), and its RDF is relative to the fastest profile the node has
(``SlowdownModel``). Its ``cores`` are its compute slices, which is what "ascending order of
resources" (Alg. 1 line 2) sorts a MIG GPU's slices by; its memory is the device's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from splitserve.placement.devices import GpuPartition
from splitserve.protean.distributor import Job, Slot
from splitserve.protean.slowdown import SlowdownModel

if TYPE_CHECKING:
    from splitserve.protean.partitions import ProteanProfileSource


def mig_slots(parts: Sequence[GpuPartition], running: Mapping[str, Sequence[Job]] | None = None) -> list[Slot]:
    """One slot per MIG device of ``parts`` (the node's partitions in NVML order, as
    ``devices.partitions_of`` lists them): its id is its index there (the ``N`` of
    ``cuda:N``), with the batches ``running`` on it (by device UUID). Whole GPUs are left
    out: they are not slices."""
    running = running or {}
    return [Slot(i, p.compute_slices, p.mem_bytes, tuple(running.get(p.uuid, ())), p.profile)
            for i, p in enumerate(parts) if p.profile is not None]


def mig_slowdown_model(profiles: ProteanProfileSource, models: Iterable[str], parts: Sequence[GpuPartition],
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
