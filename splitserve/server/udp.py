"""The fast path over UDP.

A request larger than one datagram is split by the client into ``seg_count`` segments;
each carries its ``seq_num`` and its ``payload_offset`` into the whole payload. The server
peeks at the 64-byte header, checks the segment against those already received, then
receives the datagram with ``recvmsg_into`` directly into the right bytes of the
tensor-queue slots (a segment may span two input tensors).

A request is submitted only when its segments tile the payload exactly: segment ``i``
starts where segment ``i - 1`` ends, none overlaps another, and the last ends at
``total_len``. A segment that overlaps or contradicts another, a set of segments with a
gap, or a request still incomplete ``frame_timeout_s`` after its first segment is answered
with an error and its slots are freed, so no request ever runs on stale slot bytes.

Clients retransmit on timeout; the server de-duplicates on (peer, req_id): segments it has
are dropped, a request still running is not started twice, and a request already answered
gets its remembered answer again (``AnswerCache``, bounded in entries and in bytes; an
answer too large to remember is recomputed if asked again, which inference allows).
"""

from __future__ import annotations

import bisect
import json
import logging
import socket
import time
from collections import OrderedDict
from typing import Any

from splitserve.errors import BadFrame, BadSegment, BadSize, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header
from splitserve.server.intake import Arrival
from splitserve.server.monitor import Call, after_us
from splitserve.server.ports import FastPathHost, FrontEnd

log = logging.getLogger(__name__)

# Fewest payload bytes per segment on average: bounds seg_count, and so the per-request
# bookkeeping, by the request's size.
_MIN_SEGMENT = 1024


class Coverage:
    """Which bytes of one message its segments cover so far (pure).

    ``add`` is called with each segment's header before its bytes are received, so a
    segment that overlaps bytes already received is refused before it can overwrite them.
    """

    __slots__ = ("total", "seg_count", "segs", "_starts", "_ends")

    def __init__(self, total: int, seg_count: int) -> None:
        self.total = total
        self.seg_count = seg_count
        self.segs: dict[int, tuple[int, int]] = {}  # seq_num -> (offset, length)
        self._starts: list[int] = []  # offsets of the segments received, sorted
        self._ends: list[int] = []  # their ends, in the same order

    def add(self, seq_num: int, offset: int, length: int) -> bool:
        """Record a segment; False if it is an exact repeat. Raises BadSegment naming the problem."""
        if seq_num >= self.seg_count:
            raise BadSegment(f"segment {seq_num} of a request of {self.seg_count} segments")
        if length == 0 or offset + length > self.total:
            raise BadSegment(f"segment {seq_num} covers bytes [{offset}, {offset + length}) "
                             f"of a request of {self.total} B")
        seen = self.segs.get(seq_num)
        if seen is not None:
            if seen == (offset, length):
                return False
            raise BadSegment(f"segment {seq_num} came as bytes [{offset}, {offset + length}) "
                             f"and earlier as [{seen[0]}, {seen[0] + seen[1]})")
        i = bisect.bisect_right(self._starts, offset)
        if (i and self._ends[i - 1] > offset) or (i < len(self._starts) and self._starts[i] < offset + length):
            raise BadSegment(f"segment {seq_num} (bytes [{offset}, {offset + length})) overlaps another segment")
        self._starts.insert(i, offset)
        self._ends.insert(i, offset + length)
        self.segs[seq_num] = (offset, length)
        return True

    @property
    def complete(self) -> bool:
        """Every segment has arrived (``check`` then says whether they tile the message)."""
        return len(self.segs) == self.seg_count

    def check(self) -> None:
        """Raise BadSegment unless the segments tile ``[0, total)`` in ``seq_num`` order."""
        end = 0
        for i in range(self.seg_count):
            off, n = self.segs[i]
            if off != end:
                raise BadSegment(f"segment {i} starts at byte {off} but the one before it ends at {end}")
            end = off + n
        if end != self.total:
            raise BadSegment(f"the {self.seg_count} segments cover {end} B of a {self.total} B request")


