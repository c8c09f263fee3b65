"""The system shared-memory registry without a server: keys, bounds, caps, and a region
unregistered while a call still holds a view of it (objects in a temporary directory stand
in for /dev/shm)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splitserve.errors import BadSize, InvalidInput, NotFound, Refused
from splitserve.modelconfig import ModelConfig
from splitserve.protocol import grpc_api as pb
from splitserve.protocol.grpc_codec import set_param
from splitserve.protocol.v2 import ShmRef, parse_infer_request, shm_ref
from splitserve.server.grpc_server import _decode_call, _encode_response
from splitserve.server.shm import SystemSharedMemory, input_tensor, output_views, write_outputs

CFG = ModelConfig.from_dict({
    "name": "m", "max_batch_size": 8, "artifact": {"kind": "zoo", "arch": "vecadd1k"},
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
})


@pytest.fixture
def objects(tmp_path: Path) -> Path:
    (tmp_path / "obj").write_bytes(bytes(range(64)))
    (tmp_path / "small").write_bytes(b"\0" * 8)
    (tmp_path / "link").symlink_to(tmp_path / "obj")
    return tmp_path


def test_keys_must_name_one_object_in_the_directory(objects: Path) -> None:
    regions = SystemSharedMemory(8, 1 << 20, objects)
    for key in ("/a/b", "/..", "/", "", "..", "/.hidden", "//obj"):
        with pytest.raises(InvalidInput, match="must be '/name'"):
            regions.register("r", key, 0, 8)
    with pytest.raises(NotFound, match="no shared-memory object with key '/nope'"):
        regions.register("r", "/nope", 0, 8)
    with pytest.raises(InvalidInput, match="cannot open"):  # symlinks are not followed
        regions.register("r", "/link", 0, 8)
    with pytest.raises(InvalidInput, match="runs past the end of '/small'"):
        regions.register("r", "/small", 4, 8)
    with pytest.raises(InvalidInput, match="byte_size must be positive"):
        regions.register("r", "/obj", 0, 0)
    assert regions.status() == []


def test_views_stay_inside_their_region(objects: Path) -> None:
    regions = SystemSharedMemory(8, 1 << 20, objects)
    regions.register("r", "/obj", 16, 32)  # bytes 16..47 of the object
    assert bytes(regions.view(ShmRef("r", 4, 4), "input 'a'")) == bytes([20, 21, 22, 23])
    with pytest.raises(InvalidInput, match=r"input 'a': .* runs past the end of region 'r' \(32 bytes\)"):
        regions.view(ShmRef("r", 30, 4), "input 'a'")
    with pytest.raises(InvalidInput, match="output 'y': no system shared-memory region 'q' is registered"):
        regions.view(ShmRef("q", 0, 4), "output 'y'")
    with pytest.raises(InvalidInput, match="already in manager"):
        regions.register("r", "/obj", 0, 8)
    [status] = regions.status("r")
    assert (status.key, status.offset, status.byte_size) == ("/obj", 16, 32)
    with pytest.raises(NotFound, match="no system shared-memory region 'q'"):
        regions.status("q")


def test_caps_on_regions_and_bytes(objects: Path) -> None:
    regions = SystemSharedMemory(2, 40, objects)
    regions.register("a", "/obj", 0, 32)
    with pytest.raises(Refused, match="SPLITSERVE_SHM_MAX_BYTES"):
        regions.register("b", "/obj", 0, 16)
    regions.register("b", "/obj", 0, 8)
    with pytest.raises(Refused, match="SPLITSERVE_SHM_MAX_REGIONS"):
        regions.register("c", "/small", 0, 1)
    regions.unregister("a")
    regions.register("c", "/obj", 0, 32)  # the freed bytes and place count again
    regions.unregister()
    assert regions.status() == []
    regions.unregister("never-registered")  # no error, as Triton


def test_a_region_unregistered_while_a_call_holds_it_stays_usable_by_that_call(objects: Path) -> None:
    regions = SystemSharedMemory(8, 1 << 20, objects)
    regions.register("io", "/obj", 0, 32)
    x = input_tensor(regions, "a", "FP32", (1, 4), ShmRef("io", 0, 16))
    outs = output_views(regions, CFG, 1, {"y": ShmRef("io", 16, 16)})
    regions.unregister("io")  # the call still holds its views
    assert regions.status() == []
    y = (x + 1).astype(np.float32)
    write_outputs(outs, {"y": y})
    assert (objects / "obj").read_bytes()[16:32] == y.tobytes()
    with pytest.raises(InvalidInput, match="no system shared-memory region 'io'"):
        regions.view(ShmRef("io", 0, 4), "input 'a'")


def test_tensor_sizes_must_match_their_byte_size(objects: Path) -> None:
    regions = SystemSharedMemory(8, 1 << 20, objects)
    regions.register("io", "/obj", 0, 64)
    with pytest.raises(BadSize, match=r"shared_memory_byte_size 12, but FP32\[1, 4\] is 16 bytes"):
        input_tensor(regions, "a", "FP32", (1, 4), ShmRef("io", 0, 12))
    with pytest.raises(BadSize, match="2 samples of FP32"):
        output_views(regions, CFG, 2, {"y": ShmRef("io", 0, 16)})
    with pytest.raises(InvalidInput, match="has no output 'z'"):
        output_views(regions, CFG, 1, {"z": ShmRef("io", 0, 16)})


def test_wire_parameters_name_a_region() -> None:
    assert shm_ref("input 'a'", {}) is None
    assert shm_ref("input 'a'", {"shared_memory_region": "r", "shared_memory_byte_size": 8}) == ShmRef("r", 0, 8)
    for bad in ({"shared_memory_region": "r"}, {"shared_memory_region": "", "shared_memory_byte_size": 8},
                {"shared_memory_region": "r", "shared_memory_byte_size": -1},
                {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": True}):
        with pytest.raises(InvalidInput, match="input 'a'"):
            shm_ref("input 'a'", bad)
    body = (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 4], "parameters": '
            b'{"shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": 8}}], '
            b'"outputs": [{"name": "y", "parameters": {"shared_memory_region": "o", "shared_memory_byte_size": 16}}]}')
    req = parse_infer_request(body)
    assert req.shm_inputs["a"].ref == ShmRef("r", 8, 16) and req.shm_inputs["a"].shape == (1, 4)
    assert req.shm_outputs == {"y": ShmRef("o", 0, 16)} and not req.inputs
    with pytest.raises(InvalidInput, match="also carries data"):
        parse_infer_request(body.replace(b'"shape": [1, 4],', b'"shape": [1, 4], "data": [1, 2, 3, 4],'))


def test_an_object_shrunk_after_registration_is_refused_not_touched(objects: Path) -> None:
    regions = SystemSharedMemory(8, 1 << 20, objects)
    regions.register("r", "/obj", 0, 64)
    (objects / "obj").write_bytes(b"\0" * 32)  # the client truncates it: touching bytes 32.. would be SIGBUS
    assert bytes(regions.view(ShmRef("r", 0, 32), "input 'a'")) == b"\0" * 32
    with pytest.raises(InvalidInput, match="was shrunk below the region's end"):
        regions.view(ShmRef("r", 16, 32), "input 'a'")


def test_grpc_answer_keeps_raw_output_positions_around_a_shared_memory_output(objects: Path) -> None:
    cfg = ModelConfig.from_dict({**CFG.to_dict(), "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]},
                                                              {"name": "z", "datatype": "FP32", "shape": [4]}]})
    regions = SystemSharedMemory(8, 1 << 20, objects)
    regions.register("o", "/obj", 0, 16)
    request = pb.ModelInferRequest(model_name="m", id="7", raw_input_contents=[np.ones(4, np.float32).tobytes()])
    request.inputs.add(name="a", datatype="FP32", shape=[1, 4])
    y = request.outputs.add(name="y")
    set_param(y.parameters, "shared_memory_region", "o")
    set_param(y.parameters, "shared_memory_byte_size", 16)
    request.outputs.add(name="z")
    call = _decode_call(cfg, request, regions)
    ys, zs = np.full((1, 4), 2, np.float32), np.full((1, 4), 3, np.float32)
    resp = pb.ModelInferResponse.FromString(_encode_response(cfg, "1", request, call, [ys, zs], {}, False))
    assert list(resp.raw_output_contents) == [b"", zs.tobytes()]  # z stays second, where clients look
    assert resp.outputs[0].parameters["shared_memory_region"].string_param == "o"
    assert (objects / "obj").read_bytes()[:16] == ys.tobytes()
