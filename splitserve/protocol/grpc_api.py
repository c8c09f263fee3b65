"""The Open Inference Protocol v2 gRPC service (``inference.GRPCInferenceService``): its
message classes, a client stub and the server's method handlers, built at import from
``grpc_service.proto``'s descriptor (``_generated/grpc_service_descriptor.py``, made by
``scripts/gen_grpc.sh``).

Why not protoc's generated ``_pb2`` modules: they refuse to load under a protobuf runtime
older than the one that generated them, and they register ``grpc_service.proto`` and the
``inference.*`` messages in protobuf's default descriptor pool, where tritonclient and
kserve register theirs, so importing both in one process fails with "duplicate file name".
Here the descriptor goes into a pool of its own, and the classes come from protobuf's
public ``message_factory``; the method paths clients call come from the proto's package and
service names, so the wire is unchanged.

Messages are attributes of this module: ``grpc_api.ModelInferRequest(model_name="m")``;
nested ones hang off their parent (``ModelInferRequest.InferInputTensor``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import EnumDescriptor, MethodDescriptor
from google.protobuf.message import Message

from splitserve.protocol._generated.grpc_service_descriptor import SERIALIZED_FILE

__all__ = ["FILE", "POOL", "SERVICE", "Stub", "enum", "method_handlers", "method_path"]

POOL = descriptor_pool.DescriptorPool()
POOL.AddSerializedFile(SERIALIZED_FILE)
FILE = POOL.FindFileByName("grpc_service.proto")
SERVICE = FILE.services_by_name["GRPCInferenceService"]

_MESSAGES: dict[str, type[Message]] = {
    name: message_factory.GetMessageClass(d) for name, d in FILE.message_types_by_name.items()
}

# (client streams, server streams) -> the name of grpc's channel method and handler factory.
_CARDINALITY = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def __getattr__(name: str) -> type[Message]:
    """A top-level message class of the service's proto, by its proto name."""
    try:
        return _MESSAGES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def enum(name: str) -> EnumDescriptor:
    """A top-level enum of the proto (``DataType``)."""
    return FILE.enum_types_by_name[name]


def method_path(method: MethodDescriptor) -> str:
    """The path a client calls: ``/inference.GRPCInferenceService/ModelInfer``."""
    return f"/{SERVICE.full_name}/{method.name}"


def _io(method: MethodDescriptor) -> tuple[type[Message], type[Message]]:
    return (message_factory.GetMessageClass(method.input_type),
            message_factory.GetMessageClass(method.output_type))


class Stub:
    """A client of the service: one multi-callable per method, named as in the proto
    (``Stub(channel).ModelInfer(request)``), for a sync or an asyncio channel."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        for m in SERVICE.methods:
            request, response = _io(m)
            make = getattr(channel, _CARDINALITY[(m.client_streaming, m.server_streaming)])
            setattr(self, m.name, make(method_path(m), request_serializer=request.SerializeToString,
                                       response_deserializer=response.FromString))

    def __getattr__(self, name: str) -> Any:  # the methods set in __init__, for type checkers
        raise AttributeError(f"the service has no method {name!r}")


def method_handlers(servicer: object, raw: Collection[str] = ()) -> dict[str, grpc.RpcMethodHandler]:
    """The server's handler of every method, each calling ``servicer``'s attribute of the
    method's name; the methods named in ``raw`` take and return serialized messages (bytes),
    so that the servicer can parse and encode them off the event loop. A method the
    servicer lacks gets no handler, so gRPC answers its calls UNIMPLEMENTED."""
    out = {}
    for m in SERVICE.methods:
        fn: Callable[..., Any] | None = getattr(servicer, m.name, None)
        if fn is None:
            continue
        make = getattr(grpc, _CARDINALITY[(m.client_streaming, m.server_streaming)] + "_rpc_method_handler")
        if m.name in raw:
            out[m.name] = make(fn)
        else:
            request, response = _io(m)
            out[m.name] = make(fn, request_deserializer=request.FromString,
                               response_serializer=response.SerializeToString)
    return out
