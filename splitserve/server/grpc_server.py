"""The gRPC front end: Open Inference Protocol v2 (``inference.GRPCInferenceService``) with
the model-repository and statistics extensions.

``GrpcFrontEnd`` is the front end the node starts when ``config.grpc_port`` is not None
and stops before it stops its models. The servicer runs on the node's own event loop
(grpc.aio). ``ModelInfer`` takes and returns raw message bytes, so that parsing the
message, converting its tensors to numpy arrays and encoding the answer run in the front
ends' codec threads, not on the loop the fast path shares; in between, the call runs
through the ``ServingAPI`` (the path every decoded front end shares). Management goes
through the node's ``ModelManager``, as HTTP's does.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from splitserve import __version__
from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput, PayloadTooLarge, SplitServeError
from splitserve.modelconfig import ModelConfig
from splitserve.protocol._generated import grpc_service_pb2 as pb
from splitserve.protocol._generated import grpc_service_pb2_grpc as pb_grpc
from splitserve.protocol.grpc_codec import (
    CONTENTS_FIELD, STATUS_KEY, fill_contents, param_value, params_dict, set_param, tensor_from_contents,
)
from splitserve.protocol.header import RequestClass
from splitserve.protocol.v2 import (
    deadline_seconds, infer_body_limit, model_inputs, tensor_from_bytes, tensor_to_bytes,
)
from splitserve.server.frontends import CodecPool
from splitserve.server.management import ModelManager
from splitserve.server.ports import FrontEnd, ServingAPI

log = logging.getLogger(__name__)

EXTENSIONS = ("model_repository", "statistics")

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def _rpc(fn: Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]) -> Callable[..., Awaitable[_Resp]]:
    """Turn splitserve errors into gRPC status codes, with the message as the details."""

    @functools.wraps(fn)
    async def handler(self: "InferenceServicer", request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        try:
            return await fn(self, request, context)
        except SplitServeError as e:
            await context.abort(grpc.StatusCode[e.grpc_code], e.message,
                                trailing_metadata=((STATUS_KEY, str(int(e.status))),))
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{fn.__name__} timed out inside the server")
        except Exception:  # a bug: log it, answer INTERNAL with a reference to the log, keep serving
            ref = secrets.token_hex(6)
            log.exception("gRPC %s failed (reference %s)", fn.__name__, ref)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (reference {ref} in the server log)")
        raise AssertionError("context.abort returned")  # pragma: no cover

    return handler


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


def _call_options(params: dict[str, Any]) -> tuple[RequestClass, float | None]:
    """The request class and deadline (seconds) from the parameters "class" and "deadline_ms"."""
    try:
        cls = RequestClass.parse(params.get("class"))
    except InvalidInput as e:
        raise InvalidInput(f"parameter 'class': {e.message}") from None
    return cls, deadline_seconds(params.get("deadline_ms"))


def decode_inputs(cfg: ModelConfig, request: pb.ModelInferRequest) -> list[np.ndarray]:
    """The request's input tensors as arrays in the model's declared order, fully checked."""
    raw = request.raw_input_contents
    if raw:
        if len(raw) != len(request.inputs):
            raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
        typed = [t.name for t in request.inputs if t.HasField("contents")]
        if typed:
            raise InvalidInput(f"input {typed[0]!r} has typed contents next to raw_input_contents; "
                               "use one or the other")
    given: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for i, t in enumerate(request.inputs):
        if t.name in given:
            raise InvalidInput(f"input {t.name!r} of {cfg.name!r} is given twice")
        if raw:
            given[t.name] = tensor_from_bytes(t.name, t.datatype, tuple(t.shape), raw[i])
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


def _decode_call(cfg: ModelConfig, request: pb.ModelInferRequest) -> tuple[list[np.ndarray], list[str], RequestClass,
                                                                          float | None]:
    """Inputs, wanted outputs, class and deadline of a ModelInfer call (runs in a codec thread)."""
    arrays = decode_inputs(cfg, request)
    declared = [o.name for o in cfg.outputs]
    wanted = [o.name for o in request.outputs] or declared
    for n in wanted:
        if n not in declared:
            raise InvalidInput(f"model {cfg.name!r} has no output {n!r}; its outputs are {', '.join(declared)}")
    cls, deadline_s = _call_options(params_dict(request.parameters))
    return arrays, wanted, cls, deadline_s


def _encode_response(cfg: ModelConfig, request: pb.ModelInferRequest, wanted: list[str], outputs: list[np.ndarray],
                     timings: dict[str, int]) -> bytes:
    """The serialized ModelInferResponse (runs in a codec thread when large)."""
    resp = pb.ModelInferResponse(model_name=cfg.name, model_version=str(cfg.version), id=request.id)
    typed = not request.raw_input_contents and all(o.datatype in CONTENTS_FIELD for o in cfg.outputs)
    for spec, arr in zip(cfg.outputs, outputs):
        if spec.name not in wanted:
            continue
        t = resp.outputs.add(name=spec.name, datatype=spec.datatype, shape=arr.shape)
        if typed:
            fill_contents(t.contents, arr, spec.datatype)
        else:
            resp.raw_output_contents.append(bytes(tensor_to_bytes(arr)))
    for k, v in timings.items():
        set_param(resp.parameters, k, v)
    return resp.SerializeToString()


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Stateless apart from the node it serves; per-call state lives in each call."""

    def __init__(self, api: ServingAPI, manager: ModelManager, codec: CodecPool, config: ServerConfig) -> None:
        self.api = api
        self.manager = manager
        self.codec = codec
        self.config = config

    def _config(self, name: str, version: str = "") -> ModelConfig:
        """A registered model's config; a version, if given, must be the one registered."""
        return self.manager.record(name, version).config

    # -- health and metadata -----------------------------------------------------------

    @_rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.api.ready())

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        self._config(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.api.model_ready(request.name))

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="splitserve", version=__version__, extensions=EXTENSIONS)

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        cfg = self._config(request.name, request.version)
        meta = dict(self.manager.model_metadata(request.name))
        extra = meta.pop("parameters", None) or {}
        resp = json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)
        rec = self.manager.record(request.name)
        extra = {**extra, "func_id": rec.func_id, "max_batch_size": cfg.max_batch_size,
                 "default_class": cfg.default_class, "state": self.api.model_state(request.name)}
        for k, v in extra.items():
            if isinstance(v, (bool, int, float, str)):
                set_param(resp.parameters, k, v)
        return resp

    # -- inference ---------------------------------------------------------------------

    @_rpc
    async def ModelInfer(self, message: bytes, context: Any) -> bytes:
        """Registered without (de)serializers: ``message`` is the raw ModelInferRequest."""
        codec, size = self.codec, len(message)
        async with codec.admit(size):
            request = await codec.run(size, _parse_infer, message)
            cfg = self._config(request.model_name, request.model_version)
            limit = infer_body_limit(cfg.inputs, cfg.max_batch_size, self.config.json_chars_per_value)
            if size > limit:
                raise PayloadTooLarge(f"the message of {size} bytes exceeds model {cfg.name!r}'s limit of {limit} "
                                      f"bytes (max_batch_size {cfg.max_batch_size} samples of its inputs)")
            arrays, wanted, cls, deadline_s = await codec.run(size, _decode_call, cfg, request)
        out = await self.api.infer(cfg.name, arrays, cls, deadline_s)
        timings = {"queue_us": out.queue_us, "compute_us": out.compute_us, "total_us": out.total_us}
        # typed contents take up to ~8 bytes a value once serialized
        nbytes = sum(a.nbytes for a in out.outputs) * (1 if request.raw_input_contents else 8)
        return await codec.run(nbytes, _encode_response, cfg, request, wanted, out.outputs, timings)

    # -- statistics extension ------------------------------------------------------------

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        if request.name:
            self._config(request.name, request.version)
        stats = self.manager.model_statistics(request.name or None)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- model-repository extension --------------------------------------------------------

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        resp = pb.RepositoryIndexResponse()
        for m in self.manager.repository_index(ready_only=request.ready):
            resp.models.add(name=str(m["name"]), version=str(m.get("version") or ""), state=str(m.get("state") or ""),
                            reason=str(m.get("reason") or ""))
        return resp

    @_rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Any) -> pb.RepositoryModelLoadResponse:
        """Load a registered model. Parameters: "config" (TOML) registers it first, with a
        "file:<name>" (bytes) parameter as its artifact and "labels"; "instances" resizes it;
        "keep_resident" (bool) sets whether the memory manager may evict it."""
        self.manager.check_token(_authorization(context))
        params = {k: param_value(v) for k, v in request.parameters.items()}
        name = request.model_name
        config_toml = params.get("config")
        if config_toml is not None:
            if not isinstance(config_toml, str):
                raise InvalidInput("parameter 'config' must be a string holding the model's config.toml")
            files = [v for k, v in params.items() if k.startswith("file:")]
            if len(files) > 1:
                raise InvalidInput("give at most one 'file:<name>' parameter: the model's artifact")
            if files and not isinstance(files[0], bytes):
                raise InvalidInput("a 'file:<name>' parameter must hold bytes")
            labels = params.get("labels")
            if labels is not None and not isinstance(labels, str):
                raise InvalidInput("parameter 'labels' must be a string, one label per line")
            declared = ModelConfig.from_toml(config_toml).name
            if name and name != declared:
                raise InvalidInput(f"config.toml names the model {declared!r}, but model_name is {name!r}")
            rec = await self.manager.register(config_toml, files[0] if files else None, labels)
            name = rec.name
        instances = params.get("instances")
        if instances is not None:
            if isinstance(instances, bool) or not isinstance(instances, int):
                raise InvalidInput("parameter 'instances' must be an int64")
            await self.manager.set_instances(name, instances)
        await self.manager.load(name, keep_resident=params.get("keep_resident"))
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Any) -> pb.RepositoryModelUnloadResponse:
        self.manager.check_token(_authorization(context))
        await self.manager.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


class _Handlers:
    """Catches what the generated ``add_..._to_server`` registers, so one method can be swapped."""

    def __init__(self) -> None:
        self.service = ""
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, methods: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.methods = service, dict(methods)


def _add_servicer(srv: grpc.aio.Server, servicer: InferenceServicer) -> None:
    """The generated handlers, with ModelInfer taking and returning bytes (decoded off the loop)."""
    h = _Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, h)
    h.methods["ModelInfer"] = grpc.unary_unary_rpc_method_handler(servicer.ModelInfer)
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(h.service, h.methods),))
    srv.add_registered_method_handlers(h.service, h.methods)


class GrpcFrontEnd(FrontEnd):
    """gRPC on ``config.host:config.grpc_port`` (0: a free port)."""

    def __init__(self, api: ServingAPI, manager: ModelManager, codec: CodecPool, config: ServerConfig) -> None:
        self.servicer = InferenceServicer(api, manager, codec, config)
        self.config = config
        self._server: grpc.aio.Server | None = None

    async def start(self) -> dict[str, Any]:
        cfg = self.config
        port_wanted = cfg.grpc_port or 0
        srv = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", cfg.max_upload_bytes),
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
