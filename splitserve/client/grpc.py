"""gRPC clients (Open Inference Protocol v2) for ``grpc://host:port``, sync and asyncio.

Same ``lookup`` / ``infer`` / ``infer_result`` API as the fast-path clients. Inputs travel
as ``raw_input_contents``; the server's timings come back as the response parameters
``queue_us``, ``compute_us`` and ``total_us``. Errors are raised as the same
``SplitServeError`` subclasses the fast path raises (the server sends the exact status in
the trailing metadata ``splitserve-status``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from splitserve.client.common import Endpoint, InferResult, ModelInfo, encode_inputs, target_ms
from splitserve.errors import InvalidInput, SplitServeError, Status, error_for_status
from splitserve.protocol import grpc_api as pb
from splitserve.protocol.grpc_codec import STATUS_KEY, params_dict, set_param, set_repo_param, tensor_from_contents
from splitserve.protocol.header import RequestClass
from splitserve.protocol.v2 import tensor_from_bytes, tensor_to_bytes
from splitserve.types import TensorSpec

_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
# gRPC codes without a splitserve status (a peer that is not splitserve, or the transport).
_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: Status.UNKNOWN_MODEL,
    grpc.StatusCode.INVALID_ARGUMENT: Status.INVALID_INPUT,
    grpc.StatusCode.UNAUTHENTICATED: Status.UNAUTHORIZED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status.REFUSED,
    grpc.StatusCode.ALREADY_EXISTS: Status.DUPLICATE_REQUEST,
}


def _target(url: str) -> str:
    ep = Endpoint.parse(url)
    if ep.scheme != "grpc":
        raise InvalidInput(f"URL {url!r}: the gRPC client speaks grpc://host:port")
    return f"[{ep.host}]:{ep.port}" if ":" in ep.host else f"{ep.host}:{ep.port}"


def _auth(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def translate_error(e: grpc.RpcError) -> Exception:
    """The splitserve error (or ConnectionError / TimeoutError) that a failed call stands for."""
    code, details = e.code(), e.details() or ""
    for key, value in e.trailing_metadata() or ():
        if key == STATUS_KEY:
            return error_for_status(int(value), details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"no answer in time: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"gRPC server unavailable: {details}")
    if code in _BY_CODE:
        return error_for_status(_BY_CODE[code], details)
    return SplitServeError(f"{code.name}: {details}")


def model_info(resp: pb.ModelMetadataResponse) -> ModelInfo:
    """ModelInfo from a ModelMetadata answer (the batch dimension, -1, is dropped)."""
    params = params_dict(resp.parameters)
    max_batch = int(params.get("max_batch_size", 1))

    def spec(t: pb.ModelMetadataResponse.TensorMetadata) -> TensorSpec:
        shape = tuple(t.shape)
        if shape and shape[0] == -1:
            shape = shape[1:]
        return TensorSpec(t.name, t.datatype.upper(), shape)

    extra = json_format.MessageToDict(resp, preserving_proto_field_name=True)
    return ModelInfo(resp.name, int(params.get("func_id", 0)), tuple(spec(t) for t in resp.inputs),
                     tuple(spec(t) for t in resp.outputs), max_batch, extra)


def infer_request(info: ModelInfo, arrays: Sequence[np.ndarray], cls: Any, deadline_ms: float | None,
                  outputs: Sequence[str] = (), slo_ms: float | None = None) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=info.name)
    for spec, a in zip(info.inputs, arrays):
        req.inputs.add(name=spec.name, datatype=spec.datatype, shape=a.shape)
        req.raw_input_contents.append(bytes(tensor_to_bytes(a)))
    for name in outputs:
        req.outputs.add(name=name)
    c = RequestClass.parse(cls)
    if c != RequestClass.DEFAULT:
        set_param(req.parameters, "class", "rt" if c == RequestClass.RT else "be")
    for name, value in (("deadline_ms", deadline_ms), ("slo_ms", slo_ms)):
        if value is not None:
            set_param(req.parameters, name, target_ms(value, name))
    return req


def infer_result(resp: pb.ModelInferResponse, batched: bool) -> InferResult:
    """Outputs by name (batch dimension dropped when the caller gave none) and the timings."""
    outs: dict[str, np.ndarray] = {}
    raw = resp.raw_output_contents
    if raw and len(raw) != len(resp.outputs):
        raise InvalidInput(f"response has {len(raw)} raw_output_contents for {len(resp.outputs)} outputs")
    for i, t in enumerate(resp.outputs):
        if raw:  # a writable copy, as the fast path's outputs are
            a = tensor_from_bytes(t.name, t.datatype, tuple(t.shape), raw[i]).copy()
        else:
            a = tensor_from_contents(t.name, t.datatype, tuple(t.shape), t.contents)
        outs[t.name] = a if batched else a[0]
    p = params_dict(resp.parameters)
    return InferResult(outs, int(p.get("queue_us", 0)), int(p.get("compute_us", 0)), int(p.get("total_us", 0)))


def load_request(model: str, config_toml: str | None, artifact: bytes | None, artifact_name: str,
                 labels: str | None, instances: int | None) -> pb.RepositoryModelLoadRequest:
    req = pb.RepositoryModelLoadRequest(model_name=model)
    if config_toml is not None:
        set_repo_param(req.parameters, "config", config_toml)
    if artifact is not None:
        set_repo_param(req.parameters, f"file:{artifact_name}", artifact)
    if labels is not None:
        set_repo_param(req.parameters, "labels", labels)
    if instances is not None:
        set_repo_param(req.parameters, "instances", int(instances))
    return req


def _index(resp: pb.RepositoryIndexResponse) -> list[dict[str, str]]:
    return [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in resp.models]


def _stats(resp: pb.ModelStatisticsResponse) -> dict[str, Any]:
    return json_format.MessageToDict(resp, preserving_proto_field_name=True)


class GrpcPendingCall:
    """A call in flight on a ``GrpcClient``; ``result()`` waits for its ``InferResult``."""

    def __init__(self, future: Any, batched: bool) -> None:
        self._future = future
        self._batched = batched

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> InferResult:
        try:
            resp = self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError("no answer to the gRPC call yet") from None
        except grpc.RpcError as e:
            raise translate_error(e) from None
        return infer_result(resp, self._batched)


class GrpcClient:
    """Synchronous gRPC client for ``grpc://host:port``; thread-safe (one channel)."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None) -> None:
        self.endpoint = Endpoint.parse(url)
        self.timeout = timeout
        self.token = token
        self.channel = grpc.insecure_channel(_target(url), options=_OPTIONS)
        self.stub = pb.Stub(self.channel)
        self._models: dict[str, ModelInfo] = {}
        self.closed = False

    def _call(self, method: str, request: Any, metadata: Any = None) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise translate_error(e) from None

    # -- the shared client API ---------------------------------------------------------

    def lookup(self, model: str) -> ModelInfo:
        """The model's shapes and datatypes, from ModelMetadata (cached)."""
        info = self._models.get(model)
        if info is None:
            info = self._models[model] = model_info(self._call("ModelMetadata", pb.ModelMetadataRequest(name=model)))
        return info

    def submit(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
               slo_ms: float | None = None) -> GrpcPendingCall:
        """Send a call and return at once; ``.result()`` gives an ``InferResult``."""
        info = self.lookup(model)
        arrays, _, batched = encode_inputs(info, x)
        fut = self.stub.ModelInfer.future(infer_request(info, arrays, cls, deadline_ms, slo_ms=slo_ms),
                                         timeout=self.timeout)
        return GrpcPendingCall(fut, batched)

    def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                     slo_ms: float | None = None) -> InferResult:
        info = self.lookup(model)
        arrays, _, batched = encode_inputs(info, x)
        request = infer_request(info, arrays, cls, deadline_ms, slo_ms=slo_ms)
        return infer_result(self._call("ModelInfer", request), batched)

    def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        """numpy in, numpy out: the single output, or a dict of outputs."""
        return self.infer_result(model, x, **kw).value()

    # -- health, metadata, statistics ---------------------------------------------------

    def live(self) -> bool:
        return self._call("ServerLive", pb.ServerLiveRequest()).live

    def ready(self) -> bool:
        return self._call("ServerReady", pb.ServerReadyRequest()).ready

    def model_ready(self, model: str) -> bool:
        return self._call("ModelReady", pb.ModelReadyRequest(name=model)).ready

    def server_metadata(self) -> dict[str, Any]:
        return json_format.MessageToDict(self._call("ServerMetadata", pb.ServerMetadataRequest()),
                                         preserving_proto_field_name=True)

    def statistics(self, model: str | None = None) -> dict[str, Any]:
        """Triton-shaped statistics: ``{"model_stats": [...]}``."""
        return _stats(self._call("ModelStatistics", pb.ModelStatisticsRequest(name=model or "")))

    # -- management (model-repository extension) -------------------------------------------

    def index(self, ready_only: bool = False, token: str | None = None) -> list[dict[str, str]]:
        req = pb.RepositoryIndexRequest(ready=ready_only)
        return _index(self._call("RepositoryIndex", req, _auth(token or self.token)))

    def load(self, model: str, token: str | None = None, *, config_toml: str | None = None,
             artifact: bytes | None = None, artifact_name: str = "model.pt", labels: str | None = None,
             instances: int | None = None) -> None:
        """Load a model; with ``config_toml`` (and ``artifact``) register it first."""
        req = load_request(model, config_toml, artifact, artifact_name, labels, instances)
        self._call("RepositoryModelLoad", req, _auth(token or self.token))
        self._models.pop(model, None)

    def unload(self, model: str, token: str | None = None) -> None:
        self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model),
                   _auth(token or self.token))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.channel.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient:
    """asyncio gRPC client (grpc.aio) for ``grpc://host:port``: many calls in flight."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None) -> None:
        self.endpoint = Endpoint.parse(url)
        self._target = _target(url)
        self.timeout = timeout
        self.token = token
        self.channel: grpc.aio.Channel | None = None
        self._models: dict[str, ModelInfo] = {}

    async def connect(self) -> "AsyncGrpcClient":
        """Open the channel (on the running loop)."""
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(self._target, options=_OPTIONS)
            self.stub = pb.Stub(self.channel)
        return self

    async def __aenter__(self) -> "AsyncGrpcClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def _call(self, method: str, request: Any, metadata: Any = None) -> Any:
        if self.channel is None:
            await self.connect()
        try:
            return await getattr(self.stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise translate_error(e) from None

    async def lookup(self, model: str) -> ModelInfo:
        info = self._models.get(model)
        if info is None:
            resp = await self._call("ModelMetadata", pb.ModelMetadataRequest(name=model))
            info = self._models[model] = model_info(resp)
        return info

    async def infer_result(self, model: str, x: Any, *, cls: Any = None,
                           deadline_ms: float | None = None, slo_ms: float | None = None) -> InferResult:
        info = await self.lookup(model)
        arrays, _, batched = encode_inputs(info, x)
        request = infer_request(info, arrays, cls, deadline_ms, slo_ms=slo_ms)
        return infer_result(await self._call("ModelInfer", request), batched)

    async def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        return (await self.infer_result(model, x, **kw)).value()

    async def live(self) -> bool:
        return (await self._call("ServerLive", pb.ServerLiveRequest())).live

    async def ready(self) -> bool:
        return (await self._call("ServerReady", pb.ServerReadyRequest())).ready

    async def model_ready(self, model: str) -> bool:
        return (await self._call("ModelReady", pb.ModelReadyRequest(name=model))).ready

    async def statistics(self, model: str | None = None) -> dict[str, Any]:
        return _stats(await self._call("ModelStatistics", pb.ModelStatisticsRequest(name=model or "")))

    async def index(self, ready_only: bool = False, token: str | None = None) -> list[dict[str, str]]:
        req = pb.RepositoryIndexRequest(ready=ready_only)
        return _index(await self._call("RepositoryIndex", req, _auth(token or self.token)))

    async def load(self, model: str, token: str | None = None, *, config_toml: str | None = None,
                   artifact: bytes | None = None, artifact_name: str = "model.pt", labels: str | None = None,
                   instances: int | None = None) -> None:
        req = load_request(model, config_toml, artifact, artifact_name, labels, instances)
        await self._call("RepositoryModelLoad", req, _auth(token or self.token))
        self._models.pop(model, None)

    async def unload(self, model: str, token: str | None = None) -> None:
        await self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model),
                         _auth(token or self.token))
