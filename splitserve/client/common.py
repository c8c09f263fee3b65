"""What every client transport shares: URLs, model info, input encoding, output decoding."""

from __future__ import annotations

import json
import numbers
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

    @cached_property
    def codec(self) -> "ModelCodec":
        """This model's input encoder and output decoder (``encode_inputs``, ``decode_outputs``)."""
        return ModelCodec(self)


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


def target_ms(value: float | None, name: str) -> float | None:
    """A call's ``deadline_ms`` or ``slo_ms`` as given (None: none), checked the way the
    servers check it: a positive number of ms of at least 1 µs (the fast path's unit). A
    deadline computed as 0 or less is already past: it is refused here, not sent as "none"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0.001:
        raise InvalidInput(f"{name} must be a positive number of milliseconds (at least 0.001), not {value!r}")
    return float(value)


def encode_inputs(info: ModelInfo, x: Any) -> tuple[list[np.ndarray], int, bool]:
    """Arrays in declared order, the sample count, and whether the caller gave a batch dim.

    Dtypes must match exactly: a silent cast would hide a client bug.
    """
    return info.codec.encode(x)


def decode_outputs(info: ModelInfo, payload: "bytes | bytearray | memoryview", count: int, batched: bool) -> dict[str, np.ndarray]:
    """The outputs of an answer to ``count`` samples, by name: views of ``payload``, shaped
    ``(count, *shape)`` when the call gave a batch dimension, else ``shape``."""
    return info.codec.decode(payload, count, batched)


class ModelCodec:
    """One model's input encoding and output decoding (``ModelInfo.codec``), with what they
    check worked out when the model is looked up rather than at each call.

    The usual call passes ``encode`` in a few identity and tuple comparisons: one array, or
    a list or tuple of arrays, each of the declared dtype and shape (one sample) and
    contiguous. Anything else (a batch, a mapping, a Python list, a strided array) and
    every refusal takes the general way, whose checks and messages are the whole contract.
    """

    __slots__ = ("info", "_names", "_layout", "_plain", "_sample_nbytes", "_outputs", "_out_nbytes", "_single")

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self._names = tuple(t.name for t in info.inputs)
        self._layout = info.input_layout
        # a one-input model's (dtype, shape): a bare array of them is the commonest call
        self._plain = self._layout[0] if len(self._layout) == 1 else None
        self._sample_nbytes = sum(t.nbytes for t in info.inputs)
        self._outputs = info.output_layout
        self._out_nbytes = info.output_nbytes
        self._single = self._outputs[0] if len(self._outputs) == 1 else None

    def _one_sample(self, x: Any) -> "list[np.ndarray] | tuple[np.ndarray, ...] | None":
        """``x``'s arrays when it is the usual call (see the class), else None."""
        kind = type(x)
        if kind is np.ndarray:
            plain = self._plain
            if plain is not None and x.dtype is plain[0] and x.shape == plain[1] and x.flags.c_contiguous:
                return [x]
        elif (kind is list or kind is tuple) and len(x) == len(self._layout):
            for a, (dtype, shape) in zip(x, self._layout):
                if type(a) is not np.ndarray or a.dtype is not dtype or a.shape != shape or not a.flags.c_contiguous:
                    return None
            return x
        return None

    def encode(self, x: Any) -> tuple[list[np.ndarray], int, bool]:
        """``encode_inputs`` for this model."""
        plain = self._one_sample(x)
        if plain is not None:
            return [a[np.newaxis] for a in plain], 1, False  # (1, *shape) views, a third of reshape's cost
        return self._encode(x)

    def frame(self, x: Any) -> "tuple[list[np.ndarray] | tuple[np.ndarray, ...], int, int, bool]":
        """What a fast-path request carries for ``x``: its arrays' buffers in declared order
        (contiguous, their shapes aside: only their bytes go), their bytes in all, the
        sample count and whether the caller gave a batch dimension; ``encode``'s checks."""
        plain = self._one_sample(x)
        if plain is not None:
            return plain, self._sample_nbytes, 1, False
        arrays, count, batched = self._encode(x)
        return arrays, sum(a.nbytes for a in arrays), count, batched

    def _encode(self, x: Any) -> tuple[list[np.ndarray], int, bool]:
        """The general way: every form an input may take, and every check, naming the problem."""
        info = self.info
        kind = type(x)
        if kind is np.ndarray:
            arrays = [x]
        elif kind is list or kind is tuple:
            arrays = x
        elif isinstance(x, Mapping):
            missing = [n for n in self._names if n not in x]
            if missing:
                raise InvalidInput(f"model {info.name!r}: missing inputs {missing}")
            arrays = [x[n] for n in self._names]
        elif isinstance(x, (list, tuple)):
            arrays = list(x)
        else:
            arrays = [x]
        if len(arrays) != len(self._layout):
            raise InvalidInput(f"model {info.name!r} takes {len(self._layout)} inputs, got {len(arrays)}")
        out = []
        count = None
        batched = False
        for a, spec, (dtype, shape) in zip(arrays, info.inputs, self._layout):
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            if a.dtype is not dtype and a.dtype != dtype:  # the builtin dtypes are singletons: identity first
                raise InvalidInput(f"input {spec.name!r} of {info.name!r} must be {spec.datatype} ({dtype}), "
                                   f"got {a.dtype}")
            if a.shape == shape:
                n, a = 1, a[np.newaxis]
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

    def decode(self, payload: "bytes | bytearray | memoryview", count: int, batched: bool) -> dict[str, np.ndarray]:
        """``decode_outputs`` for this model."""
        if len(payload) != self._out_nbytes * count:
            raise InvalidInput(f"response of {len(payload)} B does not match the {self._out_nbytes * count} B "
                               f"that {self.info.name!r} declares")
        single = self._single
        if single is not None:
            return {single[0]: np.ndarray((count, *single[3]) if batched else single[3], single[1], payload)}
        outs = {}
        off = 0
        for name, dtype, numel, shape in self._outputs:
            # a view of the payload built in its final shape: one numpy call, where frombuffer
            # and then reshape were two
            outs[name] = np.ndarray((count, *shape) if batched else shape, dtype, payload, off)
            off += numel * count * dtype.itemsize
        return outs
