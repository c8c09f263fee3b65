"""PROTEAN's reactive autoscaler with keep-alive (§4.2), on a fake clock."""

from __future__ import annotations

import pytest

from splitserve.errors import InvalidInput
from splitserve.protean.instance_autoscale import InstanceAutoscaler

MIN = 60.0


def test_one_instance_per_pending_batch() -> None:
    a = InstanceAutoscaler(keep_alive_s=600)
    pending = {"vision": 300, "lang": 5, "idle": 0, "new": 1}
    batch = {"vision": 128, "lang": 4, "idle": 8, "new": 16}
    current = {"vision": 0, "lang": 1, "idle": 1}
    targets = a.tick(0.0, pending, batch, current)
    # ⌈300/128⌉ = 3, ⌈5/4⌉ = 2, a loaded idle model keeps 1, a model not loaded gets ⌈1/16⌉ = 1
    assert targets == {"vision": 3, "lang": 2, "idle": 1, "new": 1}
    assert sum(targets.values()) == 7
    assert a.cold_starts == {"vision": 3, "lang": 1, "new": 1}
    assert a.tick(1.0, {}, {}, {}) == {}  # nothing loaded, nothing pending


def test_nothing_retired_before_the_keep_alive() -> None:
    a = InstanceAutoscaler(keep_alive_s=10 * MIN)
    t = 0.0
    while t < 10 * MIN:
        assert a.tick(t, {"m": 128}, {"m": 128}, {"m": 5}) == {"m": 5}
        t += MIN
    assert a.retired == {}
    assert a.tick(10 * MIN, {"m": 128}, {"m": 128}, {"m": 5}) == {"m": 1}
    assert a.retired == {"m": 4}


def test_retires_only_the_smallest_surplus_of_the_window() -> None:
    a = InstanceAutoscaler(keep_alive_s=10 * MIN)
    for i, wanted in enumerate([1, 3, 2, 1, 1, 1, 1, 1, 1, 1]):
        assert a.tick(i * MIN, {"m": wanted * 8}, {"m": 8}, {"m": 5}) == {"m": 5}
    # surplus was 4, 2, 3, 4, ...: retire 2, keep the 3 that one tick of the window needed
    assert a.tick(10 * MIN, {"m": 8}, {"m": 8}, {"m": 5}) == {"m": 3}
    # a new window starts: the remaining surplus waits another keep-alive
    assert a.tick(11 * MIN, {"m": 8}, {"m": 8}, {"m": 3}) == {"m": 3}
    assert a.tick(21 * MIN, {"m": 8}, {"m": 8}, {"m": 3}) == {"m": 1}


def test_one_tick_without_surplus_restarts_the_window() -> None:
    a = InstanceAutoscaler(keep_alive_s=10 * MIN)
    a.tick(0.0, {"m": 8}, {"m": 8}, {"m": 4})
    assert a.tick(5 * MIN, {"m": 32}, {"m": 8}, {"m": 4}) == {"m": 4}  # surplus 0
    for t in (6 * MIN, 10 * MIN, 15 * MIN):
        assert a.tick(t, {"m": 8}, {"m": 8}, {"m": 4}) == {"m": 4}
    assert a.tick(16 * MIN, {"m": 8}, {"m": 8}, {"m": 4}) == {"m": 1}


def test_scale_up_is_immediate_and_counted_as_cold_starts() -> None:
    a = InstanceAutoscaler(keep_alive_s=10 * MIN)
    assert a.tick(0.0, {"m": 8}, {"m": 8}, {"m": 0}) == {"m": 1}
    assert a.tick(1.0, {"m": 40}, {"m": 8}, {"m": 1}) == {"m": 5}
    assert a.tick(2.0, {"m": 8}, {"m": 8}, {"m": 5}) == {"m": 5}  # kept warm
    assert a.tick(3.0, {"m": 40}, {"m": 8}, {"m": 5}) == {"m": 5}  # no new cold start
    assert a.cold_starts == {"m": 5}


def test_keep_alive_saves_cold_starts() -> None:
    """The same bursty load, with and without keep-alive: immediate scale-down pays a cold
    start for every burst, keep-alive only for the first."""
    counts = {}
    for keep_alive in (0.0, 10 * MIN):
        a = InstanceAutoscaler(keep_alive_s=keep_alive)
        have = 0
        for i in range(20):
            pending = 32 if i % 2 else 8
            have = a.tick(i * 30.0, {"m": pending}, {"m": 8}, {"m": have})["m"]
        counts[keep_alive] = a.cold_starts["m"]
    assert counts == {0.0: 4 + 3 * 9, 10 * MIN: 4}


def test_forgets_unloaded_models_and_rejects_bad_input() -> None:
    a = InstanceAutoscaler(keep_alive_s=MIN)
    a.tick(0.0, {}, {"m": 8}, {"m": 3})
    a.tick(30.0, {}, {}, {})  # unloaded
    assert a.tick(61.0, {}, {"m": 8}, {"m": 3}) == {"m": 3}  # loaded again: a new window, not the old one
    with pytest.raises(InvalidInput):
        InstanceAutoscaler(keep_alive_s=-1)
    with pytest.raises(InvalidInput):
        a.tick(3.0, {"m": 1}, {"m": 0}, {"m": 1})
    assert a.to_dict()["keep_alive_s"] == MIN
