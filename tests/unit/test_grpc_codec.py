"""gRPC message encoding without a server: typed contents, parameters, request decoding."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.client.common import ModelInfo
from splitserve.client.grpc import infer_request, infer_result, model_info
from splitserve.errors import BadSize, InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.protocol import grpc_api as pb
from splitserve.protocol.grpc_codec import (
    CONTENTS_FIELD, fill_contents, params_dict, set_param, set_repo_param, tensor_from_contents,
)
from splitserve.protocol.header import RequestClass
from splitserve.server.grpc_server import _call_options, decode_inputs
from splitserve.server.shm import SystemSharedMemory
from splitserve.types import V2_TO_NUMPY, TensorSpec

NO_SHM = SystemSharedMemory(max_regions=1, max_bytes=1)  # no region registered

CFG = ModelConfig.from_dict({
    "name": "m", "max_batch_size": 8, "artifact": {"kind": "zoo", "arch": "vecadd1k"},
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [4]}, {"name": "b", "datatype": "INT32", "shape": [2, 2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
})


@pytest.mark.parametrize("datatype", [d for d in V2_TO_NUMPY if d in CONTENTS_FIELD])
def test_typed_contents_round_trip(datatype):
    dt = V2_TO_NUMPY[datatype]
    arr = (np.arange(6) % 2).astype(dt).reshape(2, 3)
    c = pb.InferTensorContents()
    fill_contents(c, arr, datatype)
    back = tensor_from_contents("t", datatype, (2, 3), c)
    assert back.dtype == dt
    np.testing.assert_array_equal(back, arr)


def test_typed_contents_refusals():
    c = pb.InferTensorContents(fp32_contents=[1.0, 2.0])
    with pytest.raises(InvalidInput, match="int_contents"):
        tensor_from_contents("t", "INT32", (2,), c)  # data in the wrong field
    with pytest.raises(BadSize, match="2 values"):
        tensor_from_contents("t", "FP32", (3,), c)
    with pytest.raises(InvalidInput, match="raw"):
        tensor_from_contents("t", "FP16", (2,), c)
    with pytest.raises(InvalidInput, match="UINT8 range"):
        tensor_from_contents("t", "UINT8", (1,), pb.InferTensorContents(uint_contents=[256]))
    with pytest.raises(InvalidInput, match="unknown datatype"):
        tensor_from_contents("t", "FLOAT", (1,), c)


def test_parameters():
    req = pb.ModelInferRequest()
    for k, v in {"b": True, "i": 7, "f": 2.5, "s": "rt"}.items():
        set_param(req.parameters, k, v)
    assert params_dict(req.parameters) == {"b": True, "i": 7, "f": 2.5, "s": "rt"}
    load = pb.RepositoryModelLoadRequest()
    set_repo_param(load.parameters, "file:w", b"\x00\x01")
    assert load.parameters["file:w"].bytes_param == b"\x00\x01"
    assert _call_options({"class": "rt", "deadline_ms": 20}) == (RequestClass.RT, 0.02, None)
    assert _call_options({"class": "rt", "slo_ms": 5}) == (RequestClass.RT, None, 0.005)
    assert _call_options({}) == (RequestClass.DEFAULT, None, None)
    assert _call_options({"class": "strict"}).cls is RequestClass.RT
    for bad in ("urgent", True, 0.5):  # bool_param and double_param are no class (True was BE)
        with pytest.raises(InvalidInput, match="class"):
            _call_options({"class": bad})
    with pytest.raises(InvalidInput, match="deadline_ms"):
        _call_options({"deadline_ms": -1})
    with pytest.raises(InvalidInput, match="slo_ms"):
        _call_options({"slo_ms": 0})


def test_client_request_decodes_on_the_server_side():
    info = ModelInfo("m", 3, CFG.inputs, CFG.outputs, 8)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(12, dtype=np.int32).reshape(3, 2, 2)
    req = pb.ModelInferRequest.FromString(infer_request(info, [a, b], "be", 50).SerializeToString())
    assert params_dict(req.parameters) == {"class": "be", "deadline_ms": 50.0}
    got = decode_inputs(CFG, req, NO_SHM)
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], b)
    # the same tensors as typed contents, given in another order
    typed = pb.ModelInferRequest(model_name="m")
    tb = typed.inputs.add(name="b", datatype="INT32", shape=[3, 2, 2])
    tb.contents.int_contents.extend(b.ravel().tolist())
    ta = typed.inputs.add(name="a", datatype="FP32", shape=[3, 4])
    ta.contents.fp32_contents.extend(a.ravel().tolist())
    got = decode_inputs(CFG, typed, NO_SHM)
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], b)


def test_decode_inputs_refusals():
    info = ModelInfo("m", 3, CFG.inputs, CFG.outputs, 8)
    a = np.zeros((1, 4), np.float32)
    b = np.zeros((1, 2, 2), np.int32)
    req = infer_request(info, [a, b], None, None)
    req.raw_input_contents[0] = b"\x00" * 15
    with pytest.raises(BadSize, match="15 bytes"):
        decode_inputs(CFG, req, NO_SHM)
    req = infer_request(info, [a, b], None, None)
    req.inputs[1].datatype = "FP32"
    with pytest.raises(InvalidInput, match="INT32, got FP32"):
        decode_inputs(CFG, req, NO_SHM)
    req = infer_request(info, [a, b], None, None)
    req.inputs[0].shape[:] = [2, 2]
    with pytest.raises(BadSize, match=r"\[n, 4\]"):
        decode_inputs(CFG, req, NO_SHM)
    req = infer_request(info, [a, b], None, None)
    req.inputs[1].name = "a"
    with pytest.raises(InvalidInput, match="twice"):
        decode_inputs(CFG, req, NO_SHM)
    req = infer_request(info, [a, b], None, None)
    req.inputs[0].contents.fp32_contents.extend([0.0] * 4)
    with pytest.raises(InvalidInput, match="one or the other"):
        decode_inputs(CFG, req, NO_SHM)
    req = infer_request(info, [a, b], None, None)
    del req.raw_input_contents[1]
    with pytest.raises(InvalidInput, match="1 entries for 2 inputs"):
        decode_inputs(CFG, req, NO_SHM)


def test_response_and_metadata_decoding():
    y = np.arange(8, dtype=np.float32).reshape(2, 4)
    resp = pb.ModelInferResponse(model_name="m")
    resp.outputs.add(name="y", datatype="FP32", shape=[2, 4])
    resp.raw_output_contents.append(y.tobytes())
    for k, v in {"queue_us": 3, "compute_us": 5, "total_us": 11}.items():
        set_param(resp.parameters, k, v)
    r = infer_result(resp, batched=True)
    np.testing.assert_array_equal(r.value(), y)
    assert r.value().flags.writeable and (r.queue_us, r.compute_us, r.total_us) == (3, 5, 11)
    np.testing.assert_array_equal(infer_result(resp, batched=False).value(), y[0])

    meta = pb.ModelMetadataResponse(name="m", versions=["1"], platform="pytorch")
    meta.inputs.add(name="a", datatype="FP32", shape=[-1, 4])
    meta.outputs.add(name="y", datatype="FP32", shape=[-1, 4])
    set_param(meta.parameters, "max_batch_size", 8)
    set_param(meta.parameters, "func_id", 3)
    info = model_info(meta)
    assert info.inputs == (TensorSpec("a", "FP32", (4,)),) and info.max_batch_size == 8 and info.func_id == 3


@pytest.mark.parametrize("value", [0, -1, "50", b"50", True, float("nan"), float("inf")])
def test_a_deadline_is_a_positive_number_of_milliseconds(value):
    with pytest.raises(InvalidInput, match="deadline_ms.*positive"):
        _call_options({"deadline_ms": value})
