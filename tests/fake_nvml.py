"""An in-memory NVML (``placement.gpus.Nvml``) that behaves like the library on a node's
GPUs: calls before ``init`` or after ``shutdown`` raise ``NVMLError_Uninitialized``, MIG calls
on a GPU without MIG raise ``NVMLError_NotSupported``, profile queries with MIG off raise
it too, and an empty MIG device index raises ``NVMLError_NotFound``, all as pynvml's own
error classes. The GPUs are plain data a test writes down."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml

from splitserve.placement.gpus import DeviceAttributes, ProfileInfo

GIB = 1 << 30


@dataclass(frozen=True)
class FakeProfile:
    index: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int
    slices: int
    max_count: int
    mem_mb: int
    placements: tuple[tuple[int, int], ...]


# An A100 40GB as NVML reports it (memory as the driver gives it, not the names' round GB).
A100 = (
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 7, 4864, tuple((s, 1) for s in range(7))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 3, 9856, ((0, 2), (2, 2), (4, 2))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 2, 19968, ((0, 4), (4, 4))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 1, 19968, ((0, 4),)),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 1, 40192, ((0, 8),)),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, 4864, tuple((s, 1) for s in range(7))),
)
# An H100 80GB: two 1-slice profiles (1g.10gb, and 1g.20gb with two memory slices).
H100 = (
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 7, 9984, tuple((s, 1) for s in range(7))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1, 4, 19968, ((0, 2), (2, 2), (4, 2), (6, 2))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 3, 19968, ((0, 2), (2, 2), (4, 2))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 2, 40192, ((0, 4), (4, 4))),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 1, 40192, ((0, 4),)),
    FakeProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 1, 81559, ((0, 8),)),
)


@dataclass
class FakeInstance:
    """A GPU instance of ``profile_id`` at ``placement`` with compute instances
    (ci id -> its slices)."""

    gi: int
    profile_id: int
    placement: tuple[int, int]
    cis: dict[int, int]


@dataclass
class FakeGpu:
    name: str
    mem_bytes: int
    mig: tuple[int, int] | None = None  # (current, pending); None: no MIG
    profiles: tuple[FakeProfile, ...] = ()
    instances: list[FakeInstance] = field(default_factory=list)
    uuid: str = ""


class FakeNvml:
    """``placement.gpus.Nvml`` over ``gpus``; ``driver=False`` is a node without the driver."""

    def __init__(self, gpus: list[FakeGpu], driver: bool = True) -> None:
        self.gpus = gpus
        self.driver = driver
        self.sessions = 0
        self.calls: list[str] = []

    def _live(self, what: str) -> None:
        self.calls.append(what)
        if self.sessions < 1:
            raise pynvml.NVMLError_Uninitialized()

    def init(self) -> None:
        if not self.driver:
            raise pynvml.NVMLError_DriverNotLoaded()
        self.sessions += 1

    def shutdown(self) -> None:
        self._live("shutdown")
        self.sessions -= 1

    def device_count(self) -> int:
        self._live("device_count")
        return len(self.gpus)

    def device(self, index: int) -> Any:
        self._live("device")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return ("gpu", index)

    def _gpu(self, handle: Any) -> FakeGpu:
        kind, index = handle[:2]
        assert kind == "gpu", "a GPU call with a MIG device handle"
        return self.gpus[index]

    def _mig_gpu(self, handle: Any) -> FakeGpu:
        g = self._gpu(handle)
        if g.mig is None:
            raise pynvml.NVMLError_NotSupported()
        return g

    def _profile(self, g: FakeGpu, profile_id: int) -> FakeProfile:
        return next(p for p in g.profiles if p.id == profile_id)

    def _slice(self, mig: Any) -> tuple[FakeGpu, FakeInstance, int]:
        kind, index, gi, ci = mig
        assert kind == "mig", "a MIG device call with a GPU handle"
        g = self.gpus[index]
        return g, next(i for i in g.instances if i.gi == gi), ci

    def name(self, handle: Any) -> str:
        self._live("name")
        return self._gpu(handle).name

    def uuid(self, handle: Any) -> str:
        self._live("uuid")
        if handle[0] == "mig":
            _, index, gi, ci = handle
            return f"MIG-{index:02d}{gi:02d}{ci:02d}00-0000-0000-0000-000000000000"
        g = self._gpu(handle)
        return g.uuid or f"GPU-{handle[1]:08d}-0000-0000-0000-000000000000"

    def memory_total(self, handle: Any) -> int:
        self._live("memory_total")
        if handle[0] == "mig":
            g, inst, _ = self._slice(handle)
            return self._profile(g, inst.profile_id).mem_mb << 20
        return self._gpu(handle).mem_bytes

    def mig_mode(self, handle: Any) -> tuple[int, int]:
        self._live("mig_mode")
        mode = self._mig_gpu(handle).mig
        assert mode is not None
        return mode

    def max_mig_devices(self, handle: Any) -> int:
        self._live("max_mig_devices")
        self._mig_gpu(handle)
        return 7

    def mig_device(self, handle: Any, index: int) -> Any:
        self._live("mig_device")
        g = self._mig_gpu(handle)
        assert g.mig is not None
        if not g.mig[0]:
            raise pynvml.NVMLError_NotFound()
        devices = [(i.gi, ci) for i in g.instances for ci in sorted(i.cis)]
        if index >= len(devices):
            raise pynvml.NVMLError_NotFound()
        return ("mig", handle[1], *devices[index])

    def gpu_instance_id(self, mig: Any) -> int:
        self._live("gpu_instance_id")
        return self._slice(mig)[1].gi

    def compute_instance_id(self, mig: Any) -> int:
        self._live("compute_instance_id")
        return self._slice(mig)[2]

    def attributes(self, mig: Any) -> DeviceAttributes:
        self._live("attributes")
        g, inst, ci = self._slice(mig)
        p = self._profile(g, inst.profile_id)
        return DeviceAttributes(p.slices, inst.cis[ci], p.mem_mb)

    def _mig_on(self, handle: Any) -> FakeGpu:
        g = self._mig_gpu(handle)
        assert g.mig is not None
        if not g.mig[0]:
            raise pynvml.NVMLError_NotSupported()
        return g

    def profile(self, handle: Any, index: int) -> ProfileInfo:
        self._live("profile")
        g = self._mig_on(handle)
        if not 0 <= index < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError_InvalidArgument()
        p = next((p for p in g.profiles if p.index == index), None)
        if p is None:
            raise pynvml.NVMLError_NotSupported()
        return ProfileInfo(p.id, p.slices, p.max_count, p.mem_mb)

    def placements(self, handle: Any, profile_id: int) -> list[tuple[int, int]]:
        self._live("placements")
        return list(self._profile(self._mig_on(handle), profile_id).placements)

    def gpu_instances(self, handle: Any, profile_id: int) -> list[tuple[int, tuple[int, int]]]:
        self._live("gpu_instances")
        g = self._mig_on(handle)
        return [(i.gi, i.placement) for i in g.instances if i.profile_id == profile_id]
