"""One model bound to a worker: its tensor queues mapped once, its weights loaded, and
what running its batches needs (restore points, measured segment times, on a GPU its
batch path: ``worker/cuda.py``).

A binding is made from a ``BindSpec``, at start or by a LOAD, and owns the queue fds it
was given. ``close`` (an UNLOAD, or a load that failed half way) releases all of it and
hands the memory back, so the same process can bind another model afterwards.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from splitserve.modelconfig import ModelConfig
from splitserve.models.handlers import with_handler
from splitserve.models.loader import load_artifact
from splitserve.models.segmented import SegmentedModel
from splitserve.placement.devices import WORKER_DEVICE
from splitserve.protocol.header import RequestClass
from splitserve.tensorqueue import TensorQueue
from splitserve.types import TensorSpec
from splitserve.worker.device_memory import DeviceMemoryUse, TorchAllocator, load_charge
from splitserve.worker.cuda import CudaDevice, GpuPath, capture_graphs, pin_queue, unpin_queue
from splitserve.worker.launch import graph_sizes
from splitserve.worker.layer_reload import CudaLanes, HostLanes, PinnedWeights, drop_device, pin_weights, reload_and_run
from splitserve.worker.spec import BindSpec

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None)


@dataclass
class Restore:
    """REEF restore point of a preempted batch: where to resume and the activations there."""

    segment: int
    acts: tuple


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (``RssAnon`` of /proc/self/status):
    what it holds beyond mapped files, such as the weights' page-cache pages."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no RssAnon line")


def model_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers hold, each storage counted once (tied
    weights and views share one)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _page_in(model: nn.Module) -> None:
    """Touch every page of the model's tensors, so that weights mapped from a file are in
    memory when the load reports LOADED (from the page cache: milliseconds; from disk: the
    read) instead of faulting in during the first batches, where they would inflate the
    segment times REEF pads with."""
    page = mmap.PAGESIZE
    with torch.inference_mode():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.device.type == "cpu" and t.numel() and t.is_contiguous():
                t.reshape(-1).view(torch.uint8)[::page].max()


def _map(specs: Sequence[TensorSpec], fds: list[int], nslots: int) -> list[TensorQueue]:
    """Attach one class's queues; refuses fds that do not match the model's tensors (a
    memfd smaller than its ring would turn the first access past its end into SIGBUS)."""
    if len(fds) != len(specs):
        raise ValueError(f"{len(fds)} queue fds for {len(specs)} tensors {[t.name for t in specs]}")
    out: list[TensorQueue] = []
    try:
        for t, fd in zip(specs, fds):
            size = os.fstat(fd).st_size
            if size < t.nbytes * nslots:
                raise ValueError(f"queue of {t.name!r} is {size} B, not {nslots} slots of {t.nbytes} B")
            out.append(TensorQueue(t.nbytes, nslots, fd))
    except BaseException:
        for tq in out:
            tq.close()
        raise
    return out


def _unpinned(t: torch.Tensor) -> torch.Tensor:
    """A model on the CPU parks in ordinary host memory: nothing to page-lock for."""
    return t


class Binding:
    """A model resident in this worker (build it with the spec; ``close`` releases it)."""

    def __init__(self, ident: int, spec: BindSpec, cache_dir: Path, segment_time_weight: float) -> None:
        """Map the queues and the weights (from the artifact's file); with ``spec.measure``,
        run one batch of zeros at max_batch_size and keep what the load and that batch
        added to the anonymous memory as ``private_bytes``. ``segment_time_weight``: the newest
        sample's weight in the segment-time estimates (``ReefSection``). On any failure, release what
        was taken (the fds included) and raise."""
        t0 = time.perf_counter_ns()
        anon0 = rss_anon()
        self.private_bytes: int | None = None
        self.device_bytes: int | None = None  # measured on a GPU with spec.measure (``worker.device_memory``)
        self.device_slack_bytes = 0
        self.ident = ident
        self._fds = spec.fds()
        self.queues: dict[int, tuple[list[TensorQueue], list[TensorQueue]]] = {}
        self.model: SegmentedModel | None = None
        self.restore: dict[int, Restore] = {}
        self.gpu: GpuPath | None = None  # the GPU batch path (None on the CPU)
        # Parked: the weights live only here, in page-locked host memory, until a batch brings them back
        self.parked: PinnedWeights | None = None
        self.reloaded = False  # a batch brought the parked weights back: ``settle`` after its answer
        self._pinned: list[TensorQueue] = []
        try:
            self.cfg = ModelConfig.from_dict(spec.model)
            # with a partition of its own, the worker's only GPU is cuda:0 whatever the config's index
            self.device = torch.device(WORKER_DEVICE if spec.visible_devices else self.cfg.device)
            self.segment_capacity = spec.segment_capacity
            # (segment, batch size) -> EWMA of its time in ns, measured as batches run;
            # seeded from the stored profile when the server has one.
            self.segment_times: dict[tuple[int, int], int] = {(i, b): ns for i, b, ns in spec.segment_times_ns}
            for cls, q in spec.queues.items():
                self.queues[int(cls)] = (_map(self.cfg.inputs, q.inputs, q.nslots),
                                         _map(self.cfg.outputs, q.outputs, q.nslots))
            art = self.cfg.artifact
            path = Path(spec.model_dir) / art.file if (spec.model_dir and art.file) else None
            device0 = DeviceMemoryUse.now(TorchAllocator(self.device)) if self.device.type == "cuda" else None
            self.model = load_artifact(art.kind, path, art.arch, seed=art.seed, cache_dir=cache_dir)
            self.model = with_handler(self.model, self.cfg.handler)  # TorchServe's pre/post-processing segments
            _page_in(self.model)
            self.model.eval().to(self.device)
            self.nbytes = model_bytes(self.model)
            if self.device.type == "cuda":
                self.gpu = GpuPath(CudaDevice(self.device), self.segment_capacity, self.segment_times,
                                   segment_time_weight)
                self._pin_queues()
            self.load_ns = time.perf_counter_ns() - t0
            if spec.measure:
                self._warm_up()
                self.private_bytes = max(0, rss_anon() - anon0)
            self._capture_graphs()
            if device0 is not None and spec.measure:  # weights, warm-up activations, graph pools, allocator slack
                self.device_bytes, self.device_slack_bytes = load_charge(
                    device0, DeviceMemoryUse.now(TorchAllocator(self.device)))
        except BaseException:
            self.close()
            raise

    def _capture_graphs(self) -> None:
        if self.gpu is not None and self.model is not None:
            capture_graphs(self.gpu, self.model, graph_sizes(self.cfg.cuda_graphs, self.nbytes,
                                                             self.cfg.max_batch_size),
                           self._zeros, self.device)

    # -- the pinned host tier --------------------------------------------------------------

    def park(self) -> int:
        """Keep the binding (queues, config, measured times) with its weights only in
        page-locked host memory: their device copies, the CUDA graphs (which read the
        weights where they were) and restore points go, and the device memory goes back to
        the driver. The next batch brings the weights back (``reload_run``). The pinned bytes."""
        assert self.model is not None
        self.restore.clear()
        if self.gpu is not None:
            torch.cuda.synchronize(self.device)  # nothing may still read the weights or the graphs
            self.gpu.graphs.clear()
        if self.parked is None:  # parked again before a batch came: the pinned copy is still the weights
            pin = torch.Tensor.pin_memory if self.device.type == "cuda" else _unpinned
            self.parked = pin_weights(self.model, pin)
        drop_device(self.parked)
        self.reloaded = False
        gc.collect()
        if self.gpu is not None:
            torch.cuda.empty_cache()
        return self.parked.nbytes

    def reload_run(self, cls: RequestClass, acts: tuple) -> tuple:
        """A batch on a parked binding: the weights are copied back segment by segment while
        ``acts`` (on the device already) runs on the class's stream, each segment starting as
        soon as its own weights are there (``layer_reload.reload_and_run``); the outputs."""
        assert self.model is not None and self.parked is not None
        lanes = HostLanes() if self.gpu is None else CudaLanes(self.device, self.gpu.device.stream(cls))
        out = reload_and_run(self.model, self.parked, lanes, acts)
        self.reloaded = True
        return out

    def settle(self) -> None:
        """After the reload batch was answered: the pinned copy goes (its copies are done:
        the answer waited for the last segment, which waited for them) and, on a GPU, the
        CUDA graphs are captured again over the weights' new addresses."""
        self.parked, self.reloaded = None, False
        gc.collect()
        if self.gpu is not None:
            # the caching host allocator keeps freed page-locked blocks until told
            empty_host = getattr(torch._C, "_host_emptyCache", None)
            if empty_host is not None:
                empty_host()
            self._capture_graphs()

    def _warm_up(self) -> None:
        """One batch of zeros at max_batch_size: the activations and scratch memory the
        largest batch needs are allocated once, so the memory measured after it includes them."""
        assert self.model is not None
        with torch.inference_mode():
            self.model(*self._zeros(self.cfg.max_batch_size))
        if self.gpu is not None:
            torch.cuda.synchronize(self.device)

    def _zeros(self, n: int) -> tuple[torch.Tensor, ...]:
        """A batch of ``n`` zero samples of every input, on the model's device."""
        return tuple(torch.from_numpy(np.zeros((n, *t.shape), t.dtype)).to(self.device) for t in self.cfg.inputs)

    @property
    def pinned_queues(self) -> int:
        """Queues page-locked for DMA (0 on the CPU, or where the driver refused)."""
        return len(self._pinned)

    def _pin_queues(self) -> None:
        """Page-lock the queues' shared memory (``cuda.pin_queue``: the whole double mapping,
        in one registration) so a batch's one copy each way is an asynchronous DMA.

        If the driver refuses, the worker still copies once per batch, from pageable
        memory, and says so (``pinned_queues`` in the model's description, ``gpu``, shows it too)."""
        cudart = torch.cuda.cudart()
        for ins, outs in self.queues.values():
            for tq in ins + outs:
                if pin_queue(cudart, tq.base, tq.size):
                    self._pinned.append(tq)
                else:
                    log.warning("could not pin a %d B tensor queue; its copies are pageable", tq.size)

    def close(self) -> None:
        """Release the weights, restore points, queue mappings and fds, and return the
        memory: the queues must not stay pinned or mapped, and freed heap goes back to the
        system (glibc keeps it otherwise; on CUDA, torch's cache keeps device memory)."""
        self.restore.clear()
        self.model, self.parked = None, None
        if self.gpu is not None:
            torch.cuda.synchronize(self.device)  # nothing may still read the queues or the graphs
            self.gpu = None
        if self._pinned:
            cudart = torch.cuda.cudart()
            for tq in self._pinned:
                if not unpin_queue(cudart, tq.base):
                    log.warning("could not unpin a %d B tensor queue", tq.size)
            self._pinned.clear()
        gc.collect()  # tensors over the rings must be gone before they are unmapped
        for ins, outs in self.queues.values():
            for tq in ins + outs:
                tq.close()
        self.queues.clear()
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed: nothing left to release
        self._fds = []
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        trim = getattr(_libc, "malloc_trim", None)
        if trim is not None:
            trim(0)
