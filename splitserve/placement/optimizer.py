"""Packrat's ⟨instances, threads, batch⟩ optimizer (Packrat §3.2 to §3.3 and appendix B).

A model is profiled one instance at a time: ``LatencyProfile`` holds the mean batch latency of
one instance with ``t`` intra-op threads on a batch of ``b`` inputs. ``optimize`` then splits a
server's ``T`` threads and a batch of ``B`` inputs among concurrent instances so that the
slowest instance finishes as early as possible, with the paper's 2-D knapsack dynamic program.

Everything here is pure: no clock, no processes, no torch. The worker side pins the instances
(``splitserve.placement.topology``) and the batch-size estimator (``estimator``) picks ``B``.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from splitserve.errors import InvalidInput

# Latencies within this relative distance of the optimum count as ties (profiles are means of
# noisy measurements; a 1e-9 difference is rounding, not a better configuration).
_TIE_RTOL = 1e-9


@dataclass(frozen=True)
class LatencyProfile:
    """Measured single-instance batch latencies of one model (Packrat §3.2).

    ``table[(t, b)]`` is the mean latency in seconds of one instance running a batch of ``b``
    inputs with ``t`` intra-op threads. Every thread count from 1 to ``max_threads`` must be
    present; batch sizes may be sparse (Packrat profiles powers of two) and ``latency``
    interpolates between them. The table is copied on construction, so mutating the caller's
    dict later cannot change a profile that ``optimize`` has cached a plan for.
    """

    model: str
    table: dict[tuple[int, int], float]

    def __post_init__(self) -> None:
        if not self.table:
            raise InvalidInput(f"latency profile of {self.model!r} is empty")
        table: dict[tuple[int, int], float] = {}
        for key, value in self.table.items():
            if (
                not isinstance(key, tuple)
                or len(key) != 2
                or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in key)
            ):
                raise InvalidInput(
                    f"latency profile of {self.model!r}: key {key!r} is not a (threads, batch) "
                    "pair of positive integers"
                )
            latency = float(value)
            if not math.isfinite(latency) or latency <= 0.0:
                raise InvalidInput(
                    f"latency profile of {self.model!r}: latency {value!r} at {key} must be a "
                    "positive finite number of seconds"
                )
            table[key] = latency
        threads = {t for t, _ in table}
        missing = sorted(set(range(1, max(threads) + 1)) - threads)
        if missing:
            raise InvalidInput(
                f"latency profile of {self.model!r} has no measurements for threads {missing}; "
                f"profile every thread count from 1 to {max(threads)}"
            )
        object.__setattr__(self, "table", table)

    def __hash__(self) -> int:
        # dataclass would hash the dict field and fail; the sorted items identify the profile
        # and let ``optimize`` cache plans per profile.
        return hash(self._fingerprint)

    @cached_property
    def _fingerprint(self) -> tuple[str, tuple[tuple[tuple[int, int], float], ...]]:
        return (self.model, tuple(sorted(self.table.items())))

    @cached_property
    def _curves(self) -> dict[int, tuple[list[int], list[float]]]:
        """Per thread count: the measured batch sizes (ascending) and their latencies."""
        curves: dict[int, tuple[list[int], list[float]]] = {}
        for (t, b), latency in sorted(self.table.items()):
            batches, latencies = curves.setdefault(t, ([], []))
            batches.append(b)
            latencies.append(latency)
        return curves

    @property
    def max_threads(self) -> int:
        """The largest profiled thread count (every count from 1 up to it is profiled)."""
        return max(self._curves)

    @property
    def batches(self) -> tuple[int, ...]:
        """Every batch size measured for at least one thread count, ascending."""
        return tuple(sorted({b for _, b in self.table}))

    def latency(self, t: int, b: int) -> float:
        """Expected latency (s) of one instance with ``t`` threads on a batch of ``b`` inputs.

        Measured points are returned as is. Between two measured batch sizes of the same
        thread count the latency is interpolated linearly in ``b``; below the smallest measured
        size it is clamped to that size's latency (a smaller batch is never assumed slower, and
        nothing is known about how much faster it is). Beyond the largest size it is
        extrapolated along the last measured segment, or proportionally to ``b`` when only one
        size was measured, but never below the largest measurement: a noisy downward last
        segment must not promise that bigger batches get cheaper without bound.
        """
        if t not in self._curves:
            raise InvalidInput(f"{self.model!r} was profiled for 1..{self.max_threads} threads, not {t}")
        if b < 1:
            raise InvalidInput(f"batch size must be at least 1, got {b}")
        batches, latencies = self._curves[t]
        i = bisect.bisect_left(batches, b)
        if i < len(batches) and batches[i] == b:
            return latencies[i]
        if i == 0:
            return latencies[0]
        if i == len(batches):
            if len(batches) == 1:
                return latencies[0] * b / batches[0]
            slope = (latencies[-1] - latencies[-2]) / (batches[-1] - batches[-2])
            return latencies[-1] + max(slope, 0.0) * (b - batches[-1])
        b0, b1 = batches[i - 1], batches[i]
        l0, l1 = latencies[i - 1], latencies[i]
        return l0 + (l1 - l0) * (b - b0) / (b1 - b0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form for the registry: ``{"model": ..., "table": {"t,b": seconds}}``."""
        return {
            "model": self.model,
            "table": {f"{t},{b}": latency for (t, b), latency in sorted(self.table.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyProfile:
        """Rebuild a profile written by ``to_dict``; raises InvalidInput when malformed."""
        try:
            model = data["model"]
            raw = data["table"]
            table = {}
            for key, latency in raw.items():
                t, b = key.split(",")
                table[(int(t), int(b))] = float(latency)
        except (KeyError, AttributeError, TypeError, ValueError) as exc:
            raise InvalidInput(
                f"latency profile is malformed ({exc!r}); expected "
                '{"model": name, "table": {"threads,batch": seconds}}'
            ) from None
        if not isinstance(model, str):
            raise InvalidInput(f"latency profile model name must be a string, got {model!r}")
        return cls(model=model, table=table)


@dataclass(frozen=True)
class InstanceShape:
    """``count`` identical instances, each with ``threads`` threads and a batch of ``batch``."""

    threads: int
    batch: int
    count: int

    def to_dict(self) -> dict[str, int]:
        """JSON-safe form."""
        return {"threads": self.threads, "batch": self.batch, "count": self.count}


@dataclass(frozen=True)
class Plan:
    """A configuration ⟨i, t, b⟩ (possibly a mix of shapes, appendix B) and what it promises.

    ``latency`` is the expected batch latency: the instances run concurrently, so it is the
    profiled latency of the slowest shape. ``fat_latency`` is the baseline of one instance with
    all the threads on the whole batch. Both come from isolated profiles, so they ignore the
    contention between concurrent instances (Packrat appendix A): the speedup is an upper
    estimate, which the paper found to be off by a roughly constant factor.
    """

    shapes: tuple[InstanceShape, ...]
    latency: float
    fat_latency: float

    @property
    def instances(self) -> int:
        """Number of instances, Σ count."""
        return sum(s.count for s in self.shapes)

    @property
    def total_threads(self) -> int:
        """Threads the plan uses, Σ count·threads (at most T; ties may leave some idle)."""
        return sum(s.count * s.threads for s in self.shapes)

    @property
    def total_batch(self) -> int:
        """Inputs the plan covers, Σ count·batch (always exactly B)."""
        return sum(s.count * s.batch for s in self.shapes)

    @property
    def speedup(self) -> float:
        """Expected speedup over the fat instance, fat_latency / latency (>= 1, up to the tie tolerance)."""
        return self.fat_latency / self.latency

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (shapes, latencies and the derived speedup, for logs and the API)."""
        return {
            "shapes": [s.to_dict() for s in self.shapes],
            "latency": self.latency,
            "fat_latency": self.fat_latency,
            "speedup": self.speedup,
        }


def optimize(profile: LatencyProfile, T: int, B: int) -> Plan:
    """The configuration of instances that minimizes expected batch latency (Packrat §3.3).

    Splits at most ``T`` threads and exactly ``B`` inputs among instances, each with
    ``t >= 1`` threads and ``b >= 1`` inputs, minimizing the largest profiled latency. Solves
    the paper's recurrence ``opt[t, b] = min over 1<=t'<=t, 1<=b'<=b of max(opt[t-t', b-b'],
    L[t', b'])`` with ``opt[t, 0] = 0`` and ``opt[0, b>0] = inf``, in O(T²B²).

    Ties: among configurations whose latency is within a relative 1e-9 of the optimum, the
    plan has the fewest instances, then the fewest threads in total (idle threads are left for
    other models); any tie left after that goes to the configuration built by taking the
    instance with the most threads, then the largest batch, first. Instances never get more
    threads than the profile measured, so when ``T > profile.max_threads`` the fat baseline is
    one instance with ``profile.max_threads`` threads. Plans are cached per (profile, T, B),
    as in the paper, since reconfiguration asks again for the same sizes.
    """
    if T < 1 or B < 1:
        raise InvalidInput(f"optimize needs T >= 1 threads and B >= 1 inputs, got T={T}, B={B}")
    return _optimize_cached(profile, T, B)


@lru_cache(maxsize=256)
def _optimize_cached(profile: LatencyProfile, T: int, B: int) -> Plan:
    L = _latency_grid(profile, T, B)
    best = _min_max_latency(L, T, B, _uniform_bound(L, T, B))
    # Second pass: among configurations within the tie tolerance of ``best``, minimize
    # (instances, threads). The paper's single recurrence cannot do this, since a max is not
    # strictly monotone: a slower sub-solution with fewer instances can yield the same max.
    allowed = L <= best * (1.0 + _TIE_RTOL)
    shapes = _fewest_instances(allowed, T, B)
    counts = Counter(shapes)
    merged = tuple(
        InstanceShape(threads=t, batch=b, count=n)
        for (t, b), n in sorted(counts.items(), key=lambda kv: (-kv[0][0], -kv[0][1]))
    )
    latency = max(float(L[t, b]) for t, b in counts)
    fat = profile.latency(min(T, profile.max_threads), B)
    return Plan(shapes=merged, latency=latency, fat_latency=fat)


def _latency_grid(profile: LatencyProfile, T: int, B: int) -> np.ndarray:
    """``L[t, b]`` for 0<=t<=T, 0<=b<=B; ``inf`` where no instance shape exists."""
    L = np.full((T + 1, B + 1), np.inf)
    for t in range(1, min(T, profile.max_threads) + 1):
        L[t, 1:] = [profile.latency(t, b) for b in range(1, B + 1)]
    return L


def _uniform_bound(L: np.ndarray, T: int, B: int) -> float:
    """Latency of the best near-uniform split: i instances of T//i threads, B split evenly.

    Any feasible configuration bounds the optimum from above; this one is cheap and, for
    profiles with diminishing returns in threads, close to optimal, which lets the dynamic
    program skip every instance shape slower than it.
    """
    tmax = int(np.isfinite(L[:, 1]).sum())
    bound = np.inf
    for i in range(1, min(T, B) + 1):
        t = min(T // i, tmax)
        q, r = divmod(B, i)
        worst = max(L[t, q], L[t, q + 1] if r else 0.0)
        bound = min(bound, float(worst))
    return bound


def _min_max_latency(L: np.ndarray, T: int, B: int, bound: float) -> float:
    """The paper's recurrence ``opt[t, b]``, returning ``opt[T, B]``.

    Row t only reads rows < t, so rows are filled in order, each as a vectorized min-max
    convolution over the batch axis. Shapes slower than ``bound`` (a feasible latency) are
    left out: the optimal configuration at (T, B) never uses one, and fewer shapes can only
    raise other entries, so ``opt[T, B]`` is unchanged while the work shrinks.
    """
    b = np.arange(1, B + 1)
    # Column B + 1 is padding that stays inf: indexes for b' > b point there.
    opt = np.full((T + 1, B + 2), np.inf)
    opt[:, 0] = 0.0
    shapes: list[tuple[int, np.ndarray, np.ndarray]] = []
    for tp in range(1, T + 1):
        bps = np.flatnonzero(L[tp, 1:] <= bound) + 1
        if bps.size:
            diff = b[:, None] - bps[None, :]
            shapes.append((tp, np.where(diff >= 0, diff, B + 1), L[tp, bps][None, :]))
    for t in range(1, T + 1):
        row = opt[t, 1 : B + 1]
        for tp, rest, latency in shapes:
            if tp > t:
                break
            np.minimum(row, np.maximum(opt[t - tp][rest], latency).min(axis=1), out=row)
    return float(opt[T, B])


def _fewest_instances(allowed: np.ndarray, T: int, B: int) -> list[tuple[int, int]]:
    """Allowed shapes covering B inputs with <= T threads: fewest instances, then threads.

    For a given batch only the allowed shape with the fewest threads matters (same instance
    count, fewer threads), so the table is T x B over at most B shapes. The two objectives
    are packed into one additive cost, lexicographic because an instance's weight T + 1
    exceeds any total of threads.
    """
    batches = np.flatnonzero(allowed[:, 1:].any(axis=0)) + 1
    threads = allowed[:, batches].argmax(axis=0)  # first True row: the fewest threads
    weight = (T + 1) + threads.astype(np.float64)
    b = np.arange(1, B + 1)
    cost = np.full((T + 1, B + 2), np.inf)
    cost[:, 0] = 0.0
    for t in range(1, T + 1):
        fits = threads <= t
        if not fits.any():
            continue
        diff = b[:, None] - batches[fits][None, :]
        rest = np.where(diff >= 0, diff, B + 1)
        sub = cost[(t - threads[fits])[None, :], rest] + weight[fits][None, :]
        cost[t, 1 : B + 1] = sub.min(axis=1)
    # Walk back from (T, B); when several shapes lead to the optimum, take the one with the
    # most threads, then the largest batch, so the answer does not depend on array order.
    shapes: list[tuple[int, int]] = []
    t, left = T, B
    while left > 0:
        fits = (threads <= t) & (batches <= left)
        hit = fits.copy()
        hit[fits] = cost[t - threads[fits], left - batches[fits]] + weight[fits] == cost[t, left]
        order = np.lexsort((batches[hit], threads[hit]))
        tp, bp = int(threads[hit][order[-1]]), int(batches[hit][order[-1]])
        shapes.append((tp, bp))
        t, left = t - tp, left - bp
    return shapes


def brute_force(profile: LatencyProfile, T: int, B: int) -> float:
    """Optimal expected latency by exhaustive search, to check ``optimize`` in tests.

    Enumerates every multiset of instances (t, b) with Σt <= T and Σb == B by depth-first
    search over shapes in non-increasing order, so each multiset is visited once; branches
    whose running maximum already reaches the best complete configuration are cut. Unlike the
    dynamic program it keeps no table of sub-problems. Exponential: only for small T and B.
    """
    if T < 1 or B < 1:
        raise InvalidInput(f"brute_force needs T >= 1 and B >= 1, got T={T}, B={B}")
    shapes = [(t, b, profile.latency(t, b)) for t in range(min(T, profile.max_threads), 0, -1) for b in range(B, 0, -1)]
    best = math.inf

    def search(start: int, threads_left: int, batch_left: int, worst: float) -> None:
        nonlocal best
        if batch_left == 0:
            best = min(best, worst)
            return
        if threads_left == 0:
            return
        for i in range(start, len(shapes)):
            t, b, latency = shapes[i]
            if t > threads_left or b > batch_left or max(worst, latency) >= best:
                continue
            search(i, threads_left - t, batch_left - b, max(worst, latency))

    search(0, T, B, 0.0)
    return best
