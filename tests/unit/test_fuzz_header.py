"""Property tests for the 64-byte control header.

Every valid header round-trips; any buffer either unpacks into a header that packs back to
the same bytes or is refused with BadFrame, never another exception. The property itself
lives in ``splitserve.bench.fuzz.header``, which ``splitserve bench fuzz`` runs a million times.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.bench.fuzz import header as target
from splitserve.bench.fuzz.wire import FIELDS, SPANS, frame
from splitserve.errors import BadFrame
from splitserve.protocol.header import HEADER_SIZE, MAX_PAYLOAD, Header, Kind, unpack_header

# Deterministic and database-free: the suite never writes a .hypothesis directory.
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow])

u = st.integers
headers = st.builds(
    Header, kind=st.sampled_from(Kind), req_id=u(0, 2**64 - 1), func_id=u(0, 2**16 - 1), cls=u(0, 255),
    flags=u(0, 255), seq_num=u(0, 2**16 - 1), seg_count=u(0, 2**16 - 1), status=u(0, 2**16 - 1),
    deadline_us=u(0, 2**64 - 1), payload_len=u(0, MAX_PAYLOAD), payload_offset=u(0, 2**32 - 1),
    total_len=u(0, 2**32 - 1), queue_us=u(0, 2**32 - 1), compute_us=u(0, 2**32 - 1), total_us=u(0, 2**32 - 1),
)


@FUZZ
@given(headers)
def test_every_valid_header_round_trips(h):
    b = h.pack()
    assert len(b) == HEADER_SIZE
    assert unpack_header(b) == h
    assert target.check_header_bytes(b) == h


@FUZZ
@given(st.binary(min_size=0, max_size=2 * HEADER_SIZE))
def test_random_bytes_unpack_exactly_or_are_bad_frames(buf):
    target.check_header_bytes(buf)


@FUZZ
@given(headers, st.lists(st.tuples(u(0, HEADER_SIZE - 1), u(0, 255)), min_size=1, max_size=4))
def test_mutated_headers_unpack_exactly_or_are_bad_frames(h, edits):
    buf = bytearray(h.pack())
    for pos, value in edits:
        buf[pos] = value
    target.check_header_bytes(buf)
    target.check_header_bytes(memoryview(buf))


@FUZZ
@given(st.randoms(use_true_random=False))
def test_the_bench_generator_only_finds_headers_that_hold(rnd):
    target.check(target.generate(rnd))


@pytest.mark.parametrize("value", [1, 2**63, 2**64 - 1])
def test_slo_us_in_bytes_56_to_63_round_trips(value):
    # Bytes 56-63 were reserved (refused unless zero); they now carry a request's soft SLO,
    # so any value is accepted and packs back to the bytes sent.
    buf = frame(Kind.REQUEST, slo_us=value)
    h = target.check_header_bytes(buf)
    assert h is not None and h.slo_us == value and buf[56:64] == value.to_bytes(8, "little")


def test_field_table_matches_the_header_layout():
    assert [SPANS[f][0] for f in FIELDS][-1] + SPANS["slo_us"][1] == HEADER_SIZE
    assert SPANS["payload_len"] == (32, 4)
