"""What every HTTP route module shares: the protocol's error body, bounded request bodies,
the routes' OpenAPI arguments, and the app whose errors are the protocol's."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve import __version__
from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput, PayloadTooLarge, SplitServeError
from splitserve.protocol import v2
from splitserve.server import http_schema as doc
from splitserve.server.ports import ModelRegistrar, ModelSignature

log = logging.getLogger(__name__)


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    """The protocol's error object; ``status`` (splitserve's status name) is an addition that
    lets clients rebuild the exact error class."""
    body = {"error": message}
    if code:
        body["status"] = code
    return JSONResponse(body, status_code=status)


def limited_receive(receive: Callable[[], Awaitable[dict]], limit: int, what: str) -> Callable[[], Awaitable[dict]]:
    """An ASGI receive that counts body bytes and stops at ``limit`` (chunked bodies too)."""
    seen = 0

    async def counted() -> dict:
        nonlocal seen
        msg = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge(f"the body exceeds the {limit} byte limit ({what})")
        return msg

    return counted


def content_length(request: Request, limit: int, what: str) -> int | None:
    """The declared body size (None when chunked), refused at once when over ``limit``."""
    length = request.headers.get("content-length")
    if length is None:
        return None
    try:
        n = int(length)
    except ValueError:
        raise InvalidInput(f"Content-Length {length!r} is not a number") from None
    if n > limit:
        raise PayloadTooLarge(f"the body of {n} bytes exceeds the {limit} byte limit ({what})")
    return n


def bounded(request: Request, limit: int, what: str) -> Request:
    """The same request, refused before it is read when it is (or becomes) too large."""
    content_length(request, limit, what)
    return Request(request.scope, limited_receive(request.receive, limit, what))


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The whole body, refused once it passes ``limit`` (``what`` names the limit)."""
    req = bounded(request, limit, what)
    chunks: list[bytes] = []
    stream: AsyncIterator[bytes] = req.stream()
    async for chunk in stream:
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes, default: Any = None) -> Any:
    """``body`` parsed as JSON, ``default`` when it is empty."""
    if not body.strip():
        return default
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"the request body is not valid JSON: {e}") from None


async def read_json(request: Request, limit: int, default: Any = None) -> Any:
    """A small JSON body (management calls), parsed on the loop."""
    return parse_json(await read_body(request, limit, "SPLITSERVE_MANAGEMENT_BODY_BYTES"), default)


def infer_limit(config: ServerConfig, cfg: ModelSignature) -> int:
    """The largest infer body a model takes: its largest batch as JSON."""
    return v2.infer_body_limit(cfg.inputs, cfg.max_batch_size, config.frontends.json_chars_per_value)


def authorize(registrar: ModelRegistrar, request: Request) -> None:
    """Refuse a call whose ``Authorization`` header does not carry the management token."""
    registrar.check_token(request.headers.get("authorization"))


def route_doc(ok: Any, *codes: int, alt: dict[int, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Route arguments that document the answers: ``ok`` (a model, or a ``responses`` entry)
    for 200, ErrorBody for ``codes`` and 500, and ``alt`` statuses with a body of their own."""
    ok_entry = {"model": ok} if isinstance(ok, type) else ok
    own = {code: {"model": m, "description": "Not ready"} for code, m in (alt or {}).items()}
    return {"response_model": None, "responses": {200: ok_entry, **doc.errors(*codes), **own}, **extra}


def new_app(description: str, request_models: list[type[BaseModel]]) -> FastAPI:
    """An app whose errors are the protocol's error object (handlers keep no per-request
    state on the app)."""
    app = FastAPI(title="splitserve", version=__version__, description=description)
    doc.install_openapi(app, request_models)

    # -- errors ----------------------------------------------------------------------------

    @app.exception_handler(SplitServeError)
    async def _splitserve_error(request: Request, e: SplitServeError) -> JSONResponse:
        return error_response(e.http_status, e.message, e.status.name)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(400, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # A bug: the details stay in the server log, the client gets a reference to them.
        ref = secrets.token_hex(6)
        log.exception("HTTP %s %s failed (reference %s)", request.method, request.url.path, ref)
        return error_response(500, f"internal error (reference {ref} in the server log)", "INTERNAL")

    return app
