"""Fuzz target: the 64-byte control header (``protocol.header``).

Property: any buffer either unpacks into a header that packs back to the same 64 bytes, or
raises ``BadFrame`` with a message; never another exception. A valid header round-trips.
"""

from __future__ import annotations

import random

from splitserve.bench.fuzz.wire import HEADER, SEGMENTED, frame, mutate
from splitserve.errors import BadFrame
from splitserve.protocol.header import Header, unpack_header
from splitserve.testing.fastpath_host import PropertyViolation

NAME = "header"


def check_header_bytes(buf: bytes | bytearray | memoryview) -> Header | None:
    """Unpack ``buf``; the header when it is accepted, None when it is refused as it should be."""
    try:
        h = unpack_header(buf)
    except BadFrame as e:
        if not e.message:
            raise PropertyViolation("BadFrame without a message") from e
        return None
    except Exception as e:
        raise PropertyViolation(f"unpack_header raised {type(e).__name__}: {e}") from e
    if len(buf) < HEADER:
        raise PropertyViolation(f"a {len(buf)} B buffer was accepted as a header")
    try:
        again = h.pack()
    except Exception as e:
        raise PropertyViolation(f"an accepted header does not pack: {type(e).__name__}: {e}") from e
    if again != bytes(buf[:HEADER]):
        diff = next(i for i in range(HEADER) if again[i] != bytes(buf[:HEADER])[i])
        raise PropertyViolation(f"accepted header packs back differently from byte {diff} on")
    return h


def valid_header(rnd: random.Random) -> bytes:
    """A header a correct peer could send or receive, with random field values."""
    kind = rnd.randint(1, 7)
    return frame(kind, req_id=rnd.getrandbits(64), func_id=rnd.getrandbits(16), cls=rnd.choice((0, 1, 255)),
                 flags=rnd.choice((0, SEGMENTED)), seq_num=rnd.getrandbits(16), seg_count=rnd.getrandbits(16),
                 status=rnd.choice((0, 1, 8, 99)), deadline_us=rnd.choice((0, rnd.getrandbits(64))),
                 slo_us=rnd.choice((0, rnd.getrandbits(64))),
                 payload_len=rnd.choice((0, 784, rnd.randint(0, 1 << 30))), payload_offset=rnd.getrandbits(32),
                 total_len=rnd.getrandbits(32))


def generate(rnd: random.Random) -> bytes:
    """One input: mostly mutated valid headers (random bytes almost never get past the magic)."""
    r = rnd.random()
    if r < 0.05:
        return rnd.randbytes(HEADER)
    if r < 0.08:
        return rnd.randbytes(rnd.randrange(HEADER))
    data = valid_header(rnd)
    if r < 0.2:
        return data
    for _ in range(rnd.randint(1, 3)):
        data = mutate(rnd, data)
    return data if len(data) >= HEADER or rnd.random() < 0.2 else data + rnd.randbytes(HEADER - len(data))


def check(data: bytes) -> None:
    """The header property for one input (``bytes``, and the same bytes as a memoryview)."""
    h = check_header_bytes(data)
    if h is not None and unpack_header(memoryview(bytearray(data))) != h:
        raise PropertyViolation("the same bytes unpack differently from a memoryview")




class HeaderTarget:
    """The header property as a fuzz target (no state to set up or tear down)."""

    name = NAME

    def generate(self, rnd: random.Random) -> bytes:
        return generate(rnd)

    def check(self, data: bytes) -> None:
        check(data)

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["NAME", "HeaderTarget", "check", "check_header_bytes", "generate", "valid_header"]
