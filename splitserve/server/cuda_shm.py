"""Triton's CUDA shared-memory extension: the node's registry of client device regions.

A client on the same host allocates device memory, exports it as a CUDA IPC handle
(``cudaIpcGetMemHandle``: 64 opaque bytes) and registers it by name with its device and
size. Inputs that name the region are read from it and outputs written into it.

The node opens each handle once, at registration (``cudaIpcOpenMemHandle``), and closes it
at unregistration. The device is reached through ``CudaIpc``, a small seam: ``CudartIpc``
calls the CUDA runtime through ctypes, and the CPU tests put a fake behind it. The runtime is
called directly because neither torch nor a declared dependency can open a raw IPC handle:
torch's CUDA IPC (``UntypedStorage._new_shared_cuda``) takes only handles that torch
exported itself, with its reference-counting file beside them, and ``cuda-python`` would be
one more wheel for four functions. torch's own ``libcudart`` is the one used, so the
process holds one runtime.

The bytes go between the region and the call's host tensors with one ``cudaMemcpy`` each:
the call's tensor queues are host memory (the worker's GPU path copies them to its device on
the batch's stream), so this is a device-to-host copy per input and host-to-device per
output, not device to device.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from splitserve.errors import InvalidInput, NotFound, Refused, SplitServeError
from splitserve.protocol.v2 import ShmRef
from splitserve.server.ports import CudaRegionStatus

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class CudaIpc(Protocol):
    """The device side of the registry: open and close IPC handles, copy bytes each way.
    Calls may come from any thread."""

    def open(self, handle: bytes, device_id: int) -> int:
        """Map the allocation ``handle`` exports on device ``device_id``; its device address.
        Raises NotFound naming the runtime's error when the handle does not open (no
        allocation behind it, no such device, no CUDA on this node)."""

    def close(self, address: int, device_id: int) -> None:
        """Unmap what ``open`` mapped."""

    def extent(self, address: int, device_id: int) -> int | None:
        """The bytes from ``address`` (as ``open`` gave it) to the end of the allocation it lies
        in; None where the driver cannot say. Registration checks a region's declared size
        against it: copies past an allocation's end would touch another one's memory."""

    def to_host(self, address: int, device_id: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes from device ``address`` into ``dst``."""

    def from_host(self, address: int, device_id: int, src: memoryview) -> None:
        """Copy ``src`` to device ``address``."""


_H2D, _D2H = 1, 2  # cudaMemcpyKind
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess, the only flag the call takes


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def ipc_handle(raw: bytes) -> _IpcHandle:
    """The runtime's ``cudaIpcMemHandle_t`` holding ``raw``'s 64 bytes exactly (the struct's
    constructor would stop copying at the first zero byte)."""
    return _IpcHandle.from_buffer_copy(raw)


