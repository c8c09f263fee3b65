"""Fuzz target: the stream transports' frame state machine (``server/fastpath.py``).

A real ``FastPathConnection`` serves one end of a Unix socketpair on a real asyncio loop
that the harness turns by hand; the fake server of ``splitserve.testing.fastpath_host``
stands in for the node. The client sends a case's bytes in chunks, pausing at each cut so the server sees partial
headers and payloads, then collects every frame the server sent. Properties:

- nothing escapes the connection's callbacks;
- no ring byte changes outside the slots of the request being received (the fake server's
  shadow of its rings);
- every submitted request is, byte for byte, the payload of a valid request frame that the
  client sent with that req_id, in order;
- every frame the client completed gets one answer of a kind it allows (a REQUEST: its
  RESPONSE, with the fake model's exact output, or an ERROR with a status and a message);
  a header that loses the framing gets one BAD_FRAME error and the connection closes;
- when the client is gone, every slot is free and every call closed.
"""

from __future__ import annotations

import fcntl
import random
import socket
import termios
from dataclasses import dataclass, field
from typing import Any

from splitserve.bench.fuzz.oracle import (
    RESOURCE_ERRORS,
    Expect,
    assignable,
    check_answer,
    check_end_state,
    ok_outputs,
    split_frames,
)
from splitserve.bench.fuzz.wire import (
    ERROR,
    HEADER,
    LOOKUP,
    LOOKUP_REPLY,
    MAX_LOOKUP,
    PING,
    PONG,
    REQUEST,
    RESPONSE,
    SERVER_KINDS,
    Wire,
    frame,
    mutate,
    payload_bytes,
)
from splitserve.errors import Status
from splitserve.server.fastpath import FastPathConnection
from splitserve.testing.fastpath_host import (
    FUNC_IDS,
    MODELS,
    Answer,
    LoopHarness,
    PropertyViolation,
    ring_free,
    ring_start,
)

NAME = "stream"
_SPINS = 200  # loop turns without progress before the connection counts as stuck
_REQ_IDS = 6  # small, so that req_ids repeat and duplicates in flight happen


@dataclass
class StreamCase:
    """One fuzz input for the stream target."""

    data: bytes  # everything the client sends
    cuts: list[int] = field(default_factory=list)  # offsets where the client pauses for the server
    eof: bool = False  # the client half-closes after the data, before any late answer
    answers: list[str] = field(default_factory=lambda: [Answer.SOON])  # the fake model, call by call
    start: int = 0  # ring sequence number the case starts at (near the end: batches wrap)
    free: int | None = None  # ring slots left free for the case (None: all), so QUEUE_FULL happens

    def record(self, limit: int = 4096) -> dict[str, Any]:
        """The input as JSON: hex bytes (the first ``limit``) and the knobs."""
        return {"data_hex": self.data[:limit].hex(), "data_len": len(self.data), "cuts": self.cuts, "eof": self.eof,
                "answers": self.answers, "start": self.start, "free": self.free}


# -- generating inputs ------------------------------------------------------------------

def request_frame(rnd: random.Random, req_id: int) -> bytes:
    """A REQUEST for one of the fuzzed models; usually valid, sometimes wrong in one way."""
    m = MODELS[0] if rnd.random() < 0.3 else MODELS[1]
    count = rnd.randint(1, m.max_batch_size)
    n = count * m.request_bytes
    func, cls, seq, segs = FUNC_IDS[m.name], rnd.choice((0, 1, 255)), 0, 1
    r = rnd.random()
    if r < 0.05:
        n = rnd.choice((0, n - 1, n + 1, (m.max_batch_size + 1) * m.request_bytes))
    elif r < 0.08:
        func = rnd.choice((0, 3, 65535))
    elif r < 0.11:
        cls = rnd.choice((2, 7, 254))
    elif r < 0.14:
        seq, segs = rnd.choice(((1, 2), (0, 0), (0, 2)))
    return frame(REQUEST, payload_bytes(rnd, n), req_id=req_id, func_id=func, cls=cls, seq_num=seq,
                 seg_count=segs, total_len=rnd.choice((0, n)))


def client_frame(rnd: random.Random) -> bytes:
    """One frame a client might send: mostly requests, some pings, lookups and wrong kinds,
    mutated copies of all of them, and plain junk."""
    req_id = rnd.randrange(_REQ_IDS) if rnd.random() < 0.9 else rnd.getrandbits(64)
    r = rnd.random()
    if r < 0.55:
        f = request_frame(rnd, req_id)
    elif r < 0.62:
        f = frame(PING, payload_bytes(rnd, rnd.choice((0, 0, 0, 5))), req_id=req_id)
    elif r < 0.70:
        name = rnd.choice((b"fz1", b"fz2", b"nope", b"", b"x" * (MAX_LOOKUP + 1), payload_bytes(rnd, 12)))
        f = frame(LOOKUP, name, req_id=req_id)
    elif r < 0.74:
        f = frame(rnd.choice(SERVER_KINDS), payload_bytes(rnd, rnd.randrange(8)), req_id=req_id, status=3)
    elif r < 0.86:  # most mutations lose the framing, which ends the case: keep them a minority
        f = client_frame(rnd)
        for _ in range(rnd.randint(1, 2)):
            f = mutate(rnd, f)
    elif r < 0.875:
        f = payload_bytes(rnd, rnd.randint(1, 100))
    else:
        f = request_frame(rnd, req_id)
    return f


