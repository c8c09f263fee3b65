"""Tensor datatypes and specs shared by every part of splitserve.

Datatype names are the Open Inference Protocol v2 names (``FP32``, ``UINT8`` ...), so a
config, a fast-path lookup answer, an HTTP body and a gRPC message all say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

import numpy as np

from splitserve.errors import BadSize, InvalidInput

# v2 datatype -> numpy dtype. BYTES is variable length and never lives in a tensor queue.
V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_V2: dict[np.dtype, str] = {v: k for k, v in V2_TO_NUMPY.items()}
# A stable one-byte code per datatype, used in binary lookup answers.
V2_CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(V2_TO_NUMPY)}
V2_FROM_CODE: dict[int, str] = {v: k for k, v in V2_CODES.items()}


class Choice(StrEnum):
    """A closed list of names a user writes (in a config, a flag or an environment variable).

    Each list is one subclass, defined in the module that owns the concept, with ``what``
    (how messages name the setting) and an optional ``hint``; ``parse`` is its factory.
    Members are strings, so they compare equal to and serialise as their names."""

    def __init_subclass__(cls, what: str = "", hint: str = "", **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._what = what or cls.__name__
        cls._hint = hint

    @classmethod
    def parse(cls, name: Any, what: str | None = None) -> Self:
        """The member called ``name`` (a member is returned as it is); anything else is
        refused with InvalidInput naming the setting (``what``, default the list's own) and
        every valid name."""
        try:
            return cls(name)
        except (ValueError, TypeError):
            hint = f" ({cls._hint})" if cls._hint else ""
            raise InvalidInput(f"unknown {what or cls._what} {name!r}; use one of {', '.join(cls)}{hint}") from None


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype for a v2 datatype name; raises InvalidInput for an unknown name."""
    try:
        return V2_TO_NUMPY[datatype.upper()]
    except KeyError:
        raise InvalidInput(
            f"unknown datatype {datatype!r}; expected one of {', '.join(V2_TO_NUMPY)}"
        ) from None


def v2_datatype(dtype: Any) -> str:
    """The v2 datatype name for a numpy (or numpy-compatible) dtype."""
    dt = np.dtype(dtype)
    try:
        return NUMPY_TO_V2[dt]
    except KeyError:
        raise InvalidInput(f"dtype {dt} has no Open Inference Protocol datatype") from None


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model, without the batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        numpy_dtype(self.datatype)  # validate early, with a clear message
        if any(int(d) <= 0 for d in self.shape):
            raise InvalidInput(f"tensor {self.name!r}: every dimension must be positive, got {self.shape}")

    @property
    def dtype(self) -> np.dtype:
        return numpy_dtype(self.datatype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one sample: the tensor-queue slot size."""
        return self.numel * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorSpec":
        try:
            return cls(str(d["name"]), str(d["datatype"]).upper(), tuple(int(x) for x in d["shape"]))
        except KeyError as e:
            raise InvalidInput(f"tensor spec is missing the field {e.args[0]!r}") from None


def batch_of(model: str, specs: Sequence[TensorSpec], arrays: Sequence[np.ndarray]) -> int:
    """The samples in one call of ``model``: ``arrays`` in declared order, each of its spec's
    dtype and shaped ``(n, *shape)`` with one ``n`` > 0; raises naming the first that is not."""
    if len(arrays) != len(specs):
        raise InvalidInput(f"model {model!r} takes {len(specs)} inputs "
                           f"({', '.join(t.name for t in specs)}), got {len(arrays)}")
    count = None
    for arr, spec in zip(arrays, specs):
        if arr.dtype != spec.dtype:
            raise InvalidInput(f"input {spec.name!r} of {model!r} must be {spec.datatype}, got {arr.dtype}")
        if arr.shape[1:] != spec.shape or arr.ndim != len(spec.shape) + 1:
            raise BadSize(f"input {spec.name!r} of {model!r} must have shape [n, {', '.join(map(str, spec.shape))}],"
                          f" got {list(arr.shape)}")
        if count is not None and arr.shape[0] != count:
            raise BadSize(f"inputs of {model!r} disagree on the batch size")
        count = arr.shape[0]
    if not count:
        raise BadSize("empty batch")
    return count
