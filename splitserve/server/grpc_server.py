"""The gRPC front end: Open Inference Protocol v2 (``inference.GRPCInferenceService``) with
the model-repository, statistics, model-configuration and system shared-memory extensions.

``GrpcFrontEnd`` serves one servicer. ``InferenceServicer`` is the inference half (health,
server and model metadata, ``ModelInfer``, ``ModelStreamInfer``) over the ``InferenceAPI``
and ``ModelCatalog`` seams, so a node and a cluster gateway (``cluster/gateway/dataplane.py``)
share it, as they share HTTP's ``inference_routes``; ``RepositoryServicer`` adds the
repository index and registering loads through the ``ModelRegistrar`` seam (both share it,
as HTTP's ``repository_routes``); ``NodeServicer`` adds the node's other management calls
through its ``ModelManager`` and shared-memory regions, as HTTP's ``create_app`` does. A
method a servicer lacks answers UNIMPLEMENTED.

The node starts its front end when ``config.frontends.grpc_port`` is not None and stops it before it
stops its models. The servicer runs on the server's own event loop (grpc.aio).
``ModelInfer`` takes and returns raw message bytes, so that parsing the message,
converting its tensors to numpy arrays and encoding the answer run in the front ends'
codec threads, not on the loop the fast path shares; in between, the call runs through
the ``InferenceAPI`` (the path every decoded front end shares).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from splitserve import __version__
from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput, ModelNotReady, NotFound, PayloadTooLarge, SplitServeError, UnknownModel
from splitserve.protocol import grpc_api as pb
from splitserve.protocol.grpc_codec import (
    CONTENTS_FIELD, STATUS_KEY, fill_contents, param_value, params_dict, set_param, tensor_from_contents,
)
from splitserve.protocol.header import RequestClass
from splitserve.protocol.v2 import (
    SHM_REGION, infer_body_limit, ms_parameter, model_inputs, refuse_sequence, shm_ref, tensor_from_bytes,
    tensor_to_bytes,
)
from splitserve.server.frontends import CodecPool
from splitserve.server.log_settings import LogSettings
from splitserve.server.registration import FILE_PREFIX, registration
from splitserve.server.management import ModelManager
from splitserve.server.ports import (
    FrontEnd, InferenceAPI, ModelCatalog, ModelRegistrar, ModelSignature, ServingAPI, SharedMemoryRegions,
)
from splitserve.server.shm import OutputWriters, input_tensor, output_views, write_outputs
from splitserve.server.trace_settings import TraceSampler

log = logging.getLogger(__name__)

EXTENSIONS = ("model_repository", "statistics", "model_configuration", "system_shared_memory", "trace", "logging")

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def _failure(e: Exception, what: str) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status, message and trailing metadata that answer ``what`` failing with ``e``."""
    if isinstance(e, SplitServeError):
        return grpc.StatusCode[e.grpc_code], e.message, ((STATUS_KEY, str(int(e.status))),)
    if isinstance(e, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, f"{what} timed out inside the server", ()
    # a bug: log it, answer INTERNAL with a reference to the log, keep serving
    ref = secrets.token_hex(6)
    log.error("gRPC %s failed (reference %s)", what, ref, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error (reference {ref} in the server log)", ()


def _rpc(fn: Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]) -> Callable[..., Awaitable[_Resp]]:
    """Turn splitserve errors into gRPC status codes, with the message as the details."""

    @functools.wraps(fn)
    async def handler(self: "InferenceServicer", request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        try:
            return await fn(self, request, context)
        except Exception as e:
            code, message, trailing = _failure(e, fn.__name__)
            await context.abort(code, message, trailing_metadata=trailing)
        raise AssertionError("context.abort returned")  # pragma: no cover

    return handler


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


class CallOptions(NamedTuple):
    """A call's parameters "class", "deadline_ms" (hard) and "slo_ms" (soft), times in seconds."""

    cls: RequestClass
    deadline_s: float | None
    slo_s: float | None


def _call_options(params: dict[str, Any]) -> CallOptions:
    refuse_sequence(params)
    try:
        cls = RequestClass.parse(params.get("class"))
    except InvalidInput as e:
        raise InvalidInput(f"parameter 'class': {e.message}") from None
    return CallOptions(cls, ms_parameter(params, "deadline_ms"), ms_parameter(params, "slo_ms"))


def decode_inputs(cfg: ModelSignature, request: pb.ModelInferRequest, shm: SharedMemoryRegions) -> list[np.ndarray]:
    """The request's input tensors as arrays in the model's declared order, fully checked;
    those that name a shared-memory region are arrays over it. ``raw_input_contents`` holds
    the bytes of the other inputs, in order."""
    refs = [shm_ref(f"input {t.name!r}", params_dict(t.parameters)) for t in request.inputs]
    raw = list(request.raw_input_contents)
    if raw:
        carried = sum(ref is None for ref in refs)
        if len(raw) != carried:
            raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {carried} inputs not in shared memory")
        typed = [t.name for t in request.inputs if t.HasField("contents")]
        if typed:
            raise InvalidInput(f"input {typed[0]!r} has typed contents next to raw_input_contents; "
                               "use one or the other")
    given: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for t, ref in zip(request.inputs, refs):
        if t.name in given:
            raise InvalidInput(f"input {t.name!r} of {cfg.name!r} is given twice")
        if ref is not None:
            if t.HasField("contents"):
                raise InvalidInput(f"input {t.name!r} names shared-memory region {ref.region!r} and also has contents")
            given[t.name] = input_tensor(shm, t.name, t.datatype, tuple(t.shape), ref)
        elif raw:
            given[t.name] = tensor_from_bytes(t.name, t.datatype, tuple(t.shape), raw.pop(0))
        elif t.HasField("contents"):
            given[t.name] = tensor_from_contents(t.name, t.datatype, tuple(t.shape), t.contents)
        else:
            raise InvalidInput(f"input {t.name!r} has no data: set raw_input_contents or the input's contents")
        datatypes[t.name] = t.datatype.upper()
    return model_inputs(cfg.name, cfg.inputs, given, datatypes)


def _parse_infer(message: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as e:
        raise InvalidInput(f"the ModelInferRequest message does not parse: {e}") from None


@dataclass
class _Decoded:
    """A ModelInfer call, decoded: inputs, wanted outputs, the regions of those that go to
    shared memory (their parameters echoed in the answer), class, deadline and SLO."""

    arrays: list[np.ndarray]
    wanted: list[str]
    shm_views: OutputWriters
    shm_params: dict[str, Any]
    options: CallOptions


def _decode_call(cfg: ModelSignature, request: pb.ModelInferRequest, shm: SharedMemoryRegions) -> _Decoded:
    """A ModelInfer call, decoded and checked (runs in a codec thread)."""
    arrays = decode_inputs(cfg, request, shm)
    declared = [o.name for o in cfg.outputs]
    wanted = [o.name for o in request.outputs] or declared
    for n in wanted:
        if n not in declared:
            raise InvalidInput(f"model {cfg.name!r} has no output {n!r}; its outputs are {', '.join(declared)}")
    refs = {o.name: ref for o in request.outputs
            if (ref := shm_ref(f"output {o.name!r}", params_dict(o.parameters))) is not None}
    views = output_views(shm, cfg, arrays[0].shape[0], refs)
    return _Decoded(arrays, wanted, views, {n: o.parameters for o in request.outputs if (n := o.name) in refs},
                    _call_options(params_dict(request.parameters)))


def _encode_response(cfg: ModelSignature, version: str, request: Any, call: _Decoded, outputs: list[np.ndarray],
                     timings: dict[str, int], streamed: bool) -> bytes:
    """The serialized ModelInferResponse, or ModelStreamInferResponse when ``streamed``, the
    outputs that go to shared memory written there (runs in a codec thread when large)."""
    write_outputs(call.shm_views, {spec.name: arr for spec, arr in zip(cfg.outputs, outputs)})
    outer = pb.ModelStreamInferResponse() if streamed else None
    resp = outer.infer_response if outer is not None else pb.ModelInferResponse()
    resp.model_name, resp.model_version, resp.id = cfg.name, version, request.id
    in_shm = any(t.parameters.get(SHM_REGION) is not None for t in request.inputs)
    typed = not request.raw_input_contents and not in_shm and all(o.datatype in CONTENTS_FIELD for o in cfg.outputs)
    raw: list[bytes] = []  # by position among the outputs, as clients index raw_output_contents
    for spec, arr in zip(cfg.outputs, outputs):
        if spec.name not in call.wanted:
            continue
        t = resp.outputs.add(name=spec.name, datatype=spec.datatype, shape=arr.shape)
        if spec.name in call.shm_views:  # written into its region: no contents
            for k, v in call.shm_params[spec.name].items():
                t.parameters[k].CopyFrom(v)
            raw.append(b"")
        elif typed:
            fill_contents(t.contents, arr, spec.datatype)
        else:
            raw.append(bytes(tensor_to_bytes(arr)))
    if any(raw):  # an empty entry holds a shared-memory output's place before the others'
        resp.raw_output_contents.extend(raw)
    for k, v in timings.items():
        set_param(resp.parameters, k, v)
    return (outer if outer is not None else resp).SerializeToString()


class InferenceServicer:
    """The inference half of the service through ``api`` and ``catalog``: a node's, or a
    cluster gateway's (which names no ``extensions`` and has no shared-memory regions
    registered, so a call that names one is refused). Stateless apart from what it serves;
    per-call state lives in each call."""

    def __init__(self, api: InferenceAPI, catalog: ModelCatalog, codec: CodecPool, config: ServerConfig,
                 shm: SharedMemoryRegions, extensions: Sequence[str] = ()) -> None:
        self.api = api
        self.catalog = catalog
        self.codec = codec
        self.config = config
        self.shm = shm
        self.extensions = tuple(extensions)

    # -- health and metadata -----------------------------------------------------------

    @_rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.api.ready())

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        self.catalog.version(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.api.model_ready(request.name))

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="splitserve", version=__version__, extensions=self.extensions)

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        self.catalog.version(request.name, request.version)
        meta = dict(self.catalog.model_metadata(request.name))
        extra = meta.pop("parameters", None) or {}
        resp = json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)
        for k, v in extra.items():
            if isinstance(v, (bool, int, float, str)):
                set_param(resp.parameters, k, v)
        return resp

    # -- inference ---------------------------------------------------------------------

    async def _infer(self, message: bytes, echo: Any = None) -> bytes:
        """One call from its serialized ModelInferRequest to its serialized answer, through the
        ``InferenceAPI`` as every decoded front end's calls go. ``echo`` (a ModelInferResponse), when
        given, makes it a call on a stream: it gets the request's id and model as soon as they
        are known, so that an error can be matched to its call, and the answer is a
        ModelStreamInferResponse."""
        codec, size = self.codec, len(message)
        async with codec.admit(size):
            request = await codec.run(size, _parse_infer, message)
            if echo is not None:
                echo.id, echo.model_name, echo.model_version = request.id, request.model_name, request.model_version
            version = self.catalog.version(request.model_name, request.model_version)
            cfg = self.catalog.model_config(request.model_name)
            limit = infer_body_limit(cfg.inputs, cfg.max_batch_size, self.config.frontends.json_chars_per_value)
            if size > limit:
                raise PayloadTooLarge(f"the message of {size} bytes exceeds model {cfg.name!r}'s limit of {limit} "
                                      f"bytes (max_batch_size {cfg.max_batch_size} samples of its inputs)")
            call = await codec.run(size, _decode_call, cfg, request, self.shm)
        opts = call.options
        out = await self.api.infer(cfg.name, call.arrays, opts.cls, opts.deadline_s, opts.slo_s)
        timings = {"queue_us": out.queue_us, "compute_us": out.compute_us, "total_us": out.total_us}
        # typed contents take up to ~8 bytes a value once serialized
        nbytes = sum(a.nbytes for a in out.outputs) * (1 if request.raw_input_contents else 8)
        return await codec.run(nbytes, _encode_response, cfg, version, request, call, out.outputs, timings,
                               echo is not None)

    @_rpc
    async def ModelInfer(self, message: bytes, context: Any) -> bytes:
        """Registered without (de)serializers: ``message`` is the raw ModelInferRequest."""
        return await self._infer(message)

    async def _stream_answer(self, message: bytes) -> bytes:
        """A streamed call's one ModelStreamInferResponse: its result, or its error in
        ``error_message`` (with the call's id) so that the stream stays open."""
        echo = pb.ModelInferResponse()
        try:
            return await self._infer(message, echo)
        except Exception as e:
            _, text, _ = _failure(e, "ModelStreamInfer")
            return pb.ModelStreamInferResponse(error_message=text, infer_response=echo).SerializeToString()

    async def ModelStreamInfer(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        """Registered without (de)serializers. Calls run concurrently and are answered as they
        finish. At most ``grpc_stream_max_in_flight`` are unanswered at once: at the cap the
        stream is not read (gRPC's flow control then holds the client back) until an answer
        has gone out. Each call gets exactly one answer; when the client goes away, the calls
        in flight still finish, and their answers are dropped."""
        in_flight = asyncio.Semaphore(self.config.frontends.grpc_stream_max_in_flight)
        # None: the reader is done, every answer is ahead of it. Bounded by in_flight: an
        # answer holds its call's place until it is sent.
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def answer(message: bytes) -> None:
            answers.put_nowait(await self._stream_answer(message))

        async def read() -> None:
            try:
                async for message in requests:
                    await in_flight.acquire()
                    task = asyncio.create_task(answer(message))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(set(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (out := await answers.get()) is not None:
                yield out
                in_flight.release()
            await reader  # the read's error, if it ended with one, ends the stream with it
        finally:
            reader.cancel()


def _files(params: dict[str, Any]) -> dict[str, bytes]:
    """The load's ``file:<path>`` parameters, by path: bytes, as Triton's clients send them."""
    out = {}
    for key, value in params.items():
        if key.startswith(FILE_PREFIX):
            if not isinstance(value, bytes):
                raise InvalidInput(f"parameter {key!r} must hold bytes (bytes_param)")
            out[key[len(FILE_PREFIX):]] = value
    return out


class RepositoryServicer(InferenceServicer):
    """The inference half and the repository calls that a ``ModelRegistrar`` serves (as HTTP's
    ``repository_routes``): ``RepositoryIndex``, and ``RepositoryModelLoad`` registering a
    model from its parameters (``server.registration``). A cluster gateway serves it as it is
    (``cluster/gateway/dataplane.py``): the cluster serves every model it has on its nodes, so a load
    of a model it has only checks that it serves; ``NodeServicer`` loads on the node instead.
    ``RepositoryModelUnload`` is the node's alone: a Triton unload keeps the model registered,
    to be loaded again by name, which a cluster (whose unregister forgets the model) cannot do."""

    def __init__(self, api: InferenceAPI, catalog: ModelCatalog, codec: CodecPool, config: ServerConfig,
                 shm: SharedMemoryRegions, registrar: ModelRegistrar, extensions: Sequence[str] = ()) -> None:
        super().__init__(api, catalog, codec, config, shm, extensions)
        self.registrar = registrar

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        resp = pb.RepositoryIndexResponse()
        for m in self.registrar.repository_index(ready_only=request.ready):
            resp.models.add(name=str(m["name"]), version=str(m.get("version") or ""), state=str(m.get("state") or ""),
                            reason=str(m.get("reason") or ""))
        return resp

    @_rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Any) -> pb.RepositoryModelLoadResponse:
        """Load a model; a "config" parameter (Triton's JSON or splitserve's TOML) registers
        it first, with its files as "file:<path>" (bytes) parameters and "labels" (needs the
        token, metadata ``authorization: Bearer <token>``)."""
        self.registrar.check_token(_authorization(context))
        params = {k: param_value(v) for k, v in request.parameters.items()}
        name = request.model_name
        asked = registration(name, params, _files(params))
        if asked is not None:
            name = (await self.registrar.register(*asked)).name
        await self._load(name, params)
        return pb.RepositoryModelLoadResponse()

    async def _load(self, name: str, params: dict[str, Any]) -> None:
        """Have ``name`` serve, after a registration if the call made one: here, check that it
        does. A gateway places and sizes models on its nodes, so "instances" and
        "keep_resident" are refused rather than ignored."""
        unserved = sorted({"instances", "keep_resident"} & params.keys())
        if unserved:
            raise InvalidInput(f"parameter(s) {unserved} are not served here: the cluster places and sizes each "
                               "model on its nodes")
        entry = next((m for m in self.registrar.repository_index() if m["name"] == name), None)
        if entry is None:
            raise UnknownModel(f"there is no model {name!r}; register it with a 'config' parameter (its "
                               "config.toml) and a 'file:<name>' one (its artifact)")
        if entry["state"] != "READY":
            raise ModelNotReady(f"model {name!r} is not served now: {entry.get('reason') or entry['state']}")


class NodeServicer(RepositoryServicer):
    """A node's whole service: the inference half through the node (``ServingAPI``) and its
    ``ModelManager`` as the catalog and registrar, and the management extensions through the
    manager and the node's shared-memory regions."""

    def __init__(self, api: ServingAPI, manager: ModelManager, codec: CodecPool, config: ServerConfig,
                 shm: SharedMemoryRegions, traces: TraceSampler, logs: LogSettings) -> None:
        super().__init__(api, manager, codec, config, shm, manager, EXTENSIONS)
        self.manager = manager
        self.traces = traces
        self.logs = logs

    # -- trace and logging extensions ------------------------------------------------------

    @_rpc
    async def TraceSetting(self, request: Any, context: Any) -> Any:
        """The trace settings of the node or of ``model_name``; settings sent change them
        first (needs the token). A setting with no value goes back to its default."""
        model = request.model_name or None
        if model is not None:
            self.manager.record(model)
        if request.settings:
            self.manager.check_token(_authorization(context))
            changes = {k: (None if not v.value else v.value[0] if k != "trace_level" else list(v.value))
                       for k, v in request.settings.items()}
            out = self.traces.update(changes, model)
            log.info("trace settings%s: %s", f" of model {model}" if model else "", out)
        else:
            out = self.traces.settings(model)
        resp = pb.TraceSettingResponse()
        for k, v in out.items():
            resp.settings[k].value.extend(v if isinstance(v, list) else [v])
        return resp

    @_rpc
    async def LogSettings(self, request: Any, context: Any) -> Any:
        """The node's log settings; settings sent change them first (needs the token)."""
        if request.settings:
            self.manager.check_token(_authorization(context))
            out = self.logs.update({k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
                                    for k, v in request.settings.items()})
        else:
            out = self.logs.settings()
        resp = pb.LogSettingsResponse()
        for k, v in out.items():
            field = "bool_param" if isinstance(v, bool) else "uint32_param" if isinstance(v, int) else "string_param"
            setattr(resp.settings[k], field, v)
        return resp

    # -- model configuration ----------------------------------------------------------------

    @_rpc
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        self.catalog.version(request.name, request.version)
        config = json_format.ParseDict(self.manager.triton_config(request.name), pb.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    # -- statistics extension ------------------------------------------------------------

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        if request.name:
            self.catalog.version(request.name, request.version)
        stats = self.manager.model_statistics(request.name or None)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- model-repository extension: load on the node, and unload ------------------------------

    async def _load(self, name: str, params: dict[str, Any]) -> None:
        """Parameters: "instances" resizes it; "keep_resident" (bool) sets whether the memory
        manager may evict it."""
        instances = params.get("instances")
        if instances is not None:
            if isinstance(instances, bool) or not isinstance(instances, int):
                raise InvalidInput("parameter 'instances' must be an int64")
            await self.manager.set_instances(name, instances)
        await self.manager.load(name, keep_resident=params.get("keep_resident"))

    @_rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Any) -> pb.RepositoryModelUnloadResponse:
        self.manager.check_token(_authorization(context))
        await self.manager.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- the system and CUDA shared-memory extensions ----------------------------------------

    @_rpc
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        resp = pb.SystemSharedMemoryStatusResponse()
        for r in self.shm.status(request.name or None):
            resp.regions[r.name].CopyFrom(resp.RegionStatus(name=r.name, key=r.key, offset=r.offset,
                                                            byte_size=r.byte_size))
        return resp

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.shm.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        resp = pb.CudaSharedMemoryStatusResponse()
        for r in self.shm.cuda_status(request.name or None):
            resp.regions[r.name].CopyFrom(resp.RegionStatus(name=r.name, device_id=r.device_id,
                                                            byte_size=r.byte_size))
        return resp

    @_rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.shm.cuda_register(request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.shm.cuda_unregister(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()


def _add_servicer(srv: grpc.aio.Server, servicer: InferenceServicer) -> None:
    """Every method of the service; inference takes and returns bytes (decoded off the loop)."""
    methods = pb.method_handlers(servicer, raw=("ModelInfer", "ModelStreamInfer"))
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.SERVICE.full_name, methods),))
    srv.add_registered_method_handlers(pb.SERVICE.full_name, methods)


class GrpcFrontEnd(FrontEnd):
    """gRPC of ``servicer`` (a node's ``NodeServicer``, a cluster gateway's
    ``InferenceServicer``) on ``config.host:config.frontends.grpc_port`` (0: a free port)."""

    def __init__(self, servicer: InferenceServicer, config: ServerConfig) -> None:
        self.servicer = servicer
        self.config = config
        self._server: grpc.aio.Server | None = None

    async def start(self) -> dict[str, Any]:
        cfg = self.config
        port_wanted = cfg.frontends.grpc_port or 0
        srv = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", cfg.frontends.max_upload_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),  # a port in use must fail here, not be shared silently
        ])
        _add_servicer(srv, self.servicer)
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        try:
            port = srv.add_insecure_port(f"{host}:{port_wanted}")
        except RuntimeError:
            port = 0
        if not port:
            await srv.stop(None)
            raise InvalidInput(f"cannot serve gRPC on {cfg.host}:{port_wanted} (in use or not allowed); "
                               "pick another with --grpc-port, 0 for any free port, -1 for none")
        await srv.start()
        self._server = srv
        log.info("gRPC (Open Inference Protocol v2) on %s:%d", cfg.host, port)
        return {"grpc_port": port}

    async def stop(self, grace_s: float) -> None:
        """Stop accepting calls; calls in flight get ``grace_s`` to finish."""
        srv, self._server = self._server, None
        if srv is not None:
            await srv.stop(grace_s)
