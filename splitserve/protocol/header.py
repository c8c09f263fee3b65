"""The fast path's 64-byte control header (docs/protocol.md is the normative text).

The header is all the CPU needs to route a call: everything after it is payload that the
server receives straight into tensor-queue memory. Little-endian, fixed size, versioned.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

from splitserve.errors import BadFrame, InvalidInput

MAGIC = b"SPRC"
VERSION = 1
HEADER_SIZE = 64
# magic, version, kind, flags, cls, req_id, func_id, seq_num, seg_count, status,
# deadline_us, payload_len, payload_offset, total_len, queue_us, compute_us, total_us, slo_us
_FORMAT = struct.Struct("<4sBBBBQHHHHQIIIIIIQ")
assert _FORMAT.size == HEADER_SIZE

# Largest payload one frame may carry; bigger frames are refused before any byte is read.
MAX_PAYLOAD = 1 << 30


class Kind(IntEnum):
    REQUEST = 1
    RESPONSE = 2
    ERROR = 3
    LOOKUP = 4
    LOOKUP_REPLY = 5
    PING = 6
    PONG = 7
    # client -> front end: hand this connection to a worker's direct endpoint (JSON payload);
    # the worker that takes it answers with an empty HANDOFF of the same req_id
    HANDOFF = 8


class Flags(IntFlag):
    NONE = 0
    # UDP only: the request's payload is split over seg_count datagrams.
    SEGMENTED = 1


class RequestClass(IntEnum):
    """Service class of a call: real-time/strict or best-effort (PROTEAN, REEF)."""

    RT = 0
    BE = 1
    DEFAULT = 255  # use the model's configured default

    @classmethod
    def parse(cls, value: "str | int | RequestClass | None") -> "RequestClass":
        """Accept 'rt'/'real-time'/'strict', 'be'/'best-effort', ints, or None (= DEFAULT).

        A bool or a fractional number is refused, not truncated: a gRPC ``class`` parameter
        may arrive as ``bool_param`` or ``double_param``, and True is no class."""
        if value is None:
            return cls.DEFAULT
        if isinstance(value, str):
            key = value.strip().lower().replace("_", "-")
            for names, member in (
                (("rt", "real-time", "realtime", "strict"), cls.RT),
                (("be", "best-effort", "besteffort"), cls.BE),
                (("default", ""), cls.DEFAULT),
            ):
                if key in names:
                    return member
            raise InvalidInput(f"unknown request class {value!r}; use 'rt' or 'be'")
        try:
            if isinstance(value, bool):
                raise TypeError
            return cls(operator.index(value))
        except (TypeError, ValueError):
            raise InvalidInput(f"unknown request class {value!r}; use 0 (real-time) or 1 (best-effort)") from None


@dataclass(slots=True)
class Header:
    """A decoded control header. Field meanings are in docs/protocol.md."""

    kind: int
    req_id: int = 0
    func_id: int = 0
    cls: int = RequestClass.DEFAULT
    flags: int = 0
    seq_num: int = 0
    seg_count: int = 1
    status: int = 0
    deadline_us: int = 0
    payload_len: int = 0
    payload_offset: int = 0
    total_len: int = 0
    queue_us: int = 0
    compute_us: int = 0
    total_us: int = 0
    # request: the soft SLO in µs from when the server has the header (0: the model's own, if
    # any); served late rather than dropped, only counted (replies carry 0)
    slo_us: int = 0
    version: int = VERSION

    def pack(self) -> bytes:
        return _FORMAT.pack(
            MAGIC, self.version, self.kind, self.flags, self.cls, self.req_id, self.func_id,
            self.seq_num, self.seg_count, self.status, self.deadline_us, self.payload_len,
            self.payload_offset, self.total_len, self.queue_us, self.compute_us, self.total_us, self.slo_us,
        )

    def pack_into(self, buf: "bytearray | memoryview", offset: int = 0) -> None:
        _FORMAT.pack_into(
            buf, offset, MAGIC, self.version, self.kind, self.flags, self.cls, self.req_id,
            self.func_id, self.seq_num, self.seg_count, self.status, self.deadline_us,
            self.payload_len, self.payload_offset, self.total_len, self.queue_us,
            self.compute_us, self.total_us, self.slo_us,
        )


def unpack_header(buf: "bytes | bytearray | memoryview", offset: int = 0) -> Header:
    """Decode and validate the header at ``offset`` of ``buf``; raises BadFrame naming the bad field."""
    if len(buf) - offset < HEADER_SIZE:
        raise BadFrame(f"header is {len(buf) - offset} bytes, expected {HEADER_SIZE}")
    (magic, version, kind, flags, cls, req_id, func_id, seq_num, seg_count, status, deadline_us,
     payload_len, payload_offset, total_len, queue_us, compute_us, total_us, slo_us) = (
        _FORMAT.unpack_from(buf, offset)
    )
    if magic != MAGIC:
        raise BadFrame(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BadFrame(f"unsupported protocol version {version}, this server speaks {VERSION}")
    if kind not in Kind._value2member_map_:
        raise BadFrame(f"unknown frame kind {kind}")
    if payload_len > MAX_PAYLOAD:
        raise BadFrame(f"payload_len {payload_len} exceeds the limit of {MAX_PAYLOAD} bytes")
    # positional, in the dataclass's field order: a third of the keyword form's cost, and
    # every answer a client reads and every frame a server reads comes through here
    return Header(kind, req_id, func_id, cls, flags, seq_num, seg_count, status, deadline_us, payload_len,
                  payload_offset, total_len, queue_us, compute_us, total_us, slo_us, version)


def pack_request(req_id: int, func_id: int, cls: int, deadline_us: int, slo_us: int, payload_len: int) -> bytes:
    """A REQUEST header in one struct call: the per-call form of ``Header(Kind.REQUEST,
    ...).pack()`` for a client's hot path, without building a ``Header``."""
    return _FORMAT.pack(MAGIC, VERSION, Kind.REQUEST, 0, cls, req_id, func_id, 0, 1, 0, deadline_us, payload_len,
                        0, 0, 0, 0, 0, slo_us)


