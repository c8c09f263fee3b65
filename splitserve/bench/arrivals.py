"""Arrival schedules: when each request is sent, in seconds from the start of a run.

Pure functions of their arguments and a seeded ``numpy.random.Generator``: the same seed gives
the same schedule, so two systems can be measured under identical load. The load generator
(``loadgen.open_loop``) consumes ``Arrival`` lists; these functions make them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.errors import InvalidInput

CLASSES: tuple[str, ...] = ("rt", "be")  # real-time and best-effort


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request to send: at ``t`` seconds from the start, to ``model``, in class ``cls``.

    ``tag`` names where the arrival came from (a DISB task id, a trace name) so results can be
    broken down by it; the load generator passes the whole arrival to the sender.
    """

    t: float
    model: str = ""
    cls: str = "rt"
    tag: str | None = None

    def __post_init__(self) -> None:
        if self.cls not in CLASSES:
            raise InvalidInput(f"arrival class must be one of {CLASSES}, got {self.cls!r}")
        if not math.isfinite(self.t) or self.t < 0:
            raise InvalidInput(f"arrival time must be a finite number >= 0, got {self.t!r}")


def _check_rate(rate: float, duration: float) -> None:
    if not (math.isfinite(rate) and rate >= 0):
        raise InvalidInput(f"rate must be a finite number >= 0 req/s, got {rate!r}")
    if not (math.isfinite(duration) and duration >= 0):
        raise InvalidInput(f"duration must be a finite number >= 0 s, got {duration!r}")


def poisson(rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    """Send times of a Poisson process of ``rate`` req/s over ``[0, duration)``, ascending.

    Built from exponential inter-arrival gaps (mean ``1/rate``), the open-loop model of
    SplitRPC §6 for user-facing load.
    """
    _check_rate(rate, duration)
    if rate == 0 or duration == 0:
        return np.empty(0)
    expected = rate * duration
    # Draw enough gaps in one go that a second round is rare (6 sigma above the mean count).
    chunk = int(expected + 6 * math.sqrt(expected) + 16)
    times = np.cumsum(rng.exponential(1.0 / rate, chunk))
    while times[-1] < duration:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, chunk))
        times = np.concatenate([times, more])
    return times[times < duration]


def uniform(rate: float, duration: float, phase: float = 0.0) -> np.ndarray:
    """Strictly periodic send times ``phase + k/rate`` in ``[0, duration)``, ascending.

    ``phase`` (``0 <= phase < 1/rate``) shifts the whole train; DISB staggers real-time clients
    of the same frequency this way so they do not all fire at the same instant.
    """
    _check_rate(rate, duration)
    if rate == 0 or duration == 0:
        return np.empty(0)
    period = 1.0 / rate
    if not (0 <= phase < period):
        raise InvalidInput(f"phase must be in [0, {period:g}) s for rate {rate:g}, got {phase!r}")
    # Count from integers, not by repeated addition, so 100 req/s over 2 s is exactly 200.
    n = max(0, math.ceil((duration - phase) * rate - 1e-9))
    return phase + np.arange(n, dtype=np.float64) / rate


def _check_points(points: Sequence[tuple[float, float]]) -> None:
    if not points:
        raise InvalidInput("rate trace has no points")
    prev = -math.inf
    for i, (t, r) in enumerate(points):
        if not (math.isfinite(t) and t >= 0):
            raise InvalidInput(f"rate trace point {i}: time must be a finite number >= 0, got {t!r}")
        if t <= prev:
            raise InvalidInput(f"rate trace point {i}: time {t!r} must be after the previous one")
        if not (math.isfinite(r) and r >= 0):
            raise InvalidInput(f"rate trace point {i}: rate must be a finite number >= 0, got {r!r}")
        prev = t


def from_rate_trace(
    points: Sequence[tuple[float, float]], duration: float, rng: np.random.Generator
) -> np.ndarray:
    """Send times of a non-homogeneous Poisson process following a rate trace, ascending.

    ``points`` are ``(time s, rate req/s)`` with increasing times; each rate holds from its time
    until the next point's (a step function; the last one holds until ``duration``), and the
    rate before the first point is 0. Each step is an exact Poisson process at its rate.
    """
    _check_points(points)
    _check_rate(0.0, duration)
    pieces: list[np.ndarray] = []
    for i, (t0, rate) in enumerate(points):
        t1 = points[i + 1][0] if i + 1 < len(points) else duration
        t1 = min(t1, duration)
        if t1 <= t0 or rate == 0:
            continue
        pieces.append(t0 + poisson(rate, t1 - t0, rng))
    return np.concatenate(pieces) if pieces else np.empty(0)


def to_arrivals(
    times: Iterable[float], model: str = "", cls: str = "rt", tag: str | None = None
) -> list[Arrival]:
    """Arrivals for ``model`` in class ``cls`` at each of ``times``."""
    return [Arrival(float(t), model, cls, tag) for t in times]


def merge(*streams: Iterable[Arrival]) -> list[Arrival]:
    """All arrivals of several streams in one list ordered by time (stable for ties)."""
    return sorted((a for s in streams for a in s), key=lambda a: a.t)


def shard(arrivals: Sequence[Arrival], index: int, count: int) -> list[Arrival]:
    """Every ``count``-th arrival starting at ``index``: one of ``count`` generator processes'
    share, each covering the whole run at ``1/count`` of the rate."""
    if not 0 <= index < count:
        raise InvalidInput(f"shard index must be in [0, {count}), got {index}")
    return list(arrivals[index::count])
