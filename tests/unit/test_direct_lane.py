"""The direct endpoint's compiled intake (splitserve/_directlane.c) against the Python path it
stands in for (its answers: tests/unit/test_direct_answers.py): whatever it takes, the frame state machine would have accepted with the same
fields, in the same rows; whatever it declines, it leaves to that machine with nothing
written but free rows."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.errors import SplitServeError
from splitserve.protocol.header import HEADER_SIZE, MAX_PAYLOAD, Header, Kind, RequestClass, unpack_header
from splitserve.protocol.requests import call_class, stream_samples
from splitserve.modelconfig import ModelConfig
from splitserve.worker.counters import PAGE_BYTES, WorkerCounters

_directlane = pytest.importorskip("splitserve._directlane", reason="the compiled intake was not built")

FUNC_ID = 9
MAX_BATCH = 4
# two inputs of different sizes, so that a payload's inputs land in the right buffers
CFG = ModelConfig.from_dict({
    "name": "two", "max_batch_size": MAX_BATCH, "artifact": {"kind": "zoo", "arch": "vecadd1k"},
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [3]}, {"name": "b", "datatype": "UINT8", "shape": [5]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
})
SIZES = [12, 5]
OUT_SIZES = [12]
CLASSES = (RequestClass.RT, RequestClass.BE)


def _out_rows() -> list[list[np.ndarray]]:
    return [[np.zeros((MAX_BATCH, 3), np.float32)] for _ in CLASSES]


def _counts() -> tuple:
    return WorkerCounters(mmap.mmap(-1, PAGE_BYTES)).lane_counts()


def _lane(rt_only: bool, default: RequestClass) -> tuple["_directlane.Lane", list[list[np.ndarray]]]:
    """A lane over fresh buffers, with the class table DirectServer builds."""
    rows = [[np.full(MAX_BATCH * n, 0xEE, np.uint8) for n in SIZES] for _ in CLASSES]
    table = bytearray([255] * 256)
    for value in range(256):
        try:
            table[value] = CLASSES.index(call_class(value, default, rt_only))
        except SplitServeError:
            pass
    return _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(table), [[memoryview(a) for a in c] for c in rows],
                            OUT_SIZES, _out_rows(), *_counts()), rows


def _python_takes(frame: bytes, rt_only: bool, default: RequestClass, free: tuple[int, int]):
    """What the Python path makes of the same read, for a lane's kind of frame: the fields
    it accepts it with, or None where it would refuse, wait or need more bytes."""
    try:
        h = unpack_header(frame)
    except SplitServeError:
        return None
    if h.kind != Kind.REQUEST or h.func_id != FUNC_ID or h.payload_len != len(frame) - HEADER_SIZE:
        return None
    try:
        count = stream_samples(h, CFG)
        c = CLASSES.index(call_class(h.cls, default, rt_only))
    except SplitServeError:
        return None
    if free[c] < 0 or free[c] + count > MAX_BATCH:
        return None
    return h.req_id, c, count, h.deadline_us, h.slo_us


@st.composite
def reads(draw):
    count = draw(st.integers(0, MAX_BATCH + 1))
    payload = draw(st.binary(min_size=count * 17, max_size=count * 17))
    h = Header(Kind.REQUEST, req_id=draw(st.integers(0, 2**64 - 1)), func_id=FUNC_ID, cls=draw(st.integers(0, 3)),
               deadline_us=draw(st.integers(0, 2**64 - 1)), payload_len=len(payload),
               slo_us=draw(st.integers(0, 2**64 - 1)))
    frame = bytearray(h.pack() + payload)
    # one change that the checks must catch (or none): a field, a trailing byte, a cut
    change = draw(st.sampled_from(["none", "magic", "version", "kind", "func_id", "seq", "segs", "len", "extra",
                                   "cut", "flags"]))
    if change == "magic":
        frame[0] ^= 1
    elif change == "version":
        frame[4] = 2
    elif change == "kind":
        frame[5] = draw(st.sampled_from([0, 2, 6, 8]))
    elif change == "func_id":
        frame[16] ^= 1
    elif change == "seq":
        frame[18] = 1
    elif change == "segs":
        frame[20] = 2
    elif change == "len":
        frame[32:36] = draw(st.sampled_from([len(payload) + 1, MAX_PAYLOAD + 1, 0])).to_bytes(4, "little")
    elif change == "extra":
        frame += b"\x00" * draw(st.integers(1, 70))
    elif change == "cut":
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif change == "flags":
        frame[6] = 1  # ignored on a stream, by both
    free = (draw(st.integers(-1, MAX_BATCH)), draw(st.integers(-1, MAX_BATCH)))
    return bytes(frame), draw(st.booleans()), draw(st.sampled_from(CLASSES)), free


@settings(max_examples=400, deadline=None)
@given(reads())
def test_the_lane_takes_exactly_what_the_python_path_accepts_into_the_same_rows(read):
    frame, rt_only, default, free = read
    lane, rows = _lane(rt_only, default)
    stage = bytearray(frame) + bytearray(64)  # the stage is bigger than a read
    got = lane.take(stage, len(frame), *free)
    assert got == _python_takes(frame, rt_only, default, free)
    untouched = [[a.copy() for a in c] for c in _lane(rt_only, default)[1]]
    if got is None:  # nothing written
        for c in range(2):
            for a, b in zip(rows[c], untouched[c]):
                np.testing.assert_array_equal(a, b)
        return
    _, c, count, _, _ = got
    off = HEADER_SIZE
    for i, n in enumerate(SIZES):  # each input's samples at the class's free row, nothing else changed
        expected = untouched[c][i]
        expected[free[c] * n : (free[c] + count) * n] = np.frombuffer(frame[off : off + count * n], np.uint8)
        np.testing.assert_array_equal(rows[c][i], expected)
        off += count * n
    for a, b in zip(rows[1 - c], untouched[1 - c]):
        np.testing.assert_array_equal(a, b)


def test_a_lane_refuses_buffers_shorter_than_a_batch_and_a_count_outside_the_stage():
    short = [[memoryview(bytearray(n)) for n in SIZES] for _ in CLASSES]
    rows = [[memoryview(bytearray(MAX_BATCH * n)) for n in SIZES] for _ in CLASSES]
    with pytest.raises(ValueError, match="shorter"):
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), short, OUT_SIZES, _out_rows(), *_counts())
    with pytest.raises(ValueError, match="out_rows.*shorter"):
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), rows, OUT_SIZES, [[np.zeros(3, np.float32)]] * 2,
                         *_counts())
    with pytest.raises(ValueError, match="one buffer per tensor"):
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), rows, OUT_SIZES + [4], _out_rows(), *_counts())
    words, page, offset, slots, received, admit, by_size, calls, call_words, durations, bounds = _counts()
    with pytest.raises(ValueError, match="slot outside"):
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), rows, OUT_SIZES, _out_rows(), words, page, offset,
                         (*slots[:7], len(words)), received, admit, by_size, calls, call_words, durations, bounds)
    with pytest.raises(ValueError, match="int64"):  # a call block too short for the words a call counts and sets
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), rows, OUT_SIZES, _out_rows(), words, page, offset,
                         slots, received, admit, by_size, calls, 7, durations, bounds)
    with pytest.raises(ValueError, match="ascending"):  # duration bins whose bounds are out of order
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), rows, OUT_SIZES, _out_rows(), words, page, offset,
                         slots, received, admit, by_size, calls, call_words, durations, bounds[::-1])
    with pytest.raises(ValueError, match="int64"):  # more bounds than a lane bins by
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), rows, OUT_SIZES, _out_rows(), words, page, offset,
                         slots, received, admit, by_size, calls, call_words, durations, tuple(range(1, 40)))
    with pytest.raises(ValueError):
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(255), rows, OUT_SIZES, _out_rows(), *_counts())
    lane, _ = _lane(False, RequestClass.RT)
    with pytest.raises(ValueError, match="outside the stage"):
        lane.take(bytearray(10), 11, 0, 0)
    with pytest.raises(BufferError):  # read-only rows cannot be written into
        _directlane.Lane(FUNC_ID, SIZES, MAX_BATCH, bytes(256), [[b"x" * 64, b"y" * 64]] * 2, OUT_SIZES, _out_rows(),
                         *_counts())
