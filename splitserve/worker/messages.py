"""Control messages between the front end and a worker: small typed structs with a
one-byte kind, over a SOCK_SEQPACKET socketpair. Tensor data never travels here.

The serving messages (RUN, DONE, PREEMPTED) are fixed structs. The residency messages
(LOAD, UNLOAD, PARK, RELOAD and their answers) are rare, so their bodies are JSON after a fixed head; a
LOAD's queue memfds ride beside it as SCM_RIGHTS, and the weights are read by the worker
from the artifact, never sent.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from splitserve.worker.spec import BindSpec


class Msg(IntEnum):
    RUN = 1  # front end -> worker: run a batch of the bound model
    STOP = 2  # front end -> worker: exit after the current batch
    LOAD = 3  # front end -> worker: bind a model (LoadMsg; its queue memfds as SCM_RIGHTS)
    UNLOAD = 4  # front end -> worker: release the bound model, its queue mappings and memory
    PARK = 5  # front end -> worker: keep the binding, its weights only in page-locked host memory (UNLOADED)
    RELOAD = 6  # front end -> worker: serve the parked binding again (LOADED; its first batch copies the weights back)
    ADOPT = 7  # front end -> worker: serve this client connection (SCM_RIGHTS) as a direct one; no answer
    READY = 10  # worker -> front end: started, bound to nothing (JSON info: its pid, anonymous RSS)
    DONE = 11  # worker -> front end: batch finished
    FAILED = 12  # worker -> front end: a RUN or LOAD (or the start) failed (FailedMsg)
    PREEMPTED = 13  # worker -> front end: batch stopped at a segment boundary
    LOADED = 14  # worker -> front end: a LOAD bound its model (LoadedMsg)
    UNLOADED = 15  # worker -> front end: an UNLOAD released the model (UnloadedMsg)
    DIRECT = 16  # worker -> front end (one byte, asked for by the page's BELL): a direct real-time batch began or ended


# The batch id a preemption flag names to stop a worker's direct best-effort batch (the
# front end's batches number from 1 and never reach it).
DIRECT_BATCH = 0xFFFFFFFF

# kind, cls, resume_segment, batch_id, seq, count
RUN = struct.Struct("<BBHIQI")
# kind, status, pad, batch_id, compute_ns, segments_run, first_segment, preempt_ns, start_ns, input_ns, output_ns
DONE = struct.Struct("<BBHIQHHQQQQ")
# kind, op, pad, id: the head of every message with a text or JSON body. ``op`` is the kind
# of the request a FAILED answers; ``id`` a batch id (RUN) or a binding id (LOAD, LOADED).
HEAD = struct.Struct("<BBxxI")
# kind, pad, the req_id of the client's HANDOFF frame (the worker's acknowledgement carries it)
ADOPT = struct.Struct("<BxxxxxxxQ")
# A control message never exceeds this (a LOAD with a large stored profile is the biggest);
# it stays under the kernel's default socket buffer, which bounds one SEQPACKET message.
MAX_MESSAGE_BYTES = 128 * 1024
# At most this many memfds ride with one LOAD (tensors per class times classes).
MAX_LOAD_FDS = 64
# The binding id of a FAILED that reports the process could not start (it exits then);
# LOADs use ids from 1.
START_BINDING = 0


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
    def unpack(cls, b: bytes | bytearray) -> "RunMsg":
        _k, c, resume, bid, seq, count = RUN.unpack_from(b)
        return cls(c, bid, seq, count, resume)


@dataclass(slots=True, frozen=True)
class DoneMsg:
    """DONE or PREEMPTED: ``segments_run`` segments from ``first_segment`` were executed.

    For PREEMPTED, the restore point is ``first_segment + segments_run`` and ``preempt_ns``
    is the time from the preemption flag being raised to the worker stopping. ``start_ns``
    is when the worker began the batch (``perf_counter_ns``: CLOCK_MONOTONIC, the front
    end's clock too), so the front end can tell the hand-off from the way back.
    ``input_ns`` and ``output_ns`` are the parts of ``compute_ns`` spent taking the inputs
    from their queue slots (onto the model's device) and writing the outputs into theirs
    (Triton's ``compute_input`` and ``compute_output``; the rest is ``compute_infer``).
    """

    kind: int
    batch_id: int
    compute_ns: int
    segments_run: int
    first_segment: int
    preempt_ns: int = 0
    start_ns: int = 0
    input_ns: int = 0
    output_ns: int = 0

    @property
    def infer_ns(self) -> int:
        """The model's own part of the run (``compute_ns`` less the input and output copies)."""
        return max(0, self.compute_ns - self.input_ns - self.output_ns)

    def pack(self) -> bytes:
        return DONE.pack(self.kind, 0, 0, self.batch_id, self.compute_ns, self.segments_run,
                         self.first_segment, self.preempt_ns, self.start_ns, self.input_ns, self.output_ns)

    @classmethod
    def unpack(cls, b: bytes) -> "DoneMsg":
        kind, _s, _p, bid, ns, run, first, pns, start, ins, outs = DONE.unpack_from(b)
        return cls(kind, bid, ns, run, first, pns, start, ins, outs)


def _pack_json(kind: Msg, ident: int, body: Any, op: int = 0) -> bytes:
    data = HEAD.pack(kind, op, ident) + json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{kind.name} message of {len(data)} B is over the {MAX_MESSAGE_BYTES} B limit")
    return data


def _unpack_json(b: bytes | bytearray) -> tuple[int, int, Any]:
    """(op, id, body) of a message with a JSON body; ValueError if it is not one."""
    if len(b) < HEAD.size:
        raise ValueError(f"a {len(b)} B message is shorter than its {HEAD.size} B head")
    _kind, op, ident = HEAD.unpack_from(b)
    return op, ident, json.loads(bytes(b[HEAD.size :]))


@dataclass(slots=True, frozen=True)
class LoadMsg:
    """Bind the worker to a model. On the wire the fds in ``bind`` are replaced by their
    places among the SCM_RIGHTS fds; ``unpack`` puts the received ones in their place."""

    binding: int
    bind: BindSpec

    def pack(self) -> tuple[bytes, list[int]]:
        """The message and the fds to send beside it."""
        fds = self.bind.fds()
        if len(fds) > MAX_LOAD_FDS:
            raise ValueError(f"a LOAD carries at most {MAX_LOAD_FDS} queue fds, not {len(fds)}")
        body = self.bind.with_fds(list(range(len(fds)))).to_dict()
        return _pack_json(Msg.LOAD, self.binding, body), fds

    @classmethod
    def unpack(cls, b: bytes | bytearray, fds: list[int]) -> "LoadMsg":
        """The LOAD in ``b`` with the ``fds`` received beside it; ValueError (or TypeError,
        KeyError) if the body is malformed or names other fds than those that came."""
        _op, ident, body = _unpack_json(b)
        bind = BindSpec.from_dict(body)
        if bind.fds() != list(range(len(fds))):
            raise ValueError(f"LOAD names queue fds {bind.fds()} but {len(fds)} came with it")
        return cls(ident, bind.with_fds(fds))


@dataclass(slots=True, frozen=True)
class LoadedMsg:
    """A binding is resident: what its weights take, what it took on top of them, and how
    long loading them took."""

    binding: int
    model: str
    nbytes: int  # parameters and buffers, measured on the loaded model (shared storage once)
    load_ns: int  # from the LOAD's arrival to the model ready on its device
    segments: int
    device: str
    # Anonymous RSS the load and a warm-up batch at max_batch_size added to the process
    # (activations, allocator, runtime); None when the LOAD did not ask for the measure.
    private_bytes: int | None = None
    # The port of the binding's TCP direct endpoint, which the worker's OS picked (None:
    # it has none; ``DirectSpec.tcp_host``).
    direct_tcp_port: int | None = None
    # Device bytes the load holds on its GPU, the caching allocator's slack included
    # (``worker.device_memory``); None on the CPU or when the LOAD did not ask for the measure.
    device_bytes: int | None = None

    def pack(self) -> bytes:
        return _pack_json(Msg.LOADED, self.binding, {"model": self.model, "nbytes": self.nbytes,
                                                      "load_ns": self.load_ns, "segments": self.segments,
                                                      "device": self.device, "private_bytes": self.private_bytes,
                                                      "direct_tcp_port": self.direct_tcp_port,
                                                      "device_bytes": self.device_bytes})

    @classmethod
    def unpack(cls, b: bytes | bytearray) -> "LoadedMsg":
        _op, ident, d = _unpack_json(b)
        return cls(ident, **d)


@dataclass(slots=True, frozen=True)
class UnloadedMsg:
    """The worker released ``binding`` (None: nothing was bound, so nothing to release)
    and holds ``rss_anon`` bytes of anonymous memory now (what decides whether the process
    is reused). An answer to PARK with ``parked_bytes`` > 0 kept the binding, its weights
    in that many bytes of page-locked host memory and none on its device; 0 released it
    as UNLOAD does (nothing to park)."""

    binding: int | None
    rss_anon: int = 0
    parked_bytes: int = 0

    def pack(self) -> bytes:
        return _pack_json(Msg.UNLOADED, 0, {"binding": self.binding, "rss_anon": self.rss_anon,
                                             "parked_bytes": self.parked_bytes})

    @classmethod
    def unpack(cls, b: bytes | bytearray) -> "UnloadedMsg":
        return cls(**_unpack_json(b)[2])


@dataclass(slots=True, frozen=True)
class FailedMsg:
    """A request failed: ``op`` is its kind (RUN: ``ident`` is the batch id; LOAD: the
    binding id, ``START_BINDING`` when the process could not start, after which it
    exits; any other kind: a message the worker could not act on, ``ident`` 0)."""

    op: int
    ident: int
    text: str

    def pack(self) -> bytes:
        return HEAD.pack(Msg.FAILED, self.op, self.ident) + self.text.encode()[:60000]

    @classmethod
    def unpack(cls, b: bytes | bytearray) -> "FailedMsg":
        _kind, op, ident = HEAD.unpack_from(b)
        return cls(op, ident, bytes(b[HEAD.size :]).decode(errors="replace"))


def pack_ready(info: dict[str, Any]) -> bytes:
    """READY with the worker's info (its pid, and ``rss_anon``: its anonymous RSS, the
    level a process bound to nothing returns to)."""
    return _pack_json(Msg.READY, 0, info)


def unpack_ready(b: bytes | bytearray) -> dict[str, Any]:
    return _unpack_json(b)[2]
