"""Judging what a transport answered: the pieces the stream and UDP targets share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.bench.fuzz.wire import ERROR, HEADER, LOOKUP_REPLY, PONG, RESPONSE, SERVER_KINDS, Wire
from splitserve.errors import Status
from splitserve.testing.fastpath_host import FuzzServer, PropertyViolation, Submitted


# Refusals any request may get, however well formed, depending on the server's state.
RESOURCE_ERRORS = frozenset({Status.QUEUE_FULL, Status.DUPLICATE_REQUEST, Status.REFUSED, Status.SHUTTING_DOWN})


@dataclass(frozen=True)
class Expect:
    """What one frame the client sent may be answered with."""

    req_id: int
    kinds: frozenset[int]  # frame kinds its answer may have (empty: it gets none)
    errors: frozenset[int]  # statuses an ERROR answer may carry
    required: bool  # it must be answered (else it may be)
    what: str  # for messages

    def allows(self, kind: int, status: int) -> bool:
        return kind in self.kinds and (kind != ERROR or status in self.errors)

    def optional(self) -> "Expect":
        return Expect(self.req_id, self.kinds, self.errors, False, self.what)


def check_answer(w: Wire, payload: bytes, server: FuzzServer, outputs: dict[int, list[bytes]] | None) -> None:
    """One frame the server sent: well formed for its kind. ``outputs`` (req_id -> answers the
    fake model gave, consumed here) checks a whole RESPONSE payload; None skips that."""
    if not w.framing_ok or w.kind not in SERVER_KINDS:
        raise PropertyViolation(f"the server sent a malformed frame: {w}")
    if w.slo_us:
        raise PropertyViolation(f"a {w.kind} frame for req_id {w.req_id} carries slo_us {w.slo_us} (replies carry 0)")
    if (w.status != 0) != (w.kind == ERROR):
        raise PropertyViolation(f"a {w.kind} frame with status {w.status} for req_id {w.req_id}")
    if w.kind == ERROR:
        if w.status not in Status._value2member_map_:
            raise PropertyViolation(f"ERROR for req_id {w.req_id} with unknown status {w.status}")
        try:
            text = payload.decode()
        except UnicodeDecodeError:
            raise PropertyViolation(f"ERROR for req_id {w.req_id} carries no UTF-8 message") from None
        if not text.strip():
            raise PropertyViolation(f"ERROR {Status(w.status).name} for req_id {w.req_id} has an empty message")
    elif w.kind == PONG and payload:
        raise PropertyViolation(f"PONG for req_id {w.req_id} with a {len(payload)} B payload")
    elif w.kind == LOOKUP_REPLY:
        try:
            body = json.loads(payload)
        except ValueError:
            raise PropertyViolation(f"LOOKUP_REPLY for req_id {w.req_id} is not JSON") from None
        rt = server.by_func.get(w.func_id)
        if rt is None or body.get("func_id") != w.func_id or body.get("name") != rt.name:
            raise PropertyViolation(f"LOOKUP_REPLY for req_id {w.req_id} names func {w.func_id}: {body}")
    elif w.kind == RESPONSE and outputs is not None:
        options = outputs.get(w.req_id, [])
        if payload not in options:
            raise PropertyViolation(f"RESPONSE for req_id {w.req_id} ({len(payload)} B) is not the answer of any "
                                    f"call with that req_id ({len(options)} answered)")
        options.remove(payload)


def ok_outputs(submitted: Sequence[Submitted], key: object = None) -> dict[int, list[bytes]]:
    """req_id -> outputs of the calls the fake model answered with a result (optionally of one peer)."""
    out: dict[int, list[bytes]] = {}
    for s in submitted:
        if s.answered_ok and (key is None or s.call.peer == key):
            out.setdefault(s.call.req_id, []).append(s.output)
    return out


def split_frames(data: bytes, what: str) -> list[tuple[Wire, bytes]]:
    """The frames of a byte stream the server sent; a partial last frame is a violation."""
    frames, pos = [], 0
    while pos < len(data):
        if len(data) - pos < HEADER:
            raise PropertyViolation(f"{what}: the server's stream ends in a partial header ({len(data) - pos} B)")
        w = Wire.decode(data[pos : pos + HEADER])
        end = pos + HEADER + w.payload_len
        if not w.framing_ok or end > len(data):
            raise PropertyViolation(f"{what}: the server sent a malformed or partial frame {w}")
        frames.append((w, data[pos + HEADER : end]))
        pos = end
    return frames


def assignable(answers: Sequence[tuple[int, int]], expects: Sequence[Expect]) -> bool:
    """Can every answer (kind, status) be matched to a distinct frame that allows it, every
    required frame getting one? (Bipartite matching: answers plus "no answer" fillers, which
    only frames that may go unanswered accept, against frames.)"""
    fillers = len(expects) - len(answers)
    if fillers < 0:
        return False
    left: list[tuple[int, int] | None] = [*answers] + [None] * fillers
    match: list[int | None] = [None] * len(expects)  # frame -> index into left

    def fits(i: int, j: int) -> bool:
        a = left[i]
        return (not expects[j].required) if a is None else expects[j].allows(*a)

    def augment(i: int, seen: list[bool]) -> bool:
        for j in range(len(expects)):
            if not seen[j] and fits(i, j):
                seen[j] = True
                if match[j] is None or augment(match[j], seen):  # type: ignore[arg-type]
                    match[j] = i
                    return True
        return False

    return all(augment(i, [False] * len(expects)) for i in range(len(left)))


def check_end_state(server: FuzzServer, where: str) -> None:
    """After a case: every slot freed, every call closed, no ring byte out of place."""
    leaked = server.in_use()
    if leaked:
        raise PropertyViolation(f"{where}: slots still allocated: {leaked}")
    if server.monitor.in_flight:
        raise PropertyViolation(f"{where}: {server.monitor.in_flight} calls never closed")
    for rt in server.runtimes.values():
        rt.check_memory(where)


__all__ = ["RESOURCE_ERRORS", "Expect", "assignable", "check_answer", "check_end_state", "ok_outputs", "split_frames"]
