"""The multimodel benchmark's pure parts: access patterns, the reference LRU, the cost model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.bench.access import (Pattern, cost_ratio, lru_misses, predicted_vs_ceiling, predicted_vs_every_request,
                                     sequence, shares, within, zipf_shares)
from splitserve.errors import InvalidInput


def test_sequential_is_round_robin():
    assert sequence("sequential", 3, 7, seed=5) == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("pattern", list(Pattern))
def test_a_seed_gives_one_sequence_in_range(pattern):
    a = sequence(pattern, 6, 500, seed=3)
    assert a == sequence(pattern, 6, 500, seed=3)
    assert len(a) == 500 and set(a) <= set(range(6))


def test_random_patterns_differ_by_seed():
    assert sequence("uniform", 8, 100, seed=1) != sequence("uniform", 8, 100, seed=2)


def test_an_unknown_pattern_is_refused_by_name():
    with pytest.raises(InvalidInput, match="pattern 'lfu'"):
        sequence("lfu", 3, 10, seed=0)


def test_truncated_zipf_shares_are_the_derived_ones_not_the_papers():
    # rafiqi.md E5: zipf(1.1) truncated to 1..5, not "50 % / 37.5 %"
    assert [round(s, 3) for s in zipf_shares(5, 1.1)] == [0.464, 0.217, 0.139, 0.101, 0.079]


def test_zipf_draws_follow_the_truncated_shares():
    seq = sequence("zipf", 5, 40_000, seed=11)
    for got, want in zip(shares(seq, 5), zipf_shares(5, 1.1)):
        assert got == pytest.approx(want, abs=0.01)


def test_lru_evicts_the_least_recently_used():
    # cache 4, A B C D E: A was evicted by E; touching A before E makes B the victim instead
    assert lru_misses("ABCDEA", 4) == [True] * 6
    assert lru_misses("ABCDAEA", 4) == [True, True, True, True, False, True, False]


def test_lru_starts_from_what_is_resident():
    assert lru_misses([0, 1, 2, 3], 4, resident=[3, 2, 1, 0]) == [False] * 4
    # resident beyond the capacity: only the most recent ones count
    assert lru_misses([0], 2, resident=[0, 1, 2]) == [True]


def test_sequential_thrashes_once_it_exceeds_the_cache():
    assert all(lru_misses(sequence("sequential", 5, 50, 0), 4))
    assert sum(lru_misses(sequence("sequential", 4, 50, 0), 4)) == 4


def test_uniform_miss_ratio_is_about_the_uncached_share():
    seq = sequence("uniform", 5, 20_000, seed=2)
    assert sum(lru_misses(seq, 4)) / len(seq) == pytest.approx(0.2, abs=0.02)  # (M - 4) / M


@given(st.lists(st.integers(0, 6), max_size=60), st.integers(1, 5))
def test_lru_equals_the_stack_distance_definition(seq, capacity):
    # independent definition: a request hits iff its model was seen before and fewer than
    # ``capacity`` distinct models were requested since (including itself)
    want = []
    for i, x in enumerate(seq):
        prev = [j for j in range(i) if seq[j] == x]
        want.append(not prev or len(set(seq[prev[-1]:i])) > capacity)
    assert lru_misses(seq, capacity) == want


def test_cost_model_reproduces_the_papers_arithmetic():
    # sequential (m = 1) at 20 % throughput means r = 4; then uniform over 5 (m = 0.2) predicts 1/1.8
    assert predicted_vs_ceiling(1.0, 4.0) == pytest.approx(0.2)
    assert predicted_vs_ceiling(0.2, 4.0) == pytest.approx(1 / 1.8)
    assert predicted_vs_every_request(1.0, 4.0) == pytest.approx(1.0)
    assert predicted_vs_every_request(0.0, 4.0) == pytest.approx(5.0)


def test_cost_ratio_from_miss_and_hit_times():
    assert cost_ratio([50.0, 50.0], [10.0, 10.0]) == pytest.approx(4.0)
    assert cost_ratio([], [10.0]) is None and cost_ratio([10.0], []) is None


def test_within_a_relative_tolerance():
    assert within(0.24, 0.2, 0.2) is True
    assert within(0.25, 0.2, 0.2) is False
    assert within(None, 0.2, 0.2) is None
