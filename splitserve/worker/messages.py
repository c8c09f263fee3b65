"""Control messages between the front end and a worker: small fixed structs with a
one-byte kind, over a SOCK_SEQPACKET socketpair. Tensor data never travels here."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum


class Msg(IntEnum):
    RUN = 1  # front end -> worker: run a batch
    STOP = 2  # front end -> worker: exit after the current batch
    READY = 10  # worker -> front end: model loaded (payload: JSON info)
    DONE = 11  # worker -> front end: batch finished
    FAILED = 12  # worker -> front end: batch raised (payload: message)
    PREEMPTED = 13  # worker -> front end: batch stopped at a segment boundary


# kind, cls, resume_segment, batch_id, seq, count
RUN = struct.Struct("<BBHIQI")
# kind, status, pad, batch_id, compute_ns, segments_run, first_segment, preempt_ns
DONE = struct.Struct("<BBHIQHHQ")
HEAD = struct.Struct("<BxxxI")  # kind, batch_id: prefix of READY/FAILED followed by text


@dataclass(slots=True, frozen=True)
class RunMsg:
    cls: int
    batch_id: int
    seq: int
    count: int
    resume_segment: int = 0

    def pack(self) -> bytes:
        return RUN.pack(Msg.RUN, self.cls, self.resume_segment, self.batch_id, self.seq, self.count)

    @classmethod
    def unpack(cls, b: bytes) -> "RunMsg":
        _k, c, resume, bid, seq, count = RUN.unpack_from(b)
        return cls(c, bid, seq, count, resume)


@dataclass(slots=True, frozen=True)
class DoneMsg:
    """DONE or PREEMPTED: ``segments_run`` segments from ``first_segment`` were executed.

    For PREEMPTED, the restore point is ``first_segment + segments_run`` and ``preempt_ns``
    is the time from the preemption flag being raised to the worker stopping.
    """

    kind: int
    batch_id: int
    compute_ns: int
    segments_run: int
    first_segment: int
    preempt_ns: int = 0

    def pack(self) -> bytes:
        return DONE.pack(self.kind, 0, 0, self.batch_id, self.compute_ns, self.segments_run,
                         self.first_segment, self.preempt_ns)

    @classmethod
    def unpack(cls, b: bytes) -> "DoneMsg":
        kind, _s, _p, bid, ns, run, first, pns = DONE.unpack_from(b)
        return cls(kind, bid, ns, run, first, pns)


def pack_text(kind: Msg, batch_id: int, text: str) -> bytes:
    return HEAD.pack(kind, batch_id) + text.encode()[:60000]


def unpack_text(b: bytes) -> tuple[int, int, str]:
    kind, bid = HEAD.unpack_from(b)
    return kind, bid, b[HEAD.size :].decode(errors="replace")
