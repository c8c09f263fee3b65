"""bench cluster-tax's arithmetic: the gateway's added latency and the ratios (no cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.bench.scenarios.cluster_tax import compare, compare_loaded


def test_the_added_latency_and_ratios_come_from_the_same_percentiles() -> None:
    direct = np.arange(1.0, 101.0)  # p50 50.5, p99 99.01
    out = compare(direct + 30.0, direct)
    assert out["added_p50_us"] == pytest.approx(30.0)
    assert out["added_p99_us"] == pytest.approx(30.0)
    assert out["ratio_p50"] == pytest.approx(80.5 / 50.5)
    assert out["ratio_p99"] == pytest.approx(129.01 / 99.01)


def test_no_samples_give_no_numbers_rather_than_an_error() -> None:
    out = compare(np.array([]), np.array([1.0]))
    assert out["added_p50_us"] is None and out["ratio_p50"] is None


def test_loaded_runs_compare_p50_p99_and_throughput() -> None:
    def summary(p50: float, p99: float, rps: float) -> dict:
        return {"latency_ms": {"p50": p50, "p99": p99}, "throughput_rps": rps, "errors": 0,
                "generator_bottleneck": False}

    out = compare_loaded(summary(2.0, 8.0, 900.0), summary(1.0, 4.0, 1000.0))
    assert out["ratio"] == pytest.approx({"p50_ms": 2.0, "p99_ms": 2.0, "rps": 0.9})
    assert out["gateway"]["bottleneck"] is None
