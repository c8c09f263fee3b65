"""The worker's device-memory measure (``worker.device_memory``): the caching allocator's
reserved growth is charged, its slack (reserved beyond allocated) included."""

from __future__ import annotations

from splitserve.worker.device_memory import DeviceMemoryUse, load_charge

MB = 1 << 20


class Allocator:
    """Counters a test sets, as the CUDA caching allocator reports them."""

    def __init__(self, allocated: int, reserved: int) -> None:
        self.a, self.r = allocated, reserved

    def allocated(self) -> int:
        return self.a

    def reserved(self) -> int:
        return self.r


def test_the_reserved_growth_is_charged_with_the_slack_named():
    alloc = Allocator(0, 0)
    before = DeviceMemoryUse.now(alloc)
    alloc.a, alloc.r = 90 * MB, 128 * MB  # weights + activations; the allocator rounded up to its blocks
    assert load_charge(before, DeviceMemoryUse.now(alloc)) == (128 * MB, 38 * MB)


def test_memory_another_binding_already_reserved_is_not_charged_twice():
    before = DeviceMemoryUse(allocated=40 * MB, reserved=64 * MB)  # an earlier binding's blocks, partly free
    after = DeviceMemoryUse(allocated=60 * MB, reserved=64 * MB)  # the load fitted in the cached free blocks
    assert load_charge(before, after) == (20 * MB, 0)


def test_a_shrinking_allocator_never_charges_below_zero():
    assert load_charge(DeviceMemoryUse(50, 80), DeviceMemoryUse(10, 20)) == (0, 0)
