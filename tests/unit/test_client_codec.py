"""What every client encodes and decodes with (splitserve/client/common.py): the forms an
input may take, the checks on it, and answers decoded as views of their payload."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.client.common import ModelInfo, decode_outputs, encode_inputs
from splitserve.errors import InvalidInput

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
