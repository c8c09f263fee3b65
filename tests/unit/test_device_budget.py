"""Device memory as its own budget per GPU partition (``memory.cache.ResidencyCache`` with
``device_budget``): every instance's copy counted, host bytes never mixed in, LRU victims
taken per partition, refusals that name the partition."""

from __future__ import annotations

from splitserve.memory.cache import Residency, ResidencyCache
from splitserve.memory.footprints import MemoryFootprint

MB = 1 << 20
GPU0, GPU1 = "GPU-aaaa", "MIG-bbbb"


def _resident(cache: ResidencyCache, name: str, now: float, host: int, device: dict[str, int]) -> None:
    cache.request(name, now)
    cache.entry(name).charge, cache.entry(name).device_charge = host, dict(device)
    plan = cache.plan(now)
    assert plan.load == [name], plan
    cache.loaded(name, host, device)


def test_device_charge_counts_every_instance_copy() -> None:
    fp = MemoryFootprint(weights_bytes=100 * MB, private_bytes=10 * MB, measured=True, device_bytes=40 * MB)
    assert fp.device_charge({GPU0: 2, GPU1: 1}) == {GPU0: 80 * MB, GPU1: 40 * MB}
    assert fp.charge(3) == 130 * MB  # host: weights once (a shared mapping), private per instance
    assert MemoryFootprint(100 * MB).device_charge({GPU0: 2}) == {}  # nothing measured on a device yet


def test_a_full_gpu_evicts_only_models_on_that_gpu_in_lru_order() -> None:
    cache = ResidencyCache(budget=None, max_resident=None, device_budget=100 * MB)
    _resident(cache, "old_on_1", 1.0, 1 * MB, {GPU1: 60 * MB})  # least recently used, but on the other GPU
    _resident(cache, "a_on_0", 2.0, 1 * MB, {GPU0: 50 * MB})
    _resident(cache, "b_on_0", 3.0, 1 * MB, {GPU0: 40 * MB})
    cache.request("new_on_0", 4.0)
    cache.entry("new_on_0").device_charge = {GPU0: 30 * MB}
    plan = cache.plan(5.0)
    assert plan.evict == ["a_on_0"] and plan.load == []  # the load waits for its victim to release
    assert cache.entry("old_on_1").residency is Residency.RESIDENT
    cache.released("a_on_0")
    assert cache.plan(6.0).load == ["new_on_0"]
    assert cache.device_reserved() == {GPU0: 70 * MB, GPU1: 60 * MB}


def test_host_and_device_budgets_are_separate() -> None:
    cache = ResidencyCache(budget=10 * MB, max_resident=None, device_budget=100 * MB)
    _resident(cache, "a", 1.0, 2 * MB, {GPU0: 90 * MB})
    cache.request("b", 2.0)
    cache.entry("b").charge, cache.entry("b").device_charge = 2 * MB, {GPU1: 90 * MB}
    assert cache.plan(3.0).load == ["b"]  # host has room, and GPU1 is empty: nothing evicted
    assert cache.reserved == 4 * MB and cache.device_reserved() == {GPU0: 90 * MB, GPU1: 90 * MB}


def test_a_measured_device_size_over_the_reservation_evicts_the_difference() -> None:
    cache = ResidencyCache(budget=None, max_resident=None, device_budget=100 * MB)
    _resident(cache, "a", 1.0, 0, {GPU0: 50 * MB})
    cache.request("b", 2.0)
    cache.entry("b").device_charge = {GPU0: 40 * MB}
    assert cache.plan(3.0).load == ["b"]
    # b measured more than it reserved: GPU0 overflows, and the least recently used model goes
    cache.loaded("b", 0, {GPU0: 60 * MB})
    assert cache.plan(5.0).evict == ["a"]


def test_a_model_larger_than_its_gpu_is_refused_naming_the_partition() -> None:
    cache = ResidencyCache(budget=None, max_resident=None, device_budget=100 * MB)
    _resident(cache, "kept", 1.0, 0, {GPU0: 30 * MB})
    cache.entry("kept").keep_resident = True
    cache.request("big", 2.0)
    cache.entry("big").device_charge = {GPU0: 80 * MB}
    plan = cache.plan(3.0)
    assert list(plan.refuse) == ["big"] and GPU0 in plan.refuse["big"] and "70" not in plan.refuse["big"]
    assert str(70 * MB) in plan.refuse["big"]
    assert cache.entry("big").residency is Residency.FAILED


def test_without_a_device_budget_device_bytes_never_evict() -> None:
    cache = ResidencyCache(budget=None, max_resident=None)
    _resident(cache, "a", 1.0, 0, {GPU0: 1 << 40})
    cache.request("b", 2.0)
    cache.entry("b").device_charge = {GPU0: 1 << 40}
    plan = cache.plan(3.0)
    assert plan.evict == [] and plan.load == ["b"]