def generate(rnd: random.Random) -> StreamCase:
    """One input: a few frames, cut at random places, with random answering and ring state."""
    data = b"".join(client_frame(rnd) for _ in range(rnd.randint(1, 10)))
    if rnd.random() < 0.05:
        data = mutate(rnd, data)
    cuts = sorted({rnd.randrange(len(data) + 1) for _ in range(rnd.randint(0, 6))}) if data else []
    answers = [rnd.choice(Answer.ALL) for _ in range(rnd.randint(1, 4))]
    return StreamCase(data, cuts, rnd.random() < 0.25, answers, ring_start(rnd), ring_free(rnd))


# -- what the client expects ------------------------------------------------------------

def _request_defects(w: Wire) -> set[int]:
    """The statuses the spec gives for what is wrong with a REQUEST frame (empty: it is valid)."""
    out = set()
    m = next((m for m in MODELS if FUNC_IDS[m.name] == w.func_id), None)
    if m is None:
        out.add(Status.UNKNOWN_MODEL)
    else:
        per = m.request_bytes
        if not (0 < w.payload_len and w.payload_len % per == 0 and w.payload_len // per <= m.max_batch_size):
            out.add(Status.BAD_SIZE)
    if w.seq_num != 0 or w.seg_count != 1:
        out.add(Status.BAD_SEGMENT)
    if w.cls not in (0, 1, 255):
        out.add(Status.INVALID_INPUT)
    return out


def _request_ok(w: Wire) -> bool:
    """A REQUEST frame the spec says a server with these models must accept (resources permitting)."""
    return not _request_defects(w)


def expectations(data: bytes) -> tuple[list[tuple[Wire, bytes, Expect]], Wire | None]:
    """The frames in ``data`` with what each may be answered with, and the header that loses
    the framing (None when the framing holds to the end)."""
    out: list[tuple[Wire, bytes, Expect]] = []
    pos = 0
    while len(data) - pos >= HEADER:
        w = Wire.decode(data[pos : pos + HEADER])
        if not w.framing_ok:
            return out, w
        payload = data[pos + HEADER : pos + HEADER + w.payload_len]
        complete = len(payload) == w.payload_len
        if w.kind == REQUEST:
            defects = _request_defects(w)
            kinds = {ERROR} if defects else {RESPONSE, ERROR}
            errors = defects | RESOURCE_ERRORS | ({Status.WORKER_FAILED} if not defects else set())
        elif w.kind == PING:
            kinds, errors = ({PONG}, set()) if w.payload_len == 0 else ({PONG, ERROR}, {Status.BAD_SIZE})
        elif w.kind == LOOKUP:
            if not 0 < w.payload_len <= MAX_LOOKUP:
                kinds, errors = {ERROR}, {Status.BAD_SIZE}
            elif payload.decode(errors="replace") in FUNC_IDS:
                kinds, errors = {LOOKUP_REPLY}, set()
            else:
                kinds, errors = {ERROR}, {Status.UNKNOWN_MODEL}
        else:
            kinds, errors = {ERROR}, {Status.BAD_FRAME}
        out.append((w, payload, Expect(w.req_id, frozenset(kinds), frozenset(errors), complete,
                                       f"frame {len(out)} (kind {w.kind})")))
        pos += HEADER + w.payload_len
    return out, None


# -- running a case ---------------------------------------------------------------------

def _pending(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (0 once it is closed)."""
    if sock.fileno() < 0:
        return 0
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")


class StreamHarness(LoopHarness):
    """A loop, a fake server and a socketpair per case; ``check(case)`` runs one input."""

    name = NAME

    def generate(self, rnd: random.Random) -> StreamCase:
        return generate(rnd)

    def check(self, case: StreamCase) -> None:
        """Run ``case``; raises PropertyViolation when a property does not hold."""
        self.server.reset(case.answers, case.start, case.free)
        self.loop_errors.clear()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        conn = FastPathConnection(self.server, theirs, "fuzz", self.server.connections)  # type: ignore[arg-type]
        got = bytearray()
        try:
            bounds = [0, *case.cuts, len(case.data)]
            for lo, hi in zip(bounds, bounds[1:]):
                if conn.closed or not self._send(ours, case.data[lo:hi], conn, got):
                    break
                self._settle(conn, theirs, ours, got, eof=False)
            if case.eof:
                ours.shutdown(socket.SHUT_WR)
                self._settle(conn, theirs, ours, got, eof=True)
            open_before_late = not conn.closed
            self.server.answer_later()
            self._settle(conn, theirs, ours, got, eof=case.eof)
            ours.close()  # the client leaves; the server must free what it still holds
            for _ in range(_SPINS):
                if conn.closed:
                    break
                self.turn()
            else:
                raise PropertyViolation("the server did not notice that the client closed")
        finally:
            ours.close()
            if not conn.closed:
                conn.close()
        self._judge(case, bytes(got), open_before_late)

    def _send(self, ours: socket.socket, data: bytes, conn: FastPathConnection, got: bytearray) -> bool:
        """Send all of ``data`` (turning the loop when the socket is full); False when the server hung up."""
        view = memoryview(data)
        for _ in range(len(data) + _SPINS):
            if not view:
                return True
            try:
                view = view[ours.send(view) :]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                return False
            if view:
                self.turn()
                self._read(ours, got)
                if conn.closed:
                    return False
        raise PropertyViolation("the server stopped reading while the client kept reading its answers")

    def _read(self, ours: socket.socket, got: bytearray) -> None:
        while True:
            try:
                chunk = ours.recv(1 << 16)
            except (BlockingIOError, ConnectionResetError):
                return
            if not chunk:
                return
            got += chunk

    def _settle(self, conn: FastPathConnection, theirs: socket.socket, ours: socket.socket, got: bytearray,
                eof: bool) -> None:
        """Turn the loop until the server has read what was sent, answered what it can and
        written it all (or closed)."""
        for _ in range(_SPINS):
            self.turn()
            self._read(ours, got)
            if conn.closed:
                return
            if not eof and not conn.closing and not conn.out and not self.server.soon and not _pending(theirs):
                return
        raise PropertyViolation(f"the connection made no progress for {_SPINS} loop turns "
                                f"({_pending(theirs)} B unread, {len(conn.out)} B unsent)")

    def _judge(self, case: StreamCase, got: bytes, open_before_late: bool) -> None:
        self.raise_seen()
        frames, lost = expectations(case.data)
        self._check_submitted(frames)
        answers = split_frames(got, "stream")
        closed_early = lost is not None or case.eof or not open_before_late
        if lost is None and not case.eof and not open_before_late:
            raise PropertyViolation("the server closed a connection whose framing was intact")
        if lost is not None:
            if not answers or answers[-1][0].kind != ERROR or answers[-1][0].status != Status.BAD_FRAME \
                    or answers[-1][0].req_id != lost.req_id:
                raise PropertyViolation(f"a header that loses the framing ({lost}) was not answered by one "
                                        "BAD_FRAME error before the close")
            answers = answers[:-1]
        outputs = ok_outputs(self.server.submitted)
        for w, payload in answers:
            check_answer(w, payload, self.server, outputs)
        if not closed_early:
            left = {r: len(v) for r, v in outputs.items() if v}
            if left:
                raise PropertyViolation(f"answered calls whose RESPONSE never came: req_ids {left}")
        by_req: dict[int, tuple[list[tuple[int, int]], list[Expect]]] = {}
        for w, _ in answers:
            by_req.setdefault(w.req_id, ([], []))[0].append((w.kind, w.status))
        for _, _, e in frames:
            by_req.setdefault(e.req_id, ([], []))[1].append(e.optional() if closed_early else e)
        for req_id, (got_kinds, expects) in by_req.items():
            if not assignable(got_kinds, expects):
                raise PropertyViolation(
                    f"req_id {req_id}: answers (kind, status) {got_kinds} do not match the frames sent: "
                    + "; ".join(f"{e.what} {'must' if e.required else 'may'} get {sorted(e.kinds)} "
                                f"errors {sorted(e.errors)}" for e in expects))
        check_end_state(self.server, "after the client closed")

    def _check_submitted(self, frames: list[tuple[Wire, bytes, Expect]]) -> None:
        """Each submitted request is the next valid request frame with its req_id, byte for byte."""
        pos = 0
        for sub in self.server.submitted:
            call = sub.call
            for i in range(pos, len(frames)):
                w, payload, _ = frames[i]
                if (w.kind == REQUEST and w.req_id == call.req_id and w.func_id == call.runtime.func_id
                        and _request_ok(w) and payload == sub.data):
                    pos = i + 1
                    break
            else:
                raise PropertyViolation(f"a request with req_id {call.req_id} ({len(sub.data)} B for "
                                        f"{call.runtime.name}) was submitted that the client never sent as such")


__all__ = ["NAME", "StreamCase", "StreamHarness", "client_frame", "expectations", "generate", "request_frame"]