# a request header as its constant bytes around its req_id (8 bytes at 8) and its
# payload_len (4 bytes at 32): what a RequestPacker fills in per call
_AROUND_ID_AND_LEN = struct.Struct("<8sQ16sI28s")
assert _AROUND_ID_AND_LEN.size == HEADER_SIZE


class RequestPacker:
    """``pack_request`` for one model's calls with the same class, deadline and SLO: the
    header's other fields are packed once, so a call packs only its ``req_id`` and
    ``payload_len`` (a third of ``pack_request``'s cost, which passes all 18 fields)."""

    __slots__ = ("_pre", "_mid", "_post")

    def __init__(self, func_id: int, cls: int, deadline_us: int, slo_us: int) -> None:
        full = pack_request(0, func_id, cls, deadline_us, slo_us, 0)
        self._pre, self._mid, self._post = full[:8], full[16:32], full[36:]

    def pack(self, req_id: int, payload_len: int) -> bytes:
        """The REQUEST header of call ``req_id`` with ``payload_len`` bytes of payload."""
        return _AROUND_ID_AND_LEN.pack(self._pre, req_id, self._mid, payload_len, self._post)


def pack_response_into(buf: "bytearray | memoryview", offset: int, req_id: int, func_id: int, cls: int,
                       payload_len: int, queue_us: int, compute_us: int, total_us: int) -> None:
    """A RESPONSE header written at ``offset`` of ``buf`` in one struct call: the per-call
    form of ``Header(Kind.RESPONSE, ...).pack()`` for a server's answers (a batch's headers
    go into one buffer, no ``Header`` built)."""
    _FORMAT.pack_into(buf, offset, MAGIC, VERSION, Kind.RESPONSE, 0, cls, req_id, func_id, 0, 1, 0, 0, payload_len,
                      0, 0, queue_us, compute_us, total_us, 0)
