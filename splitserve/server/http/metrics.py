"""``GET /metrics``: Prometheus text, a node's and a cluster gateway's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from splitserve.server.http.base import route_doc


def metrics_route(text: Callable[[], Awaitable[str]]) -> APIRouter:
    """``GET /metrics``: the Prometheus text that ``text`` returns."""
    router = APIRouter()

    exposition = {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}

    @router.get("/metrics", tags=["metrics"],
                **route_doc({"description": "Prometheus text exposition", "content": exposition}))
    async def metrics() -> Response:
        """Prometheus metrics, per model and class."""
        return Response(await text(), media_type=CONTENT_TYPE_LATEST)

    return router
