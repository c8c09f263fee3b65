"""The worker's control messages: residency messages round-trip, a LOAD's fds travel as
places among its SCM_RIGHTS fds, and malformed or oversized messages are refused."""

from __future__ import annotations

import pytest

from splitserve.worker.messages import (MAX_LOAD_FDS, MAX_MESSAGE_BYTES, DoneMsg, FailedMsg, LoadedMsg, LoadMsg, Msg,
                                        UnloadedMsg, pack_ready, unpack_ready)
from splitserve.worker.spec import BindSpec, QueueFds, WorkerSpec

MODEL = {"name": "m", "artifact": {"kind": "zoo", "arch": "lenet"}}


def bind(rt: QueueFds, be: QueueFds, **kw) -> BindSpec:
    return BindSpec(MODEL, "/models/m", {"0": rt, "1": be}, **kw)


def test_load_carries_fd_places_and_the_receiver_puts_its_own_fds_there():
    sent = bind(QueueFds(8, [40, 41], [42]), QueueFds(8, [50, 51], [52]), segment_capacity=2,
                segment_times_ns=[(0, 1, 5)])
    data, fds = LoadMsg(7, sent).pack()
    assert data[0] == Msg.LOAD and fds == [40, 41, 42, 50, 51, 52]
    assert b"40" not in data  # the sender's fd numbers mean nothing to the receiver
    got = LoadMsg.unpack(data, [3, 4, 5, 6, 7, 8])
    assert got.binding == 7
    assert got.bind == bind(QueueFds(8, [3, 4], [5]), QueueFds(8, [6, 7], [8]), segment_capacity=2,
                            segment_times_ns=[(0, 1, 5)])


@pytest.mark.parametrize("received", [[], [3, 4, 5], [3, 4, 5, 6, 7, 8, 9]])
def test_load_with_other_fds_than_it_names_is_refused(received):
    data, _ = LoadMsg(1, bind(QueueFds(8, [40, 41], [42]), QueueFds(8, [50, 51], [52]))).pack()
    with pytest.raises(ValueError, match="fds"):
        LoadMsg.unpack(data, received)


def test_load_naming_an_fd_twice_is_refused():
    data, _ = LoadMsg(1, bind(QueueFds(8, [40], [41]), QueueFds(8, [50], [51]))).pack()
    forged = data.replace(b'"inputs":[2]', b'"inputs":[0]')
    assert forged != data
    with pytest.raises(ValueError, match="fds"):
        LoadMsg.unpack(forged, [3, 4, 5, 6])


def test_load_over_the_fd_or_size_limit_is_refused_when_packed():
    many = QueueFds(8, list(range(100, 100 + MAX_LOAD_FDS)), [99])
    with pytest.raises(ValueError, match="at most"):
        LoadMsg(1, bind(many, QueueFds(8, [1], [2]))).pack()
    profile = [(i, 1, 10**9) for i in range(MAX_MESSAGE_BYTES // 8)]
    huge = bind(QueueFds(8, [1], [2]), QueueFds(8, [3], [4]), segment_times_ns=profile)
    with pytest.raises(ValueError, match="limit"):
        LoadMsg(1, huge).pack()


@pytest.mark.parametrize("data", [b"\x03", b"\x03\x00\x00\x00\x01\x00\x00\x00{", b"\x03\x00\x00\x00\x01\x00\x00\x00[]",
                                  b'\x03\x00\x00\x00\x01\x00\x00\x00{"model": {}}'])
def test_malformed_load_raises_rather_than_binding(data):
    with pytest.raises((ValueError, TypeError, KeyError, AttributeError)):
        LoadMsg.unpack(data, [])


def test_answers_round_trip():
    loaded = LoadedMsg(3, "lenet", 246_000, 1_500_000, 3, "cpu")
    assert LoadedMsg.unpack(loaded.pack()) == loaded
    measured = LoadedMsg(3, "lenet", 246_000, 1_500_000, 3, "cpu", private_bytes=5 << 20)
    assert LoadedMsg.unpack(measured.pack()) == measured
    on_gpu = LoadedMsg(3, "resnet50", 102 << 20, 1_500_000, 5, "cuda:0", private_bytes=1 << 20, device_bytes=300 << 20)
    assert LoadedMsg.unpack(on_gpu.pack()) == on_gpu
    assert UnloadedMsg.unpack(UnloadedMsg(3, 150 << 20).pack()) == UnloadedMsg(3, 150 << 20)
    assert UnloadedMsg.unpack(UnloadedMsg(None).pack()) == UnloadedMsg(None)
    assert UnloadedMsg.unpack(UnloadedMsg(3, 150 << 20, parked_bytes=1 << 20).pack()).parked_bytes == 1 << 20
    failed = FailedMsg(Msg.LOAD, 3, "InvalidInput: not a safetensors file ✗")
    assert FailedMsg.unpack(failed.pack()) == failed
    assert unpack_ready(pack_ready({"pid": 1, "binding": None})) == {"pid": 1, "binding": None}


def test_a_worker_spec_names_only_its_process_and_its_own_fds():
    spec = WorkerSpec(ctrl_fd=5, flag_fd=6, cache_dir="/c", log_level="INFO", segment_time_weight=0.25)
    assert spec.fds() == [5, 6]
    assert WorkerSpec.from_json(spec.to_json()) == spec


def test_done_carries_the_batchs_input_and_output_copy_times():
    sent = DoneMsg(Msg.DONE, 9, 5_000, 3, 0, start_ns=123, input_ns=400, output_ns=600)
    got = DoneMsg.unpack(sent.pack())
    assert got == sent and got.infer_ns == 4_000
    assert DoneMsg(Msg.DONE, 9, 100, 1, 0, input_ns=80, output_ns=80).infer_ns == 0  # never negative
