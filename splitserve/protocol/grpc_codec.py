"""Tensors and parameters in the gRPC messages of the Open Inference Protocol v2.

Shared by the gRPC front end and the gRPC client. A tensor travels either as raw bytes
(``raw_input_contents`` / ``raw_output_contents``: little-endian, row-major, no padding;
encoded and decoded with ``splitserve.protocol.v2``'s ``tensor_to_bytes`` and
``tensor_from_bytes``, as HTTP's binary extension is) or in the typed
``InferTensorContents`` field that matches its datatype, which is what this module adds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from splitserve.errors import InvalidInput
from splitserve.protocol import grpc_api as pb
from splitserve.protocol.v2 import tensor_from_json, wire_dtype

# Trailing metadata of a failed call: the exact splitserve ``Status`` (gRPC codes are coarser).
STATUS_KEY = "splitserve-status"

# The typed contents field per datatype. FP16 has none: it travels as raw bytes only.
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_ALL_FIELDS = sorted(set(CONTENTS_FIELD.values()) | {"bytes_contents"})


def tensor_from_contents(name: str, datatype: str, shape: Sequence[int],
                         contents: pb.InferTensorContents) -> np.ndarray:
    """A tensor from the typed contents field that matches ``datatype`` (and no other field).

    Values are checked like JSON ``data`` (``v2.tensor_from_json``): the right kind, in range.
    """
    dt = datatype.upper()
    field = "bytes_contents" if dt == "BYTES" else CONTENTS_FIELD.get(dt)
    if field is None:
        wire_dtype(dt)  # an unknown name gets its own message
        raise InvalidInput(f"tensor {name!r}: {dt} has no typed contents field; send it as raw contents")
    stray = [f for f in _ALL_FIELDS if f != field and len(getattr(contents, f))]
    if stray:
        raise InvalidInput(f"tensor {name!r}: {dt} data belongs in {field}, not in {', '.join(stray)}")
    return tensor_from_json(name, dt, tuple(shape), list(getattr(contents, field)))


def fill_contents(contents: pb.InferTensorContents, arr: np.ndarray, datatype: str) -> None:
    """Put ``arr`` into the typed field for ``datatype`` (raises for FP16, which has none)."""
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"{datatype} has no typed contents field; it travels as raw contents")
    getattr(contents, field).extend(arr.ravel().tolist())


def param_value(p: "pb.InferParameter | pb.ModelRepositoryParameter") -> Any:
    """The value a parameter holds (None when none of its choices is set)."""
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def params_dict(params: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf parameter map as a plain dict of values."""
    return {k: param_value(v) for k, v in params.items()}


def set_param(params: Any, key: str, value: Any) -> None:
    """Store ``value`` in a map of ``InferParameter`` under its natural choice."""
    p = params[key]
    if isinstance(value, (bool, np.bool_)):
        p.bool_param = bool(value)
    elif isinstance(value, (int, np.integer)):
        p.int64_param = int(value)
    elif isinstance(value, (float, np.floating)):
        p.double_param = float(value)
    elif isinstance(value, str):
        p.string_param = value
    else:
        raise InvalidInput(f"parameter {key!r}: {type(value).__name__} is not a bool, int, float or string")


def set_repo_param(params: Any, key: str, value: Any) -> None:
    """Store ``value`` in a map of ``ModelRepositoryParameter`` (bytes allowed)."""
    p = params[key]
    if isinstance(value, (bytes, bytearray, memoryview)):
        p.bytes_param = bytes(value)
    elif isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, str):
        p.string_param = value
    else:
        raise InvalidInput(f"parameter {key!r}: {type(value).__name__} is not bytes, a bool, an int or a string")
