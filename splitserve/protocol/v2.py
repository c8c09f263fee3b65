"""Open Inference Protocol v2 (KServe v2 / Triton) tensors and infer bodies.

Shared by the HTTP and gRPC front ends and the HTTP client. Tensors travel either as JSON
``data`` (flat row-major or nested lists) or, with Triton's binary tensor data extension,
as raw little-endian bytes after the JSON header::

    body = JSON header (Inference-Header-Content-Length bytes) + tensor bytes, in order

An input sends its bytes with ``parameters.binary_data_size``; a request asks for binary
outputs with ``parameters.binary_data_output`` (all outputs) or per output with
``outputs[i].parameters.binary_data``. BYTES elements are each a 4-byte little-endian
length and the bytes.

With Triton's system shared-memory extension, a tensor names a region that the client
registered instead of carrying bytes: ``parameters.shared_memory_region``,
``shared_memory_byte_size`` and ``shared_memory_offset`` (``ShmRef``). Such an input has
no ``data``; such an output is written into its region and its entry carries no data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitserve.errors import BadSize, InvalidInput
from splitserve.protocol.header import RequestClass
from splitserve.types import V2_TO_NUMPY, TensorSpec

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"
DATATYPES = (*V2_TO_NUMPY, "BYTES")

_HEADER_ROOM = 64 << 10  # names, shapes, parameters and whitespace of an infer body's JSON
_INT_RANGES = {name: (np.iinfo(dt).min, np.iinfo(dt).max) for name, dt in V2_TO_NUMPY.items() if dt.kind in "iu"}


# -- single tensors ----------------------------------------------------------------------------


def wire_dtype(datatype: str) -> np.dtype:
    """The little-endian numpy dtype of a v2 datatype on the wire (BYTES: object)."""
    dt = datatype.upper() if isinstance(datatype, str) else datatype
    if dt == "BYTES":
        return np.dtype(object)
    try:
        return V2_TO_NUMPY[dt].newbyteorder("<")
    except KeyError:
        raise InvalidInput(f"unknown datatype {datatype!r}; expected one of {', '.join(DATATYPES)}") from None


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidInput(f"tensor {name!r}: shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise InvalidInput(f"tensor {name!r}: shape {list(shape)} has a negative dimension")
    return tuple(shape)


def tensor_from_json(name: str, datatype: str, shape: Sequence[int], data: Any) -> np.ndarray:
    """A tensor from JSON ``data`` (flat or nested); values must fit the datatype exactly."""
    shape = check_shape(name, shape)
    dt = wire_dtype(datatype)
    datatype = datatype.upper()
    if datatype == "BYTES":
        flat = np.asarray(data, dtype=object).ravel()
        if flat.size != math.prod(shape):
            raise BadSize(f"input {name!r}: {flat.size} elements do not fill shape {list(shape)}")
        try:
            return np.array([s.encode() if isinstance(s, str) else bytes(s) for s in flat],
                            dtype=object).reshape(shape)
        except TypeError:
            raise InvalidInput(f"input {name!r}: BYTES data must be strings") from None
    try:
        arr = np.asarray(data)
    except ValueError as e:
        raise InvalidInput(f"input {name!r}: data is not a rectangular list of numbers ({e})") from None
    if arr.size != math.prod(shape):
        raise BadSize(f"input {name!r}: {arr.size} values do not fill shape {list(shape)} "
                      f"({math.prod(shape)} values)")
    if arr.size == 0:
        return np.zeros(shape, dt)
    kind = arr.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidInput(f"input {name!r}: BOOL data must be true/false")
    elif dt.kind in "iu":
        if kind not in "iu":
            # numpy turns integers beyond int64 (UINT64's upper half) into floats or objects
            flat = np.asarray(data, dtype=object).ravel().tolist()
            if not all(type(v) is int for v in flat):
                raise InvalidInput(f"input {name!r}: {datatype} data must be integers, got {_kind_name(kind)}")
            lo_v, hi_v = min(flat), max(flat)
        else:
            lo_v, hi_v = int(arr.min()), int(arr.max())
        lo, hi = _INT_RANGES[datatype]
        if lo_v < lo or hi_v > hi:
            raise InvalidInput(f"input {name!r}: values outside the {datatype} range {lo}..{hi}")
        if kind not in "iu":
            return np.array(flat, dtype=dt).reshape(shape)
    elif kind not in "iuf":
        raise InvalidInput(f"input {name!r}: {datatype} data must be numbers, got {_kind_name(kind)}")
    return arr.astype(dt, copy=False).reshape(shape)


def _kind_name(kind: str) -> str:
    return {"b": "booleans", "f": "floating-point numbers", "U": "strings", "O": "mixed values"}.get(kind, "other values")


def tensor_from_bytes(name: str, datatype: str, shape: Sequence[int], buf: "bytes | bytearray | memoryview") -> np.ndarray:
    """A tensor from raw little-endian bytes (a view of ``buf``, no copy for fixed-size types)."""
    shape = check_shape(name, shape)
    dt = wire_dtype(datatype)
    n = math.prod(shape)
    if dt == np.dtype(object):
        return _bytes_elements(name, buf, n).reshape(shape)
    want = n * dt.itemsize
    if len(buf) != want:
        raise BadSize(f"input {name!r}: {len(buf)} bytes of binary data, but {datatype.upper()}{list(shape)} "
                      f"needs {want}")
    return np.frombuffer(buf, dtype=dt, count=n).reshape(shape)


def _bytes_elements(name: str, buf: "bytes | bytearray | memoryview", n: int) -> np.ndarray:
    mv = memoryview(buf).cast("B")
    out, off = [], 0
    for _ in range(n):
        if off + 4 > len(mv):
            raise BadSize(f"input {name!r}: BYTES data ends inside an element length")
        (size,) = struct.unpack_from("<I", mv, off)
        off += 4
        if off + size > len(mv):
            raise BadSize(f"input {name!r}: BYTES element of {size} bytes runs past the data")
        out.append(bytes(mv[off : off + size]))
        off += size
    if off != len(mv):
        raise BadSize(f"input {name!r}: {len(mv) - off} bytes left over after {n} BYTES elements")
    return np.array(out, dtype=object) if out else np.zeros(0, dtype=object)


def tensor_to_bytes(arr: np.ndarray) -> "bytes | memoryview":
    """Raw little-endian bytes of a tensor (BYTES: length-prefixed elements)."""
    if arr.dtype == np.dtype(object):
        return b"".join(struct.pack("<I", len(b)) + b for b in (x if isinstance(x, bytes) else str(x).encode()
                                                                    for x in arr.ravel()))
    a = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return memoryview(a).cast("B")


def tensor_to_json(arr: np.ndarray) -> list:
    """Flat row-major JSON values (BYTES as UTF-8 text)."""
    if arr.dtype == np.dtype(object):
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in arr.ravel()]
    return arr.ravel().tolist()


def datatype_of(arr: np.ndarray) -> str:
    if arr.dtype == np.dtype(object):
        return "BYTES"
    from splitserve.types import v2_datatype

    return v2_datatype(arr.dtype.newbyteorder("="))


# -- system shared memory ----------------------------------------------------------------------

SHM_REGION = "shared_memory_region"
SHM_OFFSET = "shared_memory_offset"
SHM_BYTE_SIZE = "shared_memory_byte_size"


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a tensor lies in a registered shared-memory region: ``byte_size`` bytes from
    ``offset`` (counted from the region's start)."""

    region: str
    offset: int
    byte_size: int

    def as_params(self) -> dict[str, Any]:
        """The tensor parameters that name this place (what a response echoes)."""
        return {SHM_REGION: self.region, SHM_BYTE_SIZE: self.byte_size, SHM_OFFSET: self.offset}


