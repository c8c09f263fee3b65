"""The shared-memory routes: the system and CUDA shared-memory extensions' region registries."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.protocol import v2
from splitserve.server import http_schema as doc
from splitserve.server.http.base import read_json, route_doc
from splitserve.server.ports import SharedMemoryRegions
from splitserve.server.cuda_shm import decode_handle


def shared_memory_routes(shm: SharedMemoryRegions, config: ServerConfig) -> APIRouter:
    """The system and CUDA shared-memory extensions through ``shm``."""
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

    def cuda_list(name: str | None) -> list[dict[str, Any]]:
        return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in shm.cuda_status(name)]

    cuda_status_doc = route_doc({"model": list[doc.CudaShmRegion]}, 404)

    @router.get("/v2/cudasharedmemory/status", tags=["shared memory"], **cuda_status_doc)
    async def cuda_regions_status() -> list:
        """Every registered CUDA shared-memory region."""
        return cuda_list(None)

    @router.get("/v2/cudasharedmemory/region/{name}/status", tags=["shared memory"], **cuda_status_doc)
    async def cuda_region_status(name: str) -> list:
        """One registered CUDA shared-memory region (404 when it is not registered)."""
        return cuda_list(name)

    @router.post("/v2/cudasharedmemory/region/{name}/register", tags=["shared memory"],
                 **route_doc({"description": "Registered"}, 400, 404, 413, 429, openapi_extra=doc.body(
                     doc.CudaShmRegister, {"raw_handle": {"b64": "<64 bytes, base64>"}, "device_id": 0,
                                           "byte_size": 602112})))
    async def cuda_region_register(name: str, request: Request) -> dict:
        """Register the device allocation a client exported with ``cudaIpcGetMemHandle`` as
        region ``name``; body ``{"raw_handle": {"b64"}, "device_id", "byte_size"}``."""
        body = await read_json(request, small_limit)
        if not isinstance(body, dict) or "byte_size" not in body:
            raise InvalidInput('the body must be {"raw_handle": {"b64": "..."}, "device_id": 0, "byte_size": N}')
        shm.cuda_register(name, decode_handle(name, body.get("raw_handle")),
                          v2.json_number("device_id", body.get("device_id", 0), int),
                          v2.json_number("byte_size", body["byte_size"], int))
        return {}

    @router.post("/v2/cudasharedmemory/unregister", tags=["shared memory"],
                 **route_doc({"description": "Unregistered"}))
    async def cuda_regions_unregister() -> dict:
        """Unregister every CUDA region; calls in flight that use one still get their answers."""
        shm.cuda_unregister(None)
        return {}

    @router.post("/v2/cudasharedmemory/region/{name}/unregister", tags=["shared memory"],
                 **route_doc({"description": "Unregistered"}))
    async def cuda_region_unregister(name: str) -> dict:
        """Unregister a CUDA region (no error when it is not registered)."""
        shm.cuda_unregister(name)
        return {}

    return router
