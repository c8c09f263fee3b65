"""The fast path over TCP and Unix stream sockets.

The control header is read into a 64-byte buffer and parsed on the CPU; the payload is
then received with ``recv_into`` straight into the model's tensor-queue slots, so no
intermediate ``bytes`` object exists on the request path. Responses go out as one gather
write (header + output slots). Raw non-blocking sockets on the event loop (``add_reader``)
are used instead of asyncio transports because a transport may keep a reference to a
written buffer, and the slot must not be recycled while its bytes are still unsent.

A misbehaving peer throttles or loses only its own connection: a frame still incomplete
``frame_timeout_s`` after its first byte closes the connection; a request that arrives
slowly is moved off its ring when it holds the ring's tail (``server/intake.py``);
reading pauses, at a frame boundary, while the connection has ``fast_max_in_flight``
calls in flight or more than ``fast_out_high_water`` unsent bytes, and resumes below
``fast_out_low_water``; past ``fast_max_pending_out`` unsent bytes the peer is
disconnected.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

from splitserve.errors import BadFrame, BadSize, DuplicateRequest, SplitServeError
from splitserve.protocol.handoff import parse_handoff
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, pack_response_into
from splitserve.protocol.requests import stream_samples
from splitserve.protocol.sockets import close_drained, tcp_listener, unix_listener
from splitserve.protocol.stream import DISCARD, FIRST_OWN_STATE, HEADER, PAYLOAD, FrameStream
from splitserve.server.intake import Arrival
from splitserve.server.monitor import Call, after_us
from splitserve.server.ports import FastPathHost, FrontEnd

log = logging.getLogger(__name__)

_LOOKUP = FIRST_OWN_STATE  # reading a LOOKUP frame's model name or a HANDOFF frame's JSON


class FastPathConnection(FrameStream):
    """One client connection: many calls in flight, answered as they complete.

    ``server`` is the node as a ``FastPathHost`` (``server/ports.py``): the connection uses
    its ``loop``, ``config``, ``intake`` (slot allocation and the frame-timeout sweep),
    ``monitor``, and ``model``, ``model_by_func`` and ``request_class``. ``live`` is its
    listener's set of open connections (it adds and removes itself). It is the ``Sink`` of
    the calls it receives and a ``Receiver`` for the intake. Its frame state machine is
    ``protocol/stream.py``'s, shared with a worker's direct connections.
    """

    def __init__(self, server: FastPathHost, sock: socket.socket, peer: object,
                 live: set[FastPathConnection]) -> None:
        super().__init__(sock, f"fast-path peer {peer}")
        self.server = server
        self.live = live
        self.loop = server.loop
        self.cfg = server.config.transports  # the fast path's limits
        self.intake = server.intake
        self.peer = peer
        self.arrival: Arrival | None = None  # the request whose payload is being read
        self.lookup_buf = bytearray()
        # An answer's header is packed here: ``send`` copies what the kernel does not take,
        # so one buffer serves every answer, and no ``Header`` is built per call
        self.resp_hdr = bytearray(HEADER_SIZE)
        self.in_flight: dict[int, Call] = {}
        self.writing = False
        self.paused = False  # reading stopped by flow control
        self.loop.add_reader(self.fd, self._on_readable)
        live.add(self)
        self.intake.watch(self, self.loop)

    @property
    def max_pending_out(self) -> int:
        return self.cfg.fast_max_pending_out

    # -- reading -------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            for _ in range(self.cfg.fast_reads_per_wakeup):
                if self.closed or self.closing or self.paused or not self._read_some():
                    return
        except ConnectionError:
            self.close()
        except Exception:  # a bug must cost this connection only, never the loop or a half-parsed frame
            log.exception("fast-path peer %s: unexpected error; closing the connection", self.peer)
            self.close()

    def _read_some(self) -> bool:
        """One recv into the current target; False when the socket has nothing more now."""
        if self.state == HEADER:
            return self.read_header()
        if self.state == PAYLOAD:
            buf = self.arrival.target()
            n = self.receive(buf)
            if n and self.arrival.advance(n):
                self._on_request_complete()
            return n == len(buf)
        if self.state == DISCARD:
            return self.read_discard()
        buf = memoryview(self.scratch)[: self.header.payload_len - len(self.lookup_buf)]
        n = self.receive(buf)
        if n:
            self.lookup_buf += buf[:n]
            if len(self.lookup_buf) == self.header.payload_len:
                if self.header.kind == Kind.LOOKUP:
                    self._on_lookup(bytes(self.lookup_buf).decode(errors="replace"))
                else:
                    self._on_handoff(bytes(self.lookup_buf))
        return n == len(buf)

    def on_header(self, h: Header) -> None:
        if h.kind == Kind.REQUEST:
            try:
                self._start_request(h)
            except SplitServeError as e:
                self.discard(h.payload_len, e)
        elif h.kind == Kind.PING:
            self.discard(h.payload_len, None)
            self.send([Header(Kind.PONG, req_id=h.req_id).pack()])
        elif h.kind in (Kind.LOOKUP, Kind.HANDOFF):
            limit = self.cfg.fast_max_lookup
            if not 0 < h.payload_len <= limit:
                what = "a model name" if h.kind == Kind.LOOKUP else "JSON naming a model and an endpoint"
                self.discard(h.payload_len, BadSize(f"{Kind(h.kind).name} payload must be 1..{limit} bytes ({what})"))
            else:
                self.lookup_buf = bytearray()
                self.state = _LOOKUP
        else:
            self.discard(h.payload_len, BadFrame(f"a client may not send {Kind(h.kind).name} frames"))

    def _start_request(self, h: Header) -> None:
        if h.req_id in self.in_flight:
            raise DuplicateRequest(f"req_id {h.req_id} is already in flight on this connection")
        rt = self.server.model_by_func(h.func_id)
        count = stream_samples(h, rt.config)
        cls = self.server.request_class(rt, h.cls)
        seq = self.intake.alloc(rt, cls, count)
        now = time.perf_counter()
        call = Call(self.server.monitor, rt, h.req_id, cls, seq, count, self, after_us(now, h.deadline_us),
                    slo=after_us(now, h.slo_us))
        t0 = self.frame_t0_ns / 1e9
        call.t_first = t0  # time.monotonic is perf_counter's clock (CLOCK_MONOTONIC) on Linux
        self.in_flight[h.req_id] = call
        self.arrival = self.intake.arriving(call, rt.input_views(cls, seq, count), self, t0)
        self.state = PAYLOAD

    def _on_request_complete(self) -> None:
        arrival, self.arrival = self.arrival, None
        self.frame_done()
        call = arrival.call
        try:
            self.intake.arrived(arrival)
        except SplitServeError as e:  # it was moved aside and its ring has no room now
            call.answer(e)
            return
        call.runtime.submit(call)

    def _on_lookup(self, name: str) -> None:
        self.frame_done()
        h = self.header
        try:
            rt = self.server.model(name)
        except SplitServeError as e:
            self.send_error(h.req_id, 0, e)
            return
        # A lookup only reports the model (its state included); it never starts workers,
        # or any peer could load every registered model. The first request starts them.
        body = json.dumps(rt.describe()).encode()
        reply = Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=rt.func_id, payload_len=len(body))
        self.send([reply.pack(), body])

    def _on_handoff(self, body: bytes) -> None:
        """Hand this connection to the worker it names (``protocol/handoff.py``), or say why
        not and go on serving it. Nothing was read past this frame (a header is read into its
        64 bytes, a payload to its length), so what the client sends next is the worker's."""
        self.frame_done()
        h = self.header
        try:
            if self.in_flight or self.out or self.arrival is not None:
                raise BadFrame("a HANDOFF is a connection's first frame: this one has calls in flight or answers "
                               "unsent")
            name, endpoint = parse_handoff(body)
            self.server.model(name).hand_off(endpoint, self.sock, h.req_id)
        except SplitServeError as e:
            self.send_error(h.req_id, 0, e)
            return
        self.close(handed_over=True)

    def between_frames(self) -> None:
        """Pause here if flow control says so."""
        if len(self.in_flight) >= self.cfg.fast_max_in_flight or len(self.out) > self.cfg.fast_out_high_water:
            self.paused = True
            self.loop.remove_reader(self.fd)

    def _maybe_resume(self) -> None:
        if (self.paused and not self.closed and not self.closing
                and len(self.in_flight) < self.cfg.fast_max_in_flight and len(self.out) <= self.cfg.fast_out_low_water):
            self.paused = False
            self.loop.add_reader(self.fd, self._on_readable)

    def expire(self, now: float, limit: float) -> None:
        """Close the connection if its current frame began more than ``limit`` s ago."""
        if self.expired(int(now * 1e9), limit):
            self.close()

    def drop_arrival(self, arrival: Arrival, error: SplitServeError) -> None:
        """The intake gives up on this connection's request: say why, then close."""
        if arrival is self.arrival:
            self.send_error(arrival.call.req_id, arrival.call.runtime.func_id, error)
            self.close()

    # -- answering (Sink) -----------------------------------------------------------

    def deliver(self, call: Call) -> None:
        self.in_flight.pop(call.req_id, None)
        if self.closed:
            return
        call.t_tx = time.perf_counter()
        outs = call.runtime.output_views(call.cls, call.seq, call.count)
        hdr = self.resp_hdr
        pack_response_into(hdr, 0, call.req_id, call.runtime.func_id, call.cls, sum(map(len, outs)), call.queue_us,
                           call.compute_ns // 1000, call.total_us)
        self.send([hdr, *outs])
        self._maybe_resume()

    def fail(self, call: Call, error: SplitServeError) -> None:
        self.in_flight.pop(call.req_id, None)
        if not self.closed:
            self.send_error(call.req_id, call.runtime.func_id, error)
            self._maybe_resume()

    # -- writing -------------------------------------------------------------------

    def want_write(self) -> None:
        if not self.writing:
            self.writing = True
            self.loop.add_writer(self.fd, self._on_writable)

    def _on_writable(self) -> None:
        done = self.write_some()
        if self.closed:
            return
        if done:
            self.writing = False
            self.loop.remove_writer(self.fd)
        self._maybe_resume()

    def close(self, flush: bool = False, handed_over: bool = False) -> None:
        """Close the connection; calls still running are answered into the void. With
        ``handed_over`` a worker holds it now: this end stops watching it and closes its own
        descriptor only (no drain, which would read the client's next frame)."""
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
        self.out = bytearray()
        if self.arrival is not None:  # dropped mid-frame: its slots go back, nobody to answer
            arrival, self.arrival = self.arrival, None
            self.in_flight.pop(arrival.call.req_id, None)
            self.intake.dropped(arrival)
            arrival.call.abandon()
        self.intake.unwatch(self)
        if handed_over:
            self.sock.close()
        else:
            close_drained(self.sock)
        self.live.discard(self)


class StreamListener(FrontEnd):
    """Accepts fast-path connections on TCP (``address`` is ``(host, port)``, port 0: any
    free one) or a Unix socket (``address`` is its path), and owns those connections."""

    def __init__(self, server: FastPathHost, address: tuple[str, int] | Path) -> None:
        self.server = server
        self.address = address
        self.sock: socket.socket | None = None
        self.connections: set[FastPathConnection] = set()

    async def start(self) -> dict[str, Any]:
        if isinstance(self.address, Path):
            sock = unix_listener(self.address)
            bound: dict[str, Any] = {"unix_path": str(self.address)}
        else:
            sock = tcp_listener(*self.address)
            bound = {"fast_port": sock.getsockname()[1]}
        sock.setblocking(False)
        self.sock = sock
        self.server.loop.add_reader(sock.fileno(), self._on_accept)
        return bound

    def _on_accept(self) -> None:
        for _ in range(64):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            FastPathConnection(self.server, conn, peer, self.connections)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; open connections stay, so answers to calls in flight still go out."""
        if self.sock is not None:
            self.server.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close()

