"""Property tests for the stream transports' frame state machine.

A real ``FastPathConnection`` on a real event loop reads one end of a Unix socketpair; the
fake server of ``splitserve.testing.fastpath_host`` gives it real tensor-queue rings whose every
byte is watched. Valid, random and mutated frames, cut at random places, must never raise
out of the connection, never write outside the slots being received, submit exactly the
bytes sent, and get one answer each (or one BAD_FRAME and a close); every slot is free once
the client has gone. ``splitserve bench fuzz`` runs the same property for longer.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.bench.fuzz.stream import StreamCase, StreamHarness
from splitserve.bench.fuzz.wire import PING, REQUEST, frame, payload_bytes
from splitserve.testing.fastpath_host import FUNC_IDS, Answer

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def harness():
    with StreamHarness() as h:
        yield h


@FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_random_and_mutated_frame_streams_keep_every_property(harness, rnd):
    harness.check(harness.generate(rnd))


def _fz2_request(req_id: int, count: int = 3) -> bytes:
    return frame(REQUEST, payload_bytes(random.Random(req_id), count * 3072), req_id=req_id, func_id=FUNC_IDS["fz2"],
                 cls=1)


def test_a_wrapping_two_input_request_sent_byte_by_byte_is_received_exactly(harness):
    data = _fz2_request(7) + frame(PING, req_id=8)
    # start one slot before the end of the ring, so the batch spans the double mapping
    harness.check(StreamCase(data, cuts=list(range(1, len(data))), answers=[Answer.SOON], start=-1))
    assert [s.call.req_id for s in harness.server.submitted] == [7]


def test_a_lost_frame_after_pipelined_requests_gets_one_bad_frame_and_a_close(harness):
    data = _fz2_request(1) + _fz2_request(2) + frame(REQUEST, req_id=3, version=9) + _fz2_request(4)
    harness.check(StreamCase(data, cuts=[100, 7000], answers=[Answer.AT_END]))
    assert [s.call.req_id for s in harness.server.submitted] == [1, 2]


def test_a_full_ring_refuses_with_queue_full_and_the_stream_goes_on(harness):
    data = _fz2_request(1, 3) + _fz2_request(2, 3) + frame(PING, req_id=9)
    harness.check(StreamCase(data, answers=[Answer.AT_END], free=4))
    assert [s.call.req_id for s in harness.server.submitted] == [1]

