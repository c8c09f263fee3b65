"""Starts and stops the decoded front ends (HTTP, gRPC) beside the fast path, and owns the
thread pool that keeps their CPU work off the fast path's event loop.

Both run on the server's own event loop: HTTP is uvicorn serving the FastAPI app of
``splitserve.server.http`` (lifespan off, no signal handlers: ``Server.serve_forever`` owns
the signals), gRPC is ``splitserve.server.grpc_server``. The loop only moves bytes and
answers; parsing JSON, splitting binary tensors, converting typed gRPC contents to numpy
and encoding large responses run in ``CodecPool``'s threads, so a multi-megabyte JSON body
never holds up a fast-path client. (The front ends could have their own loop and thread
instead, but ``Server.infer`` and management touch loop-owned state, so every handler
would hop back anyway; the pool moves exactly the CPU work and nothing else.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn

from splitserve.errors import QueueFull
from splitserve.server import management

if TYPE_CHECKING:
    from splitserve.config import ServerConfig
    from splitserve.server.app import Server

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class CodecPool:
    """Decoding and encoding of HTTP and gRPC bodies, off the event loop and bounded.

    ``admit`` counts a large body from before it is received until it is decoded (or
    its response encoded): at most ``max_pending`` at once, so buffered bodies are bounded
    by ``max_pending`` × the per-model body limit; one more is refused with QueueFull
    (HTTP 503, gRPC UNAVAILABLE) and a message, at once. ``run`` calls a function in one
    of ``threads`` threads, or inline below ``inline_bytes`` where the hop costs more than
    the work.
    """

    def __init__(self, threads: int, max_pending: int, inline_bytes: int) -> None:
        self.max_pending = max_pending
        self.inline_bytes = inline_bytes
        self.pending = 0
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="splitserve-codec")

    @classmethod
    def from_config(cls, cfg: "ServerConfig") -> "CodecPool":
        return cls(cfg.codec_threads, cfg.codec_max_pending, cfg.codec_inline_bytes)

    def small(self, size: int | None) -> bool:
        """Whether a body of ``size`` bytes (None: not known yet) is handled on the loop."""
        return size is not None and size < self.inline_bytes

    @contextlib.asynccontextmanager
    async def admit(self, size: int | None) -> AsyncIterator[None]:
        """Hold one of the ``max_pending`` places while a large body is in hand."""
        if self.small(size):
            yield
            return
        if self.pending >= self.max_pending:
            raise QueueFull(f"{self.pending} large request bodies are being decoded or encoded, the most this "
                            "server takes at once (SPLITSERVE_CODEC_MAX_PENDING); retry later")
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    async def run(self, size: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a codec thread (inline for a body below ``inline_bytes``)."""
        if self.small(size):
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a loop it does not own: it installs no signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        pass


class _Running:
    """What ``start`` started for one server, for ``stop``."""

    def __init__(self, codec: CodecPool) -> None:
        self.codec = codec
        self.http: tuple[_EmbeddedUvicorn, asyncio.Task] | None = None
        self.grpc = False


_running: "dict[Server, _Running]" = {}


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    s.setblocking(False)
    return s


async def _start_http(server: "Server", codec: CodecPool) -> tuple[_EmbeddedUvicorn, asyncio.Task]:
    from splitserve.server.http import create_app

    cfg = server.config
    sock = _bind(cfg.host, cfg.http_port or 0)
    config = uvicorn.Config(
        create_app(server, codec), lifespan="off", http="httptools", loop="none", log_config=None,
        access_log=False, timeout_graceful_shutdown=max(1, round(cfg.stop_grace_s)), server_header=False,
    )
    userver = _EmbeddedUvicorn(config)
    task = asyncio.get_running_loop().create_task(userver.serve(sockets=[sock]), name="splitserve-http")
    while not userver.started:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError("the HTTP server stopped during start-up")
        await asyncio.sleep(cfg.http_start_poll_s)
    server.ports["http_port"] = sock.getsockname()[1]
    log.info("HTTP (Open Inference Protocol v2) on %s:%d", cfg.host, server.ports["http_port"])
    return userver, task


async def start(server: "Server") -> None:
    """Start HTTP and gRPC where their ports are set; make the management token."""
    cfg = server.config
    if cfg.http_port is None and cfg.grpc_port is None:
        return
    await asyncio.to_thread(management.ensure_token, server)
    running = _running[server] = _Running(CodecPool.from_config(cfg))
    if cfg.http_port is not None:
        running.http = await _start_http(server, running.codec)
    if cfg.grpc_port is not None:
        from splitserve.server import grpc_server

        server.ports["grpc_port"] = await grpc_server.start(server, running.codec)
        running.grpc = True


async def stop(server: "Server") -> None:
    """Stop taking requests on HTTP and gRPC; requests in flight get a short grace period."""
    running = _running.pop(server, None)
    if running is None:
        return
    tasks: list[asyncio.Future] = []
    if running.http is not None:
        userver, task = running.http
        userver.should_exit = True
        tasks.append(task)
    if running.grpc:
        from splitserve.server import grpc_server

        tasks.append(asyncio.ensure_future(grpc_server.stop(server)))
    for r in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            log.warning("front end stopped with an error: %r", r)
    running.codec.close()
