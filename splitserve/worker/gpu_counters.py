"""A GPU worker's copy counters, in its preemption page past the direct counters: what its
GPU path moved (``GpuCopies``), written by the worker after each GPU batch and read by
the front end for the model's statistics (``gpu``). One writer; a reader one batch behind is
as stale as any statistics."""

from __future__ import annotations

import mmap
import struct
from dataclasses import asdict, astuple, dataclass, fields


@dataclass
class GpuCopies:
    """What a binding's GPU path moved: copies and bytes each way, batches and graph replays."""

    batches: int = 0
    h2d: int = 0
    d2h: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    graph_batches: int = 0

    def __add__(self, other: "GpuCopies") -> "GpuCopies":
        return GpuCopies(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# Past the direct counters (``counters.COUNTERS_OFFSET`` and their words) with room to spare.
GPU_OFFSET = 1024
_WORDS = struct.Struct(f"={len(fields(GpuCopies)) + 2}q")  # the copies, then pinned queues and graph sizes


def write_copies(page: mmap.mmap, copies: GpuCopies, pinned: int, graph_sizes: int) -> None:
    """Worker: its counts now, with how many of its queues are page-locked and how many
    batch sizes it replays as CUDA graphs."""
    _WORDS.pack_into(page, GPU_OFFSET, *astuple(copies), pinned, graph_sizes)


def read_copies(page: mmap.mmap) -> tuple[GpuCopies, int, int]:
    """Front end: (the copies, pinned queues, graph sizes) the worker last wrote."""
    *words, pinned, graphs = _WORDS.unpack_from(page, GPU_OFFSET)
    return GpuCopies(*words), pinned, graphs
