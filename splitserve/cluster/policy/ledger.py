"""The gateway's in-flight ledger: every accepted request is answered exactly once.

Each accepted request gets a gateway-unique id and an ``Entry`` that keeps what is needed to
send it again (``handle``: the header and payload bytes, or whatever the caller keeps) until
its first answer. Inference has no side effects, so running a request twice is safe; what
must not happen is answering it twice or never:

- the first answer from any node it was sent to is delivered, and the entry goes;
- an answer for an id no longer held (a late duplicate from a node it was taken from), or
  from a node it was never sent to, is dropped;
- an answer that says the request did not run there (``QUEUE_FULL``, ``SHUTTING_DOWN``,
  ``MODEL_NOT_READY``) from the node it is on sends it elsewhere;
- a lost node (dead, or a draining one at its deadline less the margin) sends its entries
  elsewhere; a request out of attempts or past its deadline is answered with the error.

Pure: the caller dispatches (``Dispatcher.choose``) and sends; the ledger only records and
decides. ``Resend`` outcomes must be dispatched and ``sent`` again, or ``fail``ed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import count
from types import MappingProxyType

from splitserve.errors import (
    DeadlineMissed, InternalError, ModelNotReady, QueueFull, ShuttingDown, SplitServeError, WorkerFailed,
)
from splitserve.protocol.header import RequestClass

# Answers meaning the node did not run the request: it may run anywhere else.
NOT_RUN: tuple[type[SplitServeError], ...] = (QueueFull, ShuttingDown, ModelNotReady)


@dataclass
class Entry:
    """One accepted request, held until it is answered."""

    req_id: int
    model: str
    cls: RequestClass
    handle: object  # what the caller needs to send the request again
    accepted_at: float
    deadline: float | None = None  # absolute; past it the request is answered DEADLINE_MISSED, not re-sent
    node: str | None = None  # where it is now (None: waiting to be dispatched)
    attempts: int = 0  # sends so far
    sent_to: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Deliver:
    """Answer the client: with the node's result when ``error`` is None, else with ``error``."""

    entry: Entry
    node: str | None
    error: SplitServeError | None = None


@dataclass(frozen=True)
class Resend:
    """Dispatch ``entry`` again, to any node but those in ``exclude``."""

    entry: Entry
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Drop:
    """Ignore this answer: the request was answered already, or never went to that node."""

    req_id: int
    node: str
    reason: str


Outcome = Deliver | Resend | Drop


class Ledger:
    """Accepted requests by gateway id, the in-flight count per node, and counters."""

    def __init__(self, capacity: int, max_attempts: int) -> None:
        if capacity < 1 or max_attempts < 1:
            raise InternalError(f"ledger capacity and max_attempts must be at least 1, got {capacity}, {max_attempts}")
        self.capacity = capacity
        self.max_attempts = max_attempts
        self._entries: dict[int, Entry] = {}
        self._ids = count(1)
        self._in_flight: dict[str, int] = {}
        self.delivered = 0
        self.resent = 0  # re-sends after a lost node or a did-not-run answer
        self.dropped = 0  # late duplicates and answers from the wrong node

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def get(self, req_id: int) -> Entry | None:
        return self._entries.get(req_id)

    def in_flight(self) -> Mapping[str, int]:
        """Requests sent to each node and not yet answered or taken back (dispatch's input; a
        live read-only view, no copy per request)."""
        return MappingProxyType(self._in_flight)

    def accept(self, model: str, cls: RequestClass, handle: object, now: float,
               deadline: float | None = None) -> Entry:
        """Take a request: its entry, with a new id. ``QueueFull`` when the ledger is full:
        the request was not accepted, so that refusal is its one answer."""
        if len(self._entries) >= self.capacity:
            raise QueueFull(f"the gateway holds {self.capacity} unanswered requests")
        entry = Entry(next(self._ids), model, cls, handle, now, deadline)
        self._entries[entry.req_id] = entry
        return entry

    def sent(self, req_id: int, node: str) -> None:
        """``req_id`` went to ``node`` (after dispatch chose it)."""
        entry = self._entries.get(req_id)
        if entry is None or entry.node is not None:
            raise InternalError(f"request {req_id} is not waiting for dispatch")
        entry.node = node
        entry.attempts += 1
        entry.sent_to.add(node)
        self._in_flight[node] = self._in_flight.get(node, 0) + 1

    def answered(self, req_id: int, node: str, now: float, error: SplitServeError | None = None) -> Outcome:
        """``node`` answered ``req_id``: with a result (``error`` None) or an error."""
        entry = self._entries.get(req_id)
        if entry is None:
            self.dropped += 1
            return Drop(req_id, node, "already answered")
        if node not in entry.sent_to:
            self.dropped += 1
            return Drop(req_id, node, "never sent there")
        if isinstance(error, NOT_RUN):
            if node != entry.node:  # an old refusal; the request is elsewhere now
                self.dropped += 1
                return Drop(req_id, node, "a refusal from a node the request has left")
            return self._take_back(entry, now, error, frozenset({node}))
        return self._deliver(entry, node, error)

    def node_lost(self, node: str, now: float) -> list[Outcome]:
        """``node`` is gone (dead, or draining and out of time): its requests go elsewhere."""
        lost = [e for e in self._entries.values() if e.node == node]
        out = [self._take_back(e, now, WorkerFailed(f"node {node} was lost with the request on it"), frozenset())
               for e in lost]
        self._in_flight.pop(node, None)
        return out

    def fail(self, req_id: int, error: SplitServeError) -> Deliver:
        """Answer a request waiting for dispatch with ``error`` (no node could take it)."""
        entry = self._entries.get(req_id)
        if entry is None or entry.node is not None:
            raise InternalError(f"request {req_id} is not waiting for dispatch")
        return self._deliver(entry, None, error)

    def _take_back(self, entry: Entry, now: float, error: SplitServeError, exclude: frozenset[str]) -> Outcome:
        self._release(entry)
        if entry.deadline is not None and now >= entry.deadline:
            return self._deliver(entry, None, DeadlineMissed(f"request {entry.req_id} passed its deadline while "
                                                             f"its node failed: {error.message}"))
        if entry.attempts >= self.max_attempts:
            return self._deliver(entry, None, error)
        self.resent += 1
        return Resend(entry, exclude)

    def _release(self, entry: Entry) -> None:
        if entry.node is not None:
            left = self._in_flight.get(entry.node, 0) - 1
            if left > 0:
                self._in_flight[entry.node] = left
            else:
                self._in_flight.pop(entry.node, None)
        entry.node = None

    def _deliver(self, entry: Entry, node: str | None, error: SplitServeError | None) -> Deliver:
        self._release(entry)
        del self._entries[entry.req_id]
        self.delivered += 1
        return Deliver(entry, node, error)
