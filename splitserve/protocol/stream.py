"""How a server reads fast-path frames from a stream: the frame state machine of a
non-blocking connection, shared by the front end's connections (``server/fastpath.py``)
and a worker's direct connections (``worker/direct_conn.py``), and ``read_frame`` for an
asyncio stream (the cluster gateway's clients and node links).

The state machine: the 64-byte header accumulated with its frame's first-byte time,
a receive with its error and end-of-stream handling, a refused frame's payload read and
thrown away before its error is answered, a frame that cannot be parsed answered and the
connection closed, and the gather write that copies aside what the kernel does not take.

What differs stays with each side: where a payload goes (tensor-queue slots, or a
worker's batch rows), which kinds of frame it takes, how reading and writing are driven
(the event loop's readers, or the worker's epoll loop) and its flow control.
"""

from __future__ import annotations

import logging
import socket
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from splitserve.errors import BadFrame, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, MAX_PAYLOAD, Header, Kind, unpack_header

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

# A refused payload is read into nothing this many bytes at a time, so refusing one costs
# at most this much memory whatever its size.
_DISCARD_CHUNK = 1 << 20

# Reading states shared by both sides; a subclass numbers its own from ``FIRST_OWN_STATE``.
HEADER, PAYLOAD, DISCARD = range(3)
FIRST_OWN_STATE = 3


