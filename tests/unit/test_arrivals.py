"""Arrival schedules and load traces: rates, shapes, seeding and CSV parsing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splitserve.bench import arrivals, traces
from splitserve.bench.arrivals import Arrival
from splitserve.errors import InvalidInput


def test_poisson_inter_arrival_mean_matches_rate() -> None:
    rate = 200.0
    times = arrivals.poisson(rate, 60.0, np.random.default_rng(1))
    gaps = np.diff(times)[:10_000]
    assert gaps.size == 10_000
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate
    # exponential gaps: standard deviation equals the mean
    assert abs(gaps.std() - 1 / rate) < 0.05 / rate
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < 60.0


def test_poisson_is_reproducible_from_the_seed() -> None:
    a = arrivals.poisson(50.0, 10.0, np.random.default_rng(7))
    b = arrivals.poisson(50.0, 10.0, np.random.default_rng(7))
    c = arrivals.poisson(50.0, 10.0, np.random.default_rng(8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_poisson_zero_rate_and_bad_arguments() -> None:
    assert arrivals.poisson(0.0, 10.0, np.random.default_rng(0)).size == 0
    with pytest.raises(InvalidInput, match="rate"):
        arrivals.poisson(-1.0, 10.0, np.random.default_rng(0))
    with pytest.raises(InvalidInput, match="duration"):
        arrivals.poisson(1.0, float("nan"), np.random.default_rng(0))


def test_uniform_is_exactly_periodic() -> None:
    times = arrivals.uniform(100.0, 2.0)
    assert times.size == 200
    assert np.allclose(np.diff(times), 0.01)
    shifted = arrivals.uniform(100.0, 2.0, phase=0.004)
    assert shifted.size == 200 and shifted[0] == pytest.approx(0.004)
    with pytest.raises(InvalidInput, match="phase"):
        arrivals.uniform(100.0, 2.0, phase=0.02)


def test_rate_trace_steps_hold_until_the_next_point() -> None:
    rng = np.random.default_rng(3)
    times = arrivals.from_rate_trace([(0.0, 1000.0), (10.0, 0.0), (20.0, 200.0)], 30.0, rng)
    first = np.count_nonzero(times < 10.0)
    middle = np.count_nonzero((times >= 10.0) & (times < 20.0))
    last = np.count_nonzero(times >= 20.0)
    assert abs(first - 10_000) < 400  # ~4 sigma
    assert middle == 0
    assert abs(last - 2_000) < 180
    assert np.all(np.diff(times) >= 0) and times[-1] < 30.0


def test_rate_trace_refuses_bad_points() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(InvalidInput, match="no points"):
        arrivals.from_rate_trace([], 1.0, rng)
    with pytest.raises(InvalidInput, match="point 1: time"):
        arrivals.from_rate_trace([(1.0, 1.0), (1.0, 2.0)], 5.0, rng)
    with pytest.raises(InvalidInput, match="point 0: rate"):
        arrivals.from_rate_trace([(0.0, -1.0)], 5.0, rng)


def test_arrival_helpers() -> None:
    a = arrivals.to_arrivals([0.3, 0.1], "vgg19", "rt", "cam")
    b = arrivals.to_arrivals([0.2], "resnet152", "be")
    merged = arrivals.merge(a, b)
    assert [x.t for x in merged] == [0.1, 0.2, 0.3]
    assert merged[1] == Arrival(0.2, "resnet152", "be", None)
    assert [x.t for x in arrivals.shard(merged, 1, 2)] == [0.2]
    with pytest.raises(InvalidInput, match="class"):
        Arrival(0.0, "m", "gold")


def _window_mean(points: list[tuple[float, float]], t0: float, t1: float) -> float:
    return float(np.mean([r for t, r in points if t0 <= t < t1]))


def test_diurnal_has_the_mean_and_a_two_peak_day() -> None:
    duration, mean = 240.0, 50.0  # one "hour" of the day per 10 s
    clean = traces.diurnal(duration, mean, np.random.default_rng(0), noise=0.0)
    assert traces.mean_rate_of(clean, duration) == pytest.approx(mean, rel=0.01)
    rates = np.array([r for _, r in clean])
    assert 2.0 <= rates.max() / rates.min() <= 3.0
    night = _window_mean(clean, 30, 60)  # 03:00-06:00
    midday = _window_mean(clean, 115, 135)  # 11:30-13:30
    afternoon = _window_mean(clean, 160, 170)  # 16:00-17:00, between the peaks
    evening = _window_mean(clean, 195, 215)  # 19:30-21:30
    assert midday > afternoon < evening
    assert evening > midday > night

    noisy = traces.diurnal(duration, mean, np.random.default_rng(0))
    assert traces.mean_rate_of(noisy, duration) == pytest.approx(mean, rel=0.1)
    residual = np.array([r for _, r in noisy]) / rates - 1.0
    assert 0.07 < residual.std() < 0.13  # 10% Gaussian noise

    times = arrivals.from_rate_trace(noisy, duration, np.random.default_rng(1))
    assert times.size / duration == pytest.approx(mean, rel=0.1)


def test_bursty_has_the_mean_and_the_peak() -> None:
    duration, mean = 20.0, 40.0
    points = traces.bursty(duration, mean, 4.0, np.random.default_rng(2), bursts=5)
    assert traces.mean_rate_of(points, duration) == pytest.approx(mean, rel=1e-9)
    assert max(r for _, r in points) == pytest.approx(160.0)
    assert min(r for _, r in points) == 0.0
    times = arrivals.from_rate_trace(points, duration, np.random.default_rng(3))
    assert times.size / duration == pytest.approx(mean, rel=0.1)
    with pytest.raises(InvalidInput, match="peak_to_mean"):
        traces.bursty(duration, mean, 0.5, np.random.default_rng(0))


def test_periodic_rt_is_a_constant_rate() -> None:
    points = traces.periodic_rt(30.0, 5.0)
    assert traces.mean_rate_of(points, 5.0) == pytest.approx(30.0)


def test_csv_rate_form_with_and_without_header(tmp_path: Path) -> None:
    with_header = tmp_path / "a.csv"
    with_header.write_text("time,rate\n0,10\n# comment\n\n5,20.5\n")
    got = traces.load_csv(with_header)
    assert got.kind == "rate" and got.rates == [(0.0, 10.0), (5.0, 20.5)] and got.arrivals == []
    bare = tmp_path / "b.csv"
    bare.write_text("0, 10\n5, 20.5\n")
    assert traces.load_csv(bare).rates == got.rates


def test_csv_arrival_form_is_sorted(tmp_path: Path) -> None:
    f = tmp_path / "arr.csv"
    f.write_text("Time,Model,Class\n0.5,vgg19,rt\n0.1,resnet152,BE\n")
    got = traces.load_csv(f)
    assert got.kind == "arrivals"
    assert got.arrivals == [Arrival(0.1, "resnet152", "be"), Arrival(0.5, "vgg19", "rt")]
    bare = tmp_path / "bare.csv"
    bare.write_text("0.5,vgg19,rt\n")
    assert traces.load_csv(bare).arrivals == [Arrival(0.5, "vgg19", "rt")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,rate\n0,10\n1,abc\n", "line 3: rate: must be a number"),
        ("time,rate\n0,10\n1,-2\n", "line 3: rate: must be a finite number >= 0"),
        ("0,10\n0,20\n", "line 2: time: 0 must be after"),
        ("time,rate\n0,10\n1,2,3\n", "line 3: expected 2 fields"),
        ("0,vgg19,rt\nx,vgg19,rt\n", "line 2: time: must be a number"),
        ("time,model,class\n0,vgg19,gold\n", "line 2: class: must be one of rt, be"),
        ("time,model,class\n0,,rt\n", "line 2: model: must not be empty"),
        ("a,b,c,d\n", "line 1: expected 'time,rate' or 'time,model,class'"),
        ("# only a comment\n", "no rows"),
    ],
)
def test_csv_errors_name_the_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(InvalidInput, match=message) as info:
        traces.load_csv(f)
    assert str(f) in str(info.value)


def test_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read"):
        traces.load_csv(tmp_path / "nope.csv")
