"""Property tests for UDP reassembly.

A real ``UdpEndpoint`` on a real event loop serves a loopback UDP socket; the fake server
of ``splitserve.testing.fastpath_host`` gives it real tensor-queue rings whose every byte is
watched. Random, duplicated, reordered, truncated and mutated segments from two peers must
never raise out of the endpoint, never write outside the slots being assembled, and submit
a request only when its segments cover the client's payload exactly once; answers are
well formed and complete, and every slot is free once the endpoint is closed.
"""

from __future__ import annotations

import random
import socket

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from splitserve.bench.fuzz.udp import UdpCase, UdpHarness
from splitserve.bench.fuzz.wire import REQUEST, SEGMENTED, frame, payload_bytes
from splitserve.errors import Status
from splitserve.protocol.header import HEADER_SIZE, Kind, unpack_header
from splitserve.server.udp import UdpEndpoint
from splitserve.testing.fastpath_host import FUNC_IDS, Answer

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def well_formed():
    with UdpHarness(overlap=False) as h:
        yield h


@pytest.fixture(scope="module")
def any_segments():
    with UdpHarness(overlap=True) as h:
        yield h


@FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_well_formed_segmentations_keep_every_property(well_formed, rnd):
    well_formed.check(well_formed.generate(rnd))


@settings(FUZZ, phases=[Phase.explicit, Phase.generate])  # no shrinking while it is expected to fail
@given(rnd=st.randoms(use_true_random=False))
def test_overlapping_and_foreign_segments_are_never_submitted(any_segments, rnd):
    any_segments.check(any_segments.generate(rnd))


def _request(req_id: int, data: bytes, parts: list[tuple[int, int, int]]) -> list[tuple[int, bytes]]:
    """Datagrams from peer 0: (seq_num, offset, length) of ``data`` each; seg_count counts the seq_nums."""
    return [(0, frame(REQUEST, data[off : off + n], req_id=req_id, func_id=FUNC_IDS["fz2"], cls=1, seq_num=seq,
                      seg_count=len({p[0] for p in parts}), payload_offset=off, total_len=len(data), flags=SEGMENTED))
            for seq, off, n in parts]


def test_a_request_in_reordered_duplicated_segments_is_received_exactly(well_formed):
    data = payload_bytes(random.Random(1), 2 * 3072)
    dgrams = _request(4, data, [(2, 4000, 2144), (0, 0, 1500), (1, 1500, 2500), (0, 0, 1500)])
    well_formed.check(UdpCase(dgrams, answers=[Answer.SOON], start=-1))
    assert [s.data for s in well_formed.server.submitted] == [data]


def test_a_partial_request_frees_its_slots_when_the_endpoint_closes(well_formed):
    # Found by the fuzzer: close() left partial assemblies' calls open and their slots taken.
    data = bytes(3072)
    well_formed.check(UdpCase(_request(5, data, [(0, 0, 1024), (1, 1024, 1024), (2, 2048, 1024)])[:2]))
    assert well_formed.server.submitted == []


def test_two_segments_claiming_offset_zero_are_not_submitted(well_formed):
    data = bytes(range(256)) * 12  # 3072 B: one sample of fz2
    # seq 0 and seq 1 both claim bytes 0..1535; bytes 1536..3071 never arrive
    well_formed.check(UdpCase(_request(6, data, [(0, 0, 1536), (1, 0, 1536)])))


def test_a_refused_request_keeps_its_refusal_when_retransmitted(well_formed):
    # Found by bench chaos: a refusal at admission (QUEUE_FULL, MODEL_NOT_READY) was sent but
    # not remembered, so a retransmit that crossed it was admitted once there was room, and
    # the request got two different answers.
    h = well_formed
    h.server.reset([Answer.SOON], 0, 0)  # every slot taken: the first try is refused
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    ep = UdpEndpoint(h.server, sock)
    got: list[list[bytes]] = [[] for _ in h.clients]
    (_, dgram), = _request(8, bytes(3072), [(0, 0, 3072)])
    try:
        h.clients[0].sendto(dgram, sock.getsockname())
        h._settle(sock, got)
        for rt in h.server.runtimes.values():
            rt.release_held()  # room now: a fresh request would be admitted
        h.clients[0].sendto(dgram, sock.getsockname())  # the retransmit
        h._settle(sock, got)
    finally:
        ep.close()
    h._read(got)
    assert h.server.submitted == []
    answers = [unpack_header(d[:HEADER_SIZE]) for d in got[0]]
    assert [(a.kind, a.req_id, Status(a.status)) for a in answers] == [(Kind.ERROR, 8, Status.QUEUE_FULL)] * 2