class CudartIpc(CudaIpc):
    """``CudaIpc`` through torch's CUDA runtime library (``libcudart``), loaded on first use."""

    def __init__(self) -> None:
        self._rt: ctypes.CDLL | None = None
        self._driver: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def _runtime(self) -> ctypes.CDLL:
        with self._lock:
            if self._rt is None:
                import torch  # loads the libcudart torch links, which the soname below then finds

                if not torch.cuda.is_available():
                    raise NotFound("CUDA shared memory needs a CUDA device on the server; this node has none")
                name = f"libcudart.so.{torch.version.cuda.split('.')[0]}"
                try:
                    rt = ctypes.CDLL(name)
                except OSError as e:
                    raise NotFound(f"CUDA shared memory: the CUDA runtime library {name} did not load ({e})") from None
                rt.cudaGetErrorString.restype = ctypes.c_char_p
                rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
                rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
                rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                self._rt = rt
            return self._rt

    def _check(self, err: int, what: str, error: type[SplitServeError] = InvalidInput) -> None:
        if err:
            raise error(f"{what}: {self._runtime().cudaGetErrorString(err).decode()}")

    def _on(self, device_id: int) -> ctypes.CDLL:
        rt = self._runtime()
        self._check(rt.cudaSetDevice(device_id), f"cannot use CUDA device {device_id}", NotFound)
        return rt

    def open(self, handle: bytes, device_id: int) -> int:
        rt = self._on(device_id)
        address = ctypes.c_void_p()
        self._check(rt.cudaIpcOpenMemHandle(ctypes.byref(address), ipc_handle(handle), _LAZY_PEER_ACCESS),
                    "failed to open CUDA IPC handle", NotFound)
        return address.value or 0

    def close(self, address: int, device_id: int) -> None:
        self._check(self._on(device_id).cudaIpcCloseMemHandle(address), "failed to close CUDA IPC handle")

    def extent(self, address: int, device_id: int) -> int | None:
        # the runtime API has no call for an allocation's range; the driver's works on the
        # context the runtime made current (its primary one), where the handle was opened
        self._on(device_id)
        with self._lock:
            if self._driver is None:
                try:
                    driver = ctypes.CDLL("libcuda.so.1")
                except OSError:
                    return None
                driver.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                          ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                self._driver = driver
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)):
            return None
        return base.value + size.value - address

    def to_host(self, address: int, device_id: int, dst: memoryview) -> None:
        host = np.frombuffer(dst, np.uint8)
        self._check(self._on(device_id).cudaMemcpy(host.ctypes.data, address, host.nbytes, _D2H),
                    "failed to copy from CUDA shared memory")

    def from_host(self, address: int, device_id: int, src: memoryview) -> None:
        host = np.frombuffer(src, np.uint8)
        self._check(self._on(device_id).cudaMemcpy(address, host.ctypes.data, host.nbytes, _H2D),
                    "failed to copy to CUDA shared memory")


def decode_handle(name: str, raw: object) -> bytes:
    """The IPC handle of an HTTP registration's ``raw_handle`` (``{"b64": ...}``), checked."""
    b64 = raw.get("b64") if isinstance(raw, dict) else None
    if not isinstance(b64, str):
        raise InvalidInput(f'cuda shared-memory region {name!r}: raw_handle must be {{"b64": "<base64 handle>"}}')
    try:
        return base64.b64decode(b64, validate=True)
    except binascii.Error:
        raise InvalidInput(f"cuda shared-memory region {name!r}: raw_handle's b64 is not base64") from None


@dataclass
class _DeviceRegion:
    status: CudaRegionStatus
    address: int
    users: int = 0  # calls in flight holding it: its handle closes when the last one ends
    closing: bool = False


