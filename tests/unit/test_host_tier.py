"""The pinned host tier's decisions: its own budget, LRU drops, models reloading now never
dropped, a model larger than the budget never kept."""

from __future__ import annotations

import pytest

from splitserve.memory.host_tier import Offer, PinnedTier


def test_models_are_kept_within_the_budget_least_recently_used_dropped_first() -> None:
    tier = PinnedTier(100)
    assert tier.offer("a", 40, now=1) == Offer(True)
    assert tier.offer("b", 40, now=2) == Offer(True)
    tier.touch("a", now=3)  # a was reloaded from the tier: b is now the least recently used
    assert tier.offer("c", 50, now=4) == Offer(True, ("b",))
    assert tier.held() == {"a": 40, "c": 50} and tier.used == 90
    assert tier.offer("d", 100, now=5) == Offer(True, ("a", "c"))
    assert tier.holds("d") and not tier.holds("a")


def test_a_model_reloading_from_the_tier_is_never_dropped() -> None:
    tier = PinnedTier(100)
    tier.offer("a", 60, now=1)
    tier.offer("b", 30, now=2)
    assert tier.offer("c", 40, now=3, reloading={"a"}) == Offer(True, ("b",))  # a is older, but in flight
    assert tier.holds("a")


def test_what_cannot_fit_is_not_kept_and_drops_nothing() -> None:
    tier = PinnedTier(100)
    tier.offer("a", 90, now=1)
    no = tier.offer("big", 101, now=2)
    assert not no.keep and "more than the pinned tier's budget of 100" in no.reason and tier.holds("a")
    no = tier.offer("c", 20, now=3, reloading={"a"})
    assert not no.keep and "reloading now" in no.reason and tier.held() == {"a": 90}
    assert tier.offer("a", 50, now=4) == Offer(True)  # offered again: its size and clock updated
    assert tier.held() == {"a": 50}
    assert tier.forget("a") and not tier.forget("a") and tier.used == 0
    with pytest.raises(ValueError, match="non-negative number of bytes"):
        PinnedTier(-1)
    assert PinnedTier(0).offer("x", 1, now=0).keep is False
