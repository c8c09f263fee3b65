"""What every client transport shares: URLs, model info, input encoding, output decoding."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np

from splitserve.errors import InvalidInput
from splitserve.types import TensorSpec

SCHEMES = ("tcp", "unix", "udp", "http", "grpc")


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str = "127.0.0.1"
    port: int = 0
    path: str = ""

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        u = urlparse(url)
        if u.scheme not in SCHEMES:
            raise InvalidInput(f"URL {url!r}: scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
        if u.scheme == "unix":
            path = (u.netloc + u.path) or ""
            if not path:
                raise InvalidInput(f"URL {url!r}: give the socket path, e.g. unix:///tmp/splitserve.sock")
            return cls("unix", path=path)
        if not u.port:
            raise InvalidInput(f"URL {url!r}: give a port, e.g. {u.scheme}://127.0.0.1:8100")
        return cls(u.scheme, u.hostname or "127.0.0.1", u.port, u.path)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    func_id: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: "bytes | str | dict") -> "ModelInfo":
        d = body if isinstance(body, dict) else json.loads(body)
        return cls(d["name"], int(d.get("func_id", 0)), tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_dict(t) for t in d["outputs"]), int(d.get("max_batch_size", 1)), d)


@dataclass
class InferResult:
    """Outputs by name plus what the server said about its own time."""

    outputs: dict[str, np.ndarray]
    queue_us: int = 0
    compute_us: int = 0
    total_us: int = 0

    def value(self) -> "np.ndarray | dict[str, np.ndarray]":
        """The single output, or the dict when the model has several."""
        return next(iter(self.outputs.values())) if len(self.outputs) == 1 else self.outputs


InputArg = "np.ndarray | Sequence[np.ndarray] | Mapping[str, np.ndarray]"


def encode_inputs(info: ModelInfo, x: Any) -> tuple[list[np.ndarray], int, bool]:
    """Arrays in declared order, the sample count, and whether the caller gave a batch dim.

    Dtypes must match exactly: a silent cast would hide a client bug.
    """
    if isinstance(x, Mapping):
        missing = [t.name for t in info.inputs if t.name not in x]
        if missing:
            raise InvalidInput(f"model {info.name!r}: missing inputs {missing}")
        arrays = [x[t.name] for t in info.inputs]
    elif isinstance(x, (list, tuple)):
        arrays = list(x)
    else:
        arrays = [x]
    if len(arrays) != len(info.inputs):
        raise InvalidInput(f"model {info.name!r} takes {len(info.inputs)} inputs, got {len(arrays)}")
    out = []
    count = None
    batched = False
    for a, spec in zip(arrays, info.inputs):
        a = np.asarray(a)
        if a.dtype != spec.dtype:
            raise InvalidInput(f"input {spec.name!r} of {info.name!r} must be {spec.datatype} ({spec.dtype}), got {a.dtype}")
        if a.shape == spec.shape:
            n, a = 1, a.reshape((1, *spec.shape))
        elif a.shape[1:] == spec.shape:
            n, batched = a.shape[0], True
        else:
            raise InvalidInput(f"input {spec.name!r} of {info.name!r} must have shape {list(spec.shape)} "
                               f"or [n, {', '.join(map(str, spec.shape))}], got {list(a.shape)}")
        if count is not None and n != count:
            raise InvalidInput(f"inputs of {info.name!r} disagree on the batch size ({count} vs {n})")
        count = n
        out.append(np.ascontiguousarray(a))
    return out, count or 1, batched


def decode_outputs(info: ModelInfo, payload: "bytes | bytearray | memoryview", count: int, batched: bool) -> dict[str, np.ndarray]:
    outs = {}
    off = 0
    for spec in info.outputs:
        n = spec.nbytes * count
        a = np.frombuffer(payload, dtype=spec.dtype, count=spec.numel * count, offset=off).reshape((count, *spec.shape))
        outs[spec.name] = a if batched else a[0]
        off += n
    if off != len(payload):
        raise InvalidInput(f"response of {len(payload)} B does not match the {off} B that {info.name!r} declares")
    return outs
