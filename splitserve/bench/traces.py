"""Built-in load traces as ``(time s, rate req/s)`` step points, and CSV trace files.

A rate trace says how hard to push over time; ``arrivals.from_rate_trace`` turns it into send
times (each rate holds until the next point). ``load_csv`` also reads explicit arrival lists
(``time,model,class``) for multi-model replays.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from splitserve.bench.arrivals import CLASSES, Arrival
from splitserve.errors import InvalidInput

RatePoints = list[tuple[float, float]]

# Wikipedia-like day (SplitRPC §6.5 replays the Wikibench trace): a night trough around 04:00,
# a midday peak and a larger evening peak. Centres and widths in hours; peak/trough is ~2.3.
_DAY_PEAKS: tuple[tuple[float, float, float], ...] = (
    # (height over the base, centre h, width h)
    (0.9, 12.5, 2.5),
    (1.3, 20.5, 2.2),
)


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise InvalidInput(f"{name} must be a positive number, got {value!r}")


def diurnal_shape(hours: np.ndarray) -> np.ndarray:
    """The noise-free daily load curve at ``hours`` (0-24), scaled to mean 1 over a day."""
    day = np.arange(0.0, 24.0, 24.0 / 1440)  # one-minute grid for the normalising mean

    def raw(h: np.ndarray) -> np.ndarray:
        out = np.ones_like(h, dtype=np.float64)
        for height, centre, width in _DAY_PEAKS:
            d = np.abs(h % 24.0 - centre)
            d = np.minimum(d, 24.0 - d)  # the day wraps: 23:00 is close to 01:00
            out += height * np.exp(-0.5 * (d / width) ** 2)
        return out

    return np.asarray(raw(np.asarray(hours, dtype=np.float64)) / raw(day).mean(), dtype=np.float64)


def diurnal(
    duration: float,
    mean_rate: float,
    rng: np.random.Generator,
    noise: float = 0.1,
    points: int = 288,
) -> RatePoints:
    """A 24-hour Wikipedia-like load compressed into ``duration`` seconds.

    ``points`` steps (288 = one per five minutes of the day) of the two-peak daily curve scaled
    to ``mean_rate``, each multiplied by ``1 + noise * N(0, 1)`` (SplitRPC §6.5 adds 10%
    Gaussian noise for burstiness) and clipped at 0.
    """
    _check_positive("duration", duration)
    if not (math.isfinite(mean_rate) and mean_rate >= 0):
        raise InvalidInput(f"mean_rate must be a number >= 0, got {mean_rate!r}")
    if not (math.isfinite(noise) and noise >= 0):
        raise InvalidInput(f"noise must be a number >= 0, got {noise!r}")
    if points < 1:
        raise InvalidInput(f"points must be >= 1, got {points}")
    step = duration / points
    hours = (np.arange(points) + 0.5) * 24.0 / points  # sample each step at its middle
    rates = mean_rate * diurnal_shape(hours) * (1.0 + noise * rng.standard_normal(points))
    rates = np.clip(rates, 0.0, None)
    return [(i * step, float(r)) for i, r in enumerate(rates)]


def _append_step(out: RatePoints, t: float, rate: float) -> None:
    # Keep times strictly increasing and drop steps that do not change the rate.
    if out and out[-1][0] >= t:
        out[-1] = (out[-1][0], rate)
    elif not out or out[-1][1] != rate:
        out.append((t, rate))


def bursty(
    duration: float,
    mean_rate: float,
    peak_to_mean: float,
    rng: np.random.Generator,
    bursts: int = 10,
) -> RatePoints:
    """On/off load: ``bursts`` equal cycles, each with one burst at ``peak_to_mean * mean_rate``
    at a random place in the cycle and silence otherwise.

    The burst lasts ``1/peak_to_mean`` of its cycle, so the mean over the run is exactly
    ``mean_rate`` and only the burst positions are random.
    """
    _check_positive("duration", duration)
    if not (math.isfinite(mean_rate) and mean_rate >= 0):
        raise InvalidInput(f"mean_rate must be a number >= 0, got {mean_rate!r}")
    if not (math.isfinite(peak_to_mean) and peak_to_mean >= 1):
        raise InvalidInput(f"peak_to_mean must be a number >= 1, got {peak_to_mean!r}")
    if bursts < 1:
        raise InvalidInput(f"bursts must be >= 1, got {bursts}")
    cycle = duration / bursts
    on = cycle / peak_to_mean
    peak = mean_rate * peak_to_mean
    out: RatePoints = []
    for k in range(bursts):
        c0 = k * cycle
        start = c0 + float(rng.uniform(0.0, cycle - on))
        _append_step(out, c0, 0.0)
        _append_step(out, start, peak)
        _append_step(out, start + on, 0.0)
    return out


def periodic_rt(frequency: float, duration: float) -> RatePoints:
    """A constant ``frequency`` as a rate trace, for plotting or composing with other traces.

    As a rate trace it replays as Poisson arrivals; for sends on a strict period (camera-like
    real-time clients) use ``arrivals.uniform(frequency, duration)`` instead.
    """
    _check_positive("frequency", frequency)
    _check_positive("duration", duration)
    return [(0.0, float(frequency)), (float(duration), float(frequency))]


def mean_rate_of(points: RatePoints, duration: float) -> float:
    """The time-averaged rate of a step trace over ``[0, duration)``."""
    _check_positive("duration", duration)
    total = 0.0
    for i, (t0, rate) in enumerate(points):
        t1 = min(points[i + 1][0] if i + 1 < len(points) else duration, duration)
        if t1 > t0:
            total += rate * (t1 - t0)
    return total / duration


@dataclass
class CsvTrace:
    """What ``load_csv`` read: either rate points or arrivals, never both."""

    rates: RatePoints = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``"rate"`` for a ``time,rate`` file, ``"arrivals"`` for a ``time,model,class`` file."""
        return "rate" if self.rates else "arrivals"


