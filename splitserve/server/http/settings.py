"""Triton's trace and logging extensions over HTTP: ``/v2/trace/setting`` (the node's and
each model's) and ``/v2/logging``. Reading is open; changing needs the token."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.server import http_schema as doc
from splitserve.server.http.base import authorize, read_json, route_doc
from splitserve.server.log_settings import LogSettings
from splitserve.server.management import ModelManager
from splitserve.server.trace_settings import TraceSampler

log = logging.getLogger(__name__)


async def _changes(request: Request, limit: int) -> dict[str, Any]:
    body = await read_json(request, limit)
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object of settings")
    return body


def settings_routes(manager: ModelManager, traces: TraceSampler, logs: LogSettings, config: ServerConfig) -> APIRouter:
    """The trace settings through ``traces`` (models checked through ``manager``, which
    also holds the token) and the log settings through ``logs``."""
    router = APIRouter()
    limit = config.frontends.management_body_bytes
    trace_doc = route_doc(doc.TraceSetting, 400, 401, 404, 413,
                          openapi_extra=doc.body(doc.TraceSetting, {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}))

    @router.get("/v2/trace/setting", tags=["trace"], **route_doc(doc.TraceSetting))
    async def node_trace() -> dict:
        """The node's trace settings (Triton's trace extension)."""
        return traces.settings()

    @router.post("/v2/trace/setting", tags=["trace"], **trace_doc)
    async def set_node_trace(request: Request) -> dict:
        """Change the node's trace settings (needs the token); answers the settings now."""
        authorize(manager, request)
        out = traces.update(await _changes(request, limit))
        log.info("trace settings: %s", out)
        return out

    @router.get("/v2/models/{name}/trace/setting", tags=["trace"], **route_doc(doc.TraceSetting, 404))
    async def model_trace(name: str) -> dict:
        """The trace settings in force for a model (its own over the node's)."""
        manager.record(name)
        return traces.settings(name)

    @router.post("/v2/models/{name}/trace/setting", tags=["trace"], **trace_doc)
    async def set_model_trace(name: str, request: Request) -> dict:
        """Change a model's own trace settings (needs the token); answers those now in force."""
        authorize(manager, request)
        manager.record(name)
        out = traces.update(await _changes(request, limit), name)
        log.info("trace settings of model %s: %s", name, out)
        return out

    @router.get("/v2/logging", tags=["logging"], **route_doc(doc.LogSetting))
    async def log_settings() -> dict:
        """The node's log settings (Triton's logging extension)."""
        return logs.settings()

    @router.post("/v2/logging", tags=["logging"], **route_doc(
        doc.LogSetting, 400, 401, 413, openapi_extra=doc.body(doc.LogSetting, {"log_verbose_level": 1})))
    async def set_log_settings(request: Request) -> dict:
        """Change the node's log levels at run time (needs the token)."""
        authorize(manager, request)
        return logs.update(await _changes(request, limit))

    return router
