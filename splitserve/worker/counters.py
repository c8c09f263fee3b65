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
import time
from array import array
from bisect import bisect_left
from dataclasses import asdict, astuple, dataclass, field, replace
from enum import IntEnum

from splitserve.errors import Status
from splitserve.slo import SloOutcome

# Byte offset of the counters in the page: the preemption flag uses the words before it.
COUNTERS_OFFSET = 256
# The direct batches run, by size, past the page's first 4 KiB: for each size n in
# 1..MAX_SIZES (``max_batch_size``'s bound) two words at 16 * (n - 1), the batches of that
# size and the ns they ran. The statistics' batch sizes and execution count are read from
# them alone, so the two always agree (Triton's sum of ``batch_stats`` is its execution count).
SIZES_OFFSET = 4096
MAX_SIZES = 4096
PAGE_BYTES = SIZES_OFFSET + 16 * MAX_SIZES  # the shared page's length (``PreemptFlag``)
# The direct calls answered, per class (real-time, then best-effort): a block of
# ``CALL_WORDS`` words each (``CallWord``, then one failure count per ``FAIL_STATUSES``).
# Triton's statistics of a call (``inference_stats``) are read from them, so a direct call
# is counted once, by the worker that answered it, with the times it measured.
CALLS_OFFSET = 1024


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
    SLO_MET = 11  # real-time calls with a soft SLO answered with their result by it (``splitserve.slo``)
    SLO_MISSED = 12  # answered with their result after it
    SLO_DROPPED = 13  # answered with an error
    ADMIT = 14  # front end -> worker: calls the worker may hold from direct connections (0: none)
    BELL = 15  # front end -> worker: 1 while real-time and best-effort work share the node: ring on RT start and end


_WORDS = len(Word)
# Indices of the words counted on every call, as plain ints (an enum member's lookup costs more)
_RECEIVED, _ANSWERED, _IN_FLIGHT_RT, _IN_FLIGHT_BE, _BUSY_NS, _BATCHES, _SAMPLES, _SLO_MET, _SLO_MISSED = (
    int(w) for w in (Word.RECEIVED, Word.ANSWERED, Word.IN_FLIGHT_RT, Word.IN_FLIGHT_BE, Word.BUSY_NS, Word.BATCHES,
                     Word.SAMPLES, Word.SLO_MET, Word.SLO_MISSED))
# Native order: the page never leaves the host, and the worker's words are an array('q')
# copied into it as they are (by ``flush``, and by the compiled lane after a batch)
_U64 = struct.Struct("=q")  # signed: an in-flight word goes down as well as up
_ZEROS = struct.Struct(f"={int(Word.ADMIT)}q")
_MINE_BYTES = _ZEROS.size
_SIZE = struct.Struct("=qq")
# The words a direct batch's answers count, in the order the compiled lane takes them (``lane_counts``)
_ANSWER_WORDS = tuple(int(w) for w in (Word.IN_FLIGHT_RT, Word.IN_FLIGHT_BE, Word.ANSWERED, Word.BUSY_NS,
                                       Word.BATCHES, Word.SAMPLES, Word.SLO_MET, Word.SLO_MISSED))


class CallWord(IntEnum):
    """A class's block of call words (u64, in the page at ``CALLS_OFFSET``). The compiled
    lane counts the first seven in this order and sets LAST_MS (``_directlane.c``, ``finish``)."""

    OK = 0  # calls answered with their result
    SAMPLES = 1  # their samples (Triton's inference_count: a hole's rows are not a call's)
    OK_NS = 2  # their durations, header in to answer out
    QUEUE_NS = 3  # header in to their batch's start
    INPUT_NS = 4  # their inputs' preparation (0 here: a payload is received into its rows)
    INFER_NS = 5  # their batch's model run
    OUTPUT_NS = 6  # their batch's outputs copied into the answer rows
    LAST_MS = 7  # when the last of them was answered (ms since the epoch: Triton's last_inference)
    FAIL_NS = 8  # calls answered with an error: their durations (counts by status follow)


# A failed call is counted by its status: one word per status past the block's CallWords
FAIL_STATUSES = tuple(Status)
CALL_WORDS = len(CallWord) + len(FAIL_STATUSES)
_FAIL_AT = {status: len(CallWord) + i for i, status in enumerate(FAIL_STATUSES)}
_CALLS = struct.Struct(f"={CALL_WORDS}q")
_ANSWERED_CALLS = struct.Struct(f"={int(CallWord.FAIL_NS)}q")  # the words answered calls count and set
_CALL_AT = (CALLS_OFFSET, CALLS_OFFSET + _CALLS.size)  # each class's block (indexed by the class: it is per batch)

