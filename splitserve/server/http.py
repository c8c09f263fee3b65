"""The HTTP front end: Open Inference Protocol v2 (KServe v2 / Triton) with the binary
tensor data, model repository and statistics extensions, model management, ``/classify``
and Prometheus ``/metrics``.

The app runs on the node's own event loop (``HttpFrontEnd`` serves it with uvicorn), so
every handler is ``async`` and calls the node directly: the ``ServingAPI`` for inference,
the node's ``ModelManager`` for everything else. The loop only receives bodies
(within the model's infer limit) and answers: infer bodies are decoded and answers encoded
in the front ends' ``CodecPool``. Errors are the protocol's ``{"error": "..."}`` with the
status of the ``SplitServeError`` raised; ``http_schema`` documents all of it in
``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve import __version__
from splitserve.config import ServerConfig
from splitserve.errors import BadSize, InvalidInput, NotFound, PayloadTooLarge, SplitServeError
from splitserve.modelconfig import check_model_name
from splitserve.protocol import v2
from splitserve.server import http_schema as doc
from splitserve.protocol.sockets import tcp_listener
from splitserve.server.frontends import CodecPool, EmbeddedUvicorn
from splitserve.server.management import ModelManager
from splitserve.server.ports import (
    FrontEnd, InferenceAPI, ModelCatalog, ModelRegistrar, ModelSignature, ServingAPI, SharedMemoryRegions,
)
from splitserve.server.shm import CUDA_UNSUPPORTED, input_tensor, output_views, write_outputs

log = logging.getLogger(__name__)

EXTENSIONS = ["binary_tensor_data", "model_repository", "statistics", "model_configuration", "system_shared_memory"]

def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    """The protocol's error object; ``status`` (splitserve's status name) is an addition that
    lets clients rebuild the exact error class."""
    body = {"error": message}
    if code:
        body["status"] = code
    return JSONResponse(body, status_code=status)


def _limited(receive: Callable[[], Awaitable[dict]], limit: int, what: str) -> Callable[[], Awaitable[dict]]:
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


def _content_length(request: Request, limit: int, what: str) -> int | None:
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


def _bounded(request: Request, limit: int, what: str) -> Request:
    """The same request, refused before it is read when it is (or becomes) too large."""
    _content_length(request, limit, what)
    return Request(request.scope, _limited(request.receive, limit, what))


async def _body(request: Request, limit: int, what: str) -> bytes:
    req = _bounded(request, limit, what)
    chunks: list[bytes] = []
    stream: AsyncIterator[bytes] = req.stream()
    async for chunk in stream:
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(body: bytes, default: Any = None) -> Any:
    if not body.strip():
        return default
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"the request body is not valid JSON: {e}") from None


async def _json(request: Request, limit: int, default: Any = None) -> Any:
    """A small JSON body (management calls), parsed on the loop."""
    return _parse_json(await _body(request, limit, "SPLITSERVE_MANAGEMENT_BODY_BYTES"), default)


def _infer_limit(config: ServerConfig, cfg: ModelSignature) -> int:
    return v2.infer_body_limit(cfg.inputs, cfg.max_batch_size, config.frontends.json_chars_per_value)


def _decode_infer(cfg: ModelSignature, body: bytes, header_length: str | None, shm: SharedMemoryRegions
                  ) -> tuple[v2.InferRequest, list[np.ndarray], dict[str, memoryview]]:
    """The request, the model's inputs in declared order (those in shared memory: arrays over
    their regions) and the regions its outputs go to (runs in a codec thread)."""
    req = v2.parse_infer_request(body, header_length)
    for name, t in req.shm_inputs.items():
        req.inputs[name] = input_tensor(shm, name, t.datatype, t.shape, t.ref)
    inputs = v2.model_inputs(cfg.name, cfg.inputs, req.inputs, req.datatypes)
    return req, inputs, output_views(shm, cfg, inputs[0].shape[0], req.shm_outputs)


def _encode_infer(model: str, version: str, req: v2.InferRequest, outputs: list[tuple[str, np.ndarray]],
                  parameters: dict[str, Any], shm_views: dict[str, memoryview]) -> tuple[bytes, int | None]:
    """The response body and its JSON header length, the outputs that go to shared memory
    written there (runs in a codec thread when large)."""
    write_outputs(shm_views, dict(outputs))
    parts, hlen = v2.build_infer_response(model, version, req, outputs, parameters)
    return b"".join(parts), hlen


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


def _doc(ok: Any, *codes: int, alt: dict[int, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Route arguments that document the answers: ``ok`` (a model, or a ``responses`` entry)
    for 200, ErrorBody for ``codes`` and 500, and ``alt`` statuses with a body of their own."""
    ok_entry = {"model": ok} if isinstance(ok, type) else ok
    own = {code: {"model": m, "description": "Not ready"} for code, m in (alt or {}).items()}
    return {"response_model": None, "responses": {200: ok_entry, **doc.errors(*codes), **own}, **extra}


