"""Per-stage timestamps of recent fast-path calls, for ``GET /v2/debug/stages`` and the
``fastpath-breakdown`` benchmark.

Every stamp is on ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, which the worker
processes and a client on the same host share), so a client can join its own stamps to the
server's by ``req_id`` and see where one call's time went. Only successful calls over the
stream fast path (TCP, Unix) are kept, the newest ``limit`` of them; with a limit of 0
nothing is built at all.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class StagedCall(Protocol):
    """What a call knows of its own way through the node (``server.monitor.Call``)."""

    req_id: int
    count: int
    t_first: float  # the frame's first byte was read
    t_ready: float  # header parsed, slots allocated
    t_rx: float  # payload complete, queued
    t_dispatch: float  # its batch was handed to a worker
    t_start_w: float  # the worker began the batch
    compute_ns: int  # the worker's run
    t_done: float  # the front end read the worker's DONE
    t_work: float  # the runtime answered it (WORK_COMPLETE)
    t_tx: float  # its transport began writing the answer


# The stamps in the order a call passes them; a record lists them under these names.
STAMPS = ("t_first", "t_ready", "t_rx", "t_dispatch", "t_start_w", "t_done", "t_work", "t_tx")


class StageTrace:
    """The stamps of the newest ``limit`` answered calls (bounded: a ring)."""

    def __init__(self, limit: int) -> None:
        self._calls: deque[tuple] = deque(maxlen=limit)

    def record(self, model: str, call: StagedCall) -> None:
        """Keep ``call``'s stamps (it was just answered with a result) if its transport stamps
        its write: the stream fast path does; UDP, HTTP and gRPC calls are not kept."""
        if not call.t_tx:
            return
        self._calls.append((model, call.req_id, call.count, call.compute_ns, *(getattr(call, s) for s in STAMPS)))

    def snapshot(self) -> list[dict[str, Any]]:
        """The kept calls, oldest first, one dict each (model, req_id, count, compute_ns, stamps)."""
        keys = ("model", "req_id", "count", "compute_ns", *STAMPS)
        return [dict(zip(keys, c)) for c in self._calls]
