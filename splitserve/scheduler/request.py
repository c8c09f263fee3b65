"""What the scheduler sees of a call: slots, sizes, times. No sockets, no futures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.protocol.header import RequestClass


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """A received request waiting for a batch.

    ``seq`` is the sequence number of its first slot in the model's ring for its class;
    it holds ``count`` consecutive slots (one per sample). ``handle`` is the server's own
    object for the call, carried through untouched.
    """

    seq: int
    count: int
    cls: RequestClass
    arrival: float
    deadline: float | None = None  # hard: still queued after it, the request is dropped
    handle: Any = None
    # Soft SLO of a real-time request (None for best-effort): served late rather than dropped,
    # only counted; an EDF key beside the deadline. Same clock as ``deadline``.
    slo: float | None = None


@dataclass(slots=True, eq=False)
class Batch:
    """A decision: run ``requests`` (slots ``[seq, seq+count)``) on ``instance``."""

    model: str
    instance: int
    cls: RequestClass
    seq: int
    count: int
    requests: list[QueuedRequest]
    created: float
    batch_id: int = 0
    # REEF: segment to resume from (0 = from the start) when a preempted batch is re-run.
    resume_segment: int = 0
    started: float | None = None  # when the node last let it start (REEF's expected end counts from there)
    # PROTEAN: its partition's tag (share taken by best-effort work) when the node placed it;
    # None: not placed by tags (no partitions, or a strict placement other than eta)
    tag: float | None = None
    # When its worker began computing it (the worker's perf_counter, the same monotonic clock as
    # the server's), for a batch run whole from its first segment; None until it is done. Arrival
    # -> this is the preemption latency: queueing, dispatch and the worker's wake-up together.
    compute_start: float | None = None