_HEADERS: dict[tuple[str, ...], str] = {
    ("time", "rate"): "rate",
    ("time", "model", "class"): "arrivals",
}


def _number(cell: str, where: str, field_name: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise InvalidInput(f"{where}: {field_name}: must be a number, got {cell!r}") from None
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(f"{where}: {field_name}: must be a finite number >= 0, got {cell!r}")
    return value


def load_csv(path: Path | str) -> CsvTrace:
    """Read a trace file: ``time,rate`` rows or ``time,model,class`` rows, header optional.

    Times are seconds from the start; rate is req/s; class is ``rt`` or ``be``. Blank lines and
    lines starting with ``#`` are skipped. Rate rows must have increasing times; arrival rows
    may come in any order and are returned sorted. Any bad row raises InvalidInput naming the
    file, line number and field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read trace file: {e.strerror or e}") from None
    kind: str | None = None
    result = CsvTrace()
    # splitlines first: csv.reader then yields exactly one row per line, so numbers match
    for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
        cells = [c.strip() for c in row]
        if not cells or not any(cells) or cells[0].startswith("#"):
            continue
        where = f"{path} line {lineno}"
        if kind is None:
            header = tuple(c.lower() for c in cells)
            if header in _HEADERS:
                kind = _HEADERS[header]
                continue
            if len(cells) == 2:
                kind = "rate"
            elif len(cells) == 3:
                kind = "arrivals"
            else:
                raise InvalidInput(
                    f"{where}: expected 'time,rate' or 'time,model,class', got {len(cells)} fields"
                )
        expected = 2 if kind == "rate" else 3
        if len(cells) != expected:
            form = "time,rate" if kind == "rate" else "time,model,class"
            raise InvalidInput(f"{where}: expected {expected} fields ({form}), got {len(cells)}")
        t = _number(cells[0], where, "time")
        if kind == "rate":
            rate = _number(cells[1], where, "rate")
            if result.rates and t <= result.rates[-1][0]:
                raise InvalidInput(f"{where}: time: {cells[0]} must be after the previous row's time")
            result.rates.append((t, rate))
        else:
            model, cls = cells[1], cells[2].lower()
            if not model:
                raise InvalidInput(f"{where}: model: must not be empty")
            if cls not in CLASSES:
                raise InvalidInput(f"{where}: class: must be one of {', '.join(CLASSES)}, got {cells[2]!r}")
            result.arrivals.append(Arrival(t, model, cls))
    if not result.rates and not result.arrivals:
        raise InvalidInput(f"{path}: trace file has no rows")
    result.arrivals.sort(key=lambda a: a.t)
    return result


# -- PROTEAN's traces (§5): shapes matched to the published peak:mean, scaled to a mean rate --

WIKI_PEAK_TO_MEAN = 316 / 303  # PROTEAN §5: the Wikipedia trace's peak:mean (diurnal, smooth)
TWITTER_PEAK_TO_MEAN = 4561 / 2969  # PROTEAN §5: the Twitter trace's peak:mean (erratic)


def fit_peak_to_mean(shape: np.ndarray, mean_rate: float, peak_to_mean: float) -> np.ndarray:
    """``shape`` mapped affinely onto rates whose mean is ``mean_rate`` and whose peak is
    ``peak_to_mean`` times that, keeping its ups and downs in place.

    An affine map keeps the shape's timing and ordering and hits both targets exactly, which a
    multiplicative scale cannot (it fixes the ratio the shape happens to have). A map so steep
    that a trough would go below 0 is refused: that shape cannot have that peak:mean.
    """
    _check_positive("peak_to_mean", peak_to_mean)
    if peak_to_mean < 1:
        raise InvalidInput(f"peak_to_mean must be >= 1, got {peak_to_mean!r}")
    if not (math.isfinite(mean_rate) and mean_rate >= 0):
        raise InvalidInput(f"mean_rate must be a number >= 0, got {mean_rate!r}")
    x = np.asarray(shape, dtype=np.float64)
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise InvalidInput("the shape must be a non-empty array of finite numbers")
    x = x / x.mean() if x.mean() > 0 else x
    spread = float(x.max()) - 1.0
    if spread <= 0:  # a flat shape has peak:mean 1 whatever the scale
        return np.full(x.shape, float(mean_rate))
    a = (peak_to_mean - 1.0) / spread
    rates = 1.0 + a * (x - 1.0)
    if float(rates.min()) < 0:
        raise InvalidInput(f"this shape cannot reach peak:mean {peak_to_mean:g} without negative rates")
    return mean_rate * rates


def _steps(duration: float, rates: np.ndarray) -> RatePoints:
    step = duration / len(rates)
    return [(i * step, float(r)) for i, r in enumerate(rates)]


def wiki_like(duration: float, mean_rate: float, rng: np.random.Generator,
              peak_to_mean: float = WIKI_PEAK_TO_MEAN, noise: float = 0.02, points: int = 240) -> RatePoints:
    """A Wikipedia-like day compressed into ``duration`` s: the smooth two-peak diurnal curve
    with a little seeded noise, at ``mean_rate`` req/s with exactly ``peak_to_mean`` (PROTEAN
    §5 gives 316:303 for the real trace, which is nearly flat).

    The seed also picks where in the day the run starts, so two seeds give different runs.
    """
    _check_positive("duration", duration)
    if points < 2:
        raise InvalidInput(f"points must be >= 2, got {points}")
    start = float(rng.uniform(0.0, 24.0))
    hours = (start + (np.arange(points) + 0.5) * 24.0 / points) % 24.0
    shape = diurnal_shape(hours) * (1.0 + noise * rng.standard_normal(points))
    return _steps(duration, fit_peak_to_mean(np.clip(shape, 0.0, None), mean_rate, peak_to_mean))


def twitter_like(duration: float, mean_rate: float, rng: np.random.Generator,
                 peak_to_mean: float = TWITTER_PEAK_TO_MEAN, points: int = 240, bursts: int = 6) -> RatePoints:
    """An erratic Twitter-like trace in ``duration`` s at ``mean_rate`` req/s with exactly
    ``peak_to_mean`` (PROTEAN §5: 4561:2969): a log-normal AR(1) walk (load that drifts and
    jitters from step to step) with ``bursts`` short seeded surges on top.
    """
    _check_positive("duration", duration)
    if points < 2:
        raise InvalidInput(f"points must be >= 2, got {points}")
    walk = np.empty(points)
    walk[0] = 0.0
    for i in range(1, points):  # AR(1): each step keeps 0.8 of the last one's deviation
        walk[i] = 0.8 * walk[i - 1] + 0.25 * rng.standard_normal()
    shape = np.exp(walk)
    for _ in range(max(0, bursts)):
        at, width = int(rng.integers(0, points)), int(rng.integers(1, max(2, points // 40) + 1))
        shape[at:at + width] *= 1.0 + float(rng.uniform(0.5, 1.5))
    return _steps(duration, fit_peak_to_mean(shape, mean_rate, peak_to_mean))


def on_off_like(duration: float, mean_rate: float, rng: np.random.Generator, peak_to_mean: float = 3.0,
                period_s: float = 12.0, burst_s: float = 2.0, jitter: float = 0.25) -> RatePoints:
    """On/off load, the burstiness a keep-alive exists for (serverless keep-alive studies;
    PROTEAN §4.2): every ``period_s`` a burst of ``burst_s`` at ``peak_to_mean × mean_rate``,
    a steady base rate in between, at exactly ``mean_rate`` over ``duration`` s.

    Each cycle is a gap, then its burst; the seed moves each burst earlier by up to ``jitter``
    of the nominal gap (``period_s - burst_s``), so two bursts are always at least
    ``(1 - jitter) × gap`` apart and the run starts with a gap. The base rate is what makes
    the mean exact over the bursts that fit (the last one is cut at ``duration``); a burst so
    tall or long that the base would go below 0 is refused.
    """
    _check_positive("duration", duration)
    _check_positive("period_s", period_s)
    _check_positive("burst_s", burst_s)
    if not (math.isfinite(mean_rate) and mean_rate >= 0):
        raise InvalidInput(f"mean_rate must be a number >= 0, got {mean_rate!r}")
    if not (math.isfinite(peak_to_mean) and peak_to_mean >= 1):
        raise InvalidInput(f"peak_to_mean must be a number >= 1, got {peak_to_mean!r}")
    if burst_s >= period_s:
        raise InvalidInput(f"burst_s ({burst_s:g}) must be shorter than period_s ({period_s:g}): a gap must remain")
    if duration < period_s:
        raise InvalidInput(f"duration ({duration:g} s) must hold at least one period ({period_s:g} s)")
    if not 0 <= jitter < 1:
        raise InvalidInput(f"jitter must be within [0, 1), got {jitter!r}")
    gap = period_s - burst_s
    bursts: list[tuple[float, float]] = []
    k = 0
    while (start := k * period_s + gap * (1.0 - jitter * float(rng.uniform()))) < duration:
        bursts.append((start, min(start + burst_s, duration)))
        k += 1
    on = sum(b - a for a, b in bursts)
    peak = peak_to_mean * mean_rate
    base = (mean_rate * duration - peak * on) / (duration - on)
    if base < 0:
        raise InvalidInput(f"bursts of {burst_s:g} s every {period_s:g} s at peak:mean {peak_to_mean:g} hold more "
                           f"than the whole mean: use lower or shorter bursts")
    out: RatePoints = []
    _append_step(out, 0.0, base)
    for a, b in bursts:
        _append_step(out, a, peak)
        _append_step(out, b, base)
    return out


def peak_to_mean_of(points: RatePoints, duration: float) -> float:
    """The highest step rate over the time-averaged rate of a step trace."""
    mean = mean_rate_of(points, duration)
    return max(r for t, r in points if t < duration) / mean if mean > 0 else math.nan


def switch_schedule(duration: float, every_s: float, models: tuple[str, ...] | list[str],
                    rng: np.random.Generator) -> list[tuple[float, str]]:
    """``(from time s, model)``: a model picked at random every ``every_s`` seconds, never the
    one just used when there is a choice (PROTEAN §5: the BE model "varies randomly (every
    ~20 s)"), so every boundary is a real switch."""
    _check_positive("duration", duration)
    _check_positive("every_s", every_s)
    if not models:
        raise InvalidInput("switch_schedule needs at least one model")
    out: list[tuple[float, str]] = []
    t, last = 0.0, None
    while t < duration:
        choices = [m for m in models if m != last] or list(models)
        last = choices[int(rng.integers(0, len(choices)))]
        out.append((t, last))
        t += every_s
    return out


def model_at(schedule: list[tuple[float, str]], t: float) -> str:
    """The model a ``switch_schedule`` names at time ``t``."""
    i = bisect.bisect_right([start for start, _ in schedule], t) - 1
    return schedule[max(i, 0)][1]


def strict_be_mix(times: np.ndarray, strict_model: str, be_schedule: list[tuple[float, str]],
                  strict_share: float, rng: np.random.Generator) -> list[Arrival]:
    """One arrival per send time: exactly ``round(strict_share × n)`` of them, chosen at random,
    are strict (``rt``) requests for ``strict_model``; the rest are best-effort requests for
    whichever model ``be_schedule`` names at their time. Tags say ``strict`` or ``be``."""
    if not (math.isfinite(strict_share) and 0 <= strict_share <= 1):
        raise InvalidInput(f"strict_share must be within 0..1, got {strict_share!r}")
    n = len(times)
    strict = np.zeros(n, dtype=bool)
    strict[rng.permutation(n)[:round(strict_share * n)]] = True
    return [Arrival(float(t), strict_model, "rt", "strict") if s
            else Arrival(float(t), model_at(be_schedule, float(t)), "be", "be")
            for t, s in zip(times, strict, strict=True)]
