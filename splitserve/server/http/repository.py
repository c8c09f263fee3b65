"""The model repository routes that a node and a cluster gateway share: index, register and
unregister."""

from __future__ import annotations

import tomllib
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.modelconfig import check_model_name
from splitserve.server import http_schema as doc
from splitserve.server.http.base import authorize, bounded, read_json, route_doc
from splitserve.server.ports import ModelRegistrar


async def _text_field(value: Any, field: str) -> str | None:
    if value is None:
        return None
    raw = await value.read() if isinstance(value, UploadFile) else value
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"form field {field!r} must be UTF-8 text") from None
    return str(raw)



def repository_routes(registrar: ModelRegistrar, config: ServerConfig) -> APIRouter:
    """The repository routes that a node and a cluster gateway share: the index, register
    (multipart config, artifact and labels, within ``max_upload_bytes``) and unregister,
    through ``registrar`` (a node's ``ModelManager``; a gateway's registrar, which forwards
    to the cluster's controller). Register and unregister need the token."""
    router = APIRouter()
    upload_limit = config.frontends.max_upload_bytes
    small_limit = config.frontends.management_body_bytes

    @router.post("/v2/repository/index", tags=["repository"], **route_doc(
        {"model": list[doc.IndexEntry]}, 400, 413, openapi_extra=doc.body(doc.IndexRequest, required=False)))
    async def repository_index(request: Request) -> list:
        """Every model and its state; body ``{"ready": true}`` lists ready models only."""
        doc = await read_json(request, small_limit, {}) or {}
        if not isinstance(doc, dict):
            raise InvalidInput("the body must be a JSON object")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"ready must be true or false, got {ready!r}")
        return registrar.repository_index(ready)

    @router.post("/v2/repository/models/{name}/register", tags=["repository"],
                 **route_doc(doc.Registered, 400, 401, 413, 507), openapi_extra={"requestBody": {
        "required": True, "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["config"],
            "properties": {"config": {"type": "string", "format": "binary", "description": "config.toml"},
                           "artifact": {"type": "string", "format": "binary",
                                        "description": "the artifact file (not for kind = 'zoo')"},
                           "labels": {"type": "string", "format": "binary",
                                      "description": "one label per line (for /classify)"}}}}}}})
    async def register(name: str, request: Request) -> dict:
        """Register a model: upload config.toml, its artifact and labels; it is loaded before
        the call returns, or the registration is rolled back (needs the token)."""
        authorize(registrar, request)
        check_model_name(name)
        req = bounded(request, upload_limit, "SPLITSERVE_MAX_UPLOAD_BYTES")
        async with req.form(max_files=3, max_fields=3, max_part_size=upload_limit) as form:
            unknown = set(form.keys()) - {"config", "artifact", "labels"}
            if unknown:
                raise InvalidInput(f"unknown form fields {sorted(unknown)}: send config, artifact and labels")
            config_toml = await _text_field(form.get("config"), "config")
            art = form.get("artifact")
            artifact = (await art.read() if isinstance(art, UploadFile) else str(art).encode()) if art else None
            labels = await _text_field(form.get("labels"), "labels")
        if not config_toml:
            raise InvalidInput("the form needs a 'config' field with the model's config.toml")
        try:
            declared = tomllib.loads(config_toml).get("name")
        except tomllib.TOMLDecodeError as e:
            raise InvalidInput(f"config.toml is not valid TOML: {e}") from None
        if declared != name:
            raise InvalidInput(f"config.toml names the model {declared!r}, but the URL says {name!r}")
        rec = await registrar.register(config_toml, artifact, labels)
        return {"name": rec.name, "func_id": rec.func_id, "version": str(rec.version), "state": "READY"}

    @router.delete("/v2/repository/models/{name}", tags=["repository"], **route_doc(doc.Deleted, 400, 401, 404))
    async def unregister(name: str, request: Request) -> dict:
        """Unload and delete a model registered at run time (needs the token)."""
        authorize(registrar, request)
        await registrar.unregister(check_model_name(name))
        return {"name": name, "deleted": True}

    return router
