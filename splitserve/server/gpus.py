"""The node's GPUs as ``GET /v2/partitions`` shows them (its ``gpus`` section), read through
NVML off the event loop.

NVML calls can take a while (the library loads, the driver answers per device), so no
request waits on them: ``GpuInventory`` reads at start in a thread, and a request that
finds the listing older than ``gpu_listing_max_age_s`` gets the one it has while a single
re-read runs in the background. Read-only: the node never changes a MIG geometry (that is
``splitserve gpus plan --apply``, for an administrator).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from splitserve.placement.mig import GpuListing

log = logging.getLogger(__name__)


def mps_active(environ: Mapping[str, str] = os.environ) -> bool:
    """An administrator runs CUDA MPS on this node: its control daemon's pipe is there
    (``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``). Detected and reported only:
    splitserve never starts, stops or configures MPS (``docs/gpu.md``)."""
    return (Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps") / "control").exists()


class GpuInventory:
    """The management's ``ports.GpuView``: the newest GPU listing and how old it is.

    ``read`` lists the GPUs (``placement.gpus.MigDriver.list`` on a node; a stub in tests);
    it runs in a thread, one read at a time."""

    def __init__(self, read: Callable[[], GpuListing], max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read = read
        self.max_age_s = max_age_s
        self.clock = clock
        self.listing: GpuListing | None = None  # None until the first read lands
        self.mps: bool | None = None  # CUDA MPS runs here (``mps_active``), read with the listing
        self.read_at: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Begin the first read (on the running loop, in a thread): start-up does not wait for it."""
        self._refresh()

    def _refresh(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._read(), name="gpu-listing")

    async def _read(self) -> None:
        try:
            listing = await asyncio.to_thread(self.read)
        except Exception as e:  # a listing that fails says why instead of breaking /v2/partitions
            log.warning("GPU listing failed: %s", e)
            listing = GpuListing(reason=f"no GPUs (listing failed: {e})")
        self.mps = await asyncio.to_thread(mps_active)
        self.listing, self.read_at = listing, self.clock()

    def current(self) -> GpuListing:
        """The listing to hand GPUs out from (``placement.devices.DeviceAssigner``): the last
        one read, or, when a GPU model binds before the first read landed, one read now (on
        the caller's thread: once, at start, and only on a node serving a GPU model)."""
        if self.listing is None:
            self.listing, self.read_at = self.read(), self.clock()
        return self.listing

    def snapshot(self) -> dict[str, Any]:
        """The listing (``mig.GpuListing.to_dict``) with ``age_s``; a stale one starts a re-read."""
        if self.listing is None or self.read_at is None:
            return {"gpus": [], "reason": "not read yet", "age_s": None}
        age = self.clock() - self.read_at
        if age > self.max_age_s:
            self._refresh()
        return {**self.listing.to_dict(), "mps": self.mps, "age_s": age}

    async def stop(self) -> None:
        """Wait for a read under way (NVML calls cannot be interrupted; they end on their own)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