# The durations of the direct calls answered, per class, as histograms: for each ``Duration``
# how many fell in each bucket of ``DURATION_BUCKETS_S`` (a value counts in the first bucket
# it is at most; the last bin holds those above them all). /metrics shows the front end's
# calls in the same buckets; the sums are the call block's.
DURATION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0)
DURATION_BOUNDS_NS = tuple(round(b * 1e9) for b in DURATION_BUCKETS_S)
BINS = len(DURATION_BOUNDS_NS) + 1


class Duration(IntEnum):
    """A direct call's durations that are binned (each a block of ``BINS`` words)."""

    REQUEST = 0  # header in to answer out (failed calls too, at their error)
    QUEUE = 1  # header in to its batch's start
    COMPUTE = 2  # its batch's model run and output copy


_HIST = struct.Struct(f"={len(Duration) * BINS}q")
DURATIONS_OFFSET = -(-(CALLS_OFFSET + 2 * _CALLS.size) // 64) * 64  # past the call blocks, cache-line aligned
_HIST_AT = (DURATIONS_OFFSET, DURATIONS_OFFSET + _HIST.size)  # each class's block
assert DURATIONS_OFFSET + 2 * _HIST.size <= SIZES_OFFSET, "the duration bins overlap the batch sizes"


def duration_bin(ns: int) -> int:
    """The bin a duration of ``ns`` counts in."""
    return bisect_left(DURATION_BOUNDS_NS, ns)


@dataclass(frozen=True, slots=True)
class DirectCalls:
    """One class's direct calls as a worker answered them (its ``CallWord`` block), or a sum."""

    ok: int = 0
    samples: int = 0
    ok_ns: int = 0
    queue_ns: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    last_ms: int = 0
    fail_ns: int = 0
    failures: tuple[int, ...] = (0,) * len(FAIL_STATUSES)  # by status, in ``FAIL_STATUSES``' order
    durations: tuple[int, ...] = (0,) * (len(Duration) * BINS)  # the bins of each ``Duration``, in order

    @classmethod
    def from_words(cls, words: tuple[int, ...], bins: tuple[int, ...]) -> "DirectCalls":
        head = len(CallWord)
        return cls(*words[:head], tuple(words[head:]), bins)

    def __add__(self, other: "DirectCalls") -> "DirectCalls":
        head = [a + b for a, b in zip(astuple(self)[:-2], astuple(other)[:-2])]
        head[CallWord.LAST_MS] = max(self.last_ms, other.last_ms)  # a time, not a count
        return DirectCalls(*head, tuple(a + b for a, b in zip(self.failures, other.failures)),
                           tuple(a + b for a, b in zip(self.durations, other.durations)))

    def bins(self, kind: Duration) -> tuple[int, ...]:
        """The calls in each bin of ``kind``'s histogram."""
        return self.durations[kind * BINS : (kind + 1) * BINS]

    def sum_ns(self, kind: Duration) -> int:
        """What the durations ``kind`` bins add up to."""
        if kind is Duration.REQUEST:
            return self.ok_ns + self.fail_ns
        return self.queue_ns if kind is Duration.QUEUE else self.infer_ns + self.output_ns

    @property
    def failed(self) -> int:
        return sum(self.failures)

    def failures_by_status(self) -> dict[Status, int]:
        """The failed calls by status (those with any)."""
        return {s: n for s, n in zip(FAIL_STATUSES, self.failures) if n}


# The word that counts each SLO outcome of a direct call.
SLO_WORDS = {SloOutcome.MET: Word.SLO_MET, SloOutcome.MISSED: Word.SLO_MISSED, SloOutcome.DROPPED: Word.SLO_DROPPED}


@dataclass(frozen=True, slots=True)
class DirectCounts:
    """A snapshot of one worker's counters (its words before ADMIT, in order), or a sum of several."""

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
    slo_met: int = 0
    slo_missed: int = 0
    slo_dropped: int = 0

    def __add__(self, other: "DirectCounts") -> "DirectCounts":
        return DirectCounts(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def finished(self) -> "DirectCounts":
        """What stays counted once the worker is gone: its totals, with nothing open."""
        return replace(self, in_flight_rt=0, in_flight_be=0, connections=0, rt_running=0)

    def slo(self) -> dict[SloOutcome, int]:
        """The SLO outcomes of its real-time calls."""
        return {SloOutcome.MET: self.slo_met, SloOutcome.MISSED: self.slo_missed,
                SloOutcome.DROPPED: self.slo_dropped}

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def add_sizes(a: dict[int, tuple[int, int]], b: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Two tallies of batches by size (size -> (batches, ns)) summed."""
    out = dict(a)
    for size, (n, ns) in b.items():
        n0, ns0 = out.get(size, (0, 0))
        out[size] = (n0 + n, ns0 + ns)
    return out


@dataclass(frozen=True, slots=True)
class DirectTally:
    """All one worker's page says (or a sum of several): its counters, its batches by size
    (size -> (batches, ns they ran)) and its answered calls per class (real-time, best-effort).
    The one read of the direct path that statistics and metrics take."""

    counts: DirectCounts = DirectCounts()
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)
    calls: tuple[DirectCalls, DirectCalls] = (DirectCalls(), DirectCalls())

    def __add__(self, other: "DirectTally") -> "DirectTally":
        return DirectTally(self.counts + other.counts, add_sizes(self.sizes, other.sizes),
                           (self.calls[0] + other.calls[0], self.calls[1] + other.calls[1]))

    def finished(self) -> "DirectTally":
        """What stays counted once the worker is gone (``DirectCounts.finished``)."""
        return replace(self, counts=self.counts.finished())

    def all_calls(self) -> DirectCalls:
        """Both classes' calls summed."""
        return self.calls[0] + self.calls[1]


class WorkerCounters:
    """The counters in ``page`` (a worker's preemption page, mapped by both processes)."""

    def __init__(self, page: mmap.mmap) -> None:
        if len(page) < PAGE_BYTES:
            raise ValueError(f"a {len(page)} B page has no room for the direct counters")
        # slices and struct, not a view: an exported buffer would keep the page from being unmapped
        self.page = page
        # The worker's words as the worker last counted them (it is their only writer), so
        # counting is one store, not a load and a store; ``flush`` copies them into the page.
        self.words = array("q", _ZEROS.unpack_from(page, COUNTERS_OFFSET))
        self._bytes = memoryview(self.words).cast("B")
        self._dirty = False

    def reset(self) -> None:
        """Worker: a new binding counts from zero (the admission limit stays the front end's)."""
        self._bytes[:] = bytes(_MINE_BYTES)
        self.page[CALLS_OFFSET : CALLS_OFFSET + 2 * _CALLS.size] = bytes(2 * _CALLS.size)
        self.page[DURATIONS_OFFSET : DURATIONS_OFFSET + 2 * _HIST.size] = bytes(2 * _HIST.size)
        self.page[SIZES_OFFSET:PAGE_BYTES] = bytes(PAGE_BYTES - SIZES_OFFSET)
        self._dirty = True
        self.flush()

    def add(self, word: Word, n: int = 1) -> None:
        """Worker: count ``n`` more on one of its own words. The page has it after the next
        ``flush``: a call counts several words, and one write of them all costs what one
        word's write does."""
        self.words[word] += n
        self._dirty = True

    def flush(self) -> None:
        """Worker: write what ``add`` counted since the last flush into the page (the worker
        flushes before a batch runs, before any answer leaves and before its loop waits)."""
        if self._dirty:
            self.page[COUNTERS_OFFSET : COUNTERS_OFFSET + _MINE_BYTES] = self._bytes
            self._dirty = False

    def accepted(self, in_flight: Word) -> None:
        """Worker: a call was accepted into ``in_flight`` (its class's word): one count of
        RECEIVED and one more in flight (one method, not two ``add``s: it is per call)."""
        mine = self.words
        mine[_RECEIVED] += 1
        mine[in_flight] += 1
        self._dirty = True

    def answered(self, in_flight: Word, calls: int, samples: int, busy_ns: int, dropped: int = 0,
                 slo_met: int = 0, slo_missed: int = 0) -> None:
        """Worker: a batch of ``samples`` ran for ``busy_ns``; of its class's ``in_flight``
        calls, ``calls`` were answered with their results (``slo_met`` and ``slo_missed`` of
        them by and after their SLO) and ``dropped`` were not (their connection closed).
        In the page at once: a client that has its answer and then asks the front end must
        find it counted, so this comes before any answer of the batch leaves."""
        mine = self.words
        mine[in_flight] -= calls + dropped
        mine[_ANSWERED] += calls
        mine[_BATCHES] += 1
        mine[_SAMPLES] += samples
        mine[_BUSY_NS] += busy_ns
        mine[_SLO_MET] += slo_met
        mine[_SLO_MISSED] += slo_missed
        self._dirty = True
        at = SIZES_OFFSET + 16 * (samples - 1)
        n, ns = _SIZE.unpack_from(self.page, at)
        _SIZE.pack_into(self.page, at, n + 1, ns + busy_ns)
        self.flush()

    def calls_answered(self, cls: int, calls: int, samples: int, ok_ns: int, queue_ns: int, infer_ns: int,
                       output_ns: int) -> None:
        """Worker: ``calls`` of class ``cls`` (0 real-time, 1 best-effort) were answered with
        their results: their ``samples``, durations and queue waits summed, and their batch's
        model run and output copy once per call (as Triton counts a call's batch). In the
        page at once, before their answers leave (``answered``'s rule), with the time they were."""
        at = _CALL_AT[cls]
        ok, n, ok0, queue0, input0, infer0, output0, last = _ANSWERED_CALLS.unpack_from(self.page, at)
        _ANSWERED_CALLS.pack_into(self.page, at, ok + calls, n + samples, ok0 + ok_ns, queue0 + queue_ns, input0,
                                  infer0 + infer_ns * calls, output0 + output_ns * calls,
                                  time.time_ns() // 1_000_000 if calls else last)

    def durations_answered(self, cls: int, request_ns: list[int], queue_ns: list[int], compute_ns: int) -> None:
        """Worker: the calls of a class ``cls`` batch answered with their results binned (the
        Python path's; the compiled lane bins its own): each one's duration and queue wait,
        and the batch's ``compute_ns`` once per call."""
        at = _HIST_AT[cls]
        bins = list(_HIST.unpack_from(self.page, at))
        queue = BINS * Duration.QUEUE
        for req, wait in zip(request_ns, queue_ns):
            bins[duration_bin(req)] += 1
            bins[queue + duration_bin(wait)] += 1
        bins[BINS * Duration.COMPUTE + duration_bin(compute_ns)] += len(request_ns)
        _HIST.pack_into(self.page, at, *bins)

    def call_failed(self, cls: int, status: Status, ns: int) -> None:
        """Worker: a call of class ``cls`` was answered with an error of ``status``, ``ns``
        after its header came (in the page at once; its duration binned as a request's)."""
        at = _CALL_AT[cls]
        for offset, n in ((at + 8 * _FAIL_AT[status], 1), (at + 8 * CallWord.FAIL_NS, ns),
                          (_HIST_AT[cls] + 8 * duration_bin(ns), 1)):
            v = _U64.unpack_from(self.page, offset)[0]
            _U64.pack_into(self.page, offset, v + n)

    def lane_counts(self) -> tuple:
        """Where the compiled lane (``_directlane.Lane``) counts calls as ``accepted`` and
        batches as ``answered`` do: the words, the page, their offset there, the words a
        batch's answers count, the RECEIVED word, the ADMIT word (read in the page) and
        where the batches are counted by size and the calls per class (``CallWord``, a class's block
        ``CALL_WORDS`` long), and where their durations are binned (``Duration``'s blocks per
        class, by ``DURATION_BOUNDS_NS``)."""
        return (self.words, self.page, COUNTERS_OFFSET, _ANSWER_WORDS, int(Word.RECEIVED), int(Word.ADMIT),
                SIZES_OFFSET, CALLS_OFFSET, CALL_WORDS, DURATIONS_OFFSET, DURATION_BOUNDS_NS)

    def in_flight(self) -> int:
        """Worker: its calls accepted and not yet answered or dropped, of both classes."""
        mine = self.words
        return mine[_IN_FLIGHT_RT] + mine[_IN_FLIGHT_BE]

    def value(self, word: Word) -> int:
        """Worker: one of its own words."""
        return self.words[word]

    def sub(self, word: Word, n: int = 1) -> None:
        self.add(word, -n)

    def set(self, word: Word, value: int) -> None:
        """One word, in the page at once (with what was counted before it: the worker's
        words all at once then, else this one alone)."""
        if word < Word.ADMIT:
            self.words[word] = value
            if self._dirty:
                self.flush()
                return
        _U64.pack_into(self.page, COUNTERS_OFFSET + 8 * word, value)

    def admit(self) -> int:
        return _U64.unpack_from(self.page, COUNTERS_OFFSET + 8 * Word.ADMIT)[0]

    def set_admit(self, calls: int) -> None:
        """Front end: the calls the worker may hold from its direct connections."""
        self.set(Word.ADMIT, calls)

    def bell(self) -> bool:
        return bool(_U64.unpack_from(self.page, COUNTERS_OFFSET + 8 * Word.BELL)[0])

    def set_bell(self, on: bool) -> None:
        """Front end: ring on direct real-time batches (both classes are about on the node)."""
        self.set(Word.BELL, int(on))

    def snapshot(self) -> DirectCounts:
        return DirectCounts(*_ZEROS.unpack_from(self.page, COUNTERS_OFFSET))

    def tally(self) -> DirectTally:
        """Front end: all the page says, in one read."""
        calls = tuple(DirectCalls.from_words(_CALLS.unpack_from(self.page, at), _HIST.unpack_from(self.page, bins))
                      for at, bins in zip(_CALL_AT, _HIST_AT))
        return DirectTally(self.snapshot(), self.batch_sizes(), calls)  # type: ignore[arg-type]

    def batch_sizes(self) -> dict[int, tuple[int, int]]:
        """The direct batches run so far by size: size -> (batches, ns they ran)."""
        words = array("q", self.page[SIZES_OFFSET:PAGE_BYTES])
        return {i // 2 + 1: (words[i], words[i + 1]) for i in range(0, len(words), 2) if words[i]}
