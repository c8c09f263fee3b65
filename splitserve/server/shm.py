"""Triton's system shared-memory extension: the node's registry of client regions, and the
reading and writing of the tensors that name them.

A client on the same host creates a POSIX shared-memory object (``/dev/shm/<key>``),
registers a region of it by name, and then sends inputs and asks for outputs that name the
region instead of carrying bytes. An input is read from the region's mapping straight into
its tensor-queue slot (``Server.infer`` copies the array over the mapping into the slot: the
one copy), and an output is written into its region, its response entry carrying no data.

``SystemSharedMemory`` is built by the composition root, handed to the HTTP and gRPC front
ends as a ``ports.SharedMemoryRegions``, and unregisters everything when the node stops. It
holds the CUDA extension's regions too (``cuda_shm.CudaSharedMemory``): region names are one
namespace, and a tensor's region is looked up in both.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitserve.errors import BadSize, InvalidInput, NotFound, Refused
from splitserve.protocol.v2 import ShmRef, tensor_from_bytes, tensor_to_bytes, wire_dtype
from splitserve.server.cuda_shm import CudaSharedMemory, CudartIpc
from splitserve.server.ports import CudaRegionStatus, ModelSignature, RegionStatus, SharedMemoryRegions

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory objects (shm_open's namespace)


@dataclass
class _Region:
    status: RegionStatus
    mapping: mmap.mmap  # the object from its start through the region's end
    fd: int  # kept open to see whether the object still covers the region (fstat)

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.mapping.close()
        except BufferError:
            pass  # a call in flight reads or writes it: unmapped when its views go


class SystemSharedMemory(SharedMemoryRegions):
    """The registered regions, bounded by ``max_regions`` and ``max_bytes`` (the sum of the
    regions' sizes). Register and unregister run on the loop; ``view`` may run in a codec
    thread, so the table is guarded by a lock.

    A region is mapped once, at registration, and its object's descriptor kept (at most
    ``max_regions``) to check at each use that the client has not shrunk the object.
    Unregistering closes both, but the mapping stays while a call in flight holds a view of
    it, until the last such view goes (its bytes no longer count against ``max_bytes`` from
    the unregister on)."""

    def __init__(self, max_regions: int, max_bytes: int, directory: Path = SHM_DIR,
                 cuda: CudaSharedMemory | None = None) -> None:
        self.cuda = cuda if cuda is not None else CudaSharedMemory(CudartIpc(), max_regions)
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.directory = directory
        self._regions: dict[str, _Region] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        """The object a key names: ``/name`` or ``name``, one file name that does not start
        with a dot (so never ``.`` or ``..``), nothing else."""
        stem = key[1:] if key.startswith("/") else key
        if not stem or "/" in stem or stem.startswith(".") or "\0" in stem:
            raise InvalidInput(f"shared-memory key {key!r} must be '/name': one name after the leading '/', "
                               "without '/' and not starting with '.' (no '..')")
        return self.directory / stem

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidInput("a shared-memory region needs a name")
        for what, v in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInput(f"shared-memory region {name!r}: {what} must be a non-negative integer, got {v!r}")
        if byte_size == 0:
            raise InvalidInput(f"shared-memory region {name!r}: byte_size must be positive")
        if not isinstance(key, str):
            raise InvalidInput(f"shared-memory region {name!r}: key must be a string")
        path = self._path(key)
        with self._lock:
            if name in self._regions or name in self.cuda:
                raise InvalidInput(f"shared memory region '{name}' already in manager; unregister it first")
            if len(self._regions) >= self.max_regions:
                raise Refused(f"{len(self._regions)} shared-memory regions are registered, the most this server "
                              "takes (SPLITSERVE_SHM_MAX_REGIONS); unregister some first")
            if self._bytes + byte_size > self.max_bytes:
                raise Refused(f"region {name!r} of {byte_size} bytes would take the registered shared memory past "
                              f"{self.max_bytes} bytes (SPLITSERVE_SHM_MAX_BYTES); {self._bytes} are registered")
            fd, mapping = _map(path, key, name, offset, byte_size)
            self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), mapping, fd)
            self._bytes += byte_size
        log.info("registered shared-memory region %r: %d bytes at offset %d of %s", name, byte_size, offset, key)

    def unregister(self, name: str | None = None) -> None:
        with self._lock:
            names = list(self._regions) if not name else [name] if name in self._regions else []
            for n in names:
                region = self._regions.pop(n)
                self._bytes -= region.status.byte_size
                region.close()
        if names:
            log.info("unregistered shared-memory regions %s", ", ".join(map(repr, names)))

    def status(self, name: str | None = None) -> list[RegionStatus]:
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"no system shared-memory region {name!r} is registered")
        return [region.status]

    def cuda_register(self, name: str, handle: bytes, device_id: int, byte_size: int) -> None:
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region '{name}' already in manager; unregister it first")
        self.cuda.register(name, handle, device_id, byte_size)

    def cuda_unregister(self, name: str | None = None) -> None:
        self.cuda.unregister(name)

    def cuda_status(self, name: str | None = None) -> list[CudaRegionStatus]:
        return self.cuda.status(name)

    def writer(self, ref: ShmRef, what: str) -> Callable[[memoryview], None]:
        if ref.region in self.cuda:
            return self.cuda.writer(ref, what)
        view = self.view(ref, what)
        return lambda data: view.__setitem__(slice(None), data)

    def view(self, ref: ShmRef, what: str) -> memoryview:
        if ref.region in self.cuda:
            return self.cuda.read(ref, what)
        with self._lock:
            region = self._regions.get(ref.region)
            if region is None:
                raise InvalidInput(f"{what}: no system shared-memory region {ref.region!r} is registered")
            size = region.status.byte_size
            if ref.offset + ref.byte_size > size:
                raise InvalidInput(f"{what}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                                   f"{ref.byte_size} runs past the end of region {ref.region!r} ({size} bytes)")
            start = region.status.offset + ref.offset
            # Touching mapped pages past the end of a file is SIGBUS, which would end the
            # server: refuse when the client shrank its object since it registered it.
            # (Shrinking it while a call copies is still the client's way to crash it, as
            # with Triton; the copy is short.)
            if os.fstat(region.fd).st_size < start + ref.byte_size:
                raise InvalidInput(f"{what}: the shared-memory object {region.status.key!r} of region "
                                   f"{ref.region!r} was shrunk below the region's end; register it again")
            return memoryview(region.mapping)[start : start + ref.byte_size]


def _map(path: Path, key: str, name: str, offset: int, byte_size: int) -> tuple[int, mmap.mmap]:
    """Open ``path`` and map it from its start through ``offset + byte_size``, read/write and
    shared; the descriptor and the mapping."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"shared-memory region {name!r}: no shared-memory object with key {key!r} "
                       f"(looked for {path})") from None
    except OSError as e:
        raise InvalidInput(f"shared-memory region {name!r}: cannot open key {key!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"shared-memory region {name!r}: key {key!r} is not a shared-memory object")
        if offset + byte_size > st.st_size:
            raise InvalidInput(f"shared-memory region {name!r}: offset {offset} + byte_size {byte_size} runs past "
                               f"the end of {key!r} ({st.st_size} bytes)")
        return fd, mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


# -- the tensors of one call --------------------------------------------------------------------


def input_tensor(regions: SharedMemoryRegions, name: str, datatype: str, shape: Sequence[int],
                 ref: ShmRef) -> np.ndarray:
    """An input as an array over its region's mapping (no copy); its byte size must be the
    tensor's."""
    dt = wire_dtype(datatype)
    if dt != np.dtype(object):
        want = math.prod(shape) * dt.itemsize
        if ref.byte_size != want:
            raise BadSize(f"input {name!r}: shared_memory_byte_size {ref.byte_size}, but {datatype.upper()}"
                          f"{list(shape)} is {want} bytes")
    return tensor_from_bytes(name, datatype, shape, regions.view(ref, f"input {name!r}"))


OutputWriters = dict[str, Callable[[memoryview], None]]


def output_views(regions: SharedMemoryRegions, cfg: ModelSignature, count: int,
                 refs: Mapping[str, ShmRef]) -> OutputWriters:
    """The writers into the regions the outputs of a call of ``count`` samples go to,
    checked before it runs."""
    specs = {o.name: o for o in cfg.outputs}
    out = {}
    for name, ref in refs.items():
        spec = specs.get(name)
        if spec is None:
            raise InvalidInput(f"model {cfg.name!r} has no output {name!r}; its outputs are {sorted(specs)}")
        want = count * spec.nbytes
        if ref.byte_size != want:
            raise BadSize(f"output {name!r}: shared_memory_byte_size {ref.byte_size}, but {count} samples of "
                          f"{spec.datatype}{list(spec.shape)} are {want} bytes")
        out[name] = regions.writer(ref, f"output {name!r}")
    return out


def write_outputs(writers: OutputWriters, outputs: Mapping[str, np.ndarray]) -> None:
    """Each output that goes to shared memory, into its region."""
    for name, write in writers.items():
        write(memoryview(tensor_to_bytes(outputs[name])))
