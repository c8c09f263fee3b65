"""A GPU per worker: the model's ``device`` read strictly, partitions (whole GPUs, MIG devices)
from the NVML listing (an in-memory NVML that raises NVML's errors), the assignment per
instance, and the worker's CUDA_VISIBLE_DEVICES claim."""

from __future__ import annotations

import asyncio
import tomllib

import pytest

from splitserve.client.http import with_device
from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.placement.devices import DeviceAssigner, DeviceRequest, parse_device, partitions_of
from splitserve.placement.gpus import read_gpus
from splitserve.placement.mig import GpuListing
from splitserve.server.gpus import GpuInventory
from splitserve.worker.gpu_env import VAR, claim_visible
from tests.fake_nvml import A100, GIB, FakeGpu, FakeInstance, FakeNvml


def node(*gpus: FakeGpu) -> GpuListing:
    return read_gpus(FakeNvml(list(gpus)))


def h200(uuid: str) -> FakeGpu:
    return FakeGpu("NVIDIA H200", 141 * GIB, None, (), [], uuid)


def a100_mig(uuid: str) -> FakeGpu:
    """An A100 with MIG on, split 4g + 3g."""
    return FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GIB, (1, 1), A100,
                   [FakeInstance(1, 5, (0, 4), {0: 4}), FakeInstance(2, 9, (4, 4), {0: 3})], uuid)


@pytest.mark.parametrize("text, want", [("cpu", DeviceRequest("cpu")), ("cuda", DeviceRequest("cuda")),
                                        ("cuda:0", DeviceRequest("cuda", 0)), ("cuda:12", DeviceRequest("cuda", 12))])
def test_device_forms_accepted(text, want):
    assert parse_device(text) == want


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:1", "CUDA", "cuda:0 ", "cuda0"])
def test_other_device_forms_are_refused_with_the_forms_named(text):
    with pytest.raises(InvalidInput, match="use 'cpu', 'cuda' or 'cuda:N'"):
        parse_device(text)


def test_a_model_config_with_a_bad_device_is_refused_at_registration():
    base = {"name": "m", "artifact": {"kind": "zoo", "arch": "resnet18"}}
    assert ModelConfig.from_dict({**base, "device": "cuda:1"}).device == "cuda:1"
    with pytest.raises(InvalidInput, match="cuda:N"):
        ModelConfig.from_dict({**base, "device": "cuda:one"})


def test_partitions_are_whole_gpus_and_the_mig_devices_of_gpus_with_mig_on():
    parts = partitions_of(node(h200("GPU-a"), a100_mig("GPU-b")))
    assert [p.gpu for p in parts] == [0, 1, 1]
    assert parts[0].uuid == "GPU-a" and parts[0].mem_bytes == 141 * GIB
    assert all(p.uuid.startswith("MIG-") for p in parts[1:])  # never the MIG GPU whole
    assert "MIG 4g" in parts[1].name and "MIG 3g" in parts[2].name


def test_cuda_spreads_instances_over_the_least_held_partition_and_an_index_names_one():
    d = DeviceAssigner(lambda: node(h200("GPU-a"), h200("GPU-b")))
    assert d.assign("m", 0, "cpu") is None
    got = [d.assign("m", i, "cuda").visible_devices for i in range(3)]
    assert got == ["GPU-a", "GPU-b", "GPU-a"]
    assert d.assign("m", 1, "cuda").visible_devices == "GPU-b"  # a restarted instance keeps its GPU
    pinned = d.assign("n", 0, "cuda:1")
    assert pinned.visible_devices == "GPU-b" and pinned.torch_device == "cuda:0"
    assert d.held() == {"GPU-a": 2, "GPU-b": 2}
    assert d.owners_on({"GPU-a"}) == {"m"} and d.owners_on({"GPU-b"}) == {"m", "n"}  # what a re-carve drains
    d.release("m", 0)
    assert d.held() == {"GPU-a": 1, "GPU-b": 2}
    d.release("m")
    assert d.held() == {"GPU-b": 1} and d.owners_on({"GPU-a"}) == set()


def test_expected_names_the_partition_assign_would_give_without_taking_it():
    d = DeviceAssigner(lambda: node(h200("GPU-a"), a100_mig("GPU-b")))
    assert d.expected("m", 0, "cpu") is None
    assert d.expected("m", 0, "cuda:9") is None  # its load fails and says why; nothing to charge
    mig = d.expected("m", 0, "cuda:2")
    assert mig is not None and mig.startswith("MIG-") and d.held() == {}
    d.assign("n", 0, "cuda")
    assert d.expected("m", 0, "cuda") != "GPU-a"  # the least-held partition, as assign would choose
    assert d.expected("n", 0, "cuda") == "GPU-a"  # an instance that holds one keeps it


def test_an_index_past_the_partitions_or_a_node_without_gpus_says_what_there_is():
    d = DeviceAssigner(lambda: node(h200("GPU-a")))
    with pytest.raises(InvalidInput, match=r"cuda:3.*this node has cuda:0 \(NVIDIA H200\)"):
        d.assign("m", 0, "cuda:3")
    none = DeviceAssigner(lambda: read_gpus(FakeNvml([], driver=False)))
    with pytest.raises(InvalidInput, match="NVML not available"):
        none.assign("m", 0, "cuda")
    assert none.held() == {}


