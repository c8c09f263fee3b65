"""A GPU model's statistics (``gpu``): each serving instance's GPU partition and what its
workers' GPU paths copied, workers gone included (read from their pages, ``worker.gpu_counters``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from splitserve.worker.gpu_counters import GpuCopies


class GpuWorker(Protocol):
    """A worker as the statistics read it (``worker.pool.WorkerHandle``)."""

    def gpu_copies(self) -> tuple[GpuCopies, int, int]:
        """(its GPU path's copies, its page-locked queues, its CUDA graph batch sizes)."""


class GpuStats:
    """What a GPU model's workers copied: the live ones' pages plus the workers gone."""

    def __init__(self) -> None:
        self.past = GpuCopies()

    def harvest(self, handle: GpuWorker) -> None:
        """A worker leaves the model (unloaded or gone): keep what its page counted."""
        self.past = self.past + handle.gpu_copies()[0]

    def snapshot(self, workers: Iterable[GpuWorker], partitions: list[str | None]) -> dict[str, Any]:
        """``partitions``: each serving instance's CUDA_VISIBLE_DEVICES (None: not assigned yet).
        ``copies_per_batch`` is the H2D and D2H copies per GPU batch (one per input and one
        per output tensor when the path is right)."""
        total, pinned, graphs = self.past, [], []
        for w in workers:
            copies, p, g = w.gpu_copies()
            total = total + copies
            pinned.append(p)
            graphs.append(g)
        per = {k: (getattr(total, k) / total.batches if total.batches else None) for k in ("h2d", "d2h")}
        return {"partitions": partitions, "copies": total.to_dict(), "copies_per_batch": per,
                "pinned_queues": pinned, "graph_sizes": graphs}
