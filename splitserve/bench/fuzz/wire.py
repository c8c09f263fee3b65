"""The fast-path wire format as docs/protocol.md states it: build, mutate and judge frames.

The fuzz oracles decode headers here, by the rules the protocol document states, and not
with ``protocol.header.unpack_header``: the code under test must not be its own judge.
Generators take a ``random.Random`` (or hypothesis's ``st.randoms()``, which shrinks), so
the test suite and ``splitserve bench fuzz`` draw from the same distributions.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

HEADER = 64
MAGIC = b"SPRC"
VERSION = 1
MAX_PAYLOAD = 1 << 30
MAX_LOOKUP = 4096
REQUEST, RESPONSE, ERROR, LOOKUP, LOOKUP_REPLY, PING, PONG = range(1, 8)
CLIENT_KINDS = (REQUEST, LOOKUP, PING)
SERVER_KINDS = (RESPONSE, ERROR, LOOKUP_REPLY, PONG)
SEGMENTED = 1
# docs/protocol.md, "Header layout": the format string and field order, restated.
SPEC = struct.Struct("<4sBBBBQHHHHQIIIIIIQ")
FIELDS = ("magic", "version", "kind", "flags", "cls", "req_id", "func_id", "seq_num", "seg_count", "status",
          "deadline_us", "payload_len", "payload_offset", "total_len", "queue_us", "compute_us", "total_us",
          "slo_us")


def _spans() -> dict[str, tuple[int, int]]:
    out, pos = {}, 0
    for name, code in zip(FIELDS, ("4s", "B", "B", "B", "B", "Q", "H", "H", "H", "H", "Q", "I", "I", "I", "I", "I",
                                   "I", "Q")):
        size = struct.calcsize("<" + code)
        out[name] = (pos, size)
        pos += size
    return out


SPANS: dict[str, tuple[int, int]] = _spans()  # field -> (offset, size) in the header
# Fields whose corruption changes how a UDP request's segments cover its payload.
LAYOUT_FIELDS = ("seq_num", "seg_count", "payload_len", "payload_offset", "total_len")


@dataclass(frozen=True, slots=True)
class Wire:
    """A header decoded without judging it."""

    magic: bytes
    version: int
    kind: int
    flags: int
    cls: int
    req_id: int
    func_id: int
    seq_num: int
    seg_count: int
    status: int
    deadline_us: int
    payload_len: int
    payload_offset: int
    total_len: int
    queue_us: int
    compute_us: int
    total_us: int
    slo_us: int  # a request's soft SLO (any value); a server's frame carries 0

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> "Wire":
        return cls(*SPEC.unpack_from(buf, 0))

    @property
    def framing_ok(self) -> bool:
        """What a stream needs to find the next frame: magic, version, a kind, a sane length."""
        return (self.magic == MAGIC and self.version == VERSION and REQUEST <= self.kind <= PONG
                and self.payload_len <= MAX_PAYLOAD)


def frame(kind: int, payload: bytes = b"", *, req_id: int = 0, func_id: int = 0, cls: int = 255, flags: int = 0,
          seq_num: int = 0, seg_count: int = 1, status: int = 0, deadline_us: int = 0, payload_len: int | None = None,
          payload_offset: int = 0, total_len: int = 0, magic: bytes = MAGIC, version: int = VERSION,
          slo_us: int = 0) -> bytes:
    """One frame: a header (any field settable, however wrong) and its payload."""
    n = len(payload) if payload_len is None else payload_len
    return SPEC.pack(magic, version, kind, flags, cls, req_id, func_id, seq_num, seg_count, status, deadline_us,
                     n, payload_offset, total_len, 0, 0, 0, slo_us) + payload


def set_field(data: bytes, name: str, value: int) -> bytes:
    """``data`` (a frame) with header field ``name`` set to ``value`` (truncated to its width)."""
    off, size = SPANS[name]
    if len(data) < off + size:
        return data
    raw = (value % (1 << (8 * size))).to_bytes(size, "little") if name != "magic" else value.to_bytes(4, "little")
    return data[:off] + raw + data[off + size :]


def payload_bytes(rnd: random.Random, n: int) -> bytes:
    """``n`` random bytes from one draw (cheap, and small for hypothesis to shrink)."""
    return random.Random(rnd.getrandbits(32)).randbytes(n)


def boundary(rnd: random.Random, size: int) -> int:
    """A value that sits on an edge of a ``size``-byte unsigned field, or one near the limits."""
    top = (1 << (8 * size)) - 1
    return rnd.choice((0, 1, 2, top, top - 1, top >> 1, (top >> 1) + 1, MAX_PAYLOAD, MAX_PAYLOAD + 1,
                       1024, 4096, 65535, rnd.getrandbits(8 * size))) & top


def mutate(rnd: random.Random, data: bytes, keep: tuple[str, ...] = ()) -> bytes:
    """``data`` with one random mutation: a bit flip, a byte, a header field on an edge, a cut,
    an extension or a duplicated run. Header fields named in ``keep`` are left as they were."""
    if not data:
        return payload_bytes(rnd, rnd.randint(1, 80))
    op = rnd.randrange(7)
    if op in (0, 1, 2) and len(data) >= HEADER:
        names = [f for f in FIELDS if f not in keep]
        name = rnd.choice(names)
        off, size = SPANS[name]
        if op == 0:  # one bit
            bit = rnd.randrange(8 * size)
            pos = off + bit // 8
            return data[:pos] + bytes([data[pos] ^ (1 << (bit % 8))]) + data[pos + 1 :]
        if op == 1:  # one byte
            pos = off + rnd.randrange(size)
            return data[:pos] + bytes([rnd.randrange(256)]) + data[pos + 1 :]
        if name == "magic":
            return data[:off] + payload_bytes(rnd, 4) + data[off + 4 :]
        if name == "payload_len" and rnd.random() < 0.5:  # off by a little from the truth
            return set_field(data, name, max(0, len(data) - HEADER + rnd.choice((-2, -1, 1, 2, 4096))))
        return set_field(data, name, boundary(rnd, size))
    if op == 3:  # cut short
        return data[: rnd.randrange(len(data))]
    if op == 4:  # grow
        return data + payload_bytes(rnd, rnd.randint(1, 64))
    first = HEADER if keep and len(data) > HEADER else 0  # kept fields: leave the header alone
    if op == 5:  # a byte anywhere (payload included)
        pos = rnd.randrange(first, len(data))
        return data[:pos] + bytes([rnd.randrange(256)]) + data[pos + 1 :]
    lo = rnd.randrange(first, len(data))  # repeat a run
    hi = min(len(data), lo + rnd.randint(1, 80))
    return data[:hi] + data[lo:hi] + data[hi:]


__all__ = ["CLIENT_KINDS", "ERROR", "FIELDS", "HEADER", "LAYOUT_FIELDS", "LOOKUP", "LOOKUP_REPLY", "MAGIC",
           "MAX_LOOKUP", "MAX_PAYLOAD", "PING", "PONG", "REQUEST", "RESPONSE", "SEGMENTED", "SERVER_KINDS", "SPANS",
           "SPEC", "VERSION", "Wire", "boundary", "frame", "mutate", "payload_bytes", "set_field"]
