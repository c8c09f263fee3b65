"""What every client encodes and decodes with (splitserve/client/common.py): the forms an
input may take, the checks on it, and answers decoded as views of their payload."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.client.common import ModelInfo, decode_outputs, encode_inputs
from splitserve.client.frames import _request_fields
from splitserve.client.grpc import infer_request
from splitserve.client.http import _infer_body
from splitserve.errors import InvalidInput
from splitserve.protocol.header import RequestClass, RequestPacker, pack_request

INFO = ModelInfo.from_json({
    "name": "two", "func_id": 1, "max_batch_size": 8,
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [2, 3]}, {"name": "b", "datatype": "INT64", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}, {"name": "z", "datatype": "INT32", "shape": [2]}],
})
A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.arange(4, dtype=np.int64)


@pytest.mark.parametrize("x", [[A, B], (A, B), {"b": B, "a": A}, [A, B.tolist()]],
                         ids=["list", "tuple", "mapping", "python-list"])
def test_every_input_form_encodes_one_sample_in_declared_order(x):
    arrays, count, batched = encode_inputs(INFO, x)
    assert (count, batched) == (1, False)
    assert [a.shape for a in arrays] == [(1, 2, 3), (1, 4)]
    assert b"".join(a.tobytes() for a in arrays) == A.tobytes() + B.tobytes()


def test_a_batch_and_a_strided_input_are_sent_as_contiguous_rows():
    a = np.arange(36, dtype=np.float32).reshape(3, 2, 6)[:, :, ::2]  # a strided view: copied once
    b = np.zeros((3, 4), np.int64)
    arrays, count, batched = encode_inputs(INFO, [a, b])
    assert (count, batched) == (3, True)
    assert arrays[0].flags.c_contiguous and arrays[0].tobytes() == np.ascontiguousarray(a).tobytes()
    assert arrays[1] is b  # already contiguous: sent from the caller's own buffer


@pytest.mark.parametrize("x, words", [
    ([A.astype(np.float64), B], "must be FP32"),
    ([A.reshape(3, 2), B], "must have shape [2, 3]"),
    ([A], "takes 2 inputs, got 1"),
    ({"a": A}, "missing inputs ['b']"),
    ([np.stack([A, A]), np.stack([B, B, B])], "disagree on the batch size (2 vs 3)"),
])
def test_bad_inputs_are_refused_naming_the_problem(x, words):
    with pytest.raises(InvalidInput) as e:
        encode_inputs(INFO, x)
    assert words in str(e.value)


def test_outputs_are_views_of_the_answer_one_sample_or_a_batch():
    """An answer carries each output's rows in turn (all of y's, then all of z's)."""
    one = np.arange(3, dtype=np.float32).tobytes() + np.arange(2, dtype=np.int32).tobytes()
    payload = bytearray(np.arange(3, dtype=np.float32).tobytes() * 2 + np.arange(2, dtype=np.int32).tobytes() * 2)
    outs = decode_outputs(INFO, payload, 2, True)
    assert outs["y"].shape == (2, 3) and outs["z"].shape == (2, 2)
    assert outs["z"].tolist() == [[0, 1], [0, 1]]
    payload[0:4] = np.float32(9).tobytes()  # no copy was made
    assert outs["y"][0, 0] == 9
    single = decode_outputs(INFO, one, 1, False)
    assert single["y"].tolist() == [0, 1, 2] and single["z"].shape == (2,)


@pytest.mark.parametrize("size", [19, 21, 0])
def test_an_answer_of_the_wrong_size_is_refused_with_both_sizes(size):
    """A short answer used to surface as numpy's ValueError from frombuffer, not as the
    client's InvalidInput naming the sizes."""
    with pytest.raises(InvalidInput, match=f"response of {size} B does not match the 20 B"):
        decode_outputs(INFO, bytes(size), 1, False)


# -- the per-model codec (ModelInfo.codec) against the general way it replaced -------------

def _reference_encode(info: ModelInfo, x: object) -> tuple[list[np.ndarray], int, bool]:
    """``encode_inputs`` as it was before the per-model codec: the oracle the codec's fast
    way must agree with, input for input, refusal for refusal (message included)."""
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
    out, count, batched = [], None, False
    for a, spec in zip(arrays, info.inputs):
        a = np.asarray(a)
        if a.dtype != spec.dtype:
            raise InvalidInput(f"input {spec.name!r} of {info.name!r} must be {spec.datatype} ({spec.dtype}), "
                               f"got {a.dtype}")
        if a.shape == spec.shape:
            n, a = 1, a.reshape(1, *spec.shape)
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


_TYPES = {"FP32": np.float32, "INT64": np.int64, "UINT8": np.uint8, "FP16": np.float16}
_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


