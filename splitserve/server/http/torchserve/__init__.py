"""TorchServe's inference and management APIs, for TorchServe's users and their scripts:
on a node's HTTP port beside the v2 protocol, and on TorchServe's own ports when asked
(``--ts-inference-port``, ``--ts-management-port``), with TorchServe's request, response
and error shapes. Models come from ``.mar`` archives (``models/mar.py``)."""

from __future__ import annotations

from fastapi import FastAPI

from splitserve.config import ServerConfig
from splitserve.server.frontends import CodecPool
from splitserve.server.http.base import new_app
from splitserve.server.http.torchserve.inference import torchserve_inference_routes
from splitserve.server.http.torchserve.management import torchserve_management_routes
from splitserve.server.management import ModelManager
from splitserve.server.ports import InferenceAPI

__all__ = ["torchserve_inference_app", "torchserve_inference_routes", "torchserve_management_app",
           "torchserve_management_routes"]


def torchserve_inference_app(api: InferenceAPI, manager: ModelManager, codec: CodecPool,
                             config: ServerConfig) -> FastAPI:
    """TorchServe's inference API alone (its port 8080's)."""
    app = new_app("TorchServe's inference API.", [])
    app.include_router(torchserve_inference_routes(api, manager, codec, config))
    return app


def torchserve_management_app(manager: ModelManager, config: ServerConfig) -> FastAPI:
    """TorchServe's management API alone (its port 8081's)."""
    app = new_app("TorchServe's management API.", [])
    app.include_router(torchserve_management_routes(manager, config))
    return app
