"""TorchServe's inference API: ``GET /ping`` and ``POST /predictions/{model}[/{version}]``.

A request is one sample, as TorchServe's handlers take it: the body itself (``curl -T
kitten.jpg``), or the ``data`` (or ``body``) field of a multipart form (``curl -F
data=@kitten.jpg``). An ``image_classifier`` model answers its top 5 as ``{name: score}``;
any other model takes one sample of its single input as a JSON array (TorchServe's base
handler) and answers its output as one (a JSON object of them for several outputs).
Requests are batched with others by the model's batching, as a v2 infer call is."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from PIL import Image, UnidentifiedImageError
from starlette.datastructures import UploadFile

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.models.handler_spec import IMAGE_CLASSIFIER, encode_image
from splitserve.modelconfig import ModelConfig
from splitserve.protocol import v2
from splitserve.server.frontends import CodecPool
from splitserve.server.http.base import bounded, content_length, infer_limit, parse_json, read_body
from splitserve.server.http.torchserve.base import TorchServeRoute, check_version, known, ts_doc
from splitserve.server.management import ModelManager
from splitserve.server.ports import InferenceAPI

FORM_OVERHEAD = 64 << 10  # a multipart form's boundaries and headers around the one sample


def _image_row(data: bytes, limit: int) -> np.ndarray:
    """The image_classifier's input row; InvalidInput naming what the bytes are when Pillow
    cannot read their header (a truncated body the worker still cannot decode answers too)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.size  # noqa: B018 - the header is read: the format is known
    except (UnidentifiedImageError, OSError) as e:
        raise InvalidInput(f"the body ({len(data)} bytes starting {data[:8]!r}) is not an image Pillow reads: "
                           f"{e}") from None
    return encode_image(data, limit)[None]


def _tensor(cfg: ModelConfig, doc: Any) -> np.ndarray:
    """One sample of the model's single input from a JSON array, as the base handler takes it."""
    if len(cfg.inputs) != 1:
        raise InvalidInput(f"model {cfg.name!r} has {len(cfg.inputs)} inputs; /predictions sends one tensor "
                           f"(use /v2/models/{cfg.name}/infer)")
    spec = cfg.inputs[0]
    try:
        x = np.asarray(doc, dtype=spec.dtype)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"the body must be a JSON array of {spec.datatype} numbers: {e}") from None
    if x.shape != spec.shape:
        raise InvalidInput(f"input {spec.name!r} takes one sample of shape {list(spec.shape)}, got {list(x.shape)}")
    return x[None]


def _classes(scores: np.ndarray, classes: np.ndarray, names: dict[str, str]) -> dict[str, float]:
    if (classes < 0).all() and not np.isfinite(scores).all():
        raise InvalidInput("the image could not be decoded (truncated or corrupt image data)")
    return {names.get(str(int(c)), str(int(c))): float(s) for s, c in zip(scores, classes) if c >= 0}


def _answer(cfg: ModelConfig, outputs: list[np.ndarray]) -> Any:
    if cfg.handler.get("name") == IMAGE_CLASSIFIER:
        return _classes(outputs[0][0], outputs[1][0], cfg.handler.get("index_to_name", {}))
    rows = {t.name: o[0].tolist() for t, o in zip(cfg.outputs, outputs)}
    return next(iter(rows.values())) if len(rows) == 1 else rows


async def _sample(request: Request, limit: int) -> bytes:
    """The request's one sample: its form's ``data`` (or ``body``) field, or the body."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        req = bounded(request, limit + FORM_OVERHEAD, "the model's input size")
        async with req.form(max_files=1, max_fields=1, max_part_size=limit + FORM_OVERHEAD) as form:
            field = form.get("data") if "data" in form else form.get("body")
            if field is None:
                raise InvalidInput(f"the form has {sorted(form.keys())}; send the sample as its 'data' field")
            return await field.read() if isinstance(field, UploadFile) else str(field).encode()
    return await read_body(request, limit, "the model's input size")


def torchserve_inference_routes(api: InferenceAPI, manager: ModelManager, codec: CodecPool,
                                config: ServerConfig) -> APIRouter:
    """TorchServe's inference API through ``api``, models from ``manager``."""
    router = APIRouter(route_class=TorchServeRoute)

    @router.get("/ping", **ts_doc("Healthy", 500))
    async def ping() -> JSONResponse:
        """TorchServe's health check: 200 Healthy while the node serves, else 500 Unhealthy."""
        ok = api.ready()
        return JSONResponse({"status": "Healthy" if ok else "Unhealthy"}, status_code=200 if ok else 500)

    async def predict(model_name: str, request: Request, model_version: str | None = None) -> Any:
        """One sample in, the model's answer out (TorchServe's request and response shapes)."""
        known(manager, model_name)
        check_version(manager, model_name, model_version)
        cfg = manager.model_config(model_name)
        image = cfg.handler.get("name") == IMAGE_CLASSIFIER
        limit = int(cfg.handler["max_input_bytes"]) if image else infer_limit(config, cfg)
        async with codec.admit(content_length(request, limit + FORM_OVERHEAD, "the model's input size")):
            data = await _sample(request, limit)
            if image:
                x = await codec.run(len(data), _image_row, data, limit)
            else:
                x = _tensor(cfg, await codec.run(len(data), parse_json, data))
        cls = v2.InferRequest(parameters={"class": request.query_params.get("class")}).cls
        out = await api.infer(model_name, [x], cls, None)
        return _answer(cfg, out.outputs)

    answer = ts_doc("image_classifier: the top 5 as {name: score}; base_handler: the output as a JSON array",
                    400, 404, 413, 429, 503, 504)
    router.post("/predictions/{model_name}", summary="TorchServe prediction", **answer)(predict)
    router.post("/predictions/{model_name}/{model_version}", summary="TorchServe prediction of a model version",
                **answer)(predict)
    return router
