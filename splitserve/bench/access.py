"""Access patterns over several models, the reference LRU a memory manager is checked against,
and the cost model that says what a miss ratio costs (Rafiqi §5.0.2, Figs 2-4).

Pure: sequences, miss lists and ratios from numbers, no clock and no I/O, so the multimodel
benchmark's claims can be checked in unit tests.

The cost model (rafiqi.md 2.3): at concurrency 1 a request costs ``c`` on a hit and ``c + s``
on a miss. With the miss ratio ``m`` and ``r = s / c``, a run's throughput is
``1 / (1 + m·r)`` of a run without misses, and ``(1 + r) / (1 + m·r)`` of one that loads on
every request. The paper's own figures (20 % throughput for the sequential pattern, m = 1)
imply r = 4; the benchmark measures both m and r in the same run instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from splitserve.types import Choice


class Pattern(Choice, what="pattern"):
    """How a run picks the model of each request among M models (Rafiqi §5.0.2)."""

    SEQUENTIAL = "sequential"  # round robin: the worst case for LRU, every request swaps once M > cache
    UNIFORM = "uniform"  # uniformly random
    ZIPF = "zipf"  # zipf(a) truncated to 1..M: model k has share k^-a / sum_j j^-a (E5)


def zipf_shares(models: int, a: float) -> np.ndarray:
    """The truncated zipf(a) distribution over ``models`` models, most popular first.

    Drawing ``numpy.random.zipf(a)`` and rejecting values above ``models`` gives exactly these
    shares (its pmf is k^-a / zeta(a)); for a = 1.1 over 5 models they are 46.4 / 21.7 / 13.9 /
    10.1 / 7.9 %, not the paper's "50 % / 37.5 %" (rafiqi.md E5).
    """
    if models < 1 or a <= 0:
        raise ValueError(f"zipf over {models} models with a = {a}: need models >= 1 and a > 0")
    w = np.arange(1, models + 1, dtype=np.float64) ** -a
    return w / w.sum()


def sequence(pattern: Pattern | str, models: int, n: int, seed: int, zipf_a: float = 1.1) -> list[int]:
    """``n`` model indices in ``0..models-1`` following ``pattern``; the same for the same seed."""
    pattern = Pattern.parse(pattern)
    if models < 1 or n < 0:
        raise ValueError(f"a sequence of {n} requests over {models} models")
    if pattern is Pattern.SEQUENTIAL:
        return [i % models for i in range(n)]
    rng = np.random.default_rng(seed)
    if pattern is Pattern.UNIFORM:
        return [int(i) for i in rng.integers(0, models, n)]
    return [int(i) for i in rng.choice(models, size=n, p=zipf_shares(models, zipf_a))]


def shares(seq: Sequence[int], models: int) -> list[float]:
    """The fraction of ``seq`` that went to each model (the shares a run really used)."""
    counts = np.bincount(np.asarray(seq, dtype=np.int64), minlength=models)[:models]
    return [float(c) / max(1, len(seq)) for c in counts]


def lru_misses(seq: Iterable[Hashable], capacity: int, resident: Sequence[Hashable] = ()) -> list[bool]:
    """Per request of ``seq``, whether an LRU cache of ``capacity`` models misses it.

    ``resident`` is the cache's content before the first request, least recently used first.
    This is the reference a memory manager at concurrency 1 must equal request for request.
    """
    if capacity < 1:
        raise ValueError(f"an LRU cache of capacity {capacity}")
    cache: OrderedDict[Hashable, None] = OrderedDict.fromkeys(list(resident)[-capacity:])
    out = []
    for key in seq:
        hit = key in cache
        cache[key] = None
        cache.move_to_end(key)
        if len(cache) > capacity:
            cache.popitem(last=False)
        out.append(not hit)
    return out


def cost_ratio(miss_ms: Sequence[float], hit_ms: Sequence[float]) -> float | None:
    """r = (mean miss time - mean hit time) / mean hit time; None without both kinds."""
    if len(miss_ms) == 0 or len(hit_ms) == 0:
        return None
    hit = float(np.mean(hit_ms))
    return (float(np.mean(miss_ms)) - hit) / hit if hit > 0 else None


def predicted_vs_ceiling(m: float, r: float) -> float:
    """Throughput with miss ratio ``m`` over throughput without misses: 1 / (1 + m·r)."""
    return 1.0 / (1.0 + m * r)


def predicted_vs_every_request(m: float, r: float) -> float:
    """Throughput with miss ratio ``m`` over throughput loading on every request: (1 + r) / (1 + m·r)."""
    return (1.0 + r) / (1.0 + m * r)


def within(measured: float | None, predicted: float | None, tolerance: float) -> bool | None:
    """Whether ``measured`` is within ``tolerance`` (relative) of ``predicted``; None if either is missing."""
    if measured is None or predicted is None or predicted == 0:
        return None
    return abs(measured / predicted - 1.0) <= tolerance


__all__ = ["Pattern", "cost_ratio", "lru_misses", "predicted_vs_ceiling", "predicted_vs_every_request",
           "sequence", "shares", "within", "zipf_shares"]
