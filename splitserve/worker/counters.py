"""A worker's direct-path counters: words in its preemption page (``preempt_flag``) past
the flag's own, written by the worker and read by the front end, plus the admission
limit the front end sets and the worker enforces.

The worker serves its direct connections without telling the front end call by call
(that hand-off is what the direct path removes), so this page is how the front end keeps
its view (statistics, /metrics, the runtime's load) and its authority (admission). Each
word has one writer; aligned 8-byte stores are whole on the hosts splitserve runs on, and
a reader that sees a counter one call behind is only as stale as any statistics.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum

# Byte offset of the counters in the page: the preemption flag uses the words before it.
COUNTERS_OFFSET = 256


class Word(IntEnum):
    """The counters' words (u64). The worker writes those before ADMIT, and zeroes them when
    it binds a model (they count per binding); the front end writes ADMIT and BELL."""

    RECEIVED = 0  # direct calls accepted (a header that passed the checks)
    ANSWERED = 1  # answered with a result
    FAILED = 2  # answered with an error (deadline, refused, bad size, ...)
    IN_FLIGHT_RT = 3  # accepted, not yet answered, real-time
    IN_FLIGHT_BE = 4  # accepted, not yet answered, best-effort
    BUSY_NS = 5  # time spent running direct batches
    BATCHES = 6  # direct batches run
    SAMPLES = 7  # samples in those batches (the holes of slow frames included)
    CONNECTIONS = 8  # direct connections open now
    RT_RUNNING = 9  # 1 while a direct real-time batch runs (the CPUs it claims are its instance's)
    PREEMPTED = 10  # direct best-effort batches stopped at a segment boundary (REEF)
    ADMIT = 11  # front end -> worker: calls the worker may hold from direct connections (0: none)
    BELL = 12  # front end -> worker: 1 while real-time and best-effort work share the node: ring on RT start and end


_WORDS = len(Word)
_U64 = struct.Struct("<q")  # signed: an in-flight word goes down as well as up
_ZEROS = struct.Struct(f"<{int(Word.ADMIT)}q")


@dataclass(frozen=True, slots=True)
class DirectCounts:
    """A snapshot of one worker's counters, or a sum of several."""

    received: int = 0
    answered: int = 0
    failed: int = 0
    in_flight_rt: int = 0
    in_flight_be: int = 0
    busy_ns: int = 0
    batches: int = 0
    samples: int = 0
    connections: int = 0
    rt_running: int = 0
    preempted: int = 0

    def __add__(self, other: "DirectCounts") -> "DirectCounts":
        return DirectCounts(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.received, self.answered, self.failed, self.in_flight_rt, self.in_flight_be, self.busy_ns,
                self.batches, self.samples, self.connections, self.rt_running, self.preempted)

    def finished(self) -> "DirectCounts":
        """What stays counted once the worker is gone: its totals, with nothing open."""
        return DirectCounts(self.received, self.answered, self.failed, 0, 0, self.busy_ns, self.batches,
                            self.samples, 0, 0, self.preempted)

    def to_dict(self) -> dict[str, int]:
        return {"received": self.received, "answered": self.answered, "failed": self.failed,
                "in_flight_rt": self.in_flight_rt, "in_flight_be": self.in_flight_be, "busy_ns": self.busy_ns,
                "batches": self.batches, "samples": self.samples, "connections": self.connections,
                "rt_running": self.rt_running, "preempted": self.preempted}


class WorkerCounters:
    """The counters in ``page`` (a worker's preemption page, mapped by both processes)."""

    def __init__(self, page: mmap.mmap) -> None:
        if len(page) < COUNTERS_OFFSET + 8 * _WORDS:
            raise ValueError(f"a {len(page)} B page has no room for the direct counters")
        # struct, not a numpy view: an exported buffer would keep the page from being unmapped
        self._page = page
        # The worker's words as the worker last wrote them (it is their only writer), so
        # counting is one store, not a load and a store.
        self._mine = list(_ZEROS.unpack_from(page, COUNTERS_OFFSET))

    def reset(self) -> None:
        """Worker: a new binding counts from zero (the admission limit stays the front end's)."""
        self._mine = [0] * Word.ADMIT
        _ZEROS.pack_into(self._page, COUNTERS_OFFSET, *self._mine)

    def add(self, word: Word, n: int = 1) -> None:
        """Worker: count ``n`` more on one of its own words."""
        v = self._mine[word] = self._mine[word] + n
        _U64.pack_into(self._page, COUNTERS_OFFSET + 8 * word, v)

    def value(self, word: Word) -> int:
        """Worker: one of its own words."""
        return self._mine[word]

    def sub(self, word: Word, n: int = 1) -> None:
        self.add(word, -n)

    def set(self, word: Word, value: int) -> None:
        if word < Word.ADMIT:
            self._mine[word] = value
        _U64.pack_into(self._page, COUNTERS_OFFSET + 8 * word, value)

    def admit(self) -> int:
        return _U64.unpack_from(self._page, COUNTERS_OFFSET + 8 * Word.ADMIT)[0]

    def set_admit(self, calls: int) -> None:
        """Front end: the calls the worker may hold from its direct connections."""
        self.set(Word.ADMIT, calls)

    def bell(self) -> bool:
        return bool(_U64.unpack_from(self._page, COUNTERS_OFFSET + 8 * Word.BELL)[0])

    def set_bell(self, on: bool) -> None:
        """Front end: ring on direct real-time batches (both classes are about on the node)."""
        self.set(Word.BELL, int(on))

    def snapshot(self) -> DirectCounts:
        return DirectCounts(*_ZEROS.unpack_from(self._page, COUNTERS_OFFSET))
