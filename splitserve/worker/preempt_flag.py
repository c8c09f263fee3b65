"""The preemption flag: one page of shared memory per worker, mapped by both processes.

Words (u64, little-endian):
  0: id of the batch to stop at its next segment boundary (0 = none)
  1: CLOCK_MONOTONIC ns when word 0 was raised (for the preemption latency)
  2: padding deadline in CLOCK_MONOTONIC ns (0 = none): a best-effort batch may start a
     segment only if its expected time ends before this (REEF's padding rule 1, adapted)
  3: 1 while the worker's own direct best-effort batches are held for real-time work (the
     coordinator's ``DIRECT_BATCH``). A word apart from 0: a front-end batch on the same
     worker may be preempted, and its flag lowered, while a direct batch stays held.

The worker reads it between segments (REEF's lazy eviction: no signal, no interrupt). The
rest of the page, and the pages after it, hold the worker's direct-path counters
(``worker/counters.py``).
"""

from __future__ import annotations

import mmap
import os
import struct
import time

from splitserve.worker.counters import PAGE_BYTES

_U64 = struct.Struct("<Q")
_GATE = struct.Struct("<QQ")  # words 2 and 3: the padding deadline, the direct hold


class PreemptFlag:
    def __init__(self, fd: int | None = None) -> None:
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create("splitserve-preempt", os.MFD_CLOEXEC)
            os.ftruncate(fd, PAGE_BYTES)
        self.fd = fd
        self._mm = mmap.mmap(fd, PAGE_BYTES)

    @property
    def page(self) -> mmap.mmap:
        """The whole shared page (its words past the flag's hold the direct counters)."""
        return self._mm

    def raise_for(self, batch_id: int) -> None:
        """Ask the worker to stop ``batch_id`` at its next segment boundary."""
        # Time first, id second: the worker reads the id, so the time is valid when it looks.
        _U64.pack_into(self._mm, 8, time.monotonic_ns())
        _U64.pack_into(self._mm, 0, batch_id)

    def clear(self) -> None:
        _U64.pack_into(self._mm, 0, 0)

    def target(self) -> int:
        return _U64.unpack_from(self._mm, 0)[0]

    def raised_at_ns(self) -> int:
        return _U64.unpack_from(self._mm, 8)[0]

    def hold_direct(self, held: bool) -> None:
        """Hold the worker's direct best-effort batches at their next segment boundary, or let them go."""
        _U64.pack_into(self._mm, 24, int(held))

    def direct_gate(self) -> tuple[int, int]:
        """(the padding deadline, the direct hold) in one read: a direct best-effort batch
        looks at both before each segment."""
        return _GATE.unpack_from(self._mm, 16)

    def set_padding_deadline(self, deadline_ns: int) -> None:
        """Best-effort segments must end by ``deadline_ns`` (0 lifts the limit)."""
        _U64.pack_into(self._mm, 16, deadline_ns)

    def padding_deadline(self) -> int:
        return _U64.unpack_from(self._mm, 16)[0]

    def close(self) -> None:
        self._mm.close()
        if self.owner:
            os.close(self.fd)
