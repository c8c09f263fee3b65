"""Models' measured sizes across restarts: the registry's ``kind="memory"`` profiles.

A worker measures what a model takes when it loads it (weights, and the anonymous memory
the load and a warm-up batch at max batch added: ``LoadedMsg``); the runtime saves that
here, and after a restart reads it back before the model's first load, so nothing is
measured twice (Rafiqi §3.4 persists its size estimates the same way). Before any
measurement a model's weights bytes come from its safetensors file's header.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from splitserve.errors import InvalidInput
from splitserve.memory.weights import header_bytes, weights_file
from splitserve.modelconfig import ArtifactKind
from splitserve.models.catalog import zoo_entry
from splitserve.placement.profiler import machine_id
from splitserve.registry import ModelRecord, Registry

log = logging.getLogger(__name__)

KIND = "memory"  # the profiles' kind


@dataclass(frozen=True, slots=True)
class MemoryFootprint:
    """What one residency of a model takes in the node's memory: its weights once (mapped
    from one file, so its instances share them) plus what each instance adds on top
    (activations at the largest batch, the runtime's own allocations)."""

    weights_bytes: int = 0
    private_bytes: int = 0  # per instance
    measured: bool = False  # False: from the weights file's header (or nothing known yet), not a LOADED report
    # Device bytes one GPU instance holds (its own copy of the weights, activations and the
    # caching allocator's slack: ``worker.device_memory``); 0 on the CPU or before a GPU load.
    device_bytes: int = 0

    def charge(self, instances: int) -> int:
        """Host bytes a residency with ``instances`` instances holds."""
        return self.weights_bytes + self.private_bytes * instances

    def device_charge(self, per_partition: Mapping[str, int]) -> dict[str, int]:
        """Device bytes per partition UUID, given how many instances each holds: every
        instance's copy counts (a CUDA context cannot map another's weights). Empty while no
        device size is known."""
        if not self.device_bytes:
            return {}
        return {dev: self.device_bytes * n for dev, n in per_partition.items() if n}


class FootprintStore(Protocol):
    """What a model's residency takes, kept across restarts (``footprints.RegistryFootprints``,
    over the registry's ``kind="memory"`` profiles). A runtime reads its model's when it is
    built and saves every new measurement."""

    def footprint(self, record: ModelRecord) -> MemoryFootprint:
        """The stored measurement for this version of the model, else its weights file's
        header bytes (private bytes unknown: 0), else nothing known (0, 0)."""

    def save(self, record: ModelRecord, footprint: MemoryFootprint, load_ms: float) -> None:
        """Persist a measured footprint and load time (off the loop; returns at once)."""


@functools.cache
def _zoo_state_bytes(arch: str) -> int:
    """Bytes of a seeded zoo model's state dict, from its skeleton (no init paid): what its
    weights file's header will say once its first load has written it. Imports torch, but only
    for a zoo model whose file no load has written yet (the front end never needs it otherwise)."""
    from splitserve.models.zoo import zoo_skeleton

    return sum(t.nbytes for t in zoo_skeleton(arch).state_dict().values())


class RegistryFootprints:
    """The ``FootprintStore`` of a node, over its registry (reads on the loop, as the
    runtime's other profile reads; writes in a thread)."""

    def __init__(self, registry: Registry, cache_dir: Path) -> None:
        self.registry = registry
        self.cache_dir = cache_dir
        self.machine = machine_id()
        self._writes: set[asyncio.Future] = set()

    def footprint(self, record: ModelRecord) -> MemoryFootprint:
        stored = self.registry.load_profile(record.name, self.machine, KIND)
        if stored is not None and stored.get("version") == record.version:
            return MemoryFootprint(int(stored["weights_bytes"]), int(stored["private_bytes"]), measured=True,
                                   device_bytes=int(stored.get("device_bytes", 0)))
        path = weights_file(record.config, record.path, self.cache_dir)
        if path is not None and path.is_file():
            try:
                return MemoryFootprint(header_bytes(path))
            except InvalidInput as e:  # its load will fail and say why; a size is not known
                log.warning("model %s: %s", record.name, e)
                return MemoryFootprint()
        art = record.config.artifact
        if path is not None and art.kind is ArtifactKind.ZOO and zoo_entry(str(art.arch)).pretrained is None:
            return MemoryFootprint(_zoo_state_bytes(str(art.arch)))
        return MemoryFootprint()  # TorchScript, export, or a trained model not trained yet: LOADED tells

    def save(self, record: ModelRecord, footprint: MemoryFootprint, load_ms: float) -> None:
        data = {"version": record.version, "weights_bytes": footprint.weights_bytes,
                "private_bytes": footprint.private_bytes, "device_bytes": footprint.device_bytes, "load_ms": load_ms}
        write = asyncio.ensure_future(asyncio.to_thread(self.registry.save_profile, record.name, self.machine, KIND,
                                                        data))
        self._writes.add(write)
        write.add_done_callback(self._written)

    def _written(self, write: asyncio.Future) -> None:
        self._writes.discard(write)
        if not write.cancelled() and write.exception() is not None:
            log.error("could not save a memory profile: %s", write.exception())

    async def flush(self) -> None:
        """Wait for the writes under way (before the registry closes)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