def test_the_inventory_reads_once_on_demand_when_a_gpu_model_binds_before_the_first_read():
    reads = []

    def read() -> GpuListing:
        reads.append(1)
        return node(h200("GPU-a"))

    inv = GpuInventory(read, max_age_s=30.0, clock=lambda: 0.0)
    assert inv.current().gpus[0].uuid == "GPU-a"
    assert inv.current().gpus[0].uuid == "GPU-a"
    assert len(reads) == 1
    assert asyncio.run(_snapshot(inv))["gpus"][0]["uuid"] == "GPU-a"


async def _snapshot(inv: GpuInventory) -> dict:
    return inv.snapshot()


def test_the_worker_claims_its_partition_before_cuda_starts_and_refuses_another_after():
    env: dict[str, str] = {}
    claim_visible(None, lambda: False, env)
    assert env == {}
    claim_visible("GPU-a", lambda: False, env)
    assert env == {VAR: "GPU-a"}
    claim_visible("GPU-a", lambda: True, env)  # the same partition again: fine
    with pytest.raises(InvalidInput, match="cannot switch to GPU-b"):
        claim_visible("GPU-b", lambda: True, env)
    assert env == {VAR: "GPU-a"}


def test_the_built_in_zoo_is_served_on_the_node_s_zoo_device(tmp_path):
    from splitserve.config import ServerConfig
    from splitserve.registry import Registry

    assert ServerConfig.of(zoo_device="cuda").checked().gpu.zoo_device == "cuda"
    with pytest.raises(InvalidInput, match="cuda:N"):
        ServerConfig.of(zoo_device="gpu0").checked()
    reg = Registry(tmp_path)
    try:
        reg.sync(None, "cuda")
        assert reg.find("resnet18").config.device == "cuda"
        reg.sync(None)  # a restart on the CPU serves them there again
        assert reg.find("resnet18").config.device == "cpu"
    finally:
        reg.close()


def test_each_gpu_instance_is_bound_to_its_own_partition_through_its_load(tmp_path):
    """The runtime's LOAD carries the partition the node handed the instance (its worker's
    CUDA_VISIBLE_DEVICES), and the model's description lists them."""
    from tests.unit.test_runtime_seams import MODEL, Harness

    cfg = ModelConfig.from_dict({**MODEL.to_dict(), "device": "cuda", "instances": 2})
    h = Harness(tmp_path, cfg, devices=DeviceAssigner(lambda: node(h200("GPU-a"), h200("GPU-b"))))
    try:
        h.call(1, bytes([1, 2, 3, 4]))
        for w in h.workers:
            w.up()
        assert sorted(w.loads[0].visible_devices for w in h.workers) == ["GPU-a", "GPU-b"]
        gpu = h.rt.describe()["gpu"]
        assert sorted(gpu["partitions"]) == ["GPU-a", "GPU-b"] and gpu["copies"]["batches"] == 0
    finally:
        h.close()


def test_a_cpu_model_gets_no_partition_and_no_gpu_section(tmp_path):
    from tests.unit.test_runtime_seams import Harness

    h = Harness(tmp_path, devices=DeviceAssigner(lambda: node(h200("GPU-a"))))
    try:
        h.call(1, bytes([1, 2, 3, 4]))
        (w,) = h.workers
        w.up()
        assert w.loads[0].visible_devices is None and h.rt.describe()["gpu"] is None
    finally:
        h.close()


def test_mps_is_detected_by_its_control_pipe_and_never_started(tmp_path):
    from splitserve.server.gpus import mps_active

    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").touch()  # what nvidia-cuda-mps-control -d leaves there
    assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert list(tmp_path.iterdir()) == [tmp_path / "control"]  # nothing else was made


def test_the_device_override_replaces_a_top_level_device_line_only():
    text = 'name = "m"\ndevice = "cpu"\n[artifact]\nkind = "zoo"\narch = "lenet"\ndevice = "x"\n'
    out = with_device(text, "cuda:1")
    assert tomllib.loads(out)["device"] == "cuda:1"
    assert tomllib.loads(out)["artifact"] == {"kind": "zoo", "arch": "lenet", "device": "x"}
    assert tomllib.loads(with_device('name = "m"\n', "cuda"))["device"] == "cuda"


def test_instances_on_one_gpu_interfere_in_the_reef_view_whatever_their_cpus():
    """Real-time work on one GPU instance preempts best-effort work on another instance of the
    same GPU, although their CPUs are disjoint; on another GPU it pads beside it."""
    from splitserve.protocol.header import RequestClass
    from splitserve.scheduler.priority import InstanceView, PriorityMode, decide

    d = DeviceAssigner(lambda: node(h200("GPU-a"), h200("GPU-b")))
    d.assign("rt", 0, "cuda:0")
    d.assign("be", 0, "cuda:0")
    d.assign("other", 0, "cuda:1")
    assert d.claim("rt", 0) == d.claim("be", 0) != d.claim("other", 0)
    assert d.claim("rt", 0) <= frozenset(range(-8, 0)) and d.claim("nobody", 0) == frozenset()

    def view(model: str, cpu: int, cls: RequestClass, batch: int) -> InstanceView:
        return InstanceView(model, 0, frozenset({cpu}) | d.claim(model, 0), True, cls, batch, expected_end=1.0)

    out = decide(PriorityMode.REEF, [view("rt", 0, RequestClass.RT, 1), view("be", 1, RequestClass.BE, 2),
                                     view("other", 2, RequestClass.BE, 3)])
    assert out.preempt == [("be", 0, 2)]
    assert ("other", 0) in out.padding_deadline
