"""``InferLane``: the v2 infer calls go straight to their handler, past the router.

FastAPI matches a request against its routes one by one and then solves the endpoint's
parameters (path parameters validated through pydantic, the ``Request`` injected). For the
one route that carries the serving traffic, that is a large part of the call: with the node's
60 routes, a profile of 3,300 binary lenet calls counted 23 route matches, four router passes
and a dependency solve per call, and going past them took ≈ 190 µs off a lenet call's
≈ 1.3 ms of tax (``docs/fastpath-breakdown.md``, stop 42).
The lane is a pure ASGI middleware that takes ``POST /v2/models/{name}[/versions/{version}]/infer``
by one regular expression and calls the handler with the path's parameters as the router
would (``[^/]+`` each, from the decoded path). Everything else goes on to the app.

The app's routes still declare these paths (the OpenAPI document, and the same handler), and
the lane answers as they do: a ``SplitServeError`` is the protocol's error object with its
status (``base.error_response``); anything else goes up to the app's server-error handler,
which logs it and answers 500 with a reference, as it does for a route.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.errors import SplitServeError
from splitserve.server.http.base import error_response

# (model name, request, version or None) -> the answer (``inference.infer_endpoint``)
InferEndpoint = Callable[[str, Request, "str | None"], Awaitable[Response]]

# The two infer routes' paths, as Starlette compiles ``{name}`` and ``{version}``
INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


class InferLane:
    """ASGI middleware: infer calls to ``infer``, the rest to ``app``."""

    def __init__(self, app: ASGIApp, infer: InferEndpoint) -> None:
        self.app = app
        self.infer = infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await self.infer(match["name"], Request(scope, receive, send), match["version"])
        except SplitServeError as e:
            response = error_response(e.http_status, e.message, e.status.name)
        await response(scope, receive, send)
