"""The wait before the node's next look at its workers' pages (``server/direct_watch.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.server.direct_watch import LookPeriod


def test_looks_that_find_nothing_double_the_wait_up_to_the_idle_one_and_a_find_brings_it_back():
    p = LookPeriod(0.005, 0.05)
    assert [p.next(False) for _ in range(6)] == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]
    assert p.backed_off
    assert p.next(True) == 0.005 and not p.backed_off
    assert p.next(False) == 0.01


def test_hurry_brings_the_base_wait_back_at_once():
    p = LookPeriod(0.005, 0.05)
    for _ in range(4):
        p.next(False)
    p.hurry()
    assert p.wait_s == 0.005 and not p.backed_off


@pytest.mark.parametrize("base, idle", [(0.0, 0.05), (-1.0, 0.05), (0.05, 0.005), (float("nan"), 0.05)])
def test_a_period_out_of_order_is_refused(base, idle):
    with pytest.raises(ValueError):
        LookPeriod(base, idle)


@settings(derandomize=True, database=None)
@given(st.lists(st.booleans(), max_size=64))
def test_the_wait_stays_between_the_base_and_the_idle_one_and_is_the_base_after_a_find(finds):
    p = LookPeriod(0.005, 0.05)
    for found in finds:
        wait = p.next(found)
        assert 0.005 <= wait <= 0.05
        assert (wait == 0.005) if found else wait > 0.005