class FrameStream(ABC):
    """One non-blocking stream socket carrying fast-path frames.

    A subclass reads with ``read_header`` / ``read_discard`` / ``receive`` from its own
    ``_read_some`` (the worker's direct connection parses what it stages itself), is told of each parsed header (``on_header``), calls ``frame_done``
    when a frame has been read whole, and writes with ``send``. ``label`` names the peer
    in log lines."""

    def __init__(self, sock: socket.socket, label: str) -> None:
        self.sock = sock
        self.label = label
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # an answer is one small write: send it now, not after an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fd = sock.fileno()
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_mv = memoryview(self.hdr)
        self.got = 0  # header bytes read so far
        self.state = HEADER
        self.frame_t0_ns = 0  # CLOCK_MONOTONIC ns of the first byte of the frame being read (0: between frames)
        self.header: Header | None = None  # the frame being read, once its header is parsed
        self.discard_left = 0
        self.discard_error: SplitServeError | None = None
        self.scratch = bytearray(65536)
        self.out = bytearray()  # bytes the kernel has not taken yet
        self.closing = False  # framing lost: flush the error frame, then close
        self.closed = False

    # -- what each side provides ---------------------------------------------------------

    @abstractmethod
    def on_header(self, h: Header) -> None:
        """A frame's header was parsed (``self.header`` is ``h``): start reading its payload,
        or ``discard`` it."""

    @abstractmethod
    def between_frames(self) -> None:
        """A frame was read whole (``state`` is ``HEADER`` again): apply flow control."""

    @abstractmethod
    def want_write(self) -> None:
        """``out`` holds bytes the kernel did not take: be told when it can take more
        (then call ``write_some``)."""

    @abstractmethod
    def close(self, flush: bool = False) -> None:
        """Close the connection (with ``flush``, once ``out`` is sent, not taking more frames meanwhile)."""

    @property
    @abstractmethod
    def max_pending_out(self) -> int:
        """Unsent bytes past which the peer is disconnected (it does not read its answers)."""

    # -- reading ---------------------------------------------------------------------------

    def receive(self, bufs: memoryview | list[memoryview]) -> int:
        """One read into ``bufs`` (a scatter read when it is a list): the bytes that came,
        0 when none came now (the socket is empty, or it failed or ended: closed then)."""
        try:
            n = self.sock.recvmsg_into(bufs)[0] if isinstance(bufs, list) else self.sock.recv_into(bufs)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            log.debug("%s: %s", self.label, e)
            self.close()
            return 0
        if n == 0:
            self.close()
        return n

    def read_header(self) -> bool:
        """One read towards the next header; False when the socket has nothing more now."""
        buf = self.hdr_mv[self.got :]
        n = self.receive(buf)
        if n:
            self.header_bytes(n)
        return n == len(buf)

    def header_bytes(self, n: int) -> None:
        """``n`` more bytes of a header landed in ``hdr``: stamp a frame's first byte, and
        parse the header once it is whole."""
        if self.got == 0:
            self.frame_t0_ns = time.monotonic_ns()
        self.got += n
        if self.got == HEADER_SIZE:
            self.got = 0
            try:
                h = unpack_header(self.hdr)
            except BadFrame as e:  # framing is lost: say why, then close; other connections are unaffected
                self.send_error(int.from_bytes(self.hdr[8:16], "little"), 0, e)
                self.close(flush=True)
                return
            self.header = h
            self.on_header(h)

    def discard(self, nbytes: int, error: SplitServeError | None) -> None:
        """Read the current frame's ``nbytes`` of payload into nothing, then answer ``error`` (if any)."""
        self.discard_error = error
        if nbytes:
            self.discard_left = nbytes
            self.state = DISCARD
        else:
            self._after_discard()

    def read_discard(self) -> bool:
        """One read of a payload being discarded; False when the socket has nothing more now."""
        buf = memoryview(self.scratch)[: min(len(self.scratch), self.discard_left)]
        n = self.receive(buf)
        if n:
            self.discard_left -= n
            if self.discard_left == 0:
                self._after_discard()
        return n == len(buf)

    def _after_discard(self) -> None:
        err, self.discard_error = self.discard_error, None
        if err is not None:
            h = self.header
            assert h is not None
            self.refused(h, err)
        self.frame_done()

    def refused(self, h: Header, error: SplitServeError) -> None:
        """A frame was refused (its payload is read): answer why."""
        self.send_error(h.req_id, h.func_id, error)

    def frame_done(self) -> None:
        """A whole frame was read: expect a header."""
        self.state = HEADER
        self.frame_t0_ns = 0
        self.between_frames()

    def expired(self, now_ns: int, limit_s: float) -> bool:
        """The current frame began more than ``limit_s`` before ``now_ns``: say so to the
        peer (the caller closes the connection)."""
        if not self.frame_t0_ns or now_ns - self.frame_t0_ns <= limit_s * 1e9 or self.closed:
            return False
        log.info("closing %s: a frame still incomplete %.1fs after its first byte", self.label, limit_s)
        h = self.header if self.state != HEADER else None
        self.send_error(h.req_id if h else 0, h.func_id if h else 0,
                        BadFrame(f"frame incomplete {limit_s:g} s after its first byte; closing the connection"))
        return True

    # -- writing ---------------------------------------------------------------------------

    def send_error(self, req_id: int, func_id: int, error: SplitServeError) -> None:
        msg = error.message.encode()
        h = Header(Kind.ERROR, req_id=req_id, func_id=func_id, status=int(error.status), payload_len=len(msg))
        self.send([h.pack(), msg])

    def send(self, parts: list) -> None:
        """Gather-write ``parts``; whatever the kernel does not take now is copied aside, so
        the caller may reuse the buffers (slots, output rows) as soon as this returns."""
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
            except OSError as e:
                log.debug("%s: %s", self.label, e)
                self.close()
                return
            for p in parts:
                n = len(p)
                if sent >= n:
                    sent -= n
                    continue
                self.out += memoryview(p)[sent:]
                sent = 0
        if self.out:
            if len(self.out) > self.max_pending_out:
                log.warning("closing %s: %d B unread", self.label, len(self.out))
                self.close()
                return
            self.want_write()

    def write_some(self) -> bool:
        """One write of what ``send`` kept aside; True when all of it is gone (a closing
        connection is closed then), False otherwise or when the write failed (closed)."""
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            log.debug("%s: %s", self.label, e)
            self.close()
            return False
        del self.out[:n]
        if self.out:
            return False
        if self.closing:
            self.close()
        return True


async def read_frame(reader: asyncio.StreamReader, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytes | None]:
    """The next frame of an asyncio stream: its header and payload, or its header and None
    when the payload is over ``max_payload`` (then read and thrown away in bounded chunks,
    so the stream stays framed and the caller can answer why).

    Raises ``BadFrame`` when the header does not parse (framing is lost: the caller closes
    the stream) and ``asyncio.IncompleteReadError`` when the stream ends before a whole frame."""
    h = unpack_header(await reader.readexactly(HEADER_SIZE))
    if h.payload_len > max_payload:
        left = h.payload_len
        while left:
            n = min(left, _DISCARD_CHUNK)
            await reader.readexactly(n)
            left -= n
        return h, None
    return h, (await reader.readexactly(h.payload_len) if h.payload_len else b"")
