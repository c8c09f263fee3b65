"""Fuzz target: UDP reassembly (``server/udp.py``).

A real ``UdpEndpoint`` serves a loopback UDP socket on a real event loop that the harness
turns by hand, against the fake server of ``splitserve.testing.fastpath_host``. Two client
sockets send a case's datagrams one at a time: the segments of a few requests, duplicated, dropped, reordered,
truncated or mutated, with overlapping segments in some cases, retransmissions, pings,
lookups and junk. Properties:

- nothing escapes the endpoint's callbacks, and no request is started twice while running;
- no ring byte changes outside the slots of a request being assembled (the fake server's
  shadow of its rings);
- a submitted request is exactly the client's payload: its bytes are tiled, with no gap and
  no overlap, by segments that peer sent for that req_id, agreeing on the total length and
  on a segment count equal to the number of tiles;
- every answer is well formed, a RESPONSE segment carries the right bytes of the fake
  model's output for that peer's call, and every answered call's whole answer arrives;
- once the endpoint is closed, every slot is free and every call closed.
"""

from __future__ import annotations

import math
import random
import select
import socket
from dataclasses import dataclass, field
from typing import Any

from splitserve.bench.fuzz.oracle import check_answer, check_end_state
from splitserve.bench.fuzz.wire import (
    ERROR,
    HEADER,
    LAYOUT_FIELDS,
    LOOKUP,
    LOOKUP_REPLY,
    PING,
    PONG,
    REQUEST,
    RESPONSE,
    SEGMENTED,
    SERVER_KINDS,
    Wire,
    frame,
    mutate,
    payload_bytes,
)
from splitserve.server.udp import UdpEndpoint
from splitserve.testing.fastpath_host import (
    FUNC_IDS,
    MODELS,
    Answer,
    LoopHarness,
    PropertyViolation,
    Submitted,
    ring_free,
    ring_start,
)

NAME = "udp"
PEERS = 2
_SPINS = 200  # loop turns without progress before the endpoint counts as stuck
_MIN_SEGMENT = 1024  # the server allows at most one segment per KiB of payload


@dataclass
class UdpCase:
    """One fuzz input for the UDP target: datagrams in sending order, each from peer 0 or 1."""

    datagrams: list[tuple[int, bytes]]
    answers: list[str] = field(default_factory=lambda: [Answer.SOON])
    start: int = 0  # see StreamCase
    free: int | None = None

    def record(self, limit: int = 4096) -> dict[str, Any]:
        return {"datagrams": [{"peer": p, "hex": d[:limit].hex(), "len": len(d)} for p, d in self.datagrams],
                "answers": self.answers, "start": self.start, "free": self.free}


# -- generating inputs ------------------------------------------------------------------