@st.composite
def _model_and_input(draw: st.DrawFn) -> tuple[ModelInfo, object]:
    """A model of 1-3 inputs and a call that is right, or wrong in one or more ways: a
    dtype, a shape, a batch that disagrees, a strided array, a missing or extra input, or
    another form (bare array, list, tuple, mapping, nested Python lists)."""
    specs = draw(st.lists(st.tuples(st.sampled_from(sorted(_TYPES)), _shapes), min_size=1, max_size=3))
    info = ModelInfo.from_json({"name": "m", "func_id": 1, "max_batch_size": 8,
                                "inputs": [{"name": f"i{k}", "datatype": d, "shape": list(s)}
                                           for k, (d, s) in enumerate(specs)],
                                "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]})
    n = draw(st.sampled_from([None, 0, 1, 2]))  # None: one sample without a batch dimension
    arrays: list[object] = []
    for d, s in specs:
        dtype = _TYPES[d] if draw(st.integers(0, 9)) else draw(st.sampled_from(sorted(_TYPES.values(), key=str)))
        shape = s if n is None else (n, *s)
        if not draw(st.integers(0, 9)):  # a wrong shape, or a batch that disagrees
            shape = draw(_shapes)
        if draw(st.integers(0, 4)) or not shape or shape[-1] < 2:
            a = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=dtype).reshape(shape)
        else:  # strided: every other element of a wider array
            a = np.arange(int(np.prod(shape, dtype=np.int64)) * 2, dtype=dtype).reshape(*shape[:-1], shape[-1] * 2)
            a = a[..., ::2]
        arrays.append(a.tolist() if not draw(st.integers(0, 9)) else a)
    if not draw(st.integers(0, 9)):
        if draw(st.booleans()):
            arrays.pop()
        else:
            arrays.append(arrays[0])
    form = draw(st.sampled_from(["list", "tuple", "mapping", "bare"]))
    if form == "bare" and len(arrays) == 1:
        return info, arrays[0]
    if form == "mapping":
        return info, {f"i{k}": a for k, a in enumerate(arrays)}
    return info, tuple(arrays) if form == "tuple" else arrays


def _outcome(f: object, *args: object) -> object:
    try:
        return f(*args)
    except InvalidInput as e:
        return str(e)


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(case=_model_and_input())
def test_the_per_model_codec_takes_and_refuses_exactly_what_the_general_way_does(case):
    """Every input the old ``encode_inputs`` refused is refused with the same message;
    every one it took gives the same rows, sample count and batch flag, from ``encode``
    and from the fast path's ``frame`` (whose buffers carry the same bytes in all)."""
    info, x = case
    want = _outcome(_reference_encode, info, x)
    got = _outcome(encode_inputs, info, x)
    framed = _outcome(info.codec.frame, x)
    if isinstance(want, str):
        assert got == want and framed == want
        return
    arrays, count, batched = got
    assert (count, batched) == want[1:]
    assert [(a.dtype, a.shape) for a in arrays] == [(a.dtype, a.shape) for a in want[0]]
    assert all(a.flags.c_contiguous for a in arrays)
    assert b"".join(a.tobytes() for a in arrays) == b"".join(a.tobytes() for a in want[0])
    buffers, nbytes, f_count, f_batched = framed
    assert (f_count, f_batched) == want[1:]
    assert all(type(a) is np.ndarray and a.flags.c_contiguous for a in buffers)
    assert b"".join(a.tobytes() for a in buffers) == b"".join(a.tobytes() for a in want[0])
    assert nbytes == sum(a.nbytes for a in want[0])


def test_one_sample_of_contiguous_arrays_is_framed_from_the_callers_own_buffers():
    """The usual call: nothing is copied or reshaped, the bytes are counted from the layout."""
    x = [A, B]
    buffers, nbytes, count, batched = INFO.codec.frame(x)
    assert buffers is x and (nbytes, count, batched) == (A.nbytes + B.nbytes, 1, False)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(req_id=st.integers(0, 2**64 - 1), func_id=st.integers(0, 2**16 - 1), cls=st.integers(0, 255),
       deadline_us=st.integers(0, 2**64 - 1), slo_us=st.integers(0, 2**64 - 1), payload_len=st.integers(0, 2**32 - 1))
def test_a_request_packer_packs_the_same_header_as_pack_request(req_id, func_id, cls, deadline_us, slo_us,
                                                                  payload_len):
    """The sync client's per-model header template gives the bytes ``pack_request`` does."""
    packer = RequestPacker(func_id, cls, deadline_us, slo_us)
    assert packer.pack(req_id, payload_len) == pack_request(req_id, func_id, cls, deadline_us, slo_us, payload_len)


@pytest.mark.parametrize("value", [0, 0.0, -5, 0.0004, float("nan"), "soon", True])
def test_a_deadline_or_slo_of_none_left_is_refused_by_every_client_not_sent_as_none(value):
    # a caller's deadline that computed to 0 or less is already past: before, 0 was left out
    # of the HTTP and gRPC requests and written as "none" in the fast-path header (no limit)
    info, x = INFO, [A, B]
    for name in ("deadline_ms", "slo_ms"):
        targets = {"deadline_ms": None, "slo_ms": None, name: value}
        with pytest.raises(InvalidInput, match=name):
            _request_fields("rt", **targets)
        with pytest.raises(InvalidInput, match=name):
            _infer_body(info, x, "rt", binary=True, **targets)
        with pytest.raises(InvalidInput, match=name):
            infer_request(info, x, "rt", targets["deadline_ms"], slo_ms=targets["slo_ms"])


def test_deadlines_and_slos_reach_each_wire_in_its_unit():
    info, x = INFO, [A, B]
    assert _request_fields(None, 2.5, np.float64(0.001)) == (int(RequestClass.DEFAULT), 2500, 1)
    assert _request_fields(None, None, None) == (int(RequestClass.DEFAULT), 0, 0)
    body, _, _, _ = _infer_body(info, x, None, 2.5, np.int64(7), binary=False)
    assert json.loads(body)["parameters"] == {"deadline_ms": 2.5, "slo_ms": 7.0}
    req = infer_request(info, x, None, None, slo_ms=3)
    assert set(req.parameters) == {"slo_ms"} and req.parameters["slo_ms"].double_param == 3.0
