"""The preemption flag: one page of shared memory per worker, mapped by both processes.

Word 0 holds the id of the batch to preempt (0 = none), word 1 the CLOCK_MONOTONIC time
in ns when it was raised, so the worker can report the preemption latency. The worker
reads it between segments (REEF's lazy eviction: no signal, no interrupt).
"""

from __future__ import annotations

import mmap
import os
import struct
import time

_WORDS = struct.Struct("<QQ")


class PreemptFlag:
    def __init__(self, fd: int | None = None) -> None:
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create("splitserve-preempt", os.MFD_CLOEXEC)
            os.ftruncate(fd, mmap.PAGESIZE)
        self.fd = fd
        self._mm = mmap.mmap(fd, mmap.PAGESIZE)

    def raise_for(self, batch_id: int) -> None:
        """Ask the worker to stop ``batch_id`` at its next segment boundary."""
        # Time first, id second: the worker reads the id, so the time is valid when it looks.
        self._mm[8:16] = struct.pack("<Q", time.monotonic_ns())
        self._mm[0:8] = struct.pack("<Q", batch_id)

    def clear(self) -> None:
        self._mm[0:8] = b"\0" * 8

    def target(self) -> int:
        return struct.unpack_from("<Q", self._mm, 0)[0]

    def raised_at_ns(self) -> int:
        return struct.unpack_from("<Q", self._mm, 8)[0]

    def close(self) -> None:
        self._mm.close()
        if self.owner:
            os.close(self.fd)
