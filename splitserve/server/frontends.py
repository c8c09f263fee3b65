"""Starts and stops the decoded front ends (HTTP, gRPC) beside the fast path.

Both run on the server's own event loop. HTTP is uvicorn serving the FastAPI app of
``splitserve.server.http`` (lifespan off, no signal handlers: ``Server.serve_forever``
owns the signals); gRPC is ``splitserve.server.grpc_server`` when that module exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from splitserve.server import management

if TYPE_CHECKING:
    from splitserve.server.app import Server

log = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a loop it does not own: it installs no signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        pass


_http: "dict[Server, tuple[_EmbeddedUvicorn, asyncio.Task]]" = {}


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    s.setblocking(False)
    return s


async def _start_http(server: "Server") -> None:
    from splitserve.server.http import create_app

    cfg = server.config
    sock = _bind(cfg.host, cfg.http_port or 0)
    config = uvicorn.Config(
        create_app(server), lifespan="off", http="httptools", loop="none", log_config=None,
        access_log=False, timeout_graceful_shutdown=max(1, round(cfg.stop_grace_s)), server_header=False,
    )
    userver = _EmbeddedUvicorn(config)
    task = asyncio.get_running_loop().create_task(userver.serve(sockets=[sock]), name="splitserve-http")
    while not userver.started:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError("the HTTP server stopped during start-up")
        await asyncio.sleep(0.01)
    _http[server] = (userver, task)
    server.ports["http_port"] = sock.getsockname()[1]
    log.info("HTTP (Open Inference Protocol v2) on %s:%d", cfg.host, server.ports["http_port"])


def _grpc_available() -> bool:
    return importlib.util.find_spec("splitserve.server.grpc_server") is not None


async def start(server: "Server") -> None:
    """Start HTTP and gRPC where their ports are set; make the management token."""
    cfg = server.config
    if cfg.http_port is None and cfg.grpc_port is None:
        return
    await asyncio.to_thread(management.ensure_token, server)
    if cfg.http_port is not None:
        await _start_http(server)
    if cfg.grpc_port is not None:
        if not _grpc_available():
            log.warning("gRPC front end is not part of this install; grpc_port ignored")
            return
        from splitserve.server import grpc_server

        server.ports["grpc_port"] = await grpc_server.start(server)


async def stop(server: "Server") -> None:
    """Stop taking requests on HTTP and gRPC; requests in flight get a short grace period."""
    entry = _http.pop(server, None)
    tasks = []
    if entry is not None:
        userver, task = entry
        userver.should_exit = True
        tasks.append(task)
    if server.config.grpc_port is not None and _grpc_available():
        from splitserve.server import grpc_server

        tasks.append(asyncio.ensure_future(grpc_server.stop(server)))
    for r in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            log.warning("front end stopped with an error: %r", r)
