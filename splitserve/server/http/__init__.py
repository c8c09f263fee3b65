"""The HTTP front end: Open Inference Protocol v2 (KServe v2 / Triton) with the binary
tensor data, model repository and statistics extensions, model management, ``/classify``,
TorchServe's inference and management APIs (``torchserve/``) and Prometheus ``/metrics``.

The app runs on the node's own event loop (``HttpFrontEnd`` serves it with uvicorn), so
every handler is ``async`` and calls the node directly: the ``ServingAPI`` for inference,
the node's ``ModelManager`` for everything else. The loop only receives bodies
(within the model's infer limit) and answers: infer bodies are decoded and answers encoded
in the front ends' ``CodecPool``. Errors are the protocol's ``{"error": "..."}`` with the
status of the ``SplitServeError`` raised; ``http_schema`` documents all of it in
``/openapi.json``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fastapi import FastAPI

from splitserve.config import ServerConfig
from splitserve.server import http_schema as doc
from splitserve.server.frontends import CodecPool
from splitserve.server.http.base import new_app
from splitserve.server.http.frontend import HttpFrontEnd
from splitserve.server.http.infer_lane import InferLane
from splitserve.server.http.inference import classify_routes, infer_endpoint, inference_routes
from splitserve.server.http.management import management_routes, model_config_routes, statistics_routes
from splitserve.server.http.metrics import metrics_route
from splitserve.server.http.placement import placement_routes
from splitserve.server.http.repository import repository_routes
from splitserve.server.http.settings import settings_routes
from splitserve.server.http.shared_memory import shared_memory_routes
from splitserve.server.http.torchserve import torchserve_inference_routes, torchserve_management_routes
from splitserve.server.log_settings import LogSettings
from splitserve.server.management import ModelManager
from splitserve.server.ports import InferenceAPI, ModelCatalog, ModelRegistrar, ServingAPI, SharedMemoryRegions
from splitserve.server.trace_settings import TraceSampler

__all__ = ["EXTENSIONS", "HttpFrontEnd", "create_app", "inference_app", "inference_routes", "repository_routes"]

EXTENSIONS = ["binary_tensor_data", "model_repository", "statistics", "model_configuration", "system_shared_memory",
              "trace", "logging"]


def inference_app(api: InferenceAPI, catalog: ModelCatalog, codec: CodecPool, config: ServerConfig,
                  shm: SharedMemoryRegions, extensions: Sequence[str] = ("binary_tensor_data",),
                  metrics: Callable[[], Awaitable[str]] | None = None,
                  registrar: ModelRegistrar | None = None) -> FastAPI:
    """An app of ``inference_routes``, ``repository_routes`` through ``registrar`` when given,
    and ``/metrics`` from ``metrics`` when given (a cluster gateway's: no other management)."""
    app = new_app("Open Inference Protocol v2 (KServe v2 / Triton): health, metadata and inference.",
                   [doc.InferRequestBody] + ([doc.IndexRequest] if registrar is not None else []))
    infer = infer_endpoint(api, catalog, codec, config, shm)
    app.include_router(inference_routes(api, catalog, infer, extensions))
    app.add_middleware(InferLane, infer=infer)
    if registrar is not None:
        app.include_router(repository_routes(registrar, config))
    if metrics is not None:
        app.include_router(metrics_route(metrics))
    return app


def create_app(api: ServingAPI, manager: ModelManager, codec: CodecPool, config: ServerConfig,
               shm: SharedMemoryRegions, traces: TraceSampler, logs: LogSettings) -> FastAPI:
    """The FastAPI app of one node: the inference routes through ``api`` and ``manager``,
    tensors in shared memory through ``shm``, trace and log settings through ``traces`` and
    ``logs``, everything else through ``manager``; ``codec`` decodes and encodes large bodies
    off the loop. Routes are matched in the order included."""
    app = new_app("Open Inference Protocol v2 (KServe v2 / Triton), model management and metrics.",
                   [doc.InferRequestBody, doc.ClassifyRequest, doc.IndexRequest, doc.ConfigChange,
                    doc.LoadRequest, doc.ShmRegister, doc.CudaShmRegister, doc.GeometryChange, doc.TraceSetting,
                    doc.LogSetting])

    async def metrics_text() -> str:
        return api.metrics_text()

    infer = infer_endpoint(api, manager, codec, config, shm)

    for router in (statistics_routes(manager),  # before the inference routes' /v2/models/{name}
                   settings_routes(manager, traces, logs, config),
                   inference_routes(api, manager, infer, EXTENSIONS),
                   model_config_routes(manager),
                   classify_routes(api, manager, codec, config),
                   shared_memory_routes(shm, config),
                   repository_routes(manager, config),
                   management_routes(manager, config),
                   placement_routes(api, manager, config),
                   torchserve_inference_routes(api, manager, codec, config),
                   torchserve_management_routes(manager, config),
                   metrics_route(metrics_text)):
        app.include_router(router)
    app.add_middleware(InferLane, infer=infer)
    return app
