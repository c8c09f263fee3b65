"""The shared-memory routes: the system shared-memory extension's region registry, and
CUDA's, refused."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput, NotFound
from splitserve.protocol import v2
from splitserve.server import http_schema as doc
from splitserve.server.http.base import read_json, route_doc
from splitserve.server.ports import SharedMemoryRegions
from splitserve.server.shm import CUDA_UNSUPPORTED


def shared_memory_routes(shm: SharedMemoryRegions, config: ServerConfig) -> APIRouter:
    """The system shared-memory extension through ``shm``; CUDA's is refused (there is no GPU)."""
    router = APIRouter()
    small_limit = config.frontends.management_body_bytes

    def region_list(name: str | None) -> list[dict[str, Any]]:
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in shm.status(name)]

    shm_status_doc = route_doc({"model": list[doc.ShmRegion]}, 404)

    @router.get("/v2/systemsharedmemory/status", tags=["shared memory"], **shm_status_doc)
    async def regions_status() -> list:
        """Every registered system shared-memory region."""
        return region_list(None)

    @router.get("/v2/systemsharedmemory/region/{name}/status", tags=["shared memory"], **shm_status_doc)
    async def region_status(name: str) -> list:
        """One registered system shared-memory region (404 when it is not registered)."""
        return region_list(name)

    @router.post("/v2/systemsharedmemory/region/{name}/register", tags=["shared memory"],
                 **route_doc({"description": "Registered"}, 400, 404, 413, 429, openapi_extra=doc.body(
                     doc.ShmRegister, {"key": "/input0", "offset": 0, "byte_size": 602112})))
    async def region_register(name: str, request: Request) -> dict:
        """Register ``byte_size`` bytes from ``offset`` of the shared-memory object ``key``
        (``/name`` under /dev/shm) as region ``name``; body ``{"key", "offset", "byte_size"}``."""
        doc = await read_json(request, small_limit)
        if not isinstance(doc, dict) or not isinstance(doc.get("key"), str) or "byte_size" not in doc:
            raise InvalidInput('the body must be {"key": "/name", "offset": 0, "byte_size": N}')
        shm.register(name, doc["key"], v2.json_number("offset", doc.get("offset", 0), int),
                     v2.json_number("byte_size", doc["byte_size"], int))
        return {}

    @router.post("/v2/systemsharedmemory/unregister", tags=["shared memory"],
                 **route_doc({"description": "Unregistered"}))
    async def regions_unregister() -> dict:
        """Unregister every region; calls in flight that use one still get their answers."""
        shm.unregister(None)
        return {}

    @router.post("/v2/systemsharedmemory/region/{name}/unregister", tags=["shared memory"],
                 **route_doc({"description": "Unregistered"}))
    async def region_unregister(name: str) -> dict:
        """Unregister a region (no error when it is not registered); a call in flight that
        uses it still gets its answer."""
        shm.unregister(name)
        return {}

    async def cuda_shared_memory(request: Request) -> dict:
        """CUDA shared memory: not supported (no GPU); always 404."""
        raise NotFound(CUDA_UNSUPPORTED)

    for path in ("/v2/cudasharedmemory/status", "/v2/cudasharedmemory/region/{name}/status"):
        router.get(path, tags=["shared memory"], **route_doc({"description": "never"}, 404))(cuda_shared_memory)
    for path in ("/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/{name}/register",
                 "/v2/cudasharedmemory/region/{name}/unregister"):
        router.post(path, tags=["shared memory"], **route_doc({"description": "never"}, 404))(cuda_shared_memory)

    return router
