"""UDP reassembly and the answer cache: pure parts of server/udp.py."""

from __future__ import annotations

import pytest

from splitserve.errors import BadSegment
from splitserve.server.udp import AnswerCache, Coverage


def test_segments_that_tile_the_payload_complete_it_in_any_order():
    cov = Coverage(10, 3)
    assert cov.add(2, 8, 2) and cov.add(0, 0, 4)
    assert not cov.add(0, 0, 4)  # a retransmitted segment is a no-op
    assert not cov.complete
    assert cov.add(1, 4, 4) and cov.complete
    cov.check()


@pytest.mark.parametrize("segments, words", [
    ([(0, 0, 4), (1, 0, 4)], "overlaps"),  # two segments claim offset 0 (stale bytes in the tail)
    ([(0, 0, 6), (1, 4, 6)], "overlaps"),
    ([(0, 0, 4), (0, 2, 4)], "earlier as"),  # the same segment again, somewhere else
    ([(0, 8, 4)], "covers bytes"),  # past the end
    ([(0, 0, 0)], "covers bytes"),  # empty
    ([(3, 0, 4)], "segment 3 of a request of 2"),
])
def test_contradicting_segments_are_refused_before_their_bytes_land(segments, words):
    cov = Coverage(10, 2)
    with pytest.raises(BadSegment, match=words):
        for seq, off, n in segments:
            cov.add(seq, off, n)


@pytest.mark.parametrize("segments, words", [
    ([(0, 0, 4), (1, 6, 4)], "starts at byte 6"),  # a gap in the middle
    ([(0, 0, 4), (1, 4, 4)], "cover 8 B of a 10 B"),  # a gap at the end
    ([(0, 4, 6), (1, 0, 4)], "segment 0 starts at byte 4"),  # out of seq order
])
def test_segments_with_a_gap_never_complete_the_request(segments, words):
    cov = Coverage(10, 2)
    for seq, off, n in segments:
        cov.add(seq, off, n)
    assert cov.complete
    with pytest.raises(BadSegment, match=words):
        cov.check()


def test_answer_cache_is_bounded_in_bytes_and_entries():
    c = AnswerCache(max_entries=3, max_bytes=100)
    c.put("a", [b"x" * 40])
    c.put("b", [b"x" * 30, b"y" * 10])
    assert c.get("a") is not None  # a is now the most recently used
    c.put("c", [b"x" * 40])  # 120 B: b (least recently used) goes
    assert c.get("b") is None and c.nbytes == 80 and len(c) == 2
    c.put("d", [b"x" * 101])  # larger than the whole cache: not kept, nothing evicted
    assert c.get("d") is None and len(c) == 2
    for k in "efg":
        c.put(k, [b"z"])
    assert len(c) == 3 and c.get("a") is None and c.get("c") is None
    c.put("e", [b"z" * 5])  # replacing an answer counts its bytes once
    assert c.nbytes == 7
