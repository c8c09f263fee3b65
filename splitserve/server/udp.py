"""The fast path over UDP.

A request larger than one datagram is split by the client into ``seg_count`` segments;
each carries its ``seq_num`` and its ``payload_offset`` into the whole payload. The server
peeks at the 64-byte header, then receives the datagram with ``recvmsg_into`` directly
into the right bytes of the tensor-queue slots (a segment may span two input tensors).
Clients retransmit on timeout; the server de-duplicates on (peer, req_id): segments it has
are dropped, a request still running is not started twice, and a request already answered
gets its cached answer again.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from splitserve.errors import BadFrame, BadSegment, BadSize, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header
from splitserve.server.monitor import Call

if TYPE_CHECKING:
    from splitserve.server.app import Server

log = logging.getLogger(__name__)

_ASSEMBLY_TIMEOUT_S = 5.0  # a partial request whose client went quiet frees its slots


class _Assembly:
    __slots__ = ("call", "views", "offsets", "seen", "seg_count", "total", "last")

    def __init__(self, call: Call, views: list[memoryview], seg_count: int) -> None:
        self.call = call
        self.views = views
        self.offsets = []
        off = 0
        for v in views:
            self.offsets.append(off)
            off += len(v)
        self.total = off
        self.seen: set[int] = set()
        self.seg_count = seg_count
        self.last = time.monotonic()

    def buffers(self, offset: int, length: int) -> list[memoryview]:
        """The slot memory that bytes [offset, offset+length) of the payload belong in."""
        out = []
        for start, v in zip(self.offsets, self.views):
            end = start + len(v)
            lo, hi = max(offset, start), min(offset + length, end)
            if lo < hi:
                out.append(v[lo - start : hi - start])
        return out


class UdpEndpoint:
    """The UDP fast-path socket; it is also the Sink for the calls it receives."""

    def __init__(self, server: "Server", sock: socket.socket) -> None:
        self.server = server
        self.loop = server.loop
        self.sock = sock
        sock.setblocking(False)
        self.hdr = bytearray(HEADER_SIZE)
        self.scratch = bytearray(65536)
        self.assembling: dict[tuple, _Assembly] = {}
        self.running: set[tuple] = set()
        self.answered: OrderedDict[tuple, list[bytes]] = OrderedDict()
        self.segment = server.config.udp_segment
        self.loop.add_reader(sock.fileno(), self._on_readable)
        self._sweeper = self.loop.call_later(_ASSEMBLY_TIMEOUT_S, self._sweep)

    def _on_readable(self) -> None:
        for _ in range(256):
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
        if key in self.answered:  # a retransmit of an answered request: answer again
            self._consume()
            self.answered.move_to_end(key)
            for dgram in self.answered[key]:
                self._sendto([dgram], addr)
            return
        if key in self.running:
            self._consume()
            return
        asm = self.assembling.get(key)
        try:
            if asm is None:
                asm = self._start(addr, h)
                self.assembling[key] = asm
            if h.seg_count != asm.seg_count or h.seq_num >= asm.seg_count:
                raise BadSegment(f"segment {h.seq_num} of {h.seg_count} does not fit a request of {asm.seg_count}")
            if h.payload_offset + h.payload_len > asm.total or n < HEADER_SIZE:
                raise BadSegment(f"segment {h.seq_num} covers bytes past the request's {asm.total} B")
        except SplitServeError as e:
            self._consume()
            self._send_error(addr, h.req_id, h.func_id, e)
            return
        if h.seq_num in asm.seen:
            self._consume()
            return
        bufs = [memoryview(self.hdr), *asm.buffers(h.payload_offset, h.payload_len)]
        got, _, flags, _ = self.sock.recvmsg_into(bufs)
        if got != HEADER_SIZE + h.payload_len or flags & socket.MSG_TRUNC:
            self.assembling.pop(key, None)
            asm.call.abandon()
            self._send_error(addr, h.req_id, h.func_id, BadSize(
                f"segment {h.seq_num} carried {got - HEADER_SIZE} B, its header says {h.payload_len} B"))
            return
        asm.seen.add(h.seq_num)
        asm.last = time.monotonic()
        if len(asm.seen) == asm.seg_count:
            del self.assembling[key]
            self.running.add(key)
            asm.call.runtime.submit(asm.call)

    def _start(self, addr: tuple, h: Header) -> _Assembly:
        rt = self.server.runtime_by_func(h.func_id)
        per = rt.config.request_bytes
        total = h.total_len or h.payload_len
        if total == 0 or total % per:
            raise BadSize(f"request of {total} B for {rt.name!r}: expected a multiple of {per} B")
        if h.seg_count == 0 or h.seg_count > -(-total // 1024):
            raise BadSegment(f"seg_count {h.seg_count} is out of range for a {total} B request")
        count = total // per
        cls = self.server.request_class(rt, h.cls)
        seq = rt.alloc(cls, count)
        deadline = time.perf_counter() + h.deadline_us / 1e6 if h.deadline_us else None
        call = Call(self.server.monitor, rt, h.req_id, cls, seq, count, self, deadline, peer=addr)
        return _Assembly(call, rt.input_views(cls, seq, count), h.seg_count)

    def _on_lookup(self, addr: tuple, h: Header, name: str) -> None:
        try:
            rt = self.server.runtime(name)
        except SplitServeError as e:
            self._send_error(addr, h.req_id, 0, e)
            return
        rt.ensure_started()
        body = json.dumps(self.server.describe(rt)).encode()
        self._sendto([Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=rt.func_id, payload_len=len(body)).pack(), body], addr)

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
        self._remember(key, dgrams)
        for d in dgrams:
            self._sendto([d], call.peer)

    def fail(self, call: Call, error: SplitServeError) -> None:
        key = (call.peer, call.req_id)
        self.running.discard(key)
        msg = error.message.encode()
        d = Header(Kind.ERROR, req_id=call.req_id, func_id=call.runtime.func_id, status=int(error.status),
                   payload_len=len(msg)).pack() + msg
        self._remember(key, [d])
        self._sendto([d], call.peer)

    def _remember(self, key: tuple, dgrams: list[bytes]) -> None:
        self.answered[key] = dgrams
        while len(self.answered) > self.server.config.udp_response_cache:
            self.answered.popitem(last=False)

    def _send_error(self, addr: tuple, req_id: int, func_id: int, error: SplitServeError) -> None:
        msg = error.message.encode()
        self._sendto([Header(Kind.ERROR, req_id=req_id, func_id=func_id, status=int(error.status),
                             payload_len=len(msg)).pack(), msg], addr)

    def _sendto(self, parts: list, addr: tuple) -> None:
        try:
            self.sock.sendmsg(parts, (), 0, addr)
        except OSError as e:  # UDP gives no delivery promise; the client retransmits
            log.debug("udp send to %s failed: %s", addr, e)

    def _sweep(self) -> None:
        now = time.monotonic()
        for key, asm in list(self.assembling.items()):
            if now - asm.last > _ASSEMBLY_TIMEOUT_S:
                del self.assembling[key]
                asm.call.abandon()
        self._sweeper = self.loop.call_later(_ASSEMBLY_TIMEOUT_S, self._sweep)

    def close(self) -> None:
        self._sweeper.cancel()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for asm in self.assembling.values():  # no segment can arrive now: free their slots
            asm.call.abandon()
        self.assembling.clear()


def udp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((host, port))
    return s