def _new_app(description: str, request_models: list[type[BaseModel]]) -> FastAPI:
    """An app whose errors are the protocol's error object (handlers keep no per-request
    state on the app)."""
    app = FastAPI(title="splitserve", version=__version__, description=description)
    doc.install_openapi(app, request_models)

    # -- errors ----------------------------------------------------------------------------

    @app.exception_handler(SplitServeError)
    async def _splitserve_error(request: Request, e: SplitServeError) -> JSONResponse:
        return _error(e.http_status, e.message, e.status.name)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # A bug: the details stay in the server log, the client gets a reference to them.
        ref = secrets.token_hex(6)
        log.exception("HTTP %s %s failed (reference %s)", request.method, request.url.path, ref)
        return _error(500, f"internal error (reference {ref} in the server log)", "INTERNAL")

    return app


def inference_routes(app: FastAPI, api: InferenceAPI, catalog: ModelCatalog, codec: CodecPool,
                     config: ServerConfig, shm: SharedMemoryRegions, extensions: Sequence[str]) -> None:
    """Add the inference half of the protocol to ``app``: server metadata (naming
    ``extensions``), health, model readiness and metadata, and infer (JSON and binary
    tensors), through ``api`` and ``catalog``; a node's app and a cluster gateway's share it.
    A route of ``app`` that must not be read as a model name (``/v2/models/stats``) has to
    be added before."""

    # -- health and metadata ------------------------------------------------------------

    @app.get("/v2", tags=["health"], **_doc(doc.ServerMetadata))
    async def server_metadata() -> dict:
        """Server metadata: name, version, extensions."""
        return {"name": "splitserve", "version": __version__, "extensions": list(extensions)}

    @app.get("/v2/health/live", tags=["health"], **_doc(doc.Live))
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready", tags=["health"], **_doc(doc.Ready, alt={503: doc.Ready}))
    async def ready() -> JSONResponse:
        """Ready once the start-up models are loaded, until the server stops (others load on first use)."""
        ok = api.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def model_ready(name: str, version: str | None = None) -> JSONResponse:
        catalog.version(name, version)
        ok = api.model_ready(name)
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 400)

    async def metadata(name: str, version: str | None = None) -> dict:
        catalog.version(name, version)
        return catalog.model_metadata(name)

    ready_doc = _doc(doc.ModelReady, 404, alt={400: doc.ModelReady})
    app.get("/v2/models/{name}/ready", tags=["health"], summary="Model ready (200) or not (400)", **ready_doc)(model_ready)
    app.get("/v2/models/{name}/versions/{version}/ready", tags=["health"], summary="Model version ready",
            **ready_doc)(model_ready)

    app.get("/v2/models/{name}", tags=["metadata"], summary="Model metadata", **_doc(doc.ModelMetadata, 404))(metadata)
    app.get("/v2/models/{name}/versions/{version}", tags=["metadata"], summary="Model version metadata",
            **_doc(doc.ModelMetadata, 404))(metadata)

    # -- inference ----------------------------------------------------------------------

    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        """Run an inference: JSON tensors, or the binary tensor data extension.

        Request ``parameters``: ``class`` ("rt" or "be"), ``deadline_ms`` (hard: still queued
        then, the call is answered 504) and ``slo_ms`` (soft, real-time calls: a late one is
        served and counted ``missed``); the response's
        ``parameters`` carry the server's ``queue_us``, ``compute_us`` and ``total_us``.
        """
        ver = catalog.version(name, version)
        cfg = catalog.model_config(name)
        limit = _infer_limit(config, cfg)
        what = (f"model {name!r}: max_batch_size {cfg.max_batch_size} samples of its inputs as JSON, "
                "SPLITSERVE_JSON_CHARS_PER_VALUE characters a value")
        async with codec.admit(_content_length(request, limit, what)):
            body = await _body(request, limit, what)
            req, inputs, shm_views = await codec.run(len(body), _decode_infer, cfg, body,
                                                     request.headers.get(v2.HEADER_LENGTH), shm)
        out = await api.infer(name, inputs, req.cls, req.deadline_s, req.slo_s)
        names = [t.name for t in cfg.outputs]
        parts, hlen = await codec.run(
            sum(a.nbytes for a in out.outputs) * (1 if req.binary_output else config.frontends.json_chars_per_value),
            _encode_infer, name, ver, req, list(zip(names, out.outputs)),
            {"queue_us": out.queue_us, "compute_us": out.compute_us, "total_us": out.total_us}, shm_views)
        if hlen is None:
            return Response(parts, media_type=v2.JSON_CONTENT_TYPE)
        return Response(parts, media_type=v2.BINARY_CONTENT_TYPE, headers={v2.HEADER_LENGTH: str(hlen)})

    infer_doc = _doc(
        {"description": "Outputs as JSON, or (binary outputs asked for) a JSON header of "
                        "Inference-Header-Content-Length bytes and the tensor bytes",
         "content": {v2.JSON_CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/InferResponseBody"}},
                     v2.BINARY_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        400, 404, 413, 429, 503, 504,
        openapi_extra=doc.body(doc.InferRequestBody, {
            "id": "1", "parameters": {"class": "rt", "deadline_ms": 50},
            "inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
            binary="JSON header of Inference-Header-Content-Length bytes, then tensor bytes"))
    app.post("/v2/models/{name}/infer", tags=["inference"], summary="Inference", **infer_doc)(infer)
    app.post("/v2/models/{name}/versions/{version}/infer", tags=["inference"], summary="Inference (version)",
             **infer_doc)(infer)


def repository_routes(app: FastAPI, registrar: ModelRegistrar, config: ServerConfig) -> None:
    """Add the repository routes that a node and a cluster gateway share to ``app``: the
    index, register (multipart config, artifact and labels, within ``max_upload_bytes``) and
    unregister, through ``registrar`` (a node's ``ModelManager``; a gateway's registrar,
    which forwards to the cluster's controller). Register and unregister need the token."""
    upload_limit = config.frontends.max_upload_bytes
    small_limit = config.frontends.management_body_bytes

    def authorize(request: Request) -> None:
        registrar.check_token(request.headers.get("authorization"))

    @app.post("/v2/repository/index", tags=["repository"], **_doc(
        {"model": list[doc.IndexEntry]}, 400, 413, openapi_extra=doc.body(doc.IndexRequest, required=False)))
    async def repository_index(request: Request) -> list:
        """Every model and its state; body ``{"ready": true}`` lists ready models only."""
        doc = await _json(request, small_limit, {}) or {}
        if not isinstance(doc, dict):
            raise InvalidInput("the body must be a JSON object")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"ready must be true or false, got {ready!r}")
        return registrar.repository_index(ready)

    @app.post("/v2/repository/models/{name}/register", tags=["repository"], **_doc(doc.Registered, 400, 401, 413, 507),
              openapi_extra={"requestBody": {
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
        authorize(request)
        check_model_name(name)
        req = _bounded(request, upload_limit, "SPLITSERVE_MAX_UPLOAD_BYTES")
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

    @app.delete("/v2/repository/models/{name}", tags=["repository"], **_doc(doc.Deleted, 400, 401, 404))
    async def unregister(name: str, request: Request) -> dict:
        """Unload and delete a model registered at run time (needs the token)."""
        authorize(request)
        await registrar.unregister(check_model_name(name))
        return {"name": name, "deleted": True}


def metrics_route(app: FastAPI, text: Callable[[], Awaitable[str]]) -> None:
    """Add ``GET /metrics`` to ``app``: the Prometheus text that ``text`` returns."""

    exposition = {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}

    @app.get("/metrics", tags=["metrics"], **_doc({"description": "Prometheus text exposition", "content": exposition}))
    async def metrics() -> Response:
        """Prometheus metrics, per model and class."""
        return Response(await text(), media_type=CONTENT_TYPE_LATEST)


def inference_app(api: InferenceAPI, catalog: ModelCatalog, codec: CodecPool, config: ServerConfig,
                  shm: SharedMemoryRegions, extensions: Sequence[str] = ("binary_tensor_data",),
                  metrics: Callable[[], Awaitable[str]] | None = None,
                  registrar: ModelRegistrar | None = None) -> FastAPI:
    """An app of ``inference_routes``, ``repository_routes`` through ``registrar`` when given,
    and ``/metrics`` from ``metrics`` when given (a cluster gateway's: no other management)."""
    app = _new_app("Open Inference Protocol v2 (KServe v2 / Triton): health, metadata and inference.",
                   [doc.InferRequestBody] + ([doc.IndexRequest] if registrar is not None else []))
    inference_routes(app, api, catalog, codec, config, shm, extensions)
    if registrar is not None:
        repository_routes(app, registrar, config)
    if metrics is not None:
        metrics_route(app, metrics)
    return app


def create_app(api: ServingAPI, manager: ModelManager, codec: CodecPool, config: ServerConfig,
               shm: SharedMemoryRegions) -> FastAPI:
    """The FastAPI app of one node: ``inference_routes`` through ``api`` and ``manager``,
    tensors in shared memory through ``shm``, everything else through ``manager``; ``codec``
    decodes and encodes large bodies off the loop."""
    app = _new_app("Open Inference Protocol v2 (KServe v2 / Triton), model management and metrics.",
                   [doc.InferRequestBody, doc.ClassifyRequest, doc.IndexRequest, doc.ConfigChange,
                    doc.LoadRequest, doc.ShmRegister, doc.GeometryChange])
    small_limit = config.frontends.management_body_bytes
    version_of = manager.version

    def authorize(request: Request) -> None:
        manager.check_token(request.headers.get("authorization"))

    @app.get("/v2/models/stats", tags=["statistics"], **_doc(doc.Statistics))
    async def all_stats() -> dict:
        """Statistics of every model (Triton statistics extension)."""
        return manager.model_statistics()

    inference_routes(app, api, manager, codec, config, shm, EXTENSIONS)

    async def stats(name: str, version: str | None = None) -> dict:
        version_of(name, version)
        return manager.model_statistics(name)

    app.get("/v2/models/{name}/stats", tags=["statistics"], summary="Model statistics",
            **_doc(doc.Statistics, 404))(stats)
    app.get("/v2/models/{name}/versions/{version}/stats", tags=["statistics"], summary="Model version statistics",
            **_doc(doc.Statistics, 404))(stats)

    async def model_config(name: str, version: str | None = None) -> dict:
        version_of(name, version)
        return manager.triton_config(name)

    async def native_config(name: str, version: str | None = None) -> dict:
        version_of(name, version)
        return manager.serving_config(name)

    config_doc = _doc({"description": "Triton's model configuration (model_config.proto as JSON); splitserve's own "
                                      "settings are its parameters"}, 404)
    app.get("/v2/models/{name}/config", tags=["metadata"], summary="Model configuration (Triton's schema)",
            **config_doc)(model_config)
    app.get("/v2/models/{name}/versions/{version}/config", tags=["metadata"],
            summary="Model configuration (Triton's schema)", **config_doc)(model_config)
    native_doc = _doc({"description": "The model's config.toml as JSON, with its state and serving shape"}, 404)
    app.get("/v2/models/{name}/config/splitserve", tags=["metadata"], summary="Model configuration (splitserve's)",
            **native_doc)(native_config)
    app.get("/v2/models/{name}/versions/{version}/config/splitserve", tags=["metadata"],
            summary="Model configuration (splitserve's)", **native_doc)(native_config)

    @app.post("/classify", tags=["inference"], **_doc(doc.ClassifyResponse, 400, 404, 413, 429, 503, 504,
                                                      openapi_extra=doc.body(doc.ClassifyRequest, {
                                                          "model": "mydigits", "input": [[[0.0] * 8] * 8], "top_k": 3})))
    async def classify(request: Request) -> dict:
        """Top-k labels and softmax scores of a model registered with a labels file.

        ``input`` is one sample or a batch as nested lists, or ``{"b64": ...}`` with the raw
        little-endian bytes of one or more samples. Single-input models only.
        """
        limit = max((_infer_limit(config, r.config) for r in manager.records.values()), default=small_limit)
        what = "the largest infer body limit of any model"
        async with codec.admit(_content_length(request, limit, what)):
            body = await _body(request, limit, what)
            doc = await codec.run(len(body), _parse_json, body)
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str) or "input" not in doc:
            raise InvalidInput('the body must be {"model": NAME, "input": ..., "top_k": K}')
        name = doc["model"]
        top_k = v2.json_number("top_k", doc.get("top_k", 5), int)
        if not 1 <= top_k <= config.frontends.max_top_k:
            raise InvalidInput(f"top_k must be an integer between 1 and {config.frontends.max_top_k}")
        cfg = manager.model_config(name)
        if not cfg.labels:
            raise InvalidInput(f"model {name!r} has no labels; register it with a labels file to classify")
        if len(cfg.inputs) != 1:
            raise InvalidInput(f"/classify takes single-input models; {name!r} has {len(cfg.inputs)} inputs")
        spec = cfg.inputs[0]
        x = await codec.run(len(body), _classify_input, spec, doc["input"])
        cls = v2.InferRequest(parameters={"class": doc.get("class")}).cls
        out = await api.infer(name, [x], cls, None)
        logits = out.outputs[0].reshape(len(x), -1).astype(np.float64)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
        k = min(top_k, probs.shape[1])
        preds = []
        for p in probs:
            idx = np.argsort(-p, kind="stable")[:k]
            preds.append([{"label": cfg.labels[i] if i < len(cfg.labels) else str(i), "index": int(i),
                           "score": float(p[i])} for i in idx])
        return {"model": name, "predictions": preds}

    # -- system shared-memory extension (CUDA's: refused, there is no GPU) ------------------

    def region_list(name: str | None) -> list[dict[str, Any]]:
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in shm.status(name)]

    shm_status_doc = _doc({"model": list[doc.ShmRegion]}, 404)

    @app.get("/v2/systemsharedmemory/status", tags=["shared memory"], **shm_status_doc)
    async def regions_status() -> list:
        """Every registered system shared-memory region."""
        return region_list(None)

    @app.get("/v2/systemsharedmemory/region/{name}/status", tags=["shared memory"], **shm_status_doc)
    async def region_status(name: str) -> list:
        """One registered system shared-memory region (404 when it is not registered)."""
        return region_list(name)

    @app.post("/v2/systemsharedmemory/region/{name}/register", tags=["shared memory"],
              **_doc({"description": "Registered"}, 400, 404, 413, 429, openapi_extra=doc.body(
                  doc.ShmRegister, {"key": "/input0", "offset": 0, "byte_size": 602112})))
    async def region_register(name: str, request: Request) -> dict:
        """Register ``byte_size`` bytes from ``offset`` of the shared-memory object ``key``
        (``/name`` under /dev/shm) as region ``name``; body ``{"key", "offset", "byte_size"}``."""
        doc = await _json(request, small_limit)
        if not isinstance(doc, dict) or not isinstance(doc.get("key"), str) or "byte_size" not in doc:
            raise InvalidInput('the body must be {"key": "/name", "offset": 0, "byte_size": N}')
        shm.register(name, doc["key"], v2.json_number("offset", doc.get("offset", 0), int),
                     v2.json_number("byte_size", doc["byte_size"], int))
        return {}

    @app.post("/v2/systemsharedmemory/unregister", tags=["shared memory"], **_doc({"description": "Unregistered"}))
    async def regions_unregister() -> dict:
        """Unregister every region; calls in flight that use one still get their answers."""
        shm.unregister(None)
        return {}

    @app.post("/v2/systemsharedmemory/region/{name}/unregister", tags=["shared memory"],
              **_doc({"description": "Unregistered"}))
    async def region_unregister(name: str) -> dict:
        """Unregister a region (no error when it is not registered); a call in flight that
        uses it still gets its answer."""
        shm.unregister(name)
        return {}

    async def cuda_shared_memory(request: Request) -> dict:
        """CUDA shared memory: not supported (no GPU); always 404."""
        raise NotFound(CUDA_UNSUPPORTED)

    for path in ("/v2/cudasharedmemory/status", "/v2/cudasharedmemory/region/{name}/status"):
        app.get(path, tags=["shared memory"], **_doc({"description": "never"}, 404))(cuda_shared_memory)
    for path in ("/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/{name}/register",
                 "/v2/cudasharedmemory/region/{name}/unregister"):
        app.post(path, tags=["shared memory"], **_doc({"description": "never"}, 404))(cuda_shared_memory)

    # -- model repository and management -------------------------------------------------

    repository_routes(app, manager, config)

    @app.post("/v2/repository/models/{name}/load", tags=["repository"], **_doc(
        doc.ModelState, 400, 401, 404, 503, openapi_extra=doc.body(doc.LoadRequest, {"parameters": {
            "keep_resident": True}}, required=False)))
    async def load(name: str, request: Request) -> dict:
        """Start the model's workers and wait until it is ready (needs the token). The
        optional body's ``parameters.keep_resident`` (bool) sets whether the memory manager
        may evict it."""
        authorize(request)
        body = await _json(request, config.frontends.management_body_bytes, {})
        params = body.get("parameters") if isinstance(body, dict) else body
        if params is not None and not isinstance(params, dict):
            raise InvalidInput(f"the body must be an object whose parameters are an object, got {body!r}")
        await manager.load(name, keep_resident=(params or {}).get("keep_resident"))
        return {"name": name, "state": "READY"}

    @app.post("/v2/repository/models/{name}/unload", tags=["repository"], **_doc(doc.ModelState, 401, 404))
    async def unload(name: str, request: Request) -> dict:
        """Stop the model's workers; requests get 503 until it is loaded again (needs the token)."""
        authorize(request)
        await manager.unload(name)
        return {"name": name, "state": "UNAVAILABLE"}

    @app.post("/v2/repository/models/{name}/evict", tags=["repository"], **_doc(doc.Evicted, 401, 404))
    async def evict(name: str, request: Request) -> dict:
        """splitserve extension: release the model's weights but keep serving it (needs the
        token). It stays registered with its func_id; calls are still taken, they queue,
        and the first one loads it again."""
        authorize(request)
        evicted = await manager.evict(name)
        return {"name": name, "evicted": evicted, "state": manager.state(name)}

    @app.post("/v2/repository/models/{name}/config", tags=["repository"], **_doc(
        native_doc["responses"][200], 400, 401, 404, 413, 503, openapi_extra=doc.body(doc.ConfigChange, {
            "instances": 2, "batching": {"policy": "timeout", "max_delay_ms": 2.0, "preferred_batch": 8},
            "max_batch_size": 16})))
    async def configure(name: str, request: Request) -> dict:
        """Change instances and batching at run time without dropping requests (needs the token)."""
        authorize(request)
        doc = await _json(request, small_limit)
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
        return await native_config(name)  # what was changed, in the keys it was sent in

    # -- scheduling introspection (benchmarks read these from another process) ----------------

    @app.get("/v2/models/{name}/placement", tags=["scheduling"],
             **_doc({"description": "Serving instances, the Packrat plan, reconfigurations and partitions"}, 404))
    async def placement(name: str) -> dict:
        """The serving instance set (threads, batch, CPUs), the Packrat plan, every
        reconfiguration so far (times on the server's clock) and the model's partitions."""
        version_of(name, None)
        return manager.placement(name)

    @app.get("/v2/placement", tags=["scheduling"],
             **_doc({"description": "Every partition of the node's CPUs and the instances on it"}))
    async def node_placement() -> dict:
        """The node's CPUs, those free, and every partition with its owner and instances."""
        return manager.node_placement()

    @app.get("/v2/scheduler/events", tags=["scheduling"], **_doc(doc.SchedulerEvents, 400))
    async def scheduler_events(since: float = 0.0, limit: int = 10000) -> dict:
        """Batch events (start, preempt, preempted, resume, done) after ``since`` (server clock)."""
        return manager.scheduler_events(since, limit)

    @app.get("/v2/partitions", tags=["scheduling"],
             **_doc({"description": "The node's partitions (PROTEAN): CPUs, memory, tags, instances, geometry; "
                                    "its GPUs and MIG slices (read-only)"}))
    async def partitions() -> dict:
        """The node's partitions: each one's CPUs, memory budget, Algorithm 1's tag and the
        models' instances on it; the geometry, the controller's last tick, cold starts; and
        ``gpus``, its GPUs and MIG slices as NVML last listed them (or why there are none)."""
        return manager.partition_status()

    @app.post("/v2/partitions", tags=["scheduling"], **_doc(
        {"description": "The partitions after the change"}, 400, 401, 404, 503,
        openapi_extra=doc.body(doc.GeometryChange, {"geometry": "1,1"})))
    async def set_partitions(request: Request) -> dict:
        """Re-carve the partitions to ``geometry`` (core counts, e.g. ``"1,1"``), moving every
        model's instances without a request lost (needs the token)."""
        authorize(request)
        body = await _json(request, small_limit)
        if not isinstance(body, dict) or set(body) != {"geometry"}:
            raise InvalidInput('the body must be {"geometry": "<core counts>"}, e.g. {"geometry": "1,1"}')
        return await manager.set_geometry(body["geometry"])

    @app.get("/v2/debug/stages", tags=["scheduling"], **_doc(doc.Stages))
    async def stages() -> dict:
        """Where the newest fast-path calls spent their time: one record of stamps per call
        (``fast_stage_trace`` of them; none unless the server was started with it)."""
        return api.stage_trace()

    @app.get("/v2/memory", tags=["scheduling"], **_doc(doc.Memory))
    async def memory() -> dict:
        """The memory manager: budget, reserved and resident bytes, LRU order, loads and
        evictions, and each model's residency (RESIDENT, LOADING, EVICTED, FAILED, UNLOADED)."""
        return manager.memory_status()

    async def metrics_text() -> str:
        return api.metrics_text()

    metrics_route(app, metrics_text)
    return app


class HttpFrontEnd(FrontEnd):
    """The HTTP front end: uvicorn serving ``app`` (``create_app``'s on a node,
    ``inference_app``'s at a cluster gateway) on the running loop, on ``config.host`` and
    ``config.frontends.http_port`` (lifespan off, no signal handlers: the process's root owns the signals)."""

    def __init__(self, app: FastAPI, config: ServerConfig) -> None:
        self.app = app
        self.config = config
        self._server: EmbeddedUvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> dict[str, Any]:
        cfg = self.config
        sock = tcp_listener(cfg.host, cfg.frontends.http_port or 0)
        sock.setblocking(False)
        userver = self._server = EmbeddedUvicorn(uvicorn.Config(
            self.app, lifespan="off", http="httptools", loop="none", log_config=None, access_log=False,
            timeout_graceful_shutdown=max(1, round(cfg.frontends.stop_grace_s)), server_header=False,
        ))
        task = self._task = asyncio.get_running_loop().create_task(userver.serve(sockets=[sock]),
                                                                   name="splitserve-http")
        await userver.wait_started(task, cfg.frontends.http_start_poll_s)
        port = sock.getsockname()[1]
        log.info("HTTP (Open Inference Protocol v2) on %s:%d", cfg.host, port)
        return {"http_port": port}

    async def stop(self, grace_s: float) -> None:
        # uvicorn's own timeout_graceful_shutdown (stop_grace_s) bounds the requests in flight
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task


def _classify_input(spec: Any, value: Any) -> np.ndarray:
    """``/classify`` input as ``[n, *shape]`` of the model's dtype."""
    if isinstance(value, dict):
        b64 = value.get("b64")
        if not isinstance(b64, str):
            raise InvalidInput('a binary input is {"b64": "<base64 of the raw sample bytes>"}')
        try:
            raw = base64.b64decode(b64, validate=True)
        except ValueError:
            raise InvalidInput("input.b64 is not valid base64") from None
        if not raw or len(raw) % spec.nbytes:
            raise BadSize(f"{len(raw)} bytes are not a whole number of {spec.datatype}{list(spec.shape)} samples "
                          f"({spec.nbytes} bytes each)")
        return np.frombuffer(raw, dtype=spec.dtype.newbyteorder("<")).astype(spec.dtype).reshape((-1, *spec.shape))
    arr = np.asarray(value) if isinstance(value, list) else None
    if arr is None or arr.dtype.kind not in "biuf":
        raise InvalidInput("input must be a nested list of numbers or {\"b64\": ...}")
    if arr.shape == spec.shape:
        arr = arr.reshape((1, *spec.shape))
    x = v2.tensor_from_json(spec.name, spec.datatype, list(arr.shape), arr)
    if x.shape[1:] != spec.shape:
        raise BadSize(f"input must have shape {list(spec.shape)} or [n, {', '.join(map(str, spec.shape))}], "
                      f"got {list(x.shape)}")
    return x
