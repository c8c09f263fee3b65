"""What every client transport shares: URLs, model info, input encoding, output decoding."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
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

    # Worked out once per model rather than per call (a spec's dtype is looked up by name
    # each time it is asked for): what encoding and decoding check and slice by.
    @cached_property
    def input_layout(self) -> tuple[tuple[np.dtype, tuple[int, ...]], ...]:
        """(dtype, shape) of each input, in declared order."""
        return tuple((t.dtype, t.shape) for t in self.inputs)

    @cached_property
    def output_layout(self) -> tuple[tuple[str, np.dtype, int, tuple[int, ...]], ...]:
        """(name, dtype, elements per sample, shape) of each output, in payload order."""
        return tuple((t.name, t.dtype, t.numel, t.shape) for t in self.outputs)

    @cached_property
    def output_nbytes(self) -> int:
        """Bytes of one sample's outputs: an answer's payload is this times the sample count."""
        return sum(t.nbytes for t in self.outputs)


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
    kind = type(x)
    if kind is np.ndarray:  # the usual forms first, by exact type: a Mapping check is an ABC's
        arrays = [x]
    elif kind is list or kind is tuple:
        arrays = x
    elif isinstance(x, Mapping):
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
    for a, spec, (dtype, shape) in zip(arrays, info.inputs, info.input_layout):
        if type(a) is not np.ndarray:
            a = np.asarray(a)
        if a.dtype is not dtype and a.dtype != dtype:  # the builtin dtypes are singletons: identity first
            raise InvalidInput(f"input {spec.name!r} of {info.name!r} must be {spec.datatype} ({dtype}), got {a.dtype}")
        if a.shape == shape:
            n, a = 1, a[np.newaxis]  # the (1, *shape) view, a third of reshape's cost
        elif a.shape[1:] == shape:
            n, batched = a.shape[0], True
        else:
            raise InvalidInput(f"input {spec.name!r} of {info.name!r} must have shape {list(shape)} "
                               f"or [n, {', '.join(map(str, shape))}], got {list(a.shape)}")
        if count is not None and n != count:
            raise InvalidInput(f"inputs of {info.name!r} disagree on the batch size ({count} vs {n})")
        count = n
        out.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
    return out, count or 1, batched


def decode_outputs(info: ModelInfo, payload: "bytes | bytearray | memoryview", count: int, batched: bool) -> dict[str, np.ndarray]:
    if len(payload) != info.output_nbytes * count:
        raise InvalidInput(f"response of {len(payload)} B does not match the {info.output_nbytes * count} B "
                           f"that {info.name!r} declares")
    outs = {}
    off = 0
    for name, dtype, numel, shape in info.output_layout:
        # a view of the payload built in its final shape: one numpy call, where frombuffer
        # and then reshape were two
        outs[name] = np.ndarray((count, *shape) if batched else shape, dtype, payload, off)
        off += numel * count * dtype.itemsize
    return outs
