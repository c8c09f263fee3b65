"""The memory manager's pure decider (``memory.cache.ResidencyCache``): LRU victims, the
byte budget, one loader at a time, real-time first, and equality with a reference LRU."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.memory.cache import Plan, Residency, ResidencyCache

MB = 1 << 20


class Node:
    """Drives a cache the way ``memory.manager.MemoryManager`` does, with instant loads and
    evictions: a fake clock, and the plan carried out at once."""

    def __init__(self, cache: ResidencyCache, sizes: dict[str, int] | None = None) -> None:
        self.cache = cache
        self.sizes = sizes or {}
        self.now = 0.0
        self.misses: list[str] = []

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def plan(self, busy: tuple[str, ...] = ()) -> Plan:
        return self.cache.plan(self.tick(), busy)

    def settle(self, busy: tuple[str, ...] = ()) -> None:
        """Plan and complete every eviction and load until nothing more happens."""
        while p := self.plan(busy):
            for v in p.evict:
                self.cache.released(v)
            for m in p.load:
                self.cache.loaded(m, self.sizes.get(m, 0))

    def use(self, name: str, busy: tuple[str, ...] = ()) -> None:
        """A request for ``name`` at concurrency 1: load it if needed, then run its batch."""
        e = self.cache.entry(name)
        if e.residency is not Residency.RESIDENT:
            self.misses.append(name)
            e.charge = self.sizes.get(name, 0)
            self.cache.request(name, self.tick())
            self.settle(busy)
        assert self.cache.entry(name).residency is Residency.RESIDENT
        self.cache.touch(name, self.tick())


def reference_lru(requests: list[str], capacity: int) -> list[str]:
    """The textbook LRU cache's misses."""
    cache: OrderedDict[str, None] = OrderedDict()
    misses = []
    for r in requests:
        if r in cache:
            cache.move_to_end(r)
            continue
        misses.append(r)
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[r] = None
    return misses


def test_the_least_recently_used_model_is_the_victim_and_a_batch_start_counts_as_use():
    node = Node(ResidencyCache(None, max_resident=4))
    for m in "ABCD":
        node.use(m)
    node.use("E")
    assert node.cache.entry("A").residency is Residency.EVICTED
    assert node.cache.lru() == list("BCDE")

    node = Node(ResidencyCache(None, max_resident=4))
    for m in "ABCD":
        node.use(m)
    node.cache.touch("A", node.tick())  # a batch of A begins before E is asked for
    node.use("E")
    assert node.cache.entry("B").residency is Residency.EVICTED
    assert node.cache.lru() == list("CDAE")


def test_the_byte_budget_holds_at_most_what_fits():
    sizes = {m: 40 * MB for m in "ABC"}
    node = Node(ResidencyCache(100 * MB, None), sizes)
    for m in "ABC":
        node.use(m)
        assert node.cache.reserved <= 100 * MB
    assert node.cache.lru() == ["B", "C"]


@pytest.mark.parametrize("why", ["busy", "keep_resident"])
def test_busy_suspended_reconfiguring_and_keep_resident_models_are_never_victims(why):
    node = Node(ResidencyCache(None, max_resident=2))
    node.use("A")
    node.use("B")
    busy: tuple[str, ...] = ()
    if why == "busy":  # a running or suspended batch, or a reconfiguration: the caller says "busy"
        busy = ("A",)
    else:
        node.cache.entry("A").keep_resident = True
    node.use("C", busy=busy)
    assert node.cache.entry("A").residency is Residency.RESIDENT
    assert node.cache.entry("B").residency is Residency.EVICTED


def test_when_every_resident_model_is_busy_the_load_waits_without_evicting_or_looping():
    node = Node(ResidencyCache(None, max_resident=2))
    node.use("A")
    node.use("B")
    node.cache.request("C", node.tick())
    assert not node.plan(busy=("A", "B"))  # nothing to do now, and nothing is half done
    assert node.cache.load_queue() == ["C"]
    assert [e.residency for e in map(node.cache.entry, "AB")] == [Residency.RESIDENT] * 2
    p = node.plan(busy=("B",))  # A's batch ended: the next plan (at batch end) evicts it
    assert p.evict == ["A"] and p.load == []


