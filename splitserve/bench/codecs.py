"""Client processing time: what encoding a request and decoding its answer costs the client.

The clients do not time their own encode and decode steps, so the RPC-tax breakdown measures
them beside the calls, with the clients' own functions on the same input and an answer of the
same outputs worded as the server words it: the fast path (inputs to buffers, header pack,
outputs from the payload), HTTP (Open Inference Protocol v2 body, JSON or the binary tensor
extension) and gRPC (request message, protobuf serialisation and parsing). ``measure``
returns None when a client is not installed; its time then stays in "transport".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.transports import FAST_PATH
from splitserve.types import TensorSpec


@dataclass(frozen=True)
class CodecTiming:
    """Median seconds to encode one request and decode its answer, and how it was measured."""

    encode_s: float
    decode_s: float
    method: str

    @property
    def total_s(self) -> float:
        return self.encode_s + self.decode_s


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fast_path(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], x: Sequence[np.ndarray],
               y: Sequence[np.ndarray], reps: int) -> CodecTiming:
    from splitserve.client.common import ModelInfo, decode_outputs, encode_inputs
    from splitserve.client.frames import _request_header

    info = ModelInfo("m", 1, tuple(inputs), tuple(outputs), 1)
    arg = x[0] if len(x) == 1 else tuple(x)
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in y)

    def encode() -> None:
        arrays, _, _ = encode_inputs(info, arg)
        _request_header(info, 1, arrays, None, None, None)

    def decode() -> None:
        decode_outputs(info, payload, 1, False)

    return CodecTiming(_median_time(encode, reps), _median_time(decode, reps), "the fast-path client's functions")


def _http(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], x: Sequence[np.ndarray],
          y: Sequence[np.ndarray], reps: int, binary: bool) -> CodecTiming | None:
    try:
        from splitserve.client import http
        from splitserve.client.common import ModelInfo
        from splitserve.protocol import v2
    except ImportError:
        return None
    info = ModelInfo("m", 1, tuple(inputs), tuple(outputs), 1)
    arg = x[0] if len(x) == 1 else tuple(x)
    # the answer as the server words it: same outputs, same encoding, server timings attached
    parts, hlen = v2.build_infer_response("m", "1", v2.InferRequest(binary_output=binary),
                                          [(s.name, np.asarray(a)[None]) for s, a in zip(outputs, y)],
                                          {"queue_us": 1, "compute_us": 1, "total_us": 1})
    answer = b"".join(bytes(p) for p in parts)

    def encode() -> None:
        http._infer_body(info, arg, None, None, None, binary)

    def decode() -> None:
        resp = v2.parse_infer_response(answer, hlen)
        for s in outputs:
            resp.outputs[s.name][0]

    method = "the HTTP client's functions (" + ("binary tensor extension" if binary else "JSON") + ")"
    return CodecTiming(_median_time(encode, reps), _median_time(decode, reps), method)


def _grpc(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], x: Sequence[np.ndarray],
          y: Sequence[np.ndarray], reps: int) -> CodecTiming | None:
    try:
        from splitserve.client import grpc as grpc_client
        from splitserve.client.common import ModelInfo, encode_inputs
        from splitserve.protocol import grpc_api as pb
        from splitserve.protocol.v2 import tensor_to_bytes
    except ImportError:
        return None
    info = ModelInfo("m", 1, tuple(inputs), tuple(outputs), 1)
    arg = x[0] if len(x) == 1 else tuple(x)
    resp = pb.ModelInferResponse(model_name="m", model_version="1")
    for s, a in zip(outputs, y):
        arr = np.asarray(a)[None]
        resp.outputs.add(name=s.name, datatype=s.datatype, shape=arr.shape)
        resp.raw_output_contents.append(bytes(tensor_to_bytes(arr)))
    answer = resp.SerializeToString()

    def encode() -> None:
        arrays, _, _ = encode_inputs(info, arg)
        grpc_client.infer_request(info, arrays, None, None).SerializeToString()

    def decode() -> None:
        grpc_client.infer_result(pb.ModelInferResponse.FromString(answer), False)

    return CodecTiming(_median_time(encode, reps), _median_time(decode, reps),
                       "the gRPC client's functions and protobuf (de)serialisation")


def measure(transport: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
            x: Sequence[np.ndarray], y: Sequence[np.ndarray], reps: int = 200) -> CodecTiming | None:
    """Encode + decode time of one request of ``transport`` with inputs ``x`` and answer ``y``."""
    if transport in FAST_PATH:
        return _fast_path(inputs, outputs, x, y, reps)
    if transport in ("http-json", "http-binary"):
        return _http(inputs, outputs, x, y, reps, binary=transport == "http-binary")
    if transport == "grpc":
        return _grpc(inputs, outputs, x, y, reps)
    return None
