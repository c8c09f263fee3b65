"""When a worker's direct batch starts: the model's batching policy, as the front end's
scheduler applies it, over the calls the endpoint holds.

A worker's direct calls take rows of its per-class batch as they arrive, so what a batch
holds is every call placed when it starts, up to the instance's batch (its
``max_batch_size``, or Packrat's per-instance ``b``). What the policy decides here is *when*
it starts: ``work_conserving`` and ``none`` at once; ``timeout`` once
``preferred_batch`` samples wait or the oldest waited ``max_delay_ms``; ``adaptive`` at the
quantum boundary whose test releases the waiting samples (Rafiqi's threshold, fed by the
direct arrivals); a Packrat instance once its ``b`` samples wait or the oldest waited the
aggregation ``timeout_ms``. The deciders are ``scheduler/policy.py``'s own, asked with
the calls as queued requests (rows for slot numbers, arrival on CLOCK_MONOTONIC).

``none`` (one request per batch) caps what a batch holds instead (``max_calls``): a class
that holds one call takes no other (the compiled lane declines it, the Python intake keeps
it waiting for rows) until that call's batch ran, so each call runs alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.policy import BatchingPolicy, BatchingPolicyKind, Timeout, make_policy
from splitserve.scheduler.request import QueuedRequest
from splitserve.worker.direct_conn import _Call


def direct_policy(cfg: ModelConfig, instance_batch: int, packrat_timeout_s: float | None) -> BatchingPolicy | None:
    """The policy that times a direct batch's start (None: start at once, the default's
    work-conserving rule, which needs no look at the calls)."""
    if packrat_timeout_s is not None:
        return Timeout(packrat_timeout_s, instance_batch)
    if cfg.batching.policy in (BatchingPolicyKind.WORK_CONSERVING, BatchingPolicyKind.NONE):
        return None
    return make_policy(cfg.batching)


def max_calls(cfg: ModelConfig, packrat_timeout_s: float | None) -> int:
    """The calls one direct batch holds at most: 1 under the policy ``none``, as the front
    end's scheduler runs it; 0 (no cap but the rows) otherwise, and where Packrat's
    per-instance batch aggregates calls whatever the model's policy."""
    return int(cfg.batching.policy == BatchingPolicyKind.NONE and packrat_timeout_s is None)


class BatchGate:
    """One endpoint's policy, told of its direct arrivals and asked whether a class's
    batch starts now and, if not, when to ask again."""

    def __init__(self, policy: BatchingPolicy, max_batch: int) -> None:
        self.policy = policy
        self.max_batch = max_batch
        self.told = {RequestClass.RT: 0, RequestClass.BE: 0}  # placed calls already told to the policy
        # rows of the class's batches run so far: a call's sequence number is this plus its
        # row, so numbers only grow, as the front end's ring's do (the adaptive rule keeps
        # the first number past what it released)
        self.base = {RequestClass.RT: 0, RequestClass.BE: 0}

    def arrivals(self, cls: RequestClass, placed: list[_Call], now_s: float) -> None:
        """Tell the policy of the calls placed since the last look (the compiled lane
        places calls without Python, so they are counted here)."""
        told = self.told[cls]
        if len(placed) > told:
            self.policy.arrived(int(cls), sum(c.count for c in placed[told:]), now_s)
            self.told[cls] = len(placed)

    def rows_freed(self, cls: RequestClass, rows: int) -> None:
        """The class's batch of ``rows`` rows ran: its calls are no longer the policy's."""
        self.told[cls] = 0
        self.base[cls] += rows

    def due(self, cls: RequestClass, calls: Iterable[_Call], now_s: float) -> tuple[bool, float | None]:
        """(whether the class's batch starts now, else when to ask again: monotonic seconds,
        None for the next event) for its ``calls`` whose payload is whole, oldest first."""
        base = self.base[cls]
        run = [QueuedRequest(base + c.row, c.count, cls, c.t_rx_ns / 1e9) for c in calls]
        if not run:
            return False, None
        if self.policy.take(run, now_s, self.max_batch) > 0:
            return True, None
        return False, self.policy.wakeup(run, now_s)
