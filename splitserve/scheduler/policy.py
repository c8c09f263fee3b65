"""Batching policies: how many of the waiting requests to run now, or when to look again.

A policy only sees a run of requests whose slots are consecutive (so the batch is one
contiguous view of the tensor queue); the scheduler hands it that run.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.protocol.v2 import json_number
from splitserve.scheduler.request import QueuedRequest
from splitserve.types import Choice


class BatchingPolicyKind(Choice, what="batching.policy"):
    """The policies a model's ``[batching]`` may name (``make_policy`` builds them)."""

    WORK_CONSERVING = "work_conserving"
    TIMEOUT = "timeout"
    NONE = "none"
    ADAPTIVE = "adaptive"


class ThresholdRule(Choice, what="batching.rule"):
    """How the ``adaptive`` policy moves its threshold: Rafiqi §3.3 tried all three."""

    EWMA = "ewma"  # t <- alpha*t + (1-alpha)*c on a rise: the paper's final rule
    AIMD = "aimd"  # t <- t + c on a rise: rejected by the paper (rises too fast), kept for comparison
    FIXED = "fixed"  # t stays at threshold_cap: rejected by the paper (stalls at low load)


@dataclass(frozen=True)
class BatchingConfig:
    """``[batching]`` of a model config; unknown policy names are refused here."""

    policy: BatchingPolicyKind = BatchingPolicyKind.WORK_CONSERVING
    max_delay_ms: float = 2.0  # timeout policy: longest wait for a fuller batch
    preferred_batch: int = 8  # timeout policy: dispatch at once at this size
    quantum_ms: float = 5.0  # adaptive: the threshold is updated and tested every quantum (Rafiqi: "about 5 ms")
    alpha: float = 0.5  # adaptive, ewma rule: the old threshold's weight on a rise (Rafiqi's best: 0.5)
    threshold_cap: int = 128  # adaptive: the threshold never exceeds this many samples (the fixed rule's t)
    rule: ThresholdRule = ThresholdRule.EWMA
    adaptive_quantum: bool = False  # adaptive: the quantum follows the batch compute time (Rafiqi §7.3)
    quantum_beta: float = 0.5  # adaptive_quantum: the old quantum's weight in that average

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", BatchingPolicyKind.parse(self.policy))
        object.__setattr__(self, "rule", ThresholdRule.parse(self.rule))
        if self.max_delay_ms < 0 or self.preferred_batch < 1:
            raise InvalidInput("batching.max_delay_ms must be >= 0 and batching.preferred_batch >= 1")
        # The quantum bounds how long a request can wait for the threshold: bound it too.
        if not 0 < self.quantum_ms <= 60_000:
            raise InvalidInput(f"batching.quantum_ms must be > 0 and <= 60000, got {self.quantum_ms!r}")
        if not 0 < self.alpha < 1 or not 0 <= self.quantum_beta < 1:
            raise InvalidInput("batching.alpha must be strictly between 0 and 1 and batching.quantum_beta "
                               f"in [0, 1), got {self.alpha!r} and {self.quantum_beta!r}")
        if self.threshold_cap < 1:
            raise InvalidInput(f"batching.threshold_cap must be >= 1, got {self.threshold_cap!r}")

    def changed(self, changes: Mapping[str, Any]) -> BatchingConfig:
        """This config with ``changes`` (as a client or a TOML file wrote them; a None value
        leaves its key unchanged) applied. Unknown keys and values of the wrong type are
        refused with InvalidInput naming them."""
        known = {f.name: f for f in fields(self)}
        unknown = set(changes) - set(known)
        if unknown:
            raise InvalidInput(f"unknown batching keys {sorted(unknown)}; use {', '.join(known)}")
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            if value is None:
                continue
            kind = known[key].type
            name = f"batching.{key}"
            if kind == "bool":
                if not isinstance(value, bool):
                    raise InvalidInput(f"{name} must be true or false, got {value!r}")
                checked[key] = value
            elif kind in ("int", "float"):
                checked[key] = json_number(name, value, int if kind == "int" else float)
            elif not isinstance(value, str):
                raise InvalidInput(f"{name} must be a string, got {value!r}")
            else:
                checked[key] = value
        return replace(self, **checked)


class BatchingPolicy(ABC):
    """Called by ``ModelScheduler`` whenever an instance is free and requests wait."""

    @abstractmethod
    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        """How many requests from the front of ``run`` to dispatch now (0 = wait)."""

    def wakeup(self, run: Sequence[QueuedRequest], now: float) -> float | None:
        """When to ask again if ``take`` returned 0 (None = only on the next event)."""
        return None

    def arrived(self, cls: int, count: int, now: float) -> None:
        """``count`` samples of class ``cls`` were queued at ``now`` (a policy that follows
        the load counts them; requests handed back from a batch are not arrivals)."""

    def batch_time(self, seconds: float) -> None:
        """A whole batch of this model took ``seconds`` to compute."""


def _fit(run: Sequence[QueuedRequest], max_batch: int, until: int | None = None) -> int:
    """Requests from the front of ``run`` whose samples fit in ``max_batch`` (at least 1),
    stopping before the first whose slots start at ``until`` or later."""
    total = n = 0
    for r in run:
        if (until is not None and r.seq >= until) or (n and total + r.count > max_batch):
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
        return _fit(run, max_batch, until)

    def wakeup(self, run: Sequence[QueuedRequest], now: float) -> float | None:
        return run[0].arrival + self.timeout_s if run else None

    def retarget(self, total: int) -> None:
        """Aggregate ``total`` samples from now on (Packrat switched to a plan for that B)."""
        self.total = total


