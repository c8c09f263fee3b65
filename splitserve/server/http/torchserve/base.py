"""What TorchServe's inference and management routes share: TorchServe's error body
(``{"code", "type", "message"}``) for every error raised in them, and a model's TorchServe
view (name, archive version, handler)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

from splitserve.errors import NotFound, SplitServeError, UnknownModel
from splitserve.server import http_schema as doc
from splitserve.server.management import ModelManager

log = logging.getLogger(__name__)

# splitserve's HTTP status -> the exception type TorchServe names in its error body
_TYPES = {400: "BadRequestException", 401: "InvalidKeyException", 404: "ModelNotFoundException",
          409: "ConflictStatusException", 413: "BadRequestException", 429: "ServiceUnavailableException",
          503: "ServiceUnavailableException", 504: "RequestTimeoutException", 507: "InsufficientStorageException"}


class TorchServeError(BaseModel):
    """TorchServe's error body."""

    code: int
    type: str
    message: str


def ts_doc(ok: str, *codes: int) -> dict[str, Any]:
    """Route arguments documenting a 200 (``ok`` describes it) and TorchServe errors of
    ``codes`` (and 500)."""
    errors = {c: {**e, "model": TorchServeError} for c, e in doc.errors(*codes).items()}
    return {"response_model": None, "tags": ["torchserve"], "responses": {200: {"description": ok}, **errors}}


def ts_error(status: int, message: str) -> JSONResponse:
    """TorchServe's error body."""
    return JSONResponse({"code": status, "type": _TYPES.get(status, "InternalServerException"), "message": message},
                        status_code=status)


class TorchServeRoute(APIRoute):
    """A route whose errors (splitserve's, a bad query parameter, a bug) answer in
    TorchServe's error body instead of the v2 protocol's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except SplitServeError as e:
                return ts_error(e.http_status, e.message)
            except RequestValidationError as e:
                return ts_error(400, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
            except Exception:
                ref = secrets.token_hex(6)
                log.exception("TorchServe %s %s failed (reference %s)", request.method, request.url.path, ref)
                return ts_error(500, f"internal error (reference {ref} in the server log)")

        return answer


def ts_version(manager: ModelManager, name: str) -> str:
    """The version TorchServe's APIs give ``name``: its archive's, else splitserve's."""
    rec = manager.record(name)
    return str(rec.config.handler.get("archive_version") or rec.version)


def check_version(manager: ModelManager, name: str, version: str | None) -> str:
    """``name``'s TorchServe version; ModelNotFound when ``version`` (None, or ``all``: any) is
    not it (splitserve serves one version of a model)."""
    have = ts_version(manager, name)
    if version not in (None, "all", have):
        raise NotFound(f"Model version: {version} does not exist for model: {name} (it has {have})")
    return have


def known(manager: ModelManager, name: str) -> None:
    """UnknownModel in TorchServe's words unless ``name`` is a model."""
    if name not in manager.records:
        raise UnknownModel(f"Model not found: {name}")
