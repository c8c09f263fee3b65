"""Open Inference Protocol v2 tensor and body codec (no server, no sockets)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.errors import BadSize, InvalidInput
from splitserve.protocol import v2
from splitserve.protocol.header import RequestClass
from splitserve.types import V2_TO_NUMPY, TensorSpec


def _sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(0)
    dt = V2_TO_NUMPY[datatype]
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dt)
        a.flat[0], a.flat[-1] = info.min, info.max  # the range ends survive both encodings
        return a
    return rng.standard_normal(shape).astype(dt)


@pytest.mark.parametrize("datatype", list(V2_TO_NUMPY))
@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips(datatype, binary):
    x = _sample(datatype, (2, 3, 4))
    parts, hlen = v2.build_infer_request([("x", x)], binary=binary, id="r1")
    body = b"".join(bytes(p) for p in parts)
    req = v2.parse_infer_request(body, hlen)
    assert req.id == "r1" and req.datatypes == {"x": datatype} and req.binary_output is binary
    got = req.inputs["x"]
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, x)
    # and back out as a response
    parts, hlen = v2.build_infer_response("m", "1", req, [("y", x)], {"queue_us": 5})
    assert (hlen is not None) is binary
    resp = v2.parse_infer_response(b"".join(bytes(p) for p in parts), hlen)
    assert resp.model_name == "m" and resp.id == "r1" and resp.parameters == {"queue_us": 5}
    np.testing.assert_array_equal(resp.outputs["y"], x)


def test_nested_json_data_and_bytes_tensors():
    body = json.dumps({"inputs": [
        {"name": "a", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
        {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["hi", "there"]},
    ]}).encode()
    req = v2.parse_infer_request(body)
    np.testing.assert_array_equal(req.inputs["a"], np.array([[1, 2], [3, 4]], np.int32))
    assert list(req.inputs["s"]) == [b"hi", b"there"]
    raw = v2.tensor_to_bytes(req.inputs["s"])
    assert bytes(raw) == b"\x02\x00\x00\x00hi\x05\x00\x00\x00there"
    assert list(v2.tensor_from_bytes("s", "BYTES", [2], raw)) == [b"hi", b"there"]


def test_binary_bytes_are_little_endian_views():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3],
                                   "parameters": {"binary_data_size": 24}}]}).encode()
    req = v2.parse_infer_request(head + x.astype("<f4").tobytes(), str(len(head)))
    np.testing.assert_array_equal(req.inputs["x"], x)


def test_request_parameters_class_and_deadline():
    def req(params):
        return v2.parse_infer_request(json.dumps({"parameters": params, "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}).encode())

    assert req({"class": "rt", "deadline_ms": 50}).cls == RequestClass.RT
    assert req({"class": "be"}).deadline_s is None
    assert req({}).cls == RequestClass.DEFAULT
    assert req({"deadline_ms": 50}).deadline_s == pytest.approx(0.05)
    with pytest.raises(InvalidInput, match="parameters.class"):
        _ = req({"class": "urgent"}).cls
    with pytest.raises(InvalidInput, match="deadline_ms"):
        _ = req({"deadline_ms": -1}).deadline_s


@pytest.mark.parametrize("body, header, error, match", [
    (b"{not json", None, InvalidInput, "not valid JSON"),
    (b"[1, 2]", None, InvalidInput, "JSON object"),
    (b"{}", None, InvalidInput, "inputs"),
    (b'{"inputs": [{"name": "x", "shape": [1]}]}', None, InvalidInput, "datatype"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', None, InvalidInput, "neither"),
    (b'{"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]}', None, InvalidInput, "datatype"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2]}]}', None, BadSize, "fill"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, InvalidInput, "negative"),
    (b'{"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, 2.5]}]}', None, InvalidInput,
     "integers"),
    (b'{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [256]}]}', None, InvalidInput, "range"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None, InvalidInput, "numbers"),
    (b'{"inputs": [{"name": "x", "datatype": "BOOL", "shape": [1], "data": [1]}]}', None, InvalidInput, "true/false"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}', None, InvalidInput,
     "rectangular"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]},'
     b' {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}', None, InvalidInput, "twice"),
])
def test_malformed_requests_are_refused_with_a_reason(body, header, error, match):
    with pytest.raises(error, match=match):
        v2.parse_infer_request(body, header)


def test_binary_framing_errors():
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4],
                                   "parameters": {"binary_data_size": 16}}]}).encode()
    with pytest.raises(BadSize, match="truncated"):
        v2.parse_infer_request(head + b"\0" * 10, len(head))
    with pytest.raises(BadSize, match="no input claims"):
        v2.parse_infer_request(head + b"\0" * 20, len(head))
    with pytest.raises(BadSize, match="does not fit"):
        v2.parse_infer_request(head, len(head) + 1)
    with pytest.raises(InvalidInput, match="integer"):
        v2.parse_infer_request(head, "abc")
    wrong = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4],
                                    "parameters": {"binary_data_size": 12}}]}).encode()
    with pytest.raises(BadSize, match="needs 16"):
        v2.parse_infer_request(wrong + b"\0" * 12, len(wrong))
    with pytest.raises(BadSize, match="runs past"):
        v2.tensor_from_bytes("s", "BYTES", [1], b"\x09\x00\x00\x00abc")


def test_model_inputs_orders_and_checks_against_specs():
    specs = (TensorSpec("ids", "INT32", (4,)), TensorSpec("mask", "INT32", (4,)))
    ids, mask = np.ones((2, 4), np.int32), np.zeros((2, 4), np.int32)
    assert [a is b for a, b in zip(v2.model_inputs("m", specs, {"mask": mask, "ids": ids}), (ids, mask))] == [True, True]
    with pytest.raises(InvalidInput, match="missing"):
        v2.model_inputs("m", specs, {"ids": ids})
    with pytest.raises(InvalidInput, match="no input 'other'"):
        v2.model_inputs("m", specs, {"ids": ids, "mask": mask, "other": ids})
    with pytest.raises(InvalidInput, match="is INT32, got FP32"):
        v2.model_inputs("m", specs, {"ids": ids.astype(np.float32), "mask": mask})
    with pytest.raises(InvalidInput, match="BYTES inputs are not supported"):
        v2.model_inputs("m", specs, {"ids": np.array([[b"a"] * 4], dtype=object), "mask": mask})
    with pytest.raises(BadSize, match=r"\[n, 4\]"):
        v2.model_inputs("m", specs, {"ids": ids[0], "mask": mask[0]})


def test_requested_outputs_pick_binary_per_output():
    req = v2.parse_infer_request(json.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
        "outputs": [{"name": "b", "parameters": {"binary_data": True}}, {"name": "a"}],
    }).encode())
    a, b, c = (np.full((1, 2), v, np.float32) for v in (1, 2, 3))
    parts, hlen = v2.build_infer_response("m", "1", req, [("a", a), ("b", b), ("c", c)])
    head = json.loads(bytes(parts[0]))
    assert [o["name"] for o in head["outputs"]] == ["a", "b"]  # only those asked for
    assert head["outputs"][0]["data"] == [1.0, 1.0] and head["outputs"][1]["parameters"] == {"binary_data_size": 8}
    assert hlen == len(parts[0]) and bytes(parts[1]) == b.tobytes()
    bad = v2.parse_infer_request(json.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": [{"name": "zz"}],
    }).encode())
    with pytest.raises(InvalidInput, match="no output 'zz'"):
        v2.build_infer_response("m", "1", bad, [("a", a)])


@pytest.mark.parametrize("value, seconds", [(None, None), (2.5, 0.0025), (50, 0.05), (0, None), (-1, None),
                                            ("50", None), (True, None), (float("nan"), None), (float("inf"), None)])
def test_http_and_grpc_share_one_deadline_rule(value, seconds):
    """HTTP's parameters.deadline_ms and gRPC's deadline_ms parameter: the same values are
    accepted (absent: none) and the same refused (zero, negative, not finite, not a number)."""
    from splitserve.server.grpc_server import _call_options

    params = {} if value is None else {"deadline_ms": value}
    body = json.dumps({"parameters": params, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                                                         "data": [1]}]}).encode()
    if value is None or seconds is not None:
        assert v2.parse_infer_request(body).deadline_s == seconds == _call_options(params)[1]
    else:
        with pytest.raises(InvalidInput, match="positive"):
            _ = v2.parse_infer_request(body).deadline_s
        with pytest.raises(InvalidInput, match="positive"):
            _call_options(params)


def test_infer_body_limit_follows_the_model():
    from splitserve.types import TensorSpec

    specs = (TensorSpec.from_dict({"name": "x", "datatype": "UINT8", "shape": [1, 28, 28]}),
             TensorSpec.from_dict({"name": "y", "datatype": "FP64", "shape": [3]}))
    base = v2.infer_body_limit(specs, 1, 32)
    assert v2.infer_body_limit(specs, 4, 32) - base == 3 * (784 * 32 + 3 * 32)  # linear in the batch
    assert v2.infer_body_limit(specs, 1, 4) - v2.infer_body_limit(specs, 1, 2) == 784 * 2  # FP64 keeps its 8 bytes
    # a full batch as JSON fits
    x = np.full((4, 1, 28, 28), 255, np.uint8)
    y = np.full((4, 3), -1.2345678901234567e-300)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [4, 1, 28, 28], "data": x.tolist()},
                                  {"name": "y", "datatype": "FP64", "shape": [4, 3], "data": y.tolist()}]})
    assert len(body) < v2.infer_body_limit(specs, 4, 32)