def test_a_load_reserves_only_after_its_victims_have_released():
    node = Node(ResidencyCache(100 * MB, None), {"A": 60 * MB, "B": 60 * MB})
    node.use("A")
    node.cache.entry("B").charge = 60 * MB
    node.cache.request("B", node.tick())
    p = node.plan()
    assert p.evict == ["A"] and p.load == []
    assert node.cache.reserved == 60 * MB  # the evicting model still counts
    assert not node.plan()  # still evicting: B waits
    node.cache.released("A")
    assert node.plan().load == ["B"]
    assert node.cache.reserved == 60 * MB


def test_a_model_larger_than_the_budget_less_keep_resident_models_is_refused_naming_both():
    node = Node(ResidencyCache(100 * MB, None), {"K": 30 * MB})
    node.use("K")
    node.cache.entry("K").keep_resident = True
    node.cache.entry("big").charge = 80 * MB
    node.cache.request("big", node.tick())
    p = node.plan()
    assert list(p.refuse) == ["big"] and not p.load and not p.evict
    assert str(80 * MB) in p.refuse["big"] and str(100 * MB) in p.refuse["big"] and str(70 * MB) in p.refuse["big"]
    assert node.cache.entry("big").residency is Residency.FAILED
    assert node.cache.entry("K").residency is Residency.RESIDENT


def test_one_loader_at_a_time_by_default():
    cache = ResidencyCache(None, None)
    cache.request("A", 1.0)
    cache.request("B", 2.0)
    assert cache.plan(3.0).load == ["A"]
    assert cache.plan(4.0).load == []  # A still loads
    cache.loaded("A", 0)
    assert cache.plan(5.0).load == ["B"]
    two = ResidencyCache(None, None, max_loads=2)
    for i, m in enumerate("ABC"):
        two.request(m, float(i))
    assert two.plan(9.0).load == ["A", "B"]


def test_a_model_with_real_time_work_waiting_loads_before_older_best_effort_ones():
    cache = ResidencyCache(None, None)
    cache.request("X", 0.0)  # holds the one loader
    assert cache.plan(0.5).load == ["X"]
    cache.request("be-old", 1.0)
    cache.request("rt-new", 2.0, rt_waiting=True)
    cache.request("be-newer", 3.0)
    assert cache.load_queue() == ["rt-new", "be-old", "be-newer"]
    cache.loaded("X", 0)
    assert cache.plan(4.0).load == ["rt-new"]


def test_a_load_that_measures_more_than_it_reserved_evicts_the_difference():
    node = Node(ResidencyCache(100 * MB, None), {"A": 40 * MB, "B": 40 * MB})
    node.use("A")
    node.use("B")  # B reserved 40 MB, but measures 70
    node.cache.loaded("B", 70 * MB)
    assert node.plan().evict == ["A"]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 6), max_size=60))
def test_at_concurrency_one_the_misses_equal_a_reference_lru(capacity, seq):
    requests = [f"m{i}" for i in seq]
    node = Node(ResidencyCache(None, max_resident=capacity))
    for r in requests:
        node.use(r)
    assert node.misses == reference_lru(requests, capacity)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(0, 5), max_size=40))
def test_equal_sizes_under_a_byte_budget_are_an_lru_of_that_many(seq):
    """A byte budget of k models of equal size behaves as an LRU of capacity k."""
    requests = [f"m{i}" for i in seq]
    node = Node(ResidencyCache(3 * 10 * MB, None), {f"m{i}": 10 * MB for i in range(6)})
    for r in requests:
        node.use(r)
        assert node.cache.reserved <= 30 * MB
    assert node.misses == reference_lru(requests, 3)