class CudaSharedMemory:
    """The registered CUDA regions, bounded by ``max_regions``. Register and unregister run
    on the loop, reads and writes in codec threads too, so the table is guarded by a lock;
    a region unregistered while a call in flight uses it is closed when that call ends."""

    def __init__(self, ipc: CudaIpc, max_regions: int) -> None:
        self.ipc = ipc
        self.max_regions = max_regions
        self._regions: dict[str, _DeviceRegion] = {}
        # re-entrant: a dropped writer's finalizer releases its region, and the collector may
        # run it inside a section that holds the lock
        self._lock = threading.RLock()

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._regions

    def register(self, name: str, handle: bytes, device_id: int, byte_size: int) -> None:
        """Open ``handle`` (an allocation of at least ``byte_size`` bytes on ``device_id``) as
        region ``name``."""
        if not isinstance(name, str) or not name:
            raise InvalidInput("a cuda shared-memory region needs a name")
        for what, v in (("device_id", device_id), ("byte_size", byte_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInput(f"cuda shared-memory region {name!r}: {what} must be a non-negative integer, "
                                   f"got {v!r}")
        if byte_size == 0:
            raise InvalidInput(f"cuda shared-memory region {name!r}: byte_size must be positive")
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
            size = len(handle) if isinstance(handle, bytes) else type(handle).__name__
            raise InvalidInput(f"cuda shared-memory region {name!r}: raw_handle must be a CUDA IPC handle of "
                               f"{IPC_HANDLE_BYTES} bytes, got {size}")
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region '{name}' already in manager")
            if len(self._regions) >= self.max_regions:
                raise Refused(f"{len(self._regions)} cuda shared-memory regions are registered, the most this "
                              "server takes (SPLITSERVE_SHM_MAX_REGIONS); unregister some first")
            address = self.ipc.open(handle, device_id)
            extent = self.ipc.extent(address, device_id)
            if extent is not None and byte_size > extent:
                self.ipc.close(address, device_id)
                raise InvalidInput(f"cuda shared-memory region {name!r}: byte_size {byte_size} runs past the end of "
                                   f"the device allocation its handle names ({extent} bytes)")
            self._regions[name] = _DeviceRegion(CudaRegionStatus(name, device_id, byte_size), address)
        log.info("registered cuda shared-memory region %r: %d bytes on device %d", name, byte_size, device_id)

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name`` (None: every one); its handle closes now, or when the last
        call in flight using it ends."""
        with self._lock:
            names = list(self._regions) if not name else [name] if name in self._regions else []
            closing = [self._regions.pop(n) for n in names]
            for region in closing:
                region.closing = True
            idle = [r for r in closing if r.users == 0]
        for region in idle:
            self._close(region)
        if names:
            log.info("unregistered cuda shared-memory regions %s", ", ".join(map(repr, names)))

    def status(self, name: str | None = None) -> list[CudaRegionStatus]:
        """Every region, or the one named (NotFound when it is not registered)."""
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
        return [region.status]

    def _close(self, region: _DeviceRegion) -> None:
        try:
            self.ipc.close(region.address, region.status.device_id)
        except SplitServeError as e:
            log.warning("cuda shared-memory region %r: %s", region.status.name, e)

    def _hold(self, ref: ShmRef, what: str) -> _DeviceRegion:
        with self._lock:
            region = self._regions.get(ref.region)
            if region is None:
                raise InvalidInput(f"{what}: Unable to find shared memory region: '{ref.region}'")
            size = region.status.byte_size
            if ref.offset + ref.byte_size > size:
                raise InvalidInput(f"{what}: Invalid offset + byte size for shared memory region: '{ref.region}' "
                                   f"(offset {ref.offset} + byte size {ref.byte_size} > {size})")
            region.users += 1
            return region

    def _release(self, region: _DeviceRegion) -> None:
        with self._lock:
            region.users -= 1
            last = region.closing and region.users == 0
        if last:
            self._close(region)

    def read(self, ref: ShmRef, what: str) -> memoryview:
        """The bytes ``ref`` names, copied to host memory."""
        region = self._hold(ref, what)
        try:
            out = memoryview(bytearray(ref.byte_size))
            self.ipc.to_host(region.address + ref.offset, region.status.device_id, out)
            return out
        finally:
            self._release(region)

    def writer(self, ref: ShmRef, what: str) -> Callable[[memoryview], None]:
        """Checks ``ref`` now; the function that copies an output's bytes into it once. The
        region stays open until that function has run, or the writer is dropped."""
        region = self._hold(ref, what)
        return _DeviceWrite(self, region, ref.offset)


class _DeviceWrite:
    """One output's copy into its region; holds the region open until it has run (or is
    garbage, when the call failed before its outputs)."""

    def __init__(self, owner: CudaSharedMemory, region: _DeviceRegion, offset: int) -> None:
        self._owner, self._region, self._offset = owner, region, offset

    def __call__(self, data: memoryview) -> None:
        region = self._region
        if region is None:
            raise RuntimeError("an output's cuda shared-memory write runs once")
        try:
            self._owner.ipc.from_host(region.address + self._offset, region.status.device_id, data)
        finally:
            self._region = None
            self._owner._release(region)

    def __del__(self) -> None:
        if self._region is not None:
            self._owner._release(self._region)