class AnswerCache:
    """Answers (their datagrams) of recent UDP requests for retransmits: least recently
    used first out, bounded in entries and in bytes."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple, tuple[list[bytes], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> list[bytes] | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: tuple, dgrams: list[bytes]) -> None:
        """Remember ``dgrams`` for ``key``; an answer larger than the byte bound is not kept."""
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        size = sum(len(d) for d in dgrams)
        if size > self.max_bytes:
            return
        self._items[key] = (dgrams, size)
        self.nbytes += size
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, n) = self._items.popitem(last=False)
            self.nbytes -= n


class _Assembly:
    """A request whose segments are still arriving: where they go, and which came."""

    __slots__ = ("arrival", "coverage")

    def __init__(self, arrival: Arrival, coverage: Coverage) -> None:
        self.arrival = arrival
        self.coverage = coverage


class UdpEndpoint:
    """The UDP fast-path socket; it is also the Sink for the calls it receives.

    ``server`` is the node as a ``FastPathHost`` (``server/ports.py``): the endpoint uses
    its ``loop``, ``config`` (``udp_segment``, ``udp_rcvbuf``, the answer cache's bounds),
    ``intake`` (slot allocation and the frame-timeout sweep), ``monitor``, and ``model``,
    ``model_by_func`` and ``request_class``.
    """

    def __init__(self, server: FastPathHost, sock: socket.socket) -> None:
        self.server = server
        self.loop = server.loop
        self.intake = server.intake
        self.sock = sock
        cfg = server.config.transports
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.udp_rcvbuf)
        self.hdr = bytearray(HEADER_SIZE)
        self.scratch = bytearray(65536)
        self.assembling: dict[tuple, _Assembly] = {}
        self.running: set[tuple] = set()
        self.answered = AnswerCache(cfg.udp_response_cache, cfg.udp_response_cache_bytes)
        self.segment = cfg.udp_segment
        self.loop.add_reader(sock.fileno(), self._on_readable)
        self.intake.watch(self, self.loop)

    def _on_readable(self) -> None:
        for _ in range(self.server.config.transports.fast_reads_per_wakeup):
            try:
                n, addr = self.sock.recvfrom_into(self.hdr, HEADER_SIZE, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.debug("udp recv: %s", e)
                return
            self._on_datagram(n, addr)

    def _consume(self) -> int:
        """Drop the datagram at the head of the socket queue; its length."""
        try:
            return self.sock.recv_into(self.scratch)
        except OSError:
            return 0

    def _on_datagram(self, n: int, addr: tuple) -> None:
        try:
            if n < HEADER_SIZE:
                raise BadFrame(f"datagram of {n} B is shorter than the {HEADER_SIZE} B header")
            h = unpack_header(self.hdr)
        except BadFrame as e:
            self._consume()
            self._send_error(addr, int.from_bytes(self.hdr[8:16], "little") if n >= 16 else 0, 0, e)
            return
        key = (addr, h.req_id)
        if h.kind == Kind.PING:
            self._consume()
            self._sendto([Header(Kind.PONG, req_id=h.req_id).pack()], addr)
            return
        if h.kind == Kind.LOOKUP:
            size = self._consume()
            self._on_lookup(addr, h, bytes(self.scratch[HEADER_SIZE:size]).decode(errors="replace"))
            return
        if h.kind != Kind.REQUEST:
            self._consume()
            self._send_error(addr, h.req_id, h.func_id, BadFrame(f"a client may not send {Kind(h.kind).name} frames"))
            return
        cached = self.answered.get(key)
        if cached is not None:  # a retransmit of an answered request: answer again
            self._consume()
            for dgram in cached:
                self._sendto([dgram], addr)
            return
        if key in self.running:
            self._consume()
            return
        asm = self.assembling.get(key)
        if asm is None:
            try:
                asm = self._start(addr, h)
            except SplitServeError as e:
                self._consume()
                # The refusal is this request's one answer: a retransmit that crossed it
                # gets it again rather than being admitted later with a second answer.
                self._answer_once(key, self._error_dgram(h.req_id, h.func_id, e))
                return
            self.assembling[key] = asm
        try:
            fresh = self._add_segment(asm, h)
        except SplitServeError as e:
            self._consume()
            self._refuse(key, asm, e)
            return
        if not fresh:  # a retransmitted segment we have
            self._consume()
            return
        bufs = [memoryview(self.hdr), *asm.arrival.buffers(h.payload_offset, h.payload_len)]
        got, _, flags, _ = self.sock.recvmsg_into(bufs)
        if got != HEADER_SIZE + h.payload_len or flags & socket.MSG_TRUNC:
            self._refuse(key, asm, BadSize(
                f"segment {h.seq_num} carried {got - HEADER_SIZE} B or more, its header says {h.payload_len} B"))
            return
        if asm.coverage.complete:
            self._complete(key, asm)

    @staticmethod
    def _add_segment(asm: _Assembly, h: Header) -> bool:
        cov = asm.coverage
        claimed = h.total_len or (h.payload_len if h.seg_count == 1 else 0)
        if h.seg_count != cov.seg_count or claimed != cov.total:
            raise BadSegment(f"segment {h.seq_num} claims {h.seg_count} segments and {claimed} B; "
                             f"the request's first segment said {cov.seg_count} and {cov.total} B")
        return cov.add(h.seq_num, h.payload_offset, h.payload_len)

    def _complete(self, key: tuple, asm: _Assembly) -> None:
        del self.assembling[key]
        try:
            asm.coverage.check()
            self.intake.arrived(asm.arrival)
        except SplitServeError as e:
            self._refuse(key, asm, e)
            return
        self.running.add(key)
        asm.arrival.call.runtime.submit(asm.arrival.call)

    def _start(self, addr: tuple, h: Header) -> _Assembly:
        rt = self.server.model_by_func(h.func_id)
        per = rt.config.request_bytes
        total = h.total_len or h.payload_len
        if total == 0 or total % per:
            raise BadSize(f"request of {total} B for {rt.name!r}: expected a multiple of {per} B")
        if h.seg_count == 0 or h.seg_count > -(-total // _MIN_SEGMENT):
            raise BadSegment(f"seg_count {h.seg_count} is out of range for a {total} B request")
        count = total // per
        cls = self.server.request_class(rt, h.cls)
        seq = self.intake.alloc(rt, cls, count)
        now = time.perf_counter()
        call = Call(self.server.monitor, rt, h.req_id, cls, seq, count, self, after_us(now, h.deadline_us),
                    peer=addr, slo=after_us(now, h.slo_us))
        arrival = self.intake.arriving(call, rt.input_views(cls, seq, count), self, time.monotonic())
        return _Assembly(arrival, Coverage(total, h.seg_count))

    def _refuse(self, key: tuple, asm: _Assembly, error: SplitServeError) -> None:
        """Give up on a partial request: free its slots, answer ``error`` (remembered, so
        late segments of it get the same answer instead of starting it again)."""
        self.assembling.pop(key, None)
        self.intake.dropped(asm.arrival)
        asm.arrival.call.answer(error)

    def _on_lookup(self, addr: tuple, h: Header, name: str) -> None:
        try:
            rt = self.server.model(name)
        except SplitServeError as e:
            self._send_error(addr, h.req_id, 0, e)
            return
        # reports the model, never starts its workers (see FastPathConnection._on_lookup)
        body = json.dumps(rt.describe()).encode()
        self._sendto([Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=rt.func_id, payload_len=len(body)).pack(), body], addr)

    # -- Receiver (server/intake.py) -------------------------------------------------

    def expire(self, now: float, limit: float) -> None:
        """Refuse every request still incomplete ``limit`` s after its first segment."""
        for key, asm in list(self.assembling.items()):
            if now - asm.arrival.t0 > limit:
                cov = asm.coverage
                self._refuse(key, asm, BadSegment(
                    f"request incomplete {limit:g} s after its first segment "
                    f"({len(cov.segs)} of {cov.seg_count} segments arrived)"))

    def drop_arrival(self, arrival: Arrival, error: SplitServeError) -> None:
        key = (arrival.call.peer, arrival.call.req_id)
        asm = self.assembling.get(key)
        if asm is not None and asm.arrival is arrival:
            self._refuse(key, asm, error)

    # -- Sink --------------------------------------------------------------------

    def deliver(self, call: Call) -> None:
        key = (call.peer, call.req_id)
        self.running.discard(key)
        outs = call.runtime.output_views(call.cls, call.seq, call.count)
        payload = b"".join(outs)  # kept for retransmits, so one copy is made here
        segs = max(1, -(-len(payload) // self.segment))
        dgrams = []
        for i in range(segs):
            part = payload[i * self.segment : (i + 1) * self.segment]
            h = Header(Kind.RESPONSE, req_id=call.req_id, func_id=call.runtime.func_id, cls=call.cls,
                       seq_num=i, seg_count=segs, payload_len=len(part), payload_offset=i * self.segment,
                       total_len=len(payload), queue_us=call.queue_us, compute_us=call.compute_ns // 1000,
                       total_us=call.total_us)
            dgrams.append(h.pack() + part)
        self.answered.put(key, dgrams)
        for d in dgrams:
            self._sendto([d], call.peer)

    def fail(self, call: Call, error: SplitServeError) -> None:
        key = (call.peer, call.req_id)
        self.running.discard(key)
        self._answer_once(key, self._error_dgram(call.req_id, call.runtime.func_id, error))

    def _answer_once(self, key: tuple, dgram: bytes) -> None:
        """Send a request's one answer and remember it for retransmits."""
        self.answered.put(key, [dgram])
        self._sendto([dgram], key[0])

    @staticmethod
    def _error_dgram(req_id: int, func_id: int, error: SplitServeError) -> bytes:
        msg = error.message.encode()
        return Header(Kind.ERROR, req_id=req_id, func_id=func_id, status=int(error.status),
                      payload_len=len(msg)).pack() + msg

    def _send_error(self, addr: tuple, req_id: int, func_id: int, error: SplitServeError) -> None:
        """An error about a datagram that is no request (bad frame, lookup): not remembered."""
        self._sendto([self._error_dgram(req_id, func_id, error)], addr)

    def _sendto(self, parts: list, addr: tuple) -> None:
        try:
            self.sock.sendmsg(parts, (), 0, addr)
        except OSError as e:  # UDP gives no delivery promise; the client retransmits
            log.debug("udp send to %s failed: %s", addr, e)

    def close(self) -> None:
        """Stop receiving; partial requests are abandoned (their slots freed)."""
        self.intake.unwatch(self)
        for asm in list(self.assembling.values()):
            self.intake.dropped(asm.arrival)
            asm.arrival.call.abandon()
        self.assembling.clear()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


def udp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind((host, port))
    return s


class UdpListener(FrontEnd):
    """The UDP fast path as a front end: binds ``(host, port)`` (0: any free port) at start."""

    def __init__(self, server: FastPathHost, address: tuple[str, int]) -> None:
        self.server = server
        self.address = address
        self.endpoint: UdpEndpoint | None = None

    async def start(self) -> dict[str, Any]:
        sock = udp_socket(*self.address)
        self.endpoint = UdpEndpoint(self.server, sock)
        return {"udp_port": sock.getsockname()[1]}

    async def stop(self, grace_s: float) -> None:
        """Stop receiving at once: a datagram protocol has no connection to drain, and the
        client retransmits a request whose answer it did not get."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
