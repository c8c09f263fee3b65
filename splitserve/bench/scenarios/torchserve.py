"""torchserve: TorchServe's ``/predictions/NAME`` against ``/v2/models/NAME/infer`` for the
same model, one client, sequential calls on one keep-alive connection each.

A small TorchScript CNN (3x224x224 in, 10 classes) is archived as a ``.mar`` (the layout
``torch-model-archiver`` writes) twice and registered through TorchServe's management API:

- ``ic``: ``image_classifier``, so the worker decodes the PNG, resizes, crops, normalises
  and takes the top 5. Timed as ``/predictions/ic`` (the PNG as the body) and as
  ``/v2/models/ic/infer`` (the same bytes as its UINT8 input row, binary tensor data).
- ``base``: ``base_handler`` with its FP32 tensor declared, the preprocessing done by the
  client: ``/predictions/base`` (a JSON array) and ``/v2/models/base/infer`` (binary).

Ratios are /predictions over /v2 from the same run."""

from __future__ import annotations

import io
import json
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import lat_stats

NAME = "torchserve"
SUMMARY = "TorchServe's /predictions against /v2 infer for the same model (image_classifier and base_handler)."
MODELS: tuple[str, ...] = ("ic", "base")
TRANSPORTS: tuple[str, ...] = ("http-json", "http-binary")
MAX_IMAGE_BYTES = 256 << 10


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = MODELS
    transports: tuple[str, ...] = TRANSPORTS
    requests: int = 400  # sequential, per model and route
    warmup: int = 40

    @classmethod
    def quick(cls) -> Params:
        return cls(requests=60, warmup=10)


def _archive(path: Path, name: str, handler: str, model_bytes: bytes, config_yaml: str | None) -> None:
    """A .mar as torch-model-archiver lays it out."""
    model = {"modelName": name, "serializedFile": "cnn.pt", "handler": handler, "modelVersion": "1.0"}
    with zipfile.ZipFile(path, "w") as z:
        if config_yaml is not None:
            model["configFile"] = "model-config.yaml"
            z.writestr("model-config.yaml", config_yaml)
        z.writestr("MAR-INF/MANIFEST.json", json.dumps({"runtime": "python", "model": model}))
        z.writestr("cnn.pt", model_bytes)


def _cnn_bytes() -> bytes:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 7, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 10)).eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():  # torch.jit is deprecated upstream; TorchServe's archives hold it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.trace(net, torch.zeros(1, 3, 224, 224)), buf)
    return buf.getvalue()


def _png(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (np.linspace(0, 255, 300 * 260 * 3).reshape(260, 300, 3) + rng.normal(0, 30, (260, 300, 3)))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _v2_body(name: str, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    from splitserve.protocol import v2

    parts, hlen = v2.build_infer_request([(name, x)])
    return b"".join(bytes(p) for p in parts), {v2.HEADER_LENGTH: str(hlen), "Content-Type": "application/octet-stream"}


def _time(client: Any, path: str, body: bytes, headers: dict[str, str], n: int, warmup: int) -> list[float]:
    out = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        r = client.post(path, content=body, headers=headers)
        dt = (time.perf_counter() - t0) * 1e6
        if r.status_code != 200:
            raise RuntimeError(f"POST {path} answered {r.status_code}: {r.text[:300]}")
        if i >= warmup:
            out.append(dt)
    return out


def run(ctx: Context) -> ScenarioOutput:
    import httpx

    from splitserve.models.handler_spec import encode_image
    from splitserve.models.handlers import preprocess_image

    p: Params = ctx.params  # type: ignore[assignment]
    target = ctx.target()
    if ctx.data_dir is None:
        raise RuntimeError("the torchserve scenario registers archives in the model store: it needs a server the "
                           "bench starts, or --url naming the server's data directory")
    store = ctx.data_dir / "model-store"
    store.mkdir(exist_ok=True)
    cnn = _cnn_bytes()
    _archive(store / "bench-ic.mar", "ic", "image_classifier", cnn, f"splitserve: {{max_input_bytes: {MAX_IMAGE_BYTES}}}\n")
    _archive(store / "bench-base.mar", "base", "base_handler", cnn, (
        "splitserve:\n  inputs: [{name: x, datatype: FP32, shape: [3, 224, 224]}]\n"
        "  outputs: [{name: y, datatype: FP32, shape: [10]}]\n"))
    token = (ctx.data_dir / "token").read_text().strip()
    image = _png(p.seed)
    from PIL import Image

    x = preprocess_image(Image.open(io.BytesIO(image)))
    routes = {
        "ic": {"/predictions": (image, {}),
               "/v2 infer": _v2_body("data", encode_image(image, MAX_IMAGE_BYTES)[None])},
        "base": {"/predictions": (json.dumps(x.tolist()).encode(), {"Content-Type": "application/json"}),
                 "/v2 infer": _v2_body("x", x[None])},
    }
    results: dict[str, Any] = {}
    with httpx.Client(base_url=target.url("http-json"), timeout=120,
                      headers={"Authorization": f"Bearer {token}"}) as client, \
            ctx.task("/predictions and /v2 infer", len(p.models) * 2) as advance:
        for model in p.models:
            r = client.post("/models", params={"url": f"bench-{model}.mar"})
            if r.status_code != 200:
                raise RuntimeError(f"registering bench-{model}.mar answered {r.status_code}: {r.text[:300]}")
            cells = {}
            for route, (body, headers) in routes[model].items():
                path = f"/predictions/{model}" if route == "/predictions" else f"/v2/models/{model}/infer"
                cells[route] = {"latency_us": lat_stats(_time(client, path, body, headers, p.requests, p.warmup)),
                                "body_bytes": len(body)}
                advance(1)
            cells["ratio_p50"] = cells["/predictions"]["latency_us"]["p50"] / cells["/v2 infer"]["latency_us"]["p50"]
            results[model] = cells
            client.delete(f"/models/{model}")
    return _output(results)


def _output(results: dict[str, Any]) -> ScenarioOutput:
    rows, lines = [], []
    for model, cells in results.items():
        for route in ("/predictions", "/v2 infer"):
            lat = cells[route]["latency_us"]
            rows.append((model, route, cells[route]["body_bytes"], fmt(lat["p50"]), fmt(lat["p99"])))
        lines.append(f"{model}: /predictions p50 {fmt(cells['/predictions']['latency_us']['p50'], 0)} µs, /v2 infer "
                     f"{fmt(cells['/v2 infer']['latency_us']['p50'], 0)} µs, ratio {cells['ratio_p50']:.2f}")
    report = [report_intro(__doc__), "", md_table(("model", "route", "body bytes", "p50 µs", "p99 µs"), rows), "",
              *lines]
    return ScenarioOutput({"models": results}, "\n".join(report), {}, lines)
