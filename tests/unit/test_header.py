import pytest

from splitserve.errors import BadFrame, InvalidInput
from splitserve.protocol.header import (HEADER_SIZE, Header, Kind, RequestClass, pack_request, pack_response_into,
                                         unpack_header)


def test_round_trip_and_size():
    h = Header(Kind.REQUEST, req_id=2**63 + 5, func_id=65535, cls=RequestClass.RT, seq_num=3, seg_count=7,
               deadline_us=1234, payload_len=784, payload_offset=10, total_len=9000, status=4,
               queue_us=1, compute_us=2, total_us=3, slo_us=2**64 - 1)
    b = h.pack()
    assert len(b) == HEADER_SIZE and b[:4] == b"SPRC"
    assert unpack_header(b) == h


def test_pack_request_is_the_request_header_and_unpack_reads_at_an_offset():
    h = Header(Kind.REQUEST, req_id=2**64 - 1, func_id=9, cls=RequestClass.BE, deadline_us=5000, slo_us=700,
               payload_len=4096)
    b = pack_request(2**64 - 1, 9, RequestClass.BE, 5000, 700, 4096)
    assert b == h.pack()
    assert unpack_header(b"junk" + b + b"next", 4) == h
    with pytest.raises(BadFrame, match="header is 60 bytes"):
        unpack_header(b"junk" + b, 8)


def test_pack_response_into_writes_the_response_header_at_an_offset():
    h = Header(Kind.RESPONSE, req_id=2**64 - 2, func_id=7, cls=RequestClass.RT, payload_len=4096, queue_us=11,
               compute_us=22, total_us=2**32 - 1)
    buf = bytearray(b"x" * (2 * HEADER_SIZE + 3))
    pack_response_into(buf, HEADER_SIZE + 3, 2**64 - 2, 7, RequestClass.RT, 4096, 11, 22, 2**32 - 1)
    assert bytes(buf[HEADER_SIZE + 3 :]) == h.pack() and buf[: HEADER_SIZE + 3] == b"x" * (HEADER_SIZE + 3)


def test_slo_us_is_bytes_56_to_63():
    b = Header(Kind.REQUEST, slo_us=250_000).pack()
    assert int.from_bytes(b[56:64], "little") == 250_000
    assert unpack_header(b).slo_us == 250_000
    assert Header(Kind.RESPONSE).pack()[56:64] == bytes(8)  # replies carry 0


@pytest.mark.parametrize("mutate, word", [
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "version"),
    (lambda b: b[:5] + bytes([42]) + b[6:], "kind"),
    (lambda b: b[:32] + (2**31).to_bytes(4, "little") + b[36:], "payload_len"),
    (lambda b: b[:20], "header is 20 bytes"),
])
def test_bad_headers_name_the_problem(mutate, word):
    with pytest.raises(BadFrame, match=word):
        unpack_header(mutate(Header(Kind.REQUEST).pack()))


def test_request_class_parse():
    assert RequestClass.parse("real-time") is RequestClass.RT
    assert RequestClass.parse("best_effort") is RequestClass.BE
    assert RequestClass.parse(None) is RequestClass.DEFAULT
    with pytest.raises(InvalidInput, match="unknown request class"):
        RequestClass.parse("urgent")


def test_request_class_strict_is_rt():
    """PROTEAN's name for the real-time class is an alias of ``rt``, in any spelling."""
    for name in ("strict", "STRICT", " Strict "):
        assert RequestClass.parse(name) is RequestClass.RT


@pytest.mark.parametrize("value", [True, False, 0.0, 0.5, 1.0, 2, [0]])
def test_request_class_refuses_bools_fractions_and_unknown_numbers(value):
    """A gRPC ``class`` parameter can be a bool or a double: refused, never truncated to a class."""
    with pytest.raises(InvalidInput, match="unknown request class"):
        RequestClass.parse(value)
