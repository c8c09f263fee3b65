"""Batching policies: how many of the waiting requests to run now, or when to look again.

A policy only sees a run of requests whose slots are consecutive (so the batch is one
contiguous view of the tensor queue); the scheduler hands it that run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.scheduler.request import QueuedRequest
from splitserve.types import Choice


class BatchingPolicyKind(Choice, what="batching.policy"):
    """The policies a model's ``[batching]`` may name (``make_policy`` builds them)."""

    WORK_CONSERVING = "work_conserving"
    TIMEOUT = "timeout"
    NONE = "none"


@dataclass(frozen=True)
class BatchingConfig:
    """``[batching]`` of a model config; unknown policy names are refused here."""

    policy: BatchingPolicyKind = BatchingPolicyKind.WORK_CONSERVING
    max_delay_ms: float = 2.0  # timeout policy: longest wait for a fuller batch
    preferred_batch: int = 8  # timeout policy: dispatch at once at this size

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", BatchingPolicyKind.parse(self.policy))
        if self.max_delay_ms < 0 or self.preferred_batch < 1:
            raise InvalidInput("batching.max_delay_ms must be >= 0 and batching.preferred_batch >= 1")


class BatchingPolicy(ABC):
    """Called by ``ModelScheduler`` whenever an instance is free and requests wait."""

    @abstractmethod
    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        """How many requests from the front of ``run`` to dispatch now (0 = wait)."""

    def wakeup(self, run: Sequence[QueuedRequest], now: float) -> float | None:
        """When to ask again if ``take`` returned 0 (None = only on the next event)."""
        return None


def _fit(run: Sequence[QueuedRequest], max_batch: int) -> int:
    """Requests from the front of ``run`` whose samples fit in ``max_batch`` (at least 1)."""
    total = n = 0
    for r in run:
        if n and total + r.count > max_batch:
            break
        total += r.count
        n += 1
    return n


class WorkConserving(BatchingPolicy):
    """SplitRPC §6.4: when an instance frees up, run everything waiting, up to max batch."""

    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        return _fit(run, max_batch)


class NoBatching(BatchingPolicy):
    """One request per dispatch: the zero-copy single-request path."""

    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        return 1 if run else 0


class Timeout(BatchingPolicy):
    """Wait up to ``max_delay`` after the oldest request for ``preferred`` samples."""

    def __init__(self, max_delay_s: float, preferred: int) -> None:
        self.max_delay_s = max_delay_s
        self.preferred = preferred

    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        if not run:
            return 0
        samples = sum(r.count for r in run)
        if samples >= min(self.preferred, max_batch) or now - run[0].arrival >= self.max_delay_s:
            return _fit(run, max_batch)
        return 0

    def wakeup(self, run: Sequence[QueuedRequest], now: float) -> float | None:
        return run[0].arrival + self.max_delay_s if run else None


class PackratAggregate(BatchingPolicy):
    """Packrat §3.5: aggregate a batch of ``total`` samples per model (or whatever came
    before ``timeout``), then partition it across the instances by their own batch size
    ``b``. With tensor queues the partition is slicing one contiguous run, not copying."""

    def __init__(self, total: int, timeout_s: float) -> None:
        self.total = total
        self.timeout_s = timeout_s
        self._released: dict[int, int] = {}  # class -> first seq past the released batch

    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        if not run:
            return 0
        cls = int(run[0].cls)
        until = self._released.get(cls, -1)
        if run[0].seq >= until:
            if sum(r.count for r in run) < self.total and now - run[0].arrival < self.timeout_s:
                return 0
            total = 0
            for r in run:
                if total >= self.total:
                    break
                total += r.count
                until = r.seq + r.count
            self._released[cls] = until
        n = total = 0
        for r in run:
            if r.seq >= until or (n and total + r.count > max_batch):
                break
            total += r.count
            n += 1
        return n

    def wakeup(self, run: Sequence[QueuedRequest], now: float) -> float | None:
        return run[0].arrival + self.timeout_s if run else None

    def retarget(self, total: int) -> None:
        """Aggregate ``total`` samples from now on (Packrat switched to a plan for that B)."""
        self.total = total


def make_policy(cfg: BatchingConfig) -> BatchingPolicy:
    """The policy a model's config names (``BatchingConfig`` has refused unknown names)."""
    if cfg.policy is BatchingPolicyKind.TIMEOUT:
        return Timeout(cfg.max_delay_ms / 1000.0, cfg.preferred_batch)
    if cfg.policy is BatchingPolicyKind.NONE:
        return NoBatching()
    return WorkConserving()
