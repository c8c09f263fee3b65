"""The inference routes: the Open Inference Protocol v2's health, metadata and infer (a node's
and a cluster gateway's), and a node's ``/classify``."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from splitserve import __version__
from splitserve.config import ServerConfig
from splitserve.errors import BadSize, InvalidInput
from splitserve.protocol import v2
from splitserve.server import http_schema as doc
from splitserve.server.frontends import CodecPool
from splitserve.server.http.base import content_length, infer_limit, parse_json, read_body, route_doc
from splitserve.server.http.infer_lane import InferEndpoint
from splitserve.server.management import ModelManager
from splitserve.server.ports import InferenceAPI, ModelCatalog, ModelSignature, SharedMemoryRegions
from splitserve.server.shm import OutputWriters, input_tensor, output_views, write_outputs


def _decode_infer(cfg: ModelSignature, body: bytes, header_length: str | None, shm: SharedMemoryRegions
                  ) -> tuple[v2.InferRequest, list[np.ndarray], OutputWriters]:
    """The request, the model's inputs in declared order (those in shared memory: arrays over
    their regions) and the regions its outputs go to (runs in a codec thread)."""
    req = v2.parse_infer_request(body, header_length)
    for name, t in req.shm_inputs.items():
        req.inputs[name] = input_tensor(shm, name, t.datatype, t.shape, t.ref)
    inputs = v2.model_inputs(cfg.name, cfg.inputs, req.inputs, req.datatypes)
    return req, inputs, output_views(shm, cfg, inputs[0].shape[0], req.shm_outputs)


def _encode_infer(model: str, version: str, req: v2.InferRequest, outputs: list[tuple[str, np.ndarray]],
                  parameters: dict[str, Any], shm_views: OutputWriters) -> tuple[bytes, int | None]:
    """The response body and its JSON header length, the outputs that go to shared memory
    written there (runs in a codec thread when large)."""
    write_outputs(shm_views, dict(outputs))
    parts, hlen = v2.build_infer_response(model, version, req, outputs, parameters)
    return b"".join(parts), hlen


def infer_endpoint(api: InferenceAPI, catalog: ModelCatalog, codec: CodecPool, config: ServerConfig,
                   shm: SharedMemoryRegions) -> InferEndpoint:
    """The v2 infer handler through ``api`` and ``catalog`` (``codec`` decodes and encodes
    large bodies off the loop, ``shm`` holds tensors in shared memory): the documented
    routes' endpoint, and the one ``InferLane`` calls without the router."""

    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        """Run an inference: JSON tensors, or the binary tensor data extension.

        Request ``parameters``: ``class`` ("rt" or "be"), ``deadline_ms`` (hard: still queued
        then, the call is answered 504) and ``slo_ms`` (soft, real-time calls: a late one is
        served and counted ``missed``); the response's
        ``parameters`` carry the server's ``queue_us``, ``compute_us`` and ``total_us``.
        """
        ver = catalog.version(name, version)
        cfg = catalog.model_config(name)
        limit = infer_limit(config, cfg)
        what = (f"model {name!r}: max_batch_size {cfg.max_batch_size} samples of its inputs as JSON, "
                "SPLITSERVE_JSON_CHARS_PER_VALUE characters a value")
        async with codec.admit(content_length(request, limit, what)):
            body = await read_body(request, limit, what)
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

    return infer


def inference_routes(api: InferenceAPI, catalog: ModelCatalog, infer: InferEndpoint,
                     extensions: Sequence[str]) -> APIRouter:
    """The inference half of the protocol: server metadata (naming ``extensions``), health,
    model readiness and metadata through ``api`` and ``catalog``, and infer (JSON and binary
    tensors, ``infer_endpoint``'s ``infer``); a node's app and a cluster gateway's share it. A
    route that must not be read as a model name (``/v2/models/stats``) has to be included
    before it. ``InferLane`` takes the infer calls before the router does; the routes here
    document them."""
    router = APIRouter()

    # -- health and metadata ------------------------------------------------------------

    @router.get("/v2", tags=["health"], **route_doc(doc.ServerMetadata))
    async def server_metadata() -> dict:
        """Server metadata: name, version, extensions."""
        return {"name": "splitserve", "version": __version__, "extensions": list(extensions)}

    @router.get("/v2/health/live", tags=["health"], **route_doc(doc.Live))
    async def live() -> dict:
        return {"live": True}

    @router.get("/v2/health/ready", tags=["health"], **route_doc(doc.Ready, alt={503: doc.Ready}))
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

    ready_doc = route_doc(doc.ModelReady, 404, alt={400: doc.ModelReady})
    router.get("/v2/models/{name}/ready", tags=["health"], summary="Model ready (200) or not (400)",
               **ready_doc)(model_ready)
    router.get("/v2/models/{name}/versions/{version}/ready", tags=["health"], summary="Model version ready",
               **ready_doc)(model_ready)

    router.get("/v2/models/{name}", tags=["metadata"], summary="Model metadata",
               **route_doc(doc.ModelMetadata, 404))(metadata)
    router.get("/v2/models/{name}/versions/{version}", tags=["metadata"], summary="Model version metadata",
               **route_doc(doc.ModelMetadata, 404))(metadata)

    # -- inference ----------------------------------------------------------------------

    infer_doc = route_doc(
        {"description": "Outputs as JSON, or (binary outputs asked for) a JSON header of "
                        "Inference-Header-Content-Length bytes and the tensor bytes",
         "content": {v2.JSON_CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/InferResponseBody"}},
                     v2.BINARY_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        400, 404, 413, 429, 503, 504,
        openapi_extra=doc.body(doc.InferRequestBody, {
            "id": "1", "parameters": {"class": "rt", "deadline_ms": 50},
            "inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
            binary="JSON header of Inference-Header-Content-Length bytes, then tensor bytes"))
    router.post("/v2/models/{name}/infer", tags=["inference"], summary="Inference", **infer_doc)(infer)
    router.post("/v2/models/{name}/versions/{version}/infer", tags=["inference"], summary="Inference (version)",
                **infer_doc)(infer)

    return router


def classify_routes(api: InferenceAPI, manager: ModelManager, codec: CodecPool, config: ServerConfig) -> APIRouter:
    """``POST /classify``: top-k labels of a model registered with a labels file, through
    ``api``, the model's config and labels from ``manager``."""
    router = APIRouter()
    small_limit = config.frontends.management_body_bytes


    @router.post("/classify", tags=["inference"], **route_doc(
        doc.ClassifyResponse, 400, 404, 413, 429, 503, 504, openapi_extra=doc.body(doc.ClassifyRequest, {
            "model": "mydigits", "input": [[[0.0] * 8] * 8], "top_k": 3})))
    async def classify(request: Request) -> dict:
        """Top-k labels and softmax scores of a model registered with a labels file.

        ``input`` is one sample or a batch as nested lists, or ``{"b64": ...}`` with the raw
        little-endian bytes of one or more samples. Single-input models only.
        """
        limit = max((infer_limit(config, r.config) for r in manager.records.values()), default=small_limit)
        what = "the largest infer body limit of any model"
        async with codec.admit(content_length(request, limit, what)):
            body = await read_body(request, limit, what)
            doc = await codec.run(len(body), parse_json, body)
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

    return router


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