def segments(rnd: random.Random, req_id: int) -> list[bytes]:
    """A request split the way a client may split it: 1..8 segments of any sizes."""
    m = MODELS[0] if rnd.random() < 0.7 else MODELS[1]
    count = rnd.randint(1, m.max_batch_size)
    data = payload_bytes(rnd, count * m.request_bytes)
    total = len(data)
    n = rnd.randint(1, max(1, min(8, total // _MIN_SEGMENT)))
    cuts = [0, *sorted(rnd.sample(range(1, total), n - 1)), total]
    cls = rnd.choice((0, 1, 255))
    return [frame(REQUEST, data[lo:hi], req_id=req_id, func_id=FUNC_IDS[m.name], cls=cls, seq_num=i, seg_count=n,
                  payload_offset=lo, total_len=total if n > 1 or rnd.random() < 0.5 else 0,
                  flags=SEGMENTED if n > 1 else 0)
            for i, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]


def overlapping(rnd: random.Random, segs: list[bytes]) -> bytes:
    """A segment that claims bytes another segment of the same request also claims: another
    segment's offset under its own seq_num, or a shifted offset."""
    a = rnd.choice(segs)
    wa = Wire.decode(a)
    b = Wire.decode(rnd.choice(segs))
    if rnd.random() < 0.5:  # seq_num of b, offset and bytes of a
        return frame(REQUEST, a[HEADER:], req_id=wa.req_id, func_id=wa.func_id, cls=wa.cls, seq_num=b.seq_num,
                     seg_count=wa.seg_count, payload_offset=wa.payload_offset, total_len=wa.total_len, flags=wa.flags)
    shift = rnd.choice((-3, -1, 1, 2, 64))
    return frame(REQUEST, a[HEADER:], req_id=wa.req_id, func_id=wa.func_id, cls=wa.cls, seq_num=wa.seq_num,
                 seg_count=wa.seg_count, payload_offset=max(0, wa.payload_offset + shift), total_len=wa.total_len,
                 flags=wa.flags)


def generate(rnd: random.Random, overlap: bool = True) -> UdpCase:
    """One input. With ``overlap`` False, nothing changes how segments cover a payload (no
    overlapping segments, no mutation of the layout fields or the req_id, no req_id used
    twice by a peer), so a server without a coverage check passes."""
    out: list[tuple[int, bytes]] = []
    later: list[tuple[int, bytes]] = []
    keep = () if overlap else (*LAYOUT_FIELDS, "req_id")
    for i in range(rnd.randint(1, 4)):
        # Without overlaps a peer never reuses a req_id in a case: the segments of two
        # requests under one key overlap too.
        peer, req_id = rnd.randrange(PEERS), rnd.randrange(4) if overlap else i
        segs = segments(rnd, req_id)
        for s in segs:
            r = rnd.random()
            if r < 0.08:
                continue  # lost
            out.append((peer, s))
            if r < 0.2:
                out.append((peer, s))  # duplicated
            elif r < 0.3:
                out.append((peer, mutate(rnd, s, keep=keep)))
        if overlap and len(segs) > 1 and rnd.random() < 0.5:
            out.append((peer, overlapping(rnd, segs)))
        if rnd.random() < 0.2:
            later += [(peer, s) for s in segs]  # a retransmission, after the answer
    for _ in range(rnd.randint(0, 2)):
        peer, req_id = rnd.randrange(PEERS), rnd.randrange(4)
        out.append((peer, rnd.choice((
            frame(PING, req_id=req_id),
            frame(LOOKUP, rnd.choice((b"fz1", b"fz2", b"nope", b"")), req_id=req_id),
            frame(rnd.choice(SERVER_KINDS), req_id=req_id, status=1),
            payload_bytes(rnd, rnd.randrange(HEADER + 8)),
        ))))
    if rnd.random() < 0.6:
        rnd.shuffle(out)
    answers = [rnd.choice(Answer.ALL) for _ in range(rnd.randint(1, 3))]
    return UdpCase(out + later, answers, ring_start(rnd), ring_free(rnd))


# -- judging ----------------------------------------------------------------------------

def exact_tiling(sub: Submitted, sent: list[bytes]) -> bool:
    """Whether ``sub``'s bytes are tiled by segments in ``sent`` (one peer's datagrams)."""
    call, data = sub.call, sub.data
    total = len(data)
    starts: dict[int, dict[int, set[int]]] = {}  # seg_count -> offset -> tile lengths
    for d in sent:
        if len(d) < HEADER:
            continue
        w = Wire.decode(d)
        n = w.payload_len
        if (w.framing_ok and w.kind == REQUEST and w.req_id == call.req_id and w.func_id == call.runtime.func_id
                and n > 0 and len(d) == HEADER + n and (w.total_len or n) == total
                and w.payload_offset + n <= total and d[HEADER:] == data[w.payload_offset : w.payload_offset + n]):
            starts.setdefault(w.seg_count, {}).setdefault(w.payload_offset, set()).add(n)
    for count, tiles in starts.items():
        reach = {0}
        for _ in range(count):
            reach = {o + n for o in reach for n in tiles.get(o, ())}
        if total in reach:
            return True
    return False


class UdpHarness(LoopHarness):
    """A loop, a fake server, two client sockets and a fresh endpoint per case."""

    name = NAME

    def __init__(self, overlap: bool = True) -> None:
        super().__init__()
        self.overlap = overlap
        self.clients = []
        for _ in range(PEERS):
            c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            c.bind(("127.0.0.1", 0))
            c.setblocking(False)
            self.clients.append(c)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        super().close()

    def generate(self, rnd: random.Random) -> UdpCase:
        return generate(rnd, self.overlap)

    def check(self, case: UdpCase) -> None:
        """Run ``case``; raises PropertyViolation when a property does not hold."""
        self.server.reset(case.answers, case.start, case.free)
        self.loop_errors.clear()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        ep = UdpEndpoint(self.server, sock)  # type: ignore[arg-type]
        addr = sock.getsockname()
        got: list[list[bytes]] = [[] for _ in self.clients]
        try:
            for peer, d in case.datagrams:
                self.clients[peer].sendto(d, addr)
                self._settle(sock, got)
            self.server.answer_later()
            self._settle(sock, got)
        finally:
            ep.close()
        self._read(got)
        self._judge(case, got)

    def _read(self, got: list[list[bytes]]) -> None:
        for i, c in enumerate(self.clients):
            while True:
                try:
                    got[i].append(c.recv(1 << 16))
                except BlockingIOError:
                    break

    def _settle(self, sock: socket.socket, got: list[list[bytes]]) -> None:
        """Turn the loop until the endpoint has taken every datagram and given every answer due."""
        for _ in range(_SPINS):
            self.turn()
            self._read(got)
            if not self.server.soon and not select.select([sock], [], [], 0)[0]:
                return
        raise PropertyViolation(f"the endpoint made no progress for {_SPINS} loop turns")

    def _judge(self, case: UdpCase, got: list[list[bytes]]) -> None:
        self.raise_seen()
        names = [c.getsockname() for c in self.clients]
        sent: list[list[bytes]] = [[] for _ in self.clients]
        for peer, d in case.datagrams:
            sent[peer].append(d)
        for sub in self.server.submitted:
            peer = names.index(sub.call.peer)
            if not exact_tiling(sub, sent[peer]):
                raise PropertyViolation(
                    f"request {sub.call.req_id} of peer {peer} was submitted ({len(sub.data)} B) although its "
                    "segments do not cover its payload exactly once")
        for peer, dgrams in enumerate(got):
            self._check_answers(peer, names[peer], dgrams, sent[peer])
        check_end_state(self.server, "after the endpoint closed")

    def _check_answers(self, peer: int, name: tuple, dgrams: list[bytes], sent: list[bytes]) -> None:
        asked = {(Wire.decode(d).kind, Wire.decode(d).req_id) for d in sent if len(d) >= HEADER}
        calls = [s for s in self.server.submitted if s.call.peer == name]
        covered: dict[int, set[int]] = {}  # id(sub) -> response offsets seen
        failed = set()
        for d in dgrams:
            if len(d) < HEADER:
                raise PropertyViolation(f"a {len(d)} B datagram from the server to peer {peer}")
            w = Wire.decode(d)
            payload = d[HEADER:]
            if w.payload_len != len(payload):
                raise PropertyViolation(f"a datagram to peer {peer} says {w.payload_len} B and carries {len(payload)}")
            check_answer(w, payload, self.server, None)
            if w.kind == PONG and (PING, w.req_id) not in asked:
                raise PropertyViolation(f"a PONG to peer {peer} for req_id {w.req_id}, which it never pinged")
            if w.kind == LOOKUP_REPLY and (LOOKUP, w.req_id) not in asked:
                raise PropertyViolation(f"a LOOKUP_REPLY to peer {peer} for req_id {w.req_id} it never asked for")
            if w.kind == ERROR:
                failed.add(w.req_id)
            if w.kind == RESPONSE:
                mine = [s for s in calls if s.call.req_id == w.req_id and s.answered_ok
                        and len(s.output) == w.total_len
                        and s.output[w.payload_offset : w.payload_offset + w.payload_len] == payload]
                if not mine:
                    raise PropertyViolation(f"a RESPONSE segment to peer {peer} for req_id {w.req_id} is not part of "
                                            "the answer of any of its calls")
                if w.seg_count != max(1, math.ceil(w.total_len / self.server.config.transports.udp_segment)):
                    raise PropertyViolation(f"a RESPONSE to peer {peer} says {w.seg_count} segments")
                for s in mine:
                    covered.setdefault(id(s), set()).add(w.payload_offset)
        seg = self.server.config.transports.udp_segment
        for s in calls:
            if s.answered_ok and covered.get(id(s), set()) != set(range(0, max(1, len(s.output)), seg)):
                raise PropertyViolation(f"the answer of peer {peer}'s call {s.call.req_id} did not all arrive")
            if s.answered_ok is False and s.call.req_id not in failed:
                raise PropertyViolation(f"peer {peer}'s failed call {s.call.req_id} got no ERROR")


__all__ = ["NAME", "PEERS", "UdpCase", "UdpHarness", "exact_tiling", "generate", "overlapping", "segments"]