class AdaptiveThreshold:
    """Rafiqi §3.3's threshold for one queue: how many samples must wait before a batch is
    worth running. It rises gradually with the load and falls fast when the load falls.

    Pure arithmetic, no clock: ``update`` is told how many quantum boundaries passed and
    how many samples arrived in the first of those quanta (the others had none).
    """

    def __init__(self, rule: ThresholdRule = ThresholdRule.EWMA, alpha: float = 0.5, cap: int = 128) -> None:
        self.rule = ThresholdRule.parse(rule)
        self.alpha = alpha
        self.cap = cap
        # The paper gives no start (E3): 0 serves the first request at the first boundary.
        # The fixed rule is the paper's rejected constant threshold, so it starts (and stays) at the cap.
        self.t = float(cap) if self.rule is ThresholdRule.FIXED else 0.0

    def update(self, arrived: int, quanta: int = 1) -> float:
        """``quanta`` boundaries passed, the first closing a quantum in which ``arrived``
        samples came and the rest closing empty ones; returns the new threshold."""
        if self.rule is ThresholdRule.FIXED:
            return self.t
        t = self.t
        if arrived > t:
            t = self.alpha * t + (1 - self.alpha) * arrived if self.rule is ThresholdRule.EWMA else t + arrived
            t = min(float(self.cap), t)
        elif arrived < t:
            t /= 2
        # Each empty quantum halves it again; ldexp stays exact and cannot overflow for long idles.
        t = math.ldexp(t, -(quanta - 1))
        # Below 1 the literal test "queued > t" would still hold back a lone request (E2).
        self.t = 0.0 if t < 1 else t
        return self.t


class Adaptive(BatchingPolicy):
    """Rafiqi §3.3: every quantum, move each class's threshold t from the samples that
    arrived in the quantum just ended, and release a batch when more than t samples wait.

    A boundary's test counts the contiguous run's samples that arrived before that
    boundary; when it holds they are released and dispatched as instances free up, even
    after the boundary (Rafiqi's daemon queues the model and a free worker takes it). The
    test of a boundary at which every instance was busy is made when one frees up. A full
    batch (``max_batch`` samples) runs at once: waiting cannot make it larger.
    ``adaptive_quantum`` (§7.3) moves the quantum towards the model's batch compute time.
    """

    def __init__(self, quantum_s: float, rule: ThresholdRule = ThresholdRule.EWMA, alpha: float = 0.5,
                 cap: int = 128, adaptive_quantum: bool = False, beta: float = 0.5) -> None:
        self.quantum_s = quantum_s
        self.rule = ThresholdRule.parse(rule)
        self.alpha = alpha
        self.cap = cap
        self.adaptive_quantum = adaptive_quantum
        self.beta = beta
        self.thresholds: dict[int, AdaptiveThreshold] = {}  # per request class
        self._arrived: dict[int, int] = {}  # class -> samples arrived in the current quantum
        self._released: dict[int, int] = {}  # class -> first seq past the run its last boundary released
        self._q_end: float | None = None  # the current quantum ends here (None: no event yet)
        self._boundary = -math.inf  # the latest boundary passed

    def threshold(self, cls: int) -> AdaptiveThreshold:
        """Class ``cls``'s threshold (each class batches on its own ring, so on its own load)."""
        th = self.thresholds.get(cls)
        if th is None:
            th = self.thresholds[cls] = AdaptiveThreshold(self.rule, self.alpha, self.cap)
        return th

    def advance(self, now: float) -> None:
        """Pass every quantum boundary up to ``now``, updating each class's threshold (every
        other method calls this first, so boundaries with nothing to do are passed lazily)."""
        if self._q_end is None:
            self._q_end = now + self.quantum_s
            return
        if now < self._q_end:
            return
        k = int((now - self._q_end) // self.quantum_s) + 1
        self._boundary = self._q_end + (k - 1) * self.quantum_s
        self._q_end += k * self.quantum_s
        for cls, th in self.thresholds.items():
            th.update(self._arrived.pop(cls, 0), k)

    def arrived(self, cls: int, count: int, now: float) -> None:
        self.advance(now)
        self.threshold(int(cls))
        self._arrived[int(cls)] = self._arrived.get(int(cls), 0) + count

    def batch_time(self, seconds: float) -> None:
        if self.adaptive_quantum and seconds > 0:
            self.quantum_s = self.beta * self.quantum_s + (1 - self.beta) * seconds

    def take(self, run: Sequence[QueuedRequest], now: float, max_batch: int) -> int:
        if not run:
            return 0
        self.advance(now)
        cls = int(run[0].cls)
        until = self._released.get(cls)
        if until is not None and run[0].seq < until:
            return _fit(run, max_batch, until)
        if sum(r.count for r in run) >= max_batch:
            return _fit(run, max_batch)
        waited, end = 0, None
        for r in run:
            if r.arrival >= self._boundary:
                break
            waited += r.count
            end = r.seq + r.count
        if end is None or waited <= self.threshold(cls).t:
            return 0
        self._released[cls] = end
        return _fit(run, max_batch, end)

    def wakeup(self, run: Sequence[QueuedRequest], now: float) -> float | None:
        if not run:
            return None
        self.advance(now)
        return self._q_end


def make_policy(cfg: BatchingConfig) -> BatchingPolicy:
    """The policy a model's config names (``BatchingConfig`` has refused unknown names)."""
    if cfg.policy is BatchingPolicyKind.TIMEOUT:
        return Timeout(cfg.max_delay_ms / 1000.0, cfg.preferred_batch)
    if cfg.policy is BatchingPolicyKind.NONE:
        return NoBatching()
    if cfg.policy is BatchingPolicyKind.ADAPTIVE:
        return Adaptive(cfg.quantum_ms / 1000.0, cfg.rule, cfg.alpha, cfg.threshold_cap, cfg.adaptive_quantum,
                        cfg.quantum_beta)
    return WorkConserving()
