"""Sockets of the fast path: the listening ones, shared by the front end's listeners and a
worker's direct endpoint, and a blocking client's waits bounded in the kernel."""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path


def tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    return s


def unix_listener(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, connectable by this user only. A stale socket
    file left by a dead server is replaced; a live server's socket is never taken over."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            os.unlink(path)  # nobody listens there any more
        else:
            raise OSError(errno.EADDRINUSE, f"another server is listening on {path}")
        finally:
            probe.close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    os.chmod(path, 0o600)
    s.listen(1024)
    return s


# What ``close_drained`` reads and drops at most before it closes
_DRAIN_BYTES = 1 << 16


def close_drained(sock: socket.socket) -> None:
    """Close a connected stream socket after reading and dropping what its peer sent that
    was not read (at most ``_DRAIN_BYTES``, without waiting). A socket closed with unread
    bytes makes the kernel reset the connection (a TCP RST; ECONNRESET on a Unix peer's next
    read), and a reset can cost the peer what was just sent to it: a server that closes a
    misbehaving connection says why first, and the peer must be able to read that, then
    the end of the stream."""
    left = _DRAIN_BYTES
    try:
        while left > 0:
            chunk = sock.recv(min(left, 16384), socket.MSG_DONTWAIT)
            if not chunk:
                break
            left -= len(chunk)
    except OSError:  # nothing waiting (EAGAIN), or the connection is already gone
        pass
    sock.close()


def bound_waits(sock: socket.socket, timeout: float) -> None:
    """Make ``sock`` blocking with its sends and receives bounded by ``timeout`` in the
    kernel (SO_SNDTIMEO, SO_RCVTIMEO): a Python-level ``settimeout`` costs a poll() before
    every send and every recv, two system calls per call, to bound the same waits."""
    sock.settimeout(None)
    sec = int(timeout)
    usec = int((timeout - sec) * 1e6) or (0 if sec else 1)  # a zero timeval would mean no bound
    tv = struct.pack("ll", sec, usec)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_polling(sock: socket.socket, view: memoryview, until: float,
                 cpu_free: Callable[[int], bool] | None = None) -> int | None:
    """Receive into ``view`` without blocking, yielding the CPU between tries, until
    something comes (its byte count; 0: the peer closed) or ``until`` (``time.monotonic``)
    passes (None): a blocking caller's poll before it sleeps (``splitserve/spin.py``). The
    poll also ends (None) once ``cpu_free(now_ns)`` says a task waits for a CPU
    (``spin.HostLoad.cpu_free``, asked at every try; it reads the host at most every 10 µs)."""
    while True:
        try:
            return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            now = time.monotonic_ns()
            if now >= until * 1e9 or (cpu_free is not None and not cpu_free(now)):
                return None
            os.sched_yield()
