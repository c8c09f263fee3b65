"""The HANDOFF frame's payload (``protocol/handoff.py``) and a client's ``direct`` modes."""

import pytest

from splitserve.client.handoff import check_answer
from splitserve.client.route import direct_mode
from splitserve.errors import BadFrame, InvalidInput, Refused
from splitserve.protocol.handoff import endpoint_key, handoff_frame, parse_handoff
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header


def test_a_handoff_frame_round_trips_to_the_model_and_the_endpoints_key():
    frame = handoff_frame(77, "lenet", "tcp://[::1]:4242")
    h = unpack_header(frame)
    assert (h.kind, h.req_id, h.payload_len) == (Kind.HANDOFF, 77, len(frame) - HEADER_SIZE)
    assert parse_handoff(frame[HEADER_SIZE:]) == ("lenet", ("tcp", 4242))
    unix = handoff_frame(1, "m", "unix:///run/x/7-0.sock")
    assert parse_handoff(unix[HEADER_SIZE:]) == ("m", ("unix", "/run/x/7-0.sock"))


@pytest.mark.parametrize("url", ["tcp://host", "tcp://host:99999", "http://host:80", "unix://", "", "tcp://[::1"])
def test_an_endpoint_that_names_no_workers_port_or_path_is_a_bad_frame(url):
    with pytest.raises(BadFrame, match="tcp://host:port or unix:///path"):
        endpoint_key(url)


@pytest.mark.parametrize("body", [b"", b"\xff", b"[]", b'{"model": "m"}', b'{"model": 1, "endpoint": "tcp://h:1"}',
                                  b'{"model": "m", "endpoint": null}'])
def test_a_payload_that_is_not_the_handoffs_json_is_a_bad_frame(body):
    with pytest.raises(BadFrame, match="HANDOFF"):
        parse_handoff(body)


def test_the_answer_to_a_handoff_is_the_workers_acknowledgement_or_the_error_raised():
    check_answer(Header(Kind.HANDOFF, req_id=5), b"", 5)
    with pytest.raises(Refused, match="limit"):
        check_answer(Header(Kind.ERROR, req_id=5, status=13, payload_len=5), b"limit", 5)
    for wrong in (Header(Kind.HANDOFF, req_id=6), Header(Kind.PONG, req_id=5), Header(Kind.HANDOFF, req_id=5,
                                                                                      payload_len=3)):
        with pytest.raises(BadFrame, match="HANDOFF"):
            check_answer(wrong, b"", 5)


def test_a_clients_direct_argument_is_true_false_or_via_front():
    assert direct_mode(True) == (True, False)
    assert direct_mode(False) == (False, False)
    assert direct_mode("via-front") == (True, True)
    for bad in ("yes", 1.5, None):
        with pytest.raises(InvalidInput, match="via-front"):
            direct_mode(bad)
