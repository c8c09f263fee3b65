"""What the HTTP front end's OpenAPI schema (``/openapi.json``) says each endpoint takes and
returns: bodies, error bodies and status codes, so that a client generated from it, and
schemathesis, see the API as it is.

The models here document; handlers build their answers as plain dicts (the same ones the
gRPC front end converts), so documenting costs no validation at run time.
``tests/integration/test_http_schema.py`` checks the schema against a real server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from splitserve.protocol.v2 import DATATYPES

# Why each error status is answered (the body is always ErrorBody).
_WHY = {
    400: "Bad input: the message names the field and what is wrong with it",
    401: "No or wrong management token ('Authorization: Bearer <token>')",
    404: "Unknown model or version; a shared-memory region or object that is not there",
    413: "The body exceeds its limit (a model's infer limit, or the upload limit)",
    429: "Refused by policy (best-effort work on an rt-only server), or the shared-memory caps are reached",
    500: "A worker failed, or a server bug (the message gives a reference to the server log)",
    503: "The model is not ready, its queue is full, too many large bodies are in hand, or the server is stopping",
    504: "The request's deadline passed before it ran",
    507: "The server has no storage left for the upload",
}


class ErrorBody(BaseModel):
    """The protocol's error object; ``status`` names splitserve's status so clients can
    rebuild the exact error class."""

    error: str
    status: str | None = None


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses`` entries for these error statuses (every endpoint can also answer 500)."""
    return {c: {"model": ErrorBody, "description": _WHY[c]} for c in sorted({*codes, 500})}


# -- health and metadata -------------------------------------------------------------------------


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 stands for the batch dimension")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] = Field(default_factory=dict, description="splitserve additions")


class Duration(BaseModel):
    count: int
    ns: int


class BatchStats(BaseModel):
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class Residency(BaseModel):
    loads: int = Field(description="instances that loaded the weights")
    load_ns: int = Field(description="their load times, summed")
    evictions: int = Field(description="completed evictions")
    weights_bytes: int = Field(description="what the resident instances' weights take now")


class DirectCounts(BaseModel):
    received: int = Field(description="direct calls accepted by the workers")
    answered: int = Field(description="answered with their result")
    failed: int = Field(description="answered with an error (refused frames included)")
    in_flight_rt: int = Field(description="real-time calls accepted, not yet answered")
    in_flight_be: int = Field(description="best-effort calls accepted, not yet answered")
    busy_ns: int = Field(description="time the workers spent running direct batches")
    batches: int = Field(description="direct batches run")
    samples: int = Field(description="rows of those batches (holes left by slow frames included)")
    connections: int = Field(description="direct connections open")
    rt_running: int = Field(description="workers running a direct real-time batch now")
    preempted: int = Field(description="direct best-effort batches held at a segment boundary for real-time work")
    slo_met: int = Field(description="direct real-time calls with a soft SLO answered with their result by it")
    slo_missed: int = Field(description="answered with their result after it")
    slo_dropped: int = Field(description="answered with an error")


class SloCounts(BaseModel):
    met: int = Field(description="real-time calls with an SLO answered with their result by it")
    missed: int = Field(description="answered with their result after it (served late, never dropped for it)")
    dropped: int = Field(description="answered with an error (a hard deadline, a failure)")


class ModelStats(BaseModel):
    name: str
    version: str
    last_inference: int
    inference_count: int
    execution_count: int
    inference_stats: dict[str, Duration]
    batch_stats: list[BatchStats]
    preemptions: int
    residency: Residency = Field(description="splitserve addition")
    slo: SloCounts = Field(description="splitserve addition: soft SLOs of real-time calls")
    direct: DirectCounts = Field(description="splitserve addition: calls the workers took on the direct path")


class Statistics(BaseModel):
    model_stats: list[ModelStats]


# -- inference -----------------------------------------------------------------------------------


class InferTensor(BaseModel):
    """A request tensor: JSON ``data`` (flat or nested), or ``parameters.binary_data_size``
    bytes after the JSON header (binary tensor data extension)."""

    name: str
    datatype: Literal[DATATYPES]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=0)]]
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequestBody(BaseModel):
    """``parameters``: ``class`` ("rt" or "be"), ``deadline_ms`` (positive; hard), ``slo_ms``
    (positive; soft, real-time calls), ``binary_data_output``."""

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None


class OutputTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class InferResponseBody(BaseModel):
    """``parameters`` carry the server's ``queue_us``, ``compute_us`` and ``total_us``."""

    model_name: str
    model_version: str
    id: str
    parameters: dict[str, Any] | None = None
    outputs: list[OutputTensor]


class ClassifyRequest(BaseModel):
    """``input``: one sample or a batch as nested lists, or ``{"b64": ...}`` raw sample bytes."""

    model: str
    input: list[Any] | dict[str, str]
    top_k: int = Field(5, ge=1, le=1000)
    class_: Literal["rt", "be"] | None = Field(None, alias="class")


class Prediction(BaseModel):
    label: str
    index: int
    score: float


class ClassifyResponse(BaseModel):
    model: str
    predictions: list[list[Prediction]]


# -- repository and management -------------------------------------------------------------------


class IndexRequest(BaseModel):
    ready: bool = False


class ShmRegister(BaseModel):
    """System shared-memory extension: a region of a POSIX shared-memory object."""

    key: str = Field(pattern=r"^/?[^/.\x00][^/\x00]*$",
                     description="the object's key as shm_open takes it ('/name', under /dev/shm)")
    offset: int = Field(0, ge=0, description="where the region starts inside the object")
    byte_size: int = Field(ge=1, description="the region's length")


class ShmRegion(BaseModel):
    name: str
    key: str
    offset: int
    byte_size: int


class CudaHandle(BaseModel):
    b64: str = Field(pattern=r"^[A-Za-z0-9+/]{86}==$", description="the cudaIpcMemHandle_t's 64 bytes, base64")


class CudaShmRegister(BaseModel):
    """CUDA shared-memory extension: a client's device allocation, by its CUDA IPC handle."""

    raw_handle: CudaHandle
    device_id: int = Field(ge=0, description="the CUDA device the allocation is on")
    byte_size: int = Field(ge=1, description="the region's length")


class CudaShmRegion(BaseModel):
    name: str
    device_id: int
    byte_size: int


class IndexEntry(BaseModel):
    name: str
    version: str
    state: Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]
    reason: str


class Registered(BaseModel):
    name: str
    func_id: int
    version: str
    state: Literal["READY"]


class Deleted(BaseModel):
    name: str
    deleted: bool


class ModelState(BaseModel):
    name: str
    state: Literal["READY", "UNAVAILABLE"]


class Evicted(BaseModel):
    name: str
    evicted: bool = Field(description="false if nothing was resident (never loaded, failed, unloaded or evicted)")
    state: str = Field(description="the model's state after the call: evicted, unloaded, failed, ...")


class BatchingChange(BaseModel):
    """Keys of a model's ``[batching]`` (absent or null: unchanged)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["work_conserving", "timeout", "none", "adaptive"] | None = None
    max_delay_ms: float | None = Field(None, ge=0)
    preferred_batch: int | None = Field(None, ge=1)
    quantum_ms: float | None = Field(None, gt=0, le=60_000)
    alpha: float | None = Field(None, gt=0, lt=1)
    threshold_cap: int | None = Field(None, ge=1)
    rule: Literal["ewma", "aimd", "fixed"] | None = None
    adaptive_quantum: bool | None = None
    quantum_beta: float | None = Field(None, ge=0, lt=1)


class ConfigChange(BaseModel):
    """At least one key; ``max_batch_size`` may only go down to 1 and up to the registered one."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1})

    instances: int | None = Field(None, ge=1, le=64)
    batching: BatchingChange | None = None
    max_batch_size: int | None = Field(None, ge=1)


class GeometryChange(BaseModel):
    """``POST /v2/partitions``: the partitions' core counts, largest first (``"1,1"``, ``"4,2,1"``)."""

    geometry: str = Field(pattern=r"^\s*[1-9][0-9]*(\s*,\s*[1-9][0-9]*)*\s*$")


