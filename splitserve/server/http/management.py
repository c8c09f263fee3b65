"""A node's model management routes: statistics, configuration (Triton's and splitserve's),
and load, unload, evict and reconfigure through its ``ModelManager``."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.modelconfig import check_model_name
from splitserve.server import http_schema as doc
from splitserve.server.http.base import authorize, read_json, route_doc
from splitserve.server.management import ModelManager
from splitserve.server.registration import FILE_PREFIX, registration

NATIVE_CONFIG_DOC = route_doc({"description": "The model's config.toml as JSON, with its state and serving shape"}, 404)


def _native_config(manager: ModelManager, name: str, version: str | None) -> dict:
    """The model's config.toml as JSON, with its state and serving shape (404: no such model
    or version)."""
    manager.version(name, version)
    return manager.serving_config(name)


def statistics_routes(manager: ModelManager) -> APIRouter:
    """``GET /v2/models/stats`` (Triton's statistics extension, every model): included before
    the inference routes, which would read ``stats`` as a model name."""
    router = APIRouter()

    @router.get("/v2/models/stats", tags=["statistics"], **route_doc(doc.Statistics))
    async def all_stats() -> dict:
        """Statistics of every model (Triton statistics extension)."""
        return manager.model_statistics()

    return router


def model_config_routes(manager: ModelManager) -> APIRouter:
    """A model's statistics and configuration (Triton's schema and splitserve's), by name and
    by version."""
    router = APIRouter()
    version_of = manager.version


    async def stats(name: str, version: str | None = None) -> dict:
        version_of(name, version)
        return manager.model_statistics(name)

    router.get("/v2/models/{name}/stats", tags=["statistics"], summary="Model statistics",
               **route_doc(doc.Statistics, 404))(stats)
    router.get("/v2/models/{name}/versions/{version}/stats", tags=["statistics"], summary="Model version statistics",
               **route_doc(doc.Statistics, 404))(stats)

    async def model_config(name: str, version: str | None = None) -> dict:
        version_of(name, version)
        return manager.triton_config(name)

    async def native_config(name: str, version: str | None = None) -> dict:
        return _native_config(manager, name, version)

    config_doc = route_doc({"description": "Triton's model configuration (model_config.proto as JSON); "
                                           "splitserve's own settings are its parameters"}, 404)
    router.get("/v2/models/{name}/config", tags=["metadata"], summary="Model configuration (Triton's schema)",
               **config_doc)(model_config)
    router.get("/v2/models/{name}/versions/{version}/config", tags=["metadata"],
               summary="Model configuration (Triton's schema)", **config_doc)(model_config)
    router.get("/v2/models/{name}/config/splitserve", tags=["metadata"], summary="Model configuration (splitserve's)",
               **NATIVE_CONFIG_DOC)(native_config)
    router.get("/v2/models/{name}/versions/{version}/config/splitserve", tags=["metadata"],
               summary="Model configuration (splitserve's)", **NATIVE_CONFIG_DOC)(native_config)

    return router


def _files(params: dict) -> dict[str, bytes]:
    """A load's ``file:<path>`` parameters, by path: base64 text, as Triton's HTTP clients send them."""
    out = {}
    for key, value in params.items():
        if key.startswith(FILE_PREFIX):
            try:
                out[key[len(FILE_PREFIX):]] = base64.b64decode(value, validate=True)
            except (TypeError, ValueError):
                raise InvalidInput(f"parameter {key!r} must be the file's content in base64") from None
    return out


def management_routes(manager: ModelManager, config: ServerConfig) -> APIRouter:
    """Load, unload, evict and reconfigure a node's models at run time (each needs the token)."""
    router = APIRouter()
    small_limit = config.frontends.management_body_bytes
    # a load may carry the model's files, base64 (4 characters for 3 bytes), in its JSON
    load_limit = config.frontends.max_upload_bytes * 4 // 3 + small_limit
    version_of = manager.version

    @router.post("/v2/repository/models/{name}/load", tags=["repository"], **route_doc(
        doc.ModelState, 400, 401, 404, 503, openapi_extra=doc.body(doc.LoadRequest, {"parameters": {
            "keep_resident": True}}, required=False)))
    async def load(name: str, request: Request) -> dict:
        """Start the model's workers and wait until it is ready (needs the token). The
        optional body's ``parameters.keep_resident`` (bool) sets whether the memory manager
        may evict it; ``parameters.config`` (Triton's model configuration in JSON, or
        config.toml) with the model's files as ``file:<path>`` (base64) registers it first,
        as Triton's clients load a model they send."""
        authorize(manager, request)
        body = await read_json(request, load_limit, {})
        params = body.get("parameters") if isinstance(body, dict) else body
        if params is not None and not isinstance(params, dict):
            raise InvalidInput(f"the body must be an object whose parameters are an object, got {body!r}")
        params = params or {}
        asked = registration(check_model_name(name), params, _files(params))
        if asked is not None:
            await manager.register(*asked)
        await manager.load(name, keep_resident=params.get("keep_resident"))
        return {"name": name, "state": "READY"}

    @router.post("/v2/repository/models/{name}/unload", tags=["repository"], **route_doc(doc.ModelState, 401, 404))
    async def unload(name: str, request: Request) -> dict:
        """Stop the model's workers; requests get 503 until it is loaded again (needs the token)."""
        authorize(manager, request)
        await manager.unload(name)
        return {"name": name, "state": "UNAVAILABLE"}

    @router.post("/v2/repository/models/{name}/evict", tags=["repository"], **route_doc(doc.Evicted, 401, 404))
    async def evict(name: str, request: Request) -> dict:
        """splitserve extension: release the model's weights but keep serving it (needs the
        token). It stays registered with its func_id; calls are still taken, they queue,
        and the first one loads it again."""
        authorize(manager, request)
        evicted = await manager.evict(name)
        return {"name": name, "evicted": evicted, "state": manager.state(name)}

    @router.post("/v2/repository/models/{name}/config", tags=["repository"], **route_doc(
        NATIVE_CONFIG_DOC["responses"][200], 400, 401, 404, 413, 503, openapi_extra=doc.body(doc.ConfigChange, {
            "instances": 2, "batching": {"policy": "timeout", "max_delay_ms": 2.0, "preferred_batch": 8},
            "max_batch_size": 16})))
    async def configure(name: str, request: Request) -> dict:
        """Change instances and batching at run time without dropping requests (needs the token)."""
        authorize(manager, request)
        doc = await read_json(request, small_limit)
        if not isinstance(doc, dict) or not doc:
            raise InvalidInput('the body must be a JSON object, e.g. {"instances": 2}')
        unknown = set(doc) - {"instances", "batching", "max_batch_size"}
        if unknown:
            raise InvalidInput(f"unknown keys {sorted(unknown)}: use instances, batching and max_batch_size")
        version_of(name, None)
        batching = doc.get("batching")
        if batching is not None or "max_batch_size" in doc:
            b = batching or {}
            if not isinstance(b, dict):
                raise InvalidInput(f"batching must be an object of [batching] keys, e.g. {{\"policy\": \"adaptive\"}}, "
                                   f"got {b!r}")
            await manager.set_batching(name, b, doc.get("max_batch_size"))
        if "instances" in doc:
            await manager.set_instances(name, doc["instances"])
        return _native_config(manager, name, None)  # what was changed, in the keys it was sent in

    return router
