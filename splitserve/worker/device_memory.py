"""What a load holds in device memory, measured in the worker around it.

CUDA's caching allocator keeps freed blocks for reuse, so what a model takes from its GPU
is what the allocator *reserved* for it, not only what its tensors occupy now
(``allocated``): the difference is the allocator's slack, and the budget must count it,
since no other process can use those bytes until ``empty_cache`` returns them. The charge
is the reserved growth (never less than the allocated growth), measured after the
weights, a warm-up batch at the largest batch size and the CUDA graphs' private pools.
The CUDA context itself (a few hundred MiB per process, outside the allocator) is the
worker's, not the model's, and is not charged here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["AllocatorStats", "DeviceMemoryUse", "TorchAllocator", "load_charge"]


class AllocatorStats(Protocol):
    """The caching allocator's counters for the worker's device (``TorchAllocator``)."""

    def allocated(self) -> int: ...

    def reserved(self) -> int: ...


@dataclass(frozen=True, slots=True)
class DeviceMemoryUse:
    """The allocator's counters at one moment."""

    allocated: int
    reserved: int

    @classmethod
    def now(cls, stats: AllocatorStats) -> "DeviceMemoryUse":
        return cls(stats.allocated(), stats.reserved())


def load_charge(before: DeviceMemoryUse, after: DeviceMemoryUse) -> tuple[int, int]:
    """(bytes to charge, of which the allocator's slack) for what happened between ``before``
    and ``after``: the reserved growth, at least the allocated growth."""
    allocated = max(0, after.allocated - before.allocated)
    charge = max(allocated, after.reserved - before.reserved)
    return charge, charge - allocated


class TorchAllocator:
    """``AllocatorStats`` of one torch CUDA device."""

    def __init__(self, device: object) -> None:
        self.device = device

    def allocated(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        import torch

        return int(torch.cuda.memory_reserved(self.device))
