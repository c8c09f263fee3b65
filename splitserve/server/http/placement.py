"""A node's scheduling introspection routes: placement, scheduler events, partitions, the
fast path's stage trace and the memory manager."""

from __future__ import annotations

from fastapi import APIRouter, Request

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.server import http_schema as doc
from splitserve.server.http.base import authorize, read_json, route_doc
from splitserve.server.management import ModelManager
from splitserve.server.ports import ServingAPI


def placement_routes(api: ServingAPI, manager: ModelManager, config: ServerConfig) -> APIRouter:
    """Scheduling introspection (benchmarks read these from another process): placement,
    scheduler events, partitions (re-carved with the token), the fast path's stage trace
    through ``api``, and the memory manager."""
    router = APIRouter()
    small_limit = config.frontends.management_body_bytes
    version_of = manager.version

    @router.get("/v2/models/{name}/placement", tags=["scheduling"],
                **route_doc({"description": "Serving instances, the Packrat plan, reconfigurations and partitions"},
                            404))
    async def placement(name: str) -> dict:
        """The serving instance set (threads, batch, CPUs), the Packrat plan, every
        reconfiguration so far (times on the server's clock) and the model's partitions."""
        version_of(name, None)
        return manager.placement(name)

    @router.get("/v2/placement", tags=["scheduling"],
                **route_doc({"description": "Every partition of the node's CPUs and the instances on it"}))
    async def node_placement() -> dict:
        """The node's CPUs, those free, and every partition with its owner and instances."""
        return manager.node_placement()

    @router.get("/v2/scheduler/events", tags=["scheduling"], **route_doc(doc.SchedulerEvents, 400))
    async def scheduler_events(since: float = 0.0, limit: int = 10000) -> dict:
        """Batch events (start, preempt, preempted, resume, done) after ``since`` (server clock)."""
        return manager.scheduler_events(since, limit)

    @router.get("/v2/partitions", tags=["scheduling"],
                **route_doc({"description": "The node's partitions (PROTEAN): CPUs, memory, tags, instances, "
                                            "geometry; its GPUs and MIG slices (read-only)"}))
    async def partitions() -> dict:
        """The node's partitions: each one's CPUs, memory budget, Algorithm 1's tag and the
        models' instances on it; the geometry, the controller's last tick, cold starts; and
        ``gpus``, its GPUs and MIG slices as NVML last listed them (or why there are none)."""
        return manager.partition_status()

    @router.post("/v2/partitions", tags=["scheduling"], **route_doc(
        {"description": "The partitions after the change"}, 400, 401, 404, 503,
        openapi_extra=doc.body(doc.GeometryChange, {"geometry": "1,1"})))
    async def set_partitions(request: Request) -> dict:
        """Re-carve the partitions to ``geometry`` (core counts, e.g. ``"1,1"``), moving every
        model's instances without a request lost (needs the token)."""
        authorize(manager, request)
        body = await read_json(request, small_limit)
        if not isinstance(body, dict) or set(body) != {"geometry"}:
            raise InvalidInput('the body must be {"geometry": "<core counts>"}, e.g. {"geometry": "1,1"}')
        return await manager.set_geometry(body["geometry"])

    @router.get("/v2/debug/stages", tags=["scheduling"], **route_doc(doc.Stages))
    async def stages() -> dict:
        """Where the newest fast-path calls spent their time: one record of stamps per call
        (``fast_stage_trace`` of them; none unless the server was started with it)."""
        return api.stage_trace()

    @router.get("/v2/memory", tags=["scheduling"], **route_doc(doc.Memory))
    async def memory() -> dict:
        """The memory manager: budget, reserved and resident bytes, LRU order, loads and
        evictions, and each model's residency (RESIDENT, LOADING, EVICTED, FAILED, UNLOADED)."""
        return manager.memory_status()

    return router
