"""``HttpFrontEnd``: uvicorn serving an HTTP app on the node's (or gateway's) running loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from fastapi import FastAPI

from splitserve.config import ServerConfig
from splitserve.protocol.sockets import tcp_listener
from splitserve.server.frontends import EmbeddedUvicorn
from splitserve.server.ports import FrontEnd

log = logging.getLogger(__name__)


class HttpFrontEnd(FrontEnd):
    """The HTTP front end: uvicorn serving ``app`` (``create_app``'s on a node,
    ``inference_app``'s at a cluster gateway) on the running loop, on ``config.host`` and
    ``config.frontends.http_port`` (lifespan off, no signal handlers: the process's root owns the signals)."""

    def __init__(self, app: FastAPI, config: ServerConfig, port: int | None = None, what: str = "http_port") -> None:
        """``port`` (default ``config.frontends.http_port``) is reported as ``what``."""
        self.app = app
        self.config = config
        self.port = config.frontends.http_port if port is None else port
        self.what = what
        self._server: EmbeddedUvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> dict[str, Any]:
        cfg = self.config
        sock = tcp_listener(cfg.host, self.port or 0)
        sock.setblocking(False)
        userver = self._server = EmbeddedUvicorn(uvicorn.Config(
            self.app, lifespan="off", http="httptools", loop="none", log_config=None, access_log=False,
            timeout_graceful_shutdown=max(1, round(cfg.frontends.stop_grace_s)), server_header=False,
        ))
        task = self._task = asyncio.get_running_loop().create_task(userver.serve(sockets=[sock]),
                                                                   name=f"splitserve-{self.what}")
        await userver.wait_started(task, cfg.frontends.http_start_poll_s)
        port = sock.getsockname()[1]
        log.info("HTTP (%s) on %s:%d", self.what, cfg.host, port)
        return {self.what: port}

    async def stop(self, grace_s: float) -> None:
        # uvicorn's own timeout_graceful_shutdown (stop_grace_s) bounds the requests in flight
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
