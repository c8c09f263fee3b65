"""The GPU node's edge: its GPUs and MIG slices read through NVML, and the one place that
runs ``nvidia-smi`` to change a MIG geometry.

- ``Nvml`` is the seam: the few NVML calls splitserve makes, in Python types. ``PynvmlNvml``
  is the real one (the ``nvidia-ml-py`` package, import name ``pynvml``); tests pass an
  in-memory GPU that raises NVML's own errors.
- ``read_gpus(nvml)`` lists the node's partitions (``mig.GpuListing``): each GPU, and where
  MIG is on each MIG device, with the GPU instance profiles the GPU offers. Read-only: it
  never changes a mode or an instance. Without the NVIDIA driver it says so
  (``no GPUs (NVML not available: ...)``) instead of failing.
- ``MigDriver`` lists, plans (``mig.plan_geometry``) and applies. Applying runs the plan's
  commands one by one only when built with ``admin=True`` (``ServerConfig.gpu.gpu_admin``,
  ``--gpu-admin``: for machines you administer); otherwise it logs the plan and runs nothing.

Who calls it: ``splitserve gpus`` (the CLI) and the node's ``server.gpus.GpuInventory``
(``GET /v2/partitions``' ``gpus``), both off any request path.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import pynvml

from splitserve.errors import InvalidInput
from splitserve.placement.mig import (
    Gpu, GpuListing, MigPlan, MigProfile, MigSlice, known_profiles, plan_geometry, slice_profile_name,
)

log = logging.getLogger(__name__)

# NVML's GPU instance profile indices (NVML_GPU_INSTANCE_PROFILE_*) and the suffix nvidia-smi
# adds to a variant's name; the plain ones (no suffix) are what "Ng" in a geometry means.
_PROFILE_SUFFIX = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: "", pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: "",
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: "", pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: "",
    pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE: "", pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: "",
    pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE: "", pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: "+me", pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: "",
}


class ProfileInfo(NamedTuple):
    """What NVML says of one GPU instance profile (``nvmlGpuInstanceProfileInfo_t``)."""

    id: int
    slices: int
    max_count: int
    mem_mb: int


class DeviceAttributes(NamedTuple):
    """What NVML says of one MIG device (``nvmlDeviceAttributes_t``)."""

    gpu_instance_slices: int
    compute_instance_slices: int
    mem_mb: int


class Nvml(Protocol):
    """The NVML calls splitserve makes, each raising ``pynvml.NVMLError`` subclasses as NVML
    does (``NVMLError_NotSupported`` for MIG calls on a GPU without MIG, ``NVMLError_NotFound``
    for an empty MIG device index). Handles are opaque."""

    def init(self) -> None:
        """Load the library and start a session (``nvmlInit``)."""

    def shutdown(self) -> None:
        """End the session ``init`` started."""

    def device_count(self) -> int: ...

    def device(self, index: int) -> Any: ...

    def name(self, handle: Any) -> str: ...

    def uuid(self, handle: Any) -> str:
        """``GPU-…`` for a GPU, ``MIG-…`` for a MIG device: what CUDA_VISIBLE_DEVICES takes."""

    def memory_total(self, handle: Any) -> int:
        """Bytes of memory of a GPU or a MIG device."""

    def mig_mode(self, handle: Any) -> tuple[int, int]:
        """(current, pending) MIG mode, 1 for on."""

    def max_mig_devices(self, handle: Any) -> int: ...

    def mig_device(self, handle: Any, index: int) -> Any: ...

    def gpu_instance_id(self, mig: Any) -> int: ...

    def compute_instance_id(self, mig: Any) -> int: ...

    def attributes(self, mig: Any) -> DeviceAttributes: ...

    def profile(self, handle: Any, index: int) -> ProfileInfo:
        """GPU instance profile ``index`` (an NVML_GPU_INSTANCE_PROFILE_* value)."""

    def placements(self, handle: Any, profile_id: int) -> list[tuple[int, int]]:
        """Where an instance of the profile may sit: (start, size) on the memory slices."""

    def gpu_instances(self, handle: Any, profile_id: int) -> list[tuple[int, tuple[int, int]]]:
        """The existing GPU instances of the profile: (id, (start, size))."""


class PynvmlNvml:
    """``Nvml`` over the real library (``pynvml``, from ``nvidia-ml-py``)."""

    def init(self) -> None:
        pynvml.nvmlInit()

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def device_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def device(self, index: int) -> Any:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def name(self, handle: Any) -> str:
        return _text(pynvml.nvmlDeviceGetName(handle))

    def uuid(self, handle: Any) -> str:
        return _text(pynvml.nvmlDeviceGetUUID(handle))

    def memory_total(self, handle: Any) -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)

    def mig_mode(self, handle: Any) -> tuple[int, int]:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        return int(current), int(pending)

    def max_mig_devices(self, handle: Any) -> int:
        return int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))

    def mig_device(self, handle: Any, index: int) -> Any:
        return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)

    def gpu_instance_id(self, mig: Any) -> int:
        return int(pynvml.nvmlDeviceGetGpuInstanceId(mig))

    def compute_instance_id(self, mig: Any) -> int:
        return int(pynvml.nvmlDeviceGetComputeInstanceId(mig))

    def attributes(self, mig: Any) -> DeviceAttributes:
        a = pynvml.nvmlDeviceGetAttributes(mig)
        return DeviceAttributes(int(a.gpuInstanceSliceCount), int(a.computeInstanceSliceCount), int(a.memorySizeMB))

    def profile(self, handle: Any, index: int) -> ProfileInfo:
        p = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        return ProfileInfo(int(p.id), int(p.sliceCount), int(p.instanceCount), int(p.memorySizeMB))

    def placements(self, handle: Any, profile_id: int) -> list[tuple[int, int]]:
        # the C call fills a caller's array: 8 is an A100/H100's memory slices, the most there are
        array = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
        count = pynvml.c_uint(len(array))
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, pynvml.byref(count))
        return [(int(array[k].start), int(array[k].size)) for k in range(count.value)]

    def gpu_instances(self, handle: Any, profile_id: int) -> list[tuple[int, tuple[int, int]]]:
        array = (pynvml.c_nvmlGpuInstance_t * 8)()
        count = pynvml.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, pynvml.byref(count))
        out = []
        for k in range(count.value):
            info = pynvml.nvmlGpuInstanceGetInfo(array[k])
            out.append((int(info.id), (int(info.placement.start), int(info.placement.size))))
        return out


def _text(value: str | bytes) -> str:
    """NVML strings: bytes from older bindings, str from newer ones."""
    return value.decode() if isinstance(value, bytes) else value


def _why(e: pynvml.NVMLError) -> str:
    return str(e) or type(e).__name__


def read_gpus(nvml: Nvml) -> GpuListing:
    """The node's GPUs and MIG devices (see the module doc). Read-only; an NVML that cannot
    start (no driver, no library) gives an empty listing with the reason."""
    try:
        nvml.init()
    except pynvml.NVMLError as e:
        return GpuListing(reason=f"no GPUs (NVML not available: {_why(e)})")
    try:
        count = nvml.device_count()
        if count == 0:
            return GpuListing(reason="no GPUs (NVML lists none)")
        return GpuListing(gpus=tuple(_read_gpu(nvml, i) for i in range(count)))
    except pynvml.NVMLError as e:
        return GpuListing(reason=f"no GPUs (NVML failed: {_why(e)})")
    finally:
        nvml.shutdown()


def _read_gpu(nvml: Nvml, index: int) -> Gpu:
    h = nvml.device(index)
    name = nvml.name(h)
    base = dict(index=index, uuid=nvml.uuid(h), name=name, mem_bytes=nvml.memory_total(h))
    try:
        current, pending = nvml.mig_mode(h)
    except pynvml.NVMLError_NotSupported:
        return Gpu(**base, mig=None, mig_pending=None)
    if not current:
        return Gpu(**base, mig=False, mig_pending=bool(pending), profiles=known_profiles(name),
                   note="MIG is off: NVML lists profiles only once it is on")
    profiles, placed, note = _read_profiles(nvml, h)
    return Gpu(**base, mig=True, mig_pending=bool(pending), slices=_read_slices(nvml, h, placed),
               profiles=profiles or known_profiles(name), note=note)


def _read_profiles(nvml: Nvml, h: Any) -> tuple[tuple[MigProfile, ...], dict[int, tuple[int, int]], str | None]:
    """The GPU's instance profiles, the placement of every existing GPU instance (by id), and
    what could not be read (a profile the GPU lacks is skipped: NVML says not supported)."""
    profiles: list[MigProfile] = []
    placed: dict[int, tuple[int, int]] = {}
    missing: list[str] = []
    for index, suffix in _PROFILE_SUFFIX.items():
        try:
            info = nvml.profile(h, index)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        name = slice_profile_name(info.slices, info.slices, info.mem_mb) + suffix
        try:
            starts = tuple(nvml.placements(h, info.id))
            placed.update(nvml.gpu_instances(h, info.id))
        except pynvml.NVMLError as e:
            starts = ()
            missing.append(f"{name}: {_why(e)}")
        profiles.append(MigProfile(name, info.id, info.slices, info.mem_mb, info.max_count, starts))
    profiles.sort(key=lambda p: (-p.slices, -p.mem_mb, p.name))
    note = f"placements not read ({'; '.join(missing)})" if missing else None
    return tuple(profiles), placed, note


def _read_slices(nvml: Nvml, h: Any, placed: dict[int, tuple[int, int]]) -> tuple[MigSlice, ...]:
    out: list[MigSlice] = []
    for k in range(nvml.max_mig_devices(h)):
        try:
            mig = nvml.mig_device(h, k)
        except pynvml.NVMLError_NotFound:  # an index no instance fills
            continue
        a = nvml.attributes(mig)
        gi = nvml.gpu_instance_id(mig)
        out.append(MigSlice(uuid=nvml.uuid(mig), gpu_instance=gi, compute_instance=nvml.compute_instance_id(mig),
                            mem_bytes=nvml.memory_total(mig), slices=a.gpu_instance_slices,
                            compute_slices=a.compute_instance_slices,
                            profile=slice_profile_name(a.gpu_instance_slices, a.compute_instance_slices, a.mem_mb),
                            placement=placed.get(gi)))
    return tuple(sorted(out, key=lambda s: (s.gpu_instance, s.compute_instance)))


class Ran(NamedTuple):
    """One command a ``MigDriver`` ran, and how it ended."""

    argv: tuple[str, ...]
    returncode: int
    output: str


@dataclass(frozen=True)
class Applied:
    """How applying a plan went: ``dry_run`` (nothing ran: no admin flag), the commands run
    in order, and the failure that stopped it (None: every command succeeded)."""

    plan: MigPlan
    dry_run: bool
    ran: tuple[Ran, ...] = ()
    failed: str | None = None

    @property
    def ok(self) -> bool:
        return not self.dry_run and self.failed is None


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class MigDriver:
    """Lists a node's GPUs, plans MIG geometries and, for an administrator only, applies them.

    ``admin`` is the explicit flag (``ServerConfig.gpu.gpu_admin``): without it ``apply`` logs the
    plan and runs nothing. ``run`` is ``subprocess.run`` (a test passes a recorder);
    ``timeout_s`` bounds each command."""

    def __init__(self, nvml: Nvml | None = None, admin: bool = False, timeout_s: float = 120.0,
                 run: Runner = subprocess.run) -> None:
        self.nvml = nvml if nvml is not None else PynvmlNvml()
        self.admin = admin
        self.timeout_s = timeout_s
        self.run = run

    def list(self) -> GpuListing:
        """The node's GPUs and MIG slices (read-only)."""
        return read_gpus(self.nvml)

    def plan(self, gpu: int, geometry: str, listing: GpuListing | None = None) -> MigPlan:
        """The commands that would give GPU ``gpu`` the MIG ``geometry`` (``mig.plan_geometry``)."""
        return plan_geometry((listing or self.list()).gpu(gpu), geometry)

    def apply(self, plan: MigPlan) -> Applied:
        """Run ``plan``'s commands in order, stopping at the first that fails or times out
        (saying which); without ``admin``, only log them."""
        if not self.admin:
            for c in plan.commands:
                log.info("GPU %d (dry run, no --gpu-admin): would run %s  # %s", plan.gpu, c, c.why)
            return Applied(plan, dry_run=True)
        ran: list[Ran] = []
        for n, c in enumerate(plan.commands, 1):
            log.warning("GPU %d: running %s  # %s", plan.gpu, c, c.why)
            where = f"step {n} of {len(plan.commands)} ({c})"
            try:
                done = self.run(list(c.argv), capture_output=True, text=True, timeout=self.timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return Applied(plan, False, tuple(ran), f"{where} did not finish within {self.timeout_s:g} s")
            except OSError as e:  # nvidia-smi missing or not executable
                return Applied(plan, False, tuple(ran), f"{where} could not start: {e}")
            out = (done.stdout or "") + (done.stderr or "")
            ran.append(Ran(c.argv, done.returncode, out))
            if done.returncode != 0:
                return Applied(plan, False, tuple(ran),
                               f"{where} failed with exit status {done.returncode}: {out.strip()[-500:]}")
        return Applied(plan, False, tuple(ran))