class TraceSetting(BaseModel):
    """Triton's trace settings (trace extension). A POST sends the keys it changes; null
    gives a key back its default (for a model: the node's setting)."""

    trace_level: list[Literal["OFF", "TIMESTAMPS"]] | None = None
    trace_rate: str | None = Field(None, description="every n-th call is traced")
    trace_count: str | None = Field(None, description="traces left (-1: no limit)")
    log_frequency: str | None = Field(None, description="spans held before the trace file is written (0: at once)")
    trace_file: str | None = Field(None, description="a file name in the server's trace directory ('': none)")
    trace_mode: Literal["opentelemetry"] | None = None


class LogSetting(BaseModel):
    """Triton's log settings (logging extension). A POST sends the keys it changes."""

    log_file: str | None = Field(None, description="'' (the server's own log destination; fixed)")
    log_info: bool | None = None
    log_warning: bool | None = None
    log_error: bool | None = None
    log_verbose_level: int | None = Field(None, ge=0, description="above 0: debug messages too")
    log_format: Literal["default"] | None = None


class LoadRequest(BaseModel):
    """Optional body of a load: ``parameters.keep_resident`` pins the model under a memory budget;
    ``parameters.config`` (Triton's model configuration in JSON, or config.toml) with
    ``file:<path>`` parameters (base64) registers the model first."""

    parameters: dict[str, Any] | None = None


ResidencyName = Literal["RESIDENT", "LOADING", "EVICTED", "FAILED", "UNLOADED"]


class ModelMemory(BaseModel):
    residency: ResidencyName
    reason: str | None
    weights_bytes: int
    private_bytes: int
    reserved_bytes: int
    instances: int
    loads: int
    evictions: int
    last_load_ms: float | None
    keep_resident: bool
    last_used_s_ago: float | None
    device_bytes: int  # per GPU instance, measured at its load (0 on the CPU)
    device_reserved_bytes: dict[str, int]  # GPU partition UUID -> bytes held there, every instance's copy
    pinned_bytes: int = 0  # page-locked host bytes its parked weights hold in the pinned tier (evicted GPU models)


class Memory(BaseModel):
    """The memory manager: budget, reservations, LRU order (least recently used first), loads."""

    budget_bytes: int | None
    max_resident_models: int | None
    max_concurrent_loads: int
    reserved_bytes: int
    resident_bytes: int
    lru: list[str]
    loading: list[str]
    load_queue: list[str]
    spares: int
    spares_starting: int = 0  # spare worker processes still starting (importing torch): the node is settling
    loads: int
    evictions: int
    models: dict[str, ModelMemory]
    device_budget_bytes: int | None  # per GPU partition (None: device memory unbudgeted)
    device_reserved_bytes: dict[str, int]  # GPU partition UUID -> bytes reserved there
    pinned_tier_budget_bytes: int = 0  # page-locked host bytes evicted GPU models' weights may wait in
    pinned_tier_bytes: int = 0  # what they hold now
    pinned_tier: list[str] = []  # the models parked there, least recently used first


class Stages(BaseModel):
    """Per-stage stamps (server clock, seconds) of the newest successful fast-path calls;
    ``enabled`` is false when the server keeps none (``fast_stage_trace`` 0)."""

    enabled: bool
    now: float
    calls: list[dict[str, Any]]


class SchedulerEvents(BaseModel):
    mode: str
    now: float
    events: list[dict[str, Any]]


def body(model: type[BaseModel], example: dict[str, Any] | None = None, binary: str | None = None,
         required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a request body read by hand (handlers parse bodies themselves,
    off the loop and within limits); ``binary`` documents an octet-stream alternative."""
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
    if example is not None:
        content["application/json"]["example"] = example
    if binary is not None:
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary", "description": binary}}
    return {"requestBody": {"required": required, "content": content}}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """The app's schema, with the models of hand-read bodies added, and FastAPI's 422 left
    out: validation errors are answered 400 with an ErrorBody like every other bad input."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in request_models:
            full = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
            components.update(full.pop("$defs", {}))
            components[model.__name__] = full
        for path in schema["paths"].values():
            for op in path.values():
                responses = op.get("responses", {})
                responses.pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
