"""The fast path over TCP and Unix stream sockets.

The control header is read into a 64-byte buffer and parsed on the CPU; the payload is
then received with ``recv_into`` straight into the model's tensor-queue slots, so no
intermediate ``bytes`` object exists on the request path. Responses go out as one gather
write (header + output slots). Raw non-blocking sockets on the event loop (``add_reader``)
are used instead of asyncio transports because a transport may keep a reference to a
written buffer, and the slot must not be recycled while its bytes are still unsent.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import TYPE_CHECKING

from splitserve.errors import BadFrame, BadSegment, BadSize, DuplicateRequest, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header
from splitserve.server.monitor import Call

if TYPE_CHECKING:
    from splitserve.server.app import Server

log = logging.getLogger(__name__)

_MAX_LOOKUP = 4096  # a lookup payload is a model name
_MAX_PENDING_OUT = 256 << 20  # a peer that stops reading is disconnected past this
_READS_PER_WAKEUP = 256  # fairness between connections
_HEADER, _PAYLOAD, _DISCARD, _LOOKUP = range(4)


class FastPathConnection:
    """One client connection: many calls in flight, answered as they complete."""

    def __init__(self, server: "Server", sock: socket.socket, peer: object) -> None:
        self.server = server
        self.loop = server.loop
        self.sock = sock
        self.peer = peer
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fd = sock.fileno()
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_mv = memoryview(self.hdr)
        self.state = _HEADER
        self.got = 0
        self.header: Header | None = None
        self.call: Call | None = None
        self.targets: list[memoryview] = []
        self.ti = 0
        self.discard_left = 0
        self.discard_error: SplitServeError | None = None
        self.scratch = bytearray(65536)
        self.lookup_buf = bytearray()
        self.in_flight: dict[int, Call] = {}
        self.out = bytearray()
        self.writing = False
        self.closing = False  # framing lost: flush the error frame, then close
        self.closed = False
        self.loop.add_reader(self.fd, self._on_readable)
        server.connections.add(self)

    # -- reading -------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            for _ in range(_READS_PER_WAKEUP):
                if self.closed or self.closing or not self._read_some():
                    return
        except ConnectionError:
            self.close()

    def _read_some(self) -> bool:
        """One recv into the current target; False when the socket has nothing more now."""
        if self.state == _HEADER:
            buf = self.hdr_mv[self.got :]
        elif self.state == _PAYLOAD:
            buf = self.targets[self.ti]
        elif self.state == _DISCARD:
            buf = memoryview(self.scratch)[: min(len(self.scratch), self.discard_left)]
        else:
            buf = memoryview(self.scratch)[: self.header.payload_len - len(self.lookup_buf)]
        try:
            n = self.sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self.close()
            return False
        if n == 0:
            self.close()
            return False
        if self.state == _HEADER:
            self.got += n
            if self.got == HEADER_SIZE:
                self.got = 0
                self._on_header()
        elif self.state == _PAYLOAD:
            if n == len(buf):
                self.ti += 1
                if self.ti == len(self.targets):
                    self._on_request_complete()
            else:
                self.targets[self.ti] = buf[n:]
        elif self.state == _DISCARD:
            self.discard_left -= n
            if self.discard_left == 0:
                self._after_discard()
        else:
            self.lookup_buf += buf[:n]
            if len(self.lookup_buf) == self.header.payload_len:
                self._on_lookup(bytes(self.lookup_buf).decode(errors="replace"))
        return n == len(buf)

    def _on_header(self) -> None:
        try:
            h = unpack_header(self.hdr)
        except BadFrame as e:
            # Framing is lost: say why, then close; other connections are unaffected.
            req_id = int.from_bytes(self.hdr[8:16], "little")
            self._send_error(req_id, 0, e)
            self.close(flush=True)
            return
        self.header = h
        if h.kind == Kind.REQUEST:
            try:
                self._start_request(h)
            except SplitServeError as e:
                self._discard(h.payload_len, e)
        elif h.kind == Kind.PING:
            self._discard(h.payload_len, None)
            self._send([Header(Kind.PONG, req_id=h.req_id).pack()])
        elif h.kind == Kind.LOOKUP:
            if not 0 < h.payload_len <= _MAX_LOOKUP:
                self._discard(h.payload_len, BadSize(f"lookup payload must be 1..{_MAX_LOOKUP} bytes (a model name)"))
            else:
                self.lookup_buf = bytearray()
                self.state = _LOOKUP
        else:
            self._discard(h.payload_len, BadFrame(f"a client may not send {Kind(h.kind).name} frames"))

    def _start_request(self, h: Header) -> None:
        if h.seg_count != 1 or h.seq_num != 0:
            raise BadSegment(f"seq_num {h.seq_num} / seg_count {h.seg_count}: stream transports carry one segment")
        if h.req_id in self.in_flight:
            raise DuplicateRequest(f"req_id {h.req_id} is already in flight on this connection")
        rt = self.server.runtime_by_func(h.func_id)
        per = rt.config.request_bytes
        if h.payload_len == 0 or h.payload_len % per:
            raise BadSize(
                f"payload of {h.payload_len} B for {rt.name!r}: expected a multiple of {per} B "
                f"(inputs {', '.join(f'{t.name} {t.datatype}{list(t.shape)}' for t in rt.config.inputs)})"
            )
        count = h.payload_len // per
        cls = self.server.request_class(rt, h.cls)
        seq = rt.alloc(cls, count)
        deadline = time.perf_counter() + h.deadline_us / 1e6 if h.deadline_us else None
        call = Call(self.server.monitor, rt, h.req_id, cls, seq, count, self, deadline)
        self.call = call
        self.in_flight[h.req_id] = call
        self.targets = rt.input_views(cls, seq, count)
        self.ti = 0
        self.state = _PAYLOAD

    def _on_request_complete(self) -> None:
        call, self.call = self.call, None
        self.targets = []
        self.state = _HEADER
        call.runtime.submit(call)

    def _discard(self, nbytes: int, error: SplitServeError | None) -> None:
        self.discard_error = error
        if nbytes:
            self.discard_left = nbytes
            self.state = _DISCARD
        else:
            self._after_discard()

    def _after_discard(self) -> None:
        self.state = _HEADER
        err, self.discard_error = self.discard_error, None
        if err is not None:
            self._send_error(self.header.req_id, self.header.func_id, err)

    def _on_lookup(self, name: str) -> None:
        self.state = _HEADER
        h = self.header
        try:
            rt = self.server.runtime(name)
        except SplitServeError as e:
            self._send_error(h.req_id, 0, e)
            return
        rt.ensure_started()
        body = json.dumps(self.server.describe(rt)).encode()
        reply = Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=rt.func_id, payload_len=len(body))
        self._send([reply.pack(), body])

    # -- answering (Sink) -----------------------------------------------------------

    def deliver(self, call: Call) -> None:
        self.in_flight.pop(call.req_id, None)
        if self.closed:
            return
        outs = call.runtime.output_views(call.cls, call.seq, call.count)
        h = Header(
            Kind.RESPONSE, req_id=call.req_id, func_id=call.runtime.func_id, cls=call.cls,
            payload_len=sum(len(v) for v in outs), queue_us=call.queue_us,
            compute_us=call.compute_ns // 1000, total_us=call.total_us,
        )
        self._send([h.pack(), *outs])

    def fail(self, call: Call, error: SplitServeError) -> None:
        self.in_flight.pop(call.req_id, None)
        if not self.closed:
            self._send_error(call.req_id, call.runtime.func_id, error)

    def _send_error(self, req_id: int, func_id: int, error: SplitServeError) -> None:
        msg = error.message.encode()
        h = Header(Kind.ERROR, req_id=req_id, func_id=func_id, status=int(error.status), payload_len=len(msg))
        self._send([h.pack(), msg])

    # -- writing -------------------------------------------------------------------

    def _send(self, parts: list) -> None:
        """Gather-write ``parts``; whatever the kernel does not take now is copied aside,
        so the caller may recycle the slots as soon as this returns (TX_COMPLETE)."""
        if self.closed:
            return
        if self.out:
            for p in parts:
                self.out += p
        else:
            try:
                sent = self.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close()
                return
            for p in parts:
                n = len(p)
                if sent >= n:
                    sent -= n
                    continue
                self.out += memoryview(p)[sent:]
                sent = 0
        if self.out and not self.writing:
            if len(self.out) > _MAX_PENDING_OUT:
                log.warning("closing fast-path peer %s: %d B unread", self.peer, len(self.out))
                self.close()
                return
            self.writing = True
            self.loop.add_writer(self.fd, self._on_writable)

    def _on_writable(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        del self.out[:n]
        if not self.out:
            self.writing = False
            self.loop.remove_writer(self.fd)
            if self.closing:
                self.close()

    def close(self, flush: bool = False) -> None:
        """Close the connection; calls still running are answered into the void."""
        if self.closed:
            return
        if flush and self.out:
            self.closing = True
            self.loop.remove_reader(self.fd)
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.writing:
            self.loop.remove_writer(self.fd)
        if self.call is not None:  # dropped mid-frame: its slots go back, nobody to answer
            self.in_flight.pop(self.call.req_id, None)
            self.call.abandon()
            self.call = None
        self.sock.close()
        self.server.connections.discard(self)


class StreamListener:
    """Accepts fast-path connections on a TCP or Unix listening socket."""

    def __init__(self, server: "Server", sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        sock.setblocking(False)
        server.loop.add_reader(sock.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        for _ in range(64):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            FastPathConnection(self.server, conn, peer)

    def close(self) -> None:
        self.server.loop.remove_reader(self.sock.fileno())
        self.sock.close()


def tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    return s


def unix_listener(path) -> socket.socket:
    import os

    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1024)
    return s

