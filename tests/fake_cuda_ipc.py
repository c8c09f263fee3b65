"""An in-memory CUDA IPC (``server.cuda_shm.CudaIpc``) that behaves like the runtime on a
client's allocations: ``export`` makes an allocation and its 64-byte handle (as
``cudaIpcGetMemHandle``), ``open`` maps a handle at a fresh device address (an unknown
handle fails as ``cudaErrorInvalidValue`` would, NotFound as ``CudartIpc`` answers it), copies
outside an open mapping fail, ``extent`` is an allocation's size, and ``close`` refuses an
address it did not open. A test reads and writes the allocations."""

from __future__ import annotations

import os
import threading

from splitserve.errors import InvalidInput, NotFound
from splitserve.server.cuda_shm import IPC_HANDLE_BYTES


class FakeCudaIpc:
    """Device memory as bytearrays; every allocation lies at its own 4 GiB-aligned address."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.memory: dict[bytes, bytearray] = {}
        self.opened: dict[int, tuple[bytes, int]] = {}  # address -> handle, device
        self.closed: list[int] = []
        self._next = 1 << 32
        self._lock = threading.Lock()

    def export(self, byte_size: int) -> bytes:
        """A client's ``cudaMalloc`` + ``cudaIpcGetMemHandle``: the handle."""
        handle = os.urandom(IPC_HANDLE_BYTES)
        self.memory[handle] = bytearray(byte_size)
        return handle

    def open(self, handle: bytes, device_id: int) -> int:
        if device_id >= self.devices:
            raise NotFound(f"cannot use CUDA device {device_id}: invalid device ordinal")
        if handle not in self.memory:
            raise NotFound("failed to open CUDA IPC handle: invalid argument")
        with self._lock:
            address, self._next = self._next, self._next + (1 << 32)
            self.opened[address] = (handle, device_id)
        return address

    def close(self, address: int, device_id: int) -> None:
        with self._lock:
            if self.opened.pop(address, None) is None:
                raise InvalidInput("failed to close CUDA IPC handle: invalid argument")
            self.closed.append(address)

    def extent(self, address: int, device_id: int) -> int | None:
        with self._lock:
            handle, _ = self.opened[address]
            return len(self.memory[handle])

    def _span(self, address: int, device_id: int, n: int) -> tuple[bytearray, int]:
        with self._lock:
            for base, (handle, device) in self.opened.items():
                buf = self.memory[handle]
                if base <= address and address + n <= base + len(buf) and device == device_id:
                    return buf, address - base
        raise InvalidInput("failed to copy: an illegal memory access was encountered")

    def to_host(self, address: int, device_id: int, dst: memoryview) -> None:
        buf, start = self._span(address, device_id, len(dst))
        dst[:] = buf[start : start + len(dst)]

    def from_host(self, address: int, device_id: int, src: memoryview) -> None:
        buf, start = self._span(address, device_id, src.nbytes)
        buf[start : start + src.nbytes] = src.cast("B")
