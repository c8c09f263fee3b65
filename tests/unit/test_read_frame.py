"""``protocol.stream.read_frame``: the asyncio frame reader the cluster gateway reads its
clients and its node links with. A payload over the caller's bound is read into nothing
and the stream stays framed; a header that does not parse and a stream that ends inside a
frame are raised to the caller."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.errors import BadFrame
from splitserve.protocol.header import HEADER_SIZE, Header, Kind
from splitserve.protocol.stream import read_frame


def _frame(req_id: int, payload: bytes) -> bytes:
    return Header(Kind.REQUEST, req_id=req_id, func_id=1, payload_len=len(payload)).pack() + payload


def _reader(data: bytes) -> asyncio.StreamReader:
    """A stream holding ``data`` and then its end (made inside the running loop)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def _read_all(data: bytes, max_payload: int) -> list[tuple[int, bytes | None]]:
    reader, out = _reader(data), []
    with pytest.raises(asyncio.IncompleteReadError):
        while True:
            h, payload = await read_frame(reader, max_payload)
            out.append((h.req_id, payload))
    return out


def test_a_payload_over_the_bound_is_dropped_and_the_next_frame_is_read_whole() -> None:
    big = bytes(range(256)) * 10_000  # over two discard chunks
    data = _frame(1, b"abc") + _frame(2, big) + _frame(3, b"") + _frame(4, b"xyz")
    assert asyncio.run(_read_all(data, 1000)) == [(1, b"abc"), (2, None), (3, b""), (4, b"xyz")]


def test_a_header_that_does_not_parse_raises_bad_frame() -> None:
    async def scenario() -> None:
        with pytest.raises(BadFrame):
            await read_frame(_reader(b"\xff" * HEADER_SIZE))

    asyncio.run(scenario())


def test_a_stream_that_ends_inside_a_frame_raises_incomplete_read() -> None:
    async def scenario() -> None:
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(_reader(_frame(1, b"abcdef")[:-2]))
        with pytest.raises(asyncio.IncompleteReadError):  # inside a payload being dropped
            await read_frame(_reader(_frame(1, b"abcdef")[:-2]), max_payload=2)

    asyncio.run(scenario())
