"""Tensor queues: rings of fixed-size slots in shared memory, mapped twice back to back.

A ``TensorQueue`` holds one input or output tensor of one model, one slot per sample. The
ring's memory (a memfd) is mapped at ``base`` and again at ``base + size``, so the slots
``[s, s + n)`` are one contiguous buffer even when ``s + n`` passes the end of the ring:
a batch of consecutive requests is a single tensor view with no gather copy. The front end
and the worker map the same memfd; only slot numbers cross the process boundary.

``SlotRing`` is the allocator (front end only): slots are handed out in arrival order and
freed in any order, and the tail only moves past a slot after its response has been sent.
Because the tail only moves in order, one allocation that is never freed (a request whose
sender went quiet) would pin the whole ring; ``SlotRing.plan_room`` names the allocations at
the tail that the front end may move aside to make room (see ``server/intake.py``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from splitserve.errors import QueueFull

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_PROT_NONE = 0
PAGE = mmap.PAGESIZE


def slot_granularity(slot_bytes: int) -> int:
    """Smallest slot count whose ring size is a whole number of pages (needed to map twice)."""
    return PAGE // math.gcd(slot_bytes, PAGE)


def ring_slots(slot_sizes: list[int], wanted: int) -> int:
    """A slot count >= wanted that suits every tensor of a model (they share slot numbers)."""
    g = 1
    for s in slot_sizes:
        g = math.lcm(g, slot_granularity(s))
    return max(g, -(-wanted // g) * g)


def _check(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return addr


class TensorQueue:
    """One ring of ``nslots`` slots of ``slot_bytes`` each, double-mapped.

    Create it in the front end (``fd=None`` makes a new memfd); a worker attaches with the
    inherited ``fd``. ``close`` unmaps; views taken before must not be used afterwards.
    """

    def __init__(self, slot_bytes: int, nslots: int, fd: int | None = None, name: str = "tq") -> None:
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.size = slot_bytes * nslots
        if self.size % PAGE:
            raise ValueError(f"ring of {nslots}x{slot_bytes} B is not a whole number of pages; use ring_slots()")
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create(f"splitserve-{name}", os.MFD_CLOEXEC)
            os.ftruncate(fd, self.size)
        self.fd = fd
        self.base = 0
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        try:
            # Reserve 2x the address space first so the two MAP_FIXED mappings cannot land
            # on anything else, then map the same file into each half.
            base = _check(_mmap(None, 2 * self.size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0),
                          "reserve")
            try:
                for half in (0, self.size):
                    _check(_mmap(base + half, self.size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0), "map ring")
            except OSError:
                _munmap(base, 2 * self.size)
                raise
        except OSError:
            if self.owner:
                os.close(fd)
            raise
        self.base = base
        self._cbuf = (ctypes.c_char * (2 * self.size)).from_address(base)
        self._mv = memoryview(self._cbuf).cast("B")
        self._bytes = np.frombuffer(self._mv, dtype=np.uint8)

    def address(self, slot: int) -> int:
        """Virtual address of ``slot`` (taken modulo the ring) in the first mapping."""
        return self.base + (slot % self.nslots) * self.slot_bytes

    def view(self, slot: int, count: int = 1) -> memoryview:
        """Writable bytes of ``count`` consecutive slots starting at ``slot``; never copies."""
        if not 0 < count <= self.nslots:
            raise ValueError(f"count {count} out of range 1..{self.nslots}")
        start = (slot % self.nslots) * self.slot_bytes
        return self._mv[start : start + count * self.slot_bytes]

    def array(self, slot: int, count: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """``count`` consecutive slots as one array of shape ``(count, *shape)``; never copies."""
        start = (slot % self.nslots) * self.slot_bytes
        raw = self._bytes[start : start + count * self.slot_bytes]
        return raw.view(dtype).reshape((count, *shape))

    def close(self) -> None:
        """Unmap and close the memfd. If arrays over the ring are still alive the mapping is
        left in place (unmapping it would turn their next access into a crash), and the rest
        of the shutdown goes on."""
        if self.base:
            self._bytes = None  # type: ignore[assignment]
            try:
                self._mv.release()
            except BufferError:
                log.warning("tensor queue of %d B still has live views at close; leaving it mapped", self.size)
            else:
                _munmap(self.base, 2 * self.size)
            self.base = 0
        if self.owner and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotRing:
    """Arrival-order slot allocator over a ring of ``nslots`` (pure; front end only).

    Slots are named by a monotonically increasing *sequence number*; the ring slot is
    ``seq % nslots``. Consecutive sequence numbers are contiguous memory, which is what the
    scheduler relies on to form zero-copy batches.
    """

    def __init__(self, nslots: int) -> None:
        self.nslots = nslots
        self.head = 0  # next sequence number to hand out
        self.tail = 0  # oldest sequence number not yet freed
        self._freed: set[int] = set()  # freed seqs that the tail has not passed yet

    @property
    def in_use(self) -> int:
        return self.head - self.tail

    @property
    def free(self) -> int:
        return self.nslots - self.in_use

    def alloc(self, count: int = 1) -> int:
        """Hand out ``count`` consecutive slots; raises QueueFull when the ring has no room."""
        if count > self.free:
            raise QueueFull(f"tensor queue full ({self.in_use}/{self.nslots} slots in use)")
        seq = self.head
        self.head += count
        return seq

    def plan_room(self, count: int, movable: Mapping[int, int]) -> list[int] | None:
        """The allocations to free so that ``count`` slots fit, oldest first; None if that
        cannot be done by freeing only ``movable`` ones.

        ``movable`` maps the first sequence number of each allocation the caller could free
        now (requests still arriving, whose bytes can go elsewhere) to its slot count. The
        walk starts at the tail: slots already freed are passed over, a movable allocation is
        planned and skipped, and anything else (a request queued or running) ends the walk,
        since the tail can never pass it before it completes.
        """
        if count > self.nslots:
            return None
        plan: list[int] = []
        t = self.tail
        while self.nslots - (self.head - t) < count:
            if t in self._freed:
                t += 1
            elif t in movable:
                plan.append(t)
                t += movable[t]
            else:
                return None
        return plan

    def release(self, seq: int, count: int = 1) -> None:
        """Free slots ``[seq, seq+count)`` (after their response was sent); any order."""
        for s in range(seq, seq + count):
            if not self.tail <= s < self.head or s in self._freed:
                raise RuntimeError(f"slot seq {s} released twice or never allocated")
            self._freed.add(s)
        while self.tail in self._freed:
            self._freed.discard(self.tail)
            self.tail += 1
