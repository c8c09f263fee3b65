"""Third-party clients behind the benchmark's client face (``infer_result(model, x)``).

``bench peers`` drives every v2 server, splitserve's HTTP and gRPC front ends included, with
the same ``tritonclient`` calls a Triton user makes (binary tensors over HTTP), and Ray Serve
with plain ``httpx`` posts of the raw sample bytes. A result carries the outputs by name and
zeros for the server timings that these protocols do not report. (The benchmark imports this
module through ``transports``, which reports a missing client package as unavailable.) Each client reads a model's
input and output names once, from the server's v2 metadata, as a Triton user's client does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import tritonclient.grpc
import tritonclient.grpc.aio
import tritonclient.http
import tritonclient.http.aio
from tritonclient.utils import np_to_triton_dtype

# client kinds, by the benchmark's transport name
TRITON_HTTP = "tritonclient-http"
TRITON_GRPC = "tritonclient-grpc"
RAW_HTTP = "httpx-raw"
CLIENTS: tuple[str, ...] = (TRITON_HTTP, TRITON_GRPC, RAW_HTTP)
# What Ray Serve's deployment answers with: one sample's logits as raw bytes of this dtype.
RAW_OUTPUT_DTYPE = np.float32


@dataclass
class PeerResult:
    """One answer: outputs by name (batch dimension dropped); no server timings (all 0)."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    queue_us: float = 0.0
    compute_us: float = 0.0
    total_us: float = 0.0


def _hostport(url: str) -> str:
    # tritonclient takes host:port without a scheme
    return url.split("://", 1)[-1].rstrip("/")


@dataclass(frozen=True)
class _Names:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def _names(meta: Any) -> _Names:
    # HTTP metadata is a dict, gRPC's a protobuf message: both have inputs/outputs with a name
    get = (lambda m, k: m[k]) if isinstance(meta, dict) else getattr
    return _Names(tuple(get(t, "name") for t in get(meta, "inputs")),
                  tuple(get(t, "name") for t in get(meta, "outputs")))


def _samples(x: np.ndarray | tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return x if isinstance(x, tuple) else (x,)


class _Triton:
    """What the tritonclient HTTP and gRPC clients, blocking and asyncio, share."""

    MODULE: Any = None  # the tritonclient module a subclass speaks through

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        self._mod = self.MODULE
        self._grpc = self._mod in (tritonclient.grpc, tritonclient.grpc.aio)
        self._names: dict[str, _Names] = {}
        if self._grpc:
            kw: dict[str, Any] = {}
        elif self._mod is tritonclient.http.aio:
            kw = {"conn_timeout": timeout}
        else:
            kw = {"connection_timeout": timeout, "network_timeout": timeout}
        self.client = self._mod.InferenceServerClient(_hostport(url), **kw)

    def _request(self, names: _Names, x: np.ndarray | tuple[np.ndarray, ...]) -> dict[str, Any]:
        inputs = []
        for name, a in zip(names.inputs, _samples(x)):
            a = np.ascontiguousarray(a)[None]
            t = self._mod.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a, **({} if self._grpc else {"binary_data": True}))
            inputs.append(t)
        outputs = [self._mod.InferRequestedOutput(n, **({} if self._grpc else {"binary_data": True}))
                   for n in names.outputs]
        return {"inputs": inputs, "outputs": outputs}

    @staticmethod
    def _result(names: _Names, r: Any) -> PeerResult:
        return PeerResult({n: r.as_numpy(n)[0] for n in names.outputs})


class _BlockingTriton(_Triton):
    def infer_result(self, model: str, x: np.ndarray | tuple[np.ndarray, ...]) -> PeerResult:
        names = self._names.get(model)
        if names is None:
            names = self._names[model] = _names(self.client.get_model_metadata(model))
        return self._result(names, self.client.infer(model, **self._request(names, x)))

    def close(self) -> None:
        self.client.close()


class _AsyncTriton(_Triton):
    async def infer_result(self, model: str, x: np.ndarray | tuple[np.ndarray, ...]) -> PeerResult:
        names = self._names.get(model)
        if names is None:
            names = self._names[model] = _names(await self.client.get_model_metadata(model))
        return self._result(names, await self.client.infer(model, **self._request(names, x)))

    async def close(self) -> None:
        await self.client.close()


class TritonHttpClient(_BlockingTriton):
    """``tritonclient.http``, binary tensors."""

    MODULE = tritonclient.http


class AsyncTritonHttpClient(_AsyncTriton):
    """``tritonclient.http.aio``, binary tensors."""

    MODULE = tritonclient.http.aio


class TritonGrpcClient(_BlockingTriton):
    """``tritonclient.grpc``."""

    MODULE = tritonclient.grpc


class AsyncTritonGrpcClient(_AsyncTriton):
    """``tritonclient.grpc.aio``."""

    MODULE = tritonclient.grpc.aio


def _raw_body(x: np.ndarray | tuple[np.ndarray, ...]) -> bytes:
    (a,) = _samples(x)  # Ray Serve's deployment takes one input tensor
    return np.ascontiguousarray(a).tobytes()


def _raw_result(content: bytes) -> PeerResult:
    return PeerResult({"output": np.frombuffer(content, RAW_OUTPUT_DTYPE)})


class RawHttpClient:
    """Plain HTTP (``httpx``): POST one sample's bytes to ``/<model>``, raw output bytes back."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        self.client = httpx.Client(base_url=url, timeout=timeout)

    def infer_result(self, model: str, x: np.ndarray | tuple[np.ndarray, ...]) -> PeerResult:
        r = self.client.post(f"/{model}", content=_raw_body(x))
        r.raise_for_status()
        return _raw_result(r.content)

    def close(self) -> None:
        self.client.close()


class AsyncRawHttpClient:
    """``RawHttpClient`` over ``httpx.AsyncClient``."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=timeout)

    async def infer_result(self, model: str, x: np.ndarray | tuple[np.ndarray, ...]) -> PeerResult:
        r = await self.client.post(f"/{model}", content=_raw_body(x))
        r.raise_for_status()
        return _raw_result(r.content)

    async def close(self) -> None:
        await self.client.aclose()


def classes(kind: str) -> tuple[type, type]:
    """(blocking class, asyncio class) of client ``kind``, each built as ``cls(url, timeout)``."""
    if kind == TRITON_HTTP:
        return TritonHttpClient, AsyncTritonHttpClient
    if kind == TRITON_GRPC:
        return TritonGrpcClient, AsyncTritonGrpcClient
    if kind == RAW_HTTP:
        return RawHttpClient, AsyncRawHttpClient
    raise ValueError(f"unknown client {kind!r}; use one of {', '.join(CLIENTS)}")