def shm_ref(tensor: str, params: Mapping[str, Any]) -> ShmRef | None:
    """The region a tensor's parameters name (HTTP and gRPC alike), None when they name none."""
    region = params.get(SHM_REGION)
    if region is None:
        return None
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{tensor}: {SHM_REGION} must be a region name, got {region!r}")
    values = []
    for key, default in ((SHM_OFFSET, 0), (SHM_BYTE_SIZE, None)):
        v = params.get(key, default)
        if v is None:
            raise InvalidInput(f"{tensor}: {SHM_REGION} {region!r} needs {SHM_BYTE_SIZE}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidInput(f"{tensor}: {key} must be a non-negative integer, got {v!r}")
        values.append(v)
    return ShmRef(region, *values)


@dataclass(frozen=True, slots=True)
class ShmInput:
    """An input that lies in shared memory: where, and the datatype and shape it declares."""

    ref: ShmRef
    datatype: str
    shape: tuple[int, ...]


# -- requests ----------------------------------------------------------------------------------


@dataclass
class InferRequest:
    """A decoded v2 infer request: named input tensors and what the caller asked for."""

    id: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    datatypes: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    # requested outputs: name -> binary?  (None: every output, with ``binary_output``)
    outputs: dict[str, bool] | None = None
    binary_output: bool = False
    shm_inputs: dict[str, ShmInput] = field(default_factory=dict)  # inputs to read from shared memory
    shm_outputs: dict[str, ShmRef] = field(default_factory=dict)  # outputs to write into shared memory

    @property
    def cls(self) -> RequestClass:
        """``parameters.class``: "rt" / "be" (or 0 / 1); absent means the model's default."""
        c = self.parameters.get("class")
        if c is None:
            return RequestClass.DEFAULT
        try:
            return RequestClass.parse(c)
        except InvalidInput:
            raise InvalidInput(f"parameters.class {c!r}: use 'rt' (real-time) or 'be' (best-effort)") from None

    @property
    def deadline_s(self) -> float | None:
        """``parameters.deadline_ms`` (hard: a call still queued then is dropped) in seconds."""
        return ms_parameter(self.parameters, "deadline_ms")

    @property
    def slo_s(self) -> float | None:
        """``parameters.slo_ms`` (soft: a late real-time call is served and counted missed) in seconds."""
        return ms_parameter(self.parameters, "slo_ms")


# Triton's per-call parameters of its sequence batcher, which splitserve does not have.
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def refuse_sequence(params: Mapping[str, Any]) -> None:
    """``params`` (a call's, HTTP and gRPC alike), refused if they name a sequence: each
    call is served on its own, so a sequence's state would be silently lost."""
    given = [k for k in SEQUENCE_PARAMETERS if k in params]
    if given:
        raise InvalidInput(f"parameter(s) {', '.join(given)} are refused: splitserve has no sequence batcher and "
                           "keeps no state between calls (stateless models only); send the call without them")


def ms_parameter(params: Mapping[str, Any], name: str) -> float | None:
    """A request's ``deadline_ms`` or ``slo_ms`` parameter (HTTP and gRPC alike) in seconds;
    None when absent.

    It must be a positive, finite number of milliseconds: 0 does not mean "none", so a
    client that computed a deadline already past gets an error, not an unbounded wait."""
    ms = params.get(name)
    if ms is None:
        return None
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < math.inf:
        raise InvalidInput(f"parameter {name!r} must be a positive number of milliseconds, got {ms!r}")
    return float(ms) / 1000.0


def json_number(name: str, value: Any, kind: type) -> "int | float":
    """A JSON value that must be a finite number (``kind`` int: a whole one, 2.0 included, as
    JSON Schema counts it); InvalidInput naming ``name`` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (kind is int and not float(value).is_integer()):
        raise InvalidInput(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def infer_body_limit(specs: Sequence[TensorSpec], max_batch: int, chars_per_value: int) -> int:
    """The largest infer body worth receiving for a model: ``max_batch`` samples of every
    input as JSON text (``chars_per_value`` characters a value, at least the binary size),
    plus room for the JSON header and its parameters."""
    per_sample = sum(t.numel * max(chars_per_value, t.dtype.itemsize) for t in specs)
    return max_batch * per_sample + _HEADER_ROOM


def _params(obj: Mapping, where: str) -> dict[str, Any]:
    p = obj.get("parameters") or {}
    if not isinstance(p, Mapping):
        raise InvalidInput(f"{where}: parameters must be an object")
    return dict(p)


def parse_infer_request(body: "bytes | bytearray | memoryview", header_length: "int | str | None" = None) -> InferRequest:
    """Decode a v2 infer body: JSON, or JSON header plus binary tensor data."""
    mv = memoryview(body).cast("B")
    if header_length is not None and header_length != "":
        try:
            hlen = int(header_length)
        except (TypeError, ValueError):
            raise InvalidInput(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 < hlen <= len(mv):
            raise BadSize(f"{HEADER_LENGTH} {hlen} does not fit a body of {len(mv)} bytes")
    else:
        hlen = len(mv)
    try:
        doc = json.loads(bytes(mv[:hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"the request body is not valid JSON: {e}") from None
    if not isinstance(doc, Mapping):
        raise InvalidInput("the request body must be a JSON object")
    params = _params(doc, "request")
    refuse_sequence(params)
    req = InferRequest(id=str(doc.get("id", "")), parameters=params)
    req.binary_output = bool(req.parameters.get("binary_data_output", False))
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("the request needs a non-empty 'inputs' list")
    blob, off = mv[hlen:], 0
    for i, t in enumerate(inputs):
        if not isinstance(t, Mapping):
            raise InvalidInput(f"inputs[{i}] must be an object")
        name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str) or shape is None:
            raise InvalidInput(f"inputs[{i}] needs 'name', 'datatype' and 'shape'")
        if name in req.inputs:
            raise InvalidInput(f"input {name!r} is given twice")
        params = _params(t, f"input {name!r}")
        size = params.get("binary_data_size")
        ref = shm_ref(f"input {name!r}", params)
        if ref is not None:
            if size is not None or "data" in t:
                raise InvalidInput(f"input {name!r} names shared-memory region {ref.region!r} and also carries data")
            req.shm_inputs[name] = ShmInput(ref, datatype.upper(), check_shape(name, shape))
        elif size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInput(f"input {name!r}: binary_data_size must be a non-negative integer")
            if off + size > len(blob):
                raise BadSize(f"input {name!r}: binary data is truncated ({len(blob) - off} of {size} bytes present)")
            req.inputs[name] = tensor_from_bytes(name, datatype, shape, blob[off : off + size])
            off += size
        elif "data" in t:
            req.inputs[name] = tensor_from_json(name, datatype, shape, t["data"])
        else:
            raise InvalidInput(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
        req.datatypes[name] = datatype.upper()
    if off != len(blob):
        raise BadSize(f"{len(blob) - off} bytes of binary data follow the inputs that no input claims")
    outs = doc.get("outputs")
    if outs is not None:
        if not isinstance(outs, list):
            raise InvalidInput("'outputs' must be a list")
        req.outputs = {}
        for i, o in enumerate(outs):
            if not isinstance(o, Mapping) or not isinstance(o.get("name"), str):
                raise InvalidInput(f"outputs[{i}] must be an object with a 'name'")
            params = _params(o, f"output {o['name']!r}")
            req.outputs[o["name"]] = bool(params.get("binary_data", req.binary_output))
            ref = shm_ref(f"output {o['name']!r}", params)
            if ref is not None:
                req.shm_outputs[o["name"]] = ref
    return req


def model_inputs(model: str, specs: Sequence[TensorSpec], given: Mapping[str, np.ndarray],
                 datatypes: Mapping[str, str] | None = None) -> list[np.ndarray]:
    """The model's inputs in declared order, checked: names, datatypes, shapes ``[n, *shape]``."""
    names = [s.name for s in specs]
    unknown = [n for n in given if n not in names]
    if unknown:
        raise InvalidInput(f"model {model!r} has no input {unknown[0]!r}; its inputs are {names}")
    out = []
    for spec in specs:
        arr = given.get(spec.name)
        if arr is None:
            raise InvalidInput(f"model {model!r}: input {spec.name!r} is missing (inputs: {names})")
        dt = (datatypes or {}).get(spec.name) or datatype_of(arr)
        if dt != spec.datatype:
            extra = "; BYTES inputs are not supported by this model" if dt == "BYTES" else ""
            raise InvalidInput(f"input {spec.name!r} of {model!r} is {spec.datatype}, got {dt}{extra}")
        if arr.ndim != len(spec.shape) + 1 or arr.shape[1:] != spec.shape:
            raise BadSize(f"input {spec.name!r} of {model!r} must have shape [n, {', '.join(map(str, spec.shape))}]"
                          f" (n = batch size), got {list(arr.shape)}")
        out.append(arr)
    return out


def model_metadata(name: str, version: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                   parameters: Mapping[str, Any]) -> dict[str, Any]:
    """v2 model metadata: shapes carry -1 for the batch dimension; ``parameters`` are
    splitserve's additions (clients of the spec ignore them)."""

    def tensors(specs: Sequence[TensorSpec]) -> list[dict]:
        return [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in specs]

    return {"name": name, "versions": [version], "platform": "pytorch", "inputs": tensors(inputs),
            "outputs": tensors(outputs), "parameters": dict(parameters)}


def build_infer_request(inputs: Sequence[tuple[str, np.ndarray]], *, binary: bool = True, id: str = "",
                        outputs: Sequence[str] | None = None, parameters: Mapping[str, Any] | None = None
                        ) -> tuple[list["bytes | memoryview"], int | None]:
    """Client side: body parts and the JSON header length (None for plain JSON)."""
    params = dict(parameters or {})
    if binary:
        params["binary_data_output"] = True
    doc: dict[str, Any] = {"inputs": []}
    if id:
        doc["id"] = id
    if params:
        doc["parameters"] = params
    blobs: list[bytes] = []
    doc["inputs"].extend(_tensor_entry(name, arr, binary, blobs) for name, arr in inputs)
    if outputs is not None:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    head = json.dumps(doc, separators=(",", ":")).encode()
    return [head, *blobs], (len(head) if binary else None)


def _tensor_entry(name: str, arr: np.ndarray, binary: bool, blobs: list[bytes]) -> dict[str, Any]:
    """One tensor of a request or response: JSON data, or a binary blob appended to ``blobs``."""
    t: dict[str, Any] = {"name": name, "datatype": datatype_of(arr), "shape": list(arr.shape)}
    if binary:
        b = tensor_to_bytes(arr)
        t["parameters"] = {"binary_data_size": len(b)}
        blobs.append(b)
    else:
        t["data"] = tensor_to_json(arr)
    return t


# -- responses ---------------------------------------------------------------------------------


def build_infer_response(model: str, version: str, req: InferRequest, outputs: Sequence[tuple[str, np.ndarray]],
                         parameters: Mapping[str, Any] | None = None) -> tuple[list["bytes | memoryview"], int | None]:
    """Response body parts and the JSON header length (None when no output is binary)."""
    wanted = req.outputs
    if wanted is not None:
        known = {n for n, _ in outputs}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise InvalidInput(f"model {model!r} has no output {missing[0]!r}; its outputs are {sorted(known)}")
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "id": req.id}
    if parameters:
        doc["parameters"] = dict(parameters)
    doc["outputs"] = []
    blobs: list[bytes] = []
    for name, arr in outputs:
        if wanted is not None and name not in wanted:
            continue
        ref = req.shm_outputs.get(name)
        if ref is not None:  # already written into its region
            doc["outputs"].append({"name": name, "datatype": datatype_of(arr), "shape": list(arr.shape),
                                   "parameters": ref.as_params()})
            continue
        binary = wanted[name] if wanted is not None else req.binary_output
        doc["outputs"].append(_tensor_entry(name, arr, binary, blobs))
    head = json.dumps(doc, separators=(",", ":")).encode()
    return [head, *blobs], (len(head) if blobs else None)


@dataclass
class InferResponse:
    """A decoded v2 infer response (client side)."""

    model_name: str
    model_version: str
    id: str
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any]


def parse_infer_response(body: "bytes | bytearray | memoryview", header_length: "int | str | None" = None) -> InferResponse:
    mv = memoryview(body).cast("B")
    hlen = int(header_length) if header_length not in (None, "") else len(mv)
    try:
        doc = json.loads(bytes(mv[:hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"the response is not valid JSON: {e}") from None
    blob, off = mv[hlen:], 0
    outs: dict[str, np.ndarray] = {}
    for t in doc.get("outputs", []):
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outs[t["name"]] = tensor_from_bytes(t["name"], t["datatype"], t["shape"], blob[off : off + size])
            off += size
        else:
            outs[t["name"]] = tensor_from_json(t["name"], t["datatype"], t["shape"], t["data"])
    return InferResponse(doc.get("model_name", ""), str(doc.get("model_version", "")), str(doc.get("id", "")),
                         outs, dict(doc.get("parameters") or {}))
