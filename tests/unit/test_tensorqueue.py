import numpy as np
import pytest
import torch

from splitserve.errors import QueueFull
from splitserve.tensorqueue import PAGE, SlotRing, TensorQueue, ring_slots


def test_ring_slots_make_whole_pages_for_every_tensor():
    n = ring_slots([784, 40], 64)
    assert n >= 64
    assert (784 * n) % PAGE == 0 and (40 * n) % PAGE == 0


def test_a_batch_that_wraps_is_one_contiguous_view():
    q = TensorQueue(784, ring_slots([784], 8))
    try:
        start = q.nslots - 3
        a = q.array(start, 6, np.uint8, (1, 28, 28))
        assert a.__array_interface__["data"][0] == q.address(start)
        t = torch.from_numpy(a)
        assert t.data_ptr() == q.address(start) and t.is_contiguous()
        a[:] = np.arange(6, dtype=np.uint8)[:, None, None, None]
        # the three slots past the end are the first three slots of the ring
        assert (q.array(0, 3, np.uint8, (784,)) == np.array([3, 4, 5], dtype=np.uint8)[:, None]).all()
        assert (q.array(start, 3, np.uint8, (784,)) == np.array([0, 1, 2], dtype=np.uint8)[:, None]).all()
    finally:
        q.close()


def test_second_mapping_of_the_same_fd_sees_the_same_bytes():
    q = TensorQueue(4096, 4)
    other = TensorQueue(4096, 4, fd=q.fd)
    try:
        q.view(1)[:5] = b"hello"
        assert bytes(other.view(1)[:5]) == b"hello"
    finally:
        other.close()
        q.close()


def test_slot_ring_hands_out_in_order_and_recycles_only_from_the_tail():
    r = SlotRing(4)
    a, b, c = r.alloc(1), r.alloc(2), r.alloc(1)
    assert (a, b, c) == (0, 1, 3)
    with pytest.raises(QueueFull):
        r.alloc(1)
    r.release(b, 2)  # out of order: tail cannot move past slot 0 yet
    assert r.free == 0
    r.release(a)
    assert r.free == 3 and r.tail == 3
    with pytest.raises(RuntimeError):
        r.release(a)
    assert r.alloc(2) == 4


def test_plan_room_moves_only_what_arrives_at_the_tail():
    r = SlotRing(8)
    stalled = r.alloc(2)  # seqs 0-1: a request still arriving
    done = r.alloc(3)  # 2-4: answered and freed, but the tail cannot pass 0-1
    queued = r.alloc(3)  # 5-7: received, waiting for a batch
    r.release(done, 3)
    with pytest.raises(QueueFull):
        r.alloc(1)
    # freeing the stalled request lets the tail pass it and the freed slots behind it
    assert r.plan_room(5, {stalled: 2}) == [stalled]
    assert r.plan_room(6, {stalled: 2}) is None  # the queued request is in the way
    assert r.plan_room(1, {}) is None  # nothing may move
    assert r.plan_room(9, {stalled: 2}) is None  # more than the ring
    r.release(stalled, 2)
    assert r.plan_room(5, {}) == [] and r.alloc(5) == 8
    del queued


def test_plan_room_walks_past_several_arrivals_in_order():
    r = SlotRing(6)
    a, b, c = r.alloc(1), r.alloc(2), r.alloc(3)
    assert r.plan_room(1, {a: 1, b: 2, c: 3}) == [a]
    assert r.plan_room(3, {a: 1, b: 2, c: 3}) == [a, b]
    assert r.plan_room(4, {a: 1, b: 2, c: 3}) == [a, b, c]
    assert r.plan_room(4, {a: 1, c: 3}) is None  # b is queued: the tail stops there
