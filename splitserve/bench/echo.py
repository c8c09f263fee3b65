"""The floor: a plain Python TCP echo of a request's and a response's sizes.

Each request is a 64-byte header (the fast path's header size) whose first 8 bytes say how
many payload bytes follow (``n``) and how many bytes to answer (``m``), then the ``n`` bytes.
The server reads them and writes ``m`` bytes back. Nothing is decoded, queued or computed,
so its round trip is what moving the same bytes through the kernel costs from Python: the
fast path's round trip minus this is its own tax.

Run as ``python -m splitserve.bench.echo --port 0``: the first stdout line is JSON with the
port. One thread per connection, blocking sockets, TCP_NODELAY, buffers reused. With
``--poll-us`` each connection polls for its next request before it blocks, as a worker's
direct loop does: the floor with both sides polling. A blocking server's round trip depends
on where its thread runs (on the 2-core VM ≈ 8.5 µs when it shares its client's vCPU, ≈ 31 µs
when it does not: that vCPU halts between calls), a polling one's much less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from splitserve.launcher import stop_process
from splitserve.protocol.sockets import bound_waits, recv_polling

HEADER_SIZE = 64
_SIZES = struct.Struct("<II")  # payload bytes that follow, bytes to answer
MAX_BYTES = 1 << 30


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    while len(view):
        try:
            n = sock.recv_into(view)
        except BlockingIOError:  # SO_RCVTIMEO ran out (a client's socket)
            raise TimeoutError("the echo server did not answer in time") from None
        if n == 0:
            return False
        view = view[n:]
    return True


def _serve_connection(conn: socket.socket, poll_s: float = 0.0) -> None:
    """Echo on ``conn`` until it closes; with ``poll_s`` each request's first bytes are
    polled for that long (``recv_polling``) before the read blocks, as a worker's loop does."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(HEADER_SIZE)
    inbuf = bytearray(1 << 16)
    outbuf = bytearray(1 << 16)
    try:
        while True:
            view = memoryview(header)
            if poll_s:
                got = recv_polling(conn, view, time.monotonic() + poll_s)
                if got == 0:
                    break
                view = view[got or 0 :]
            if not _recv_exact(conn, view):
                break
            n, m = _SIZES.unpack_from(header)
            if n > MAX_BYTES or m > MAX_BYTES:
                break
            if n > len(inbuf):
                inbuf = bytearray(n)
            if not _recv_exact(conn, memoryview(inbuf)[:n]):
                break
            if m > len(outbuf):
                outbuf = bytearray(m)
            conn.sendall(memoryview(outbuf)[:m])
    except OSError:
        pass
    finally:
        conn.close()


def serve(host: str = "127.0.0.1", port: int = 0, poll_us: float = 0.0) -> None:
    """Listen on ``host:port``, print ``{"port": N}`` on stdout, serve until killed; with
    ``poll_us`` each connection polls that long for its next request before it blocks."""
    lst = socket.create_server((host, port), backlog=256)
    print(json.dumps({"port": lst.getsockname()[1]}), flush=True)
    while True:
        conn, _ = lst.accept()
        threading.Thread(target=_serve_connection, args=(conn, poll_us / 1e6), daemon=True).start()


def request_header(payload_bytes: int, answer_bytes: int) -> bytes:
    """The 64-byte header asking for ``answer_bytes`` back after ``payload_bytes``."""
    return _SIZES.pack(payload_bytes, answer_bytes) + bytes(HEADER_SIZE - _SIZES.size)


@dataclass
class EchoProcess:
    """An echo server child process; ``stop()`` ends it."""

    proc: subprocess.Popen
    host: str
    port: int

    @classmethod
    def start(cls, host: str = "127.0.0.1", timeout: float = 30.0, poll_us: float = 0.0) -> EchoProcess:
        """An echo server child; ``poll_us``: its connections poll that long for each request."""
        proc = subprocess.Popen([sys.executable, "-m", "splitserve.bench.echo", "--host", host, "--port", "0",
                                 "--poll-us", str(poll_us)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the child listens (or dies: empty line)
        if not line:
            proc.wait(timeout)
            raise RuntimeError(f"echo server exited with {proc.returncode} before listening")
        return cls(proc, host, int(json.loads(line)["port"]))

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> EchoProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EchoClient:
    """Blocking client: ``call()`` sends one request of ``request_bytes`` (header included)
    and reads the ``response_bytes`` answer, like a fast-path call of the same sizes. With
    ``poll_us`` it polls for the answer (``MSG_DONTWAIT``, yielding between tries) for up to
    that long before it blocks, as a fast-path ``Client(poll_us=...)`` does."""

    def __init__(self, host: str, port: int, request_bytes: int, response_bytes: int, timeout: float = 30.0,
                 poll_us: float = 0.0) -> None:
        if request_bytes < HEADER_SIZE or response_bytes < 1:
            raise ValueError(f"request must be >= {HEADER_SIZE} bytes and response >= 1 byte")
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # waits bounded in the kernel, as the fast-path client's: a socket timeout would
        # put a poll() before every send and recv, a floor two system calls too high
        bound_waits(self.sock, timeout)
        self._header = request_header(request_bytes - HEADER_SIZE, response_bytes)
        self._payload = bytes(request_bytes - HEADER_SIZE)
        self._answer = bytearray(response_bytes)
        self._poll_s = poll_us / 1e6

    def call(self) -> None:
        self.sock.sendmsg([self._header, self._payload])
        view = memoryview(self._answer)
        if self._poll_s:
            n = recv_polling(self.sock, view, time.monotonic() + self._poll_s)
            if n == 0:
                raise ConnectionError("echo server closed the connection")
            view = view[n or 0 :]
        if not _recv_exact(self.sock, view):
            raise ConnectionError("echo server closed the connection")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> EchoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEchoClient:
    """asyncio counterpart of ``EchoClient`` for closed-loop throughput runs."""

    def __init__(self, host: str, port: int, request_bytes: int, response_bytes: int) -> None:
        self.host, self.port = host, port
        self._header = request_header(request_bytes - HEADER_SIZE, response_bytes)
        self._payload = bytes(request_bytes - HEADER_SIZE)
        self.response_bytes = response_bytes

    async def connect(self) -> AsyncEchoClient:
        self._r, self._w = await asyncio.open_connection(self.host, self.port)
        self._w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def call(self) -> None:
        self._w.writelines([self._header, self._payload])
        await self._w.drain()
        await self._r.readexactly(self.response_bytes)

    async def close(self) -> None:
        self._w.close()
        try:
            await self._w.wait_closed()
        except (ConnectionError, OSError):
            pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m splitserve.bench.echo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--poll-us", type=float, default=0.0, help="poll this long for each request before blocking")
    args = ap.parse_args(argv)
    try:
        serve(args.host, args.port, args.poll_us)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
