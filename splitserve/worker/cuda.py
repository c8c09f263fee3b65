"""A binding's GPU path: one copy in per input and one copy out per output on the stream the
batch's segments run on, a stream per request class with real-time above best-effort, a
bounded number of segments in flight, GPU-timed segments, and CUDA graphs per batch size.

Stream semantics this follows (PyTorch's "CUDA semantics", CUDA's stream ordering):

- A batch runs on its class's stream: real-time on a stream of the device's highest
  priority, best-effort on one of the lowest. Both are pool streams made with
  ``cudaStreamNonBlocking``, which never synchronise with the legacy default stream, so
  nothing of a batch may run on the default stream: its host-to-device copy is issued *on*
  its stream (inside ``torch.cuda.stream``), which orders segment 0 after the copy.
- Tensors are allocated on the stream that uses them (the caching allocator ties a block
  to the stream current at allocation), so a block is only reused once that stream is past
  its last use; a tensor used on another stream is ``record_stream``-ed there (a restore
  point that moves between streams; ``GpuPath.adopt``).
- Outputs come back by one device-to-host copy per output tensor, issued on the batch's
  stream after its last segment, into the output queue's slots, which are page-locked
  (``pin_queue``), so the copy is asynchronous; the host waits on an event recorded after
  it before the answer is written.
- Events are made with ``blocking=True`` (``cudaEventBlockingSync``): the worker's CPU
  sleeps in the driver while it waits instead of spinning on the core it is pinned to.

Priority between models needs one CUDA context: stream priorities order kernels of one
context; separate processes time-slice. The node runs one process per instance, so here
priorities order a model's own real-time batches before its best-effort ones, and between
models the launch bound (``launch.launch_ahead``) is what keeps a best-effort batch from
holding a real-time one back: preemption stops launching and drains the segments in flight
(stock CUDA cannot reset a running kernel, as REEF's modified driver does). ``docs/gpu.md``
says what that gives and what it does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from splitserve.models.segmented import SegmentedModel
from splitserve.protocol.header import RequestClass
from splitserve.worker.gpu_counters import GpuCopies
from splitserve.worker.launch import ewma, graph_size_for, launch_ahead, segment_times

log = logging.getLogger(__name__)

# torch clamps a stream priority into the device's range (lower is higher): these ask for
# its highest and its lowest.
RT_PRIORITY = -(1 << 10)
BE_PRIORITY = 0


class Device(Protocol):
    """The few device operations the GPU path makes (``CudaDevice``; tests pass a fake that
    runs on the CPU and records the order of what it was asked)."""

    def stream(self, cls: RequestClass) -> Any:
        """The class's stream."""

    def on(self, stream: Any) -> Any:
        """Run what is issued inside on ``stream`` (``torch.cuda.stream``)."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One asynchronous copy of ``host`` to the device, on the current stream."""

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One asynchronous copy ``src`` -> ``dst`` on the current stream (either direction)."""

    def event(self) -> Any:
        """An event recorded on the current stream now."""

    def wait(self, event: Any) -> None:
        """Block this thread until ``event`` completed."""

    def elapsed_ns(self, start: Any, end: Any) -> int:
        """Device time between two completed events."""

    def keep_on(self, t: torch.Tensor, stream: Any) -> None:
        """``t`` is used on ``stream`` too (``record_stream``): its block waits for it."""


class CudaDevice:
    """``Device`` on a CUDA device, with one stream per class."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {RequestClass.RT: torch.cuda.Stream(device, priority=RT_PRIORITY),
                        RequestClass.BE: torch.cuda.Stream(device, priority=BE_PRIORITY)}

    def stream(self, cls: RequestClass) -> Any:
        return self.streams[RequestClass(cls)]

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def event(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True, blocking=True)
        ev.record()
        return ev

    def wait(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return int(start.elapsed_time(end) * 1e6)

    def keep_on(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def synchronize(self) -> None:
        for s in self.streams.values():
            s.synchronize()


@dataclass
class _Graph:
    """One segment captured at one batch size: replaying ``graph`` reads ``ins`` and writes ``outs``."""

    graph: Any
    ins: tuple
    outs: tuple


@dataclass
class GpuPath:
    """One binding's GPU batch path over ``device`` (see the module doc).

    ``times`` is the binding's (segment, batch size) -> ns estimates, which padding reads:
    here they are measured on the GPU (between events around each segment). ``graphs`` maps a
    batch size to its captured segments (``capture_graphs``)."""

    device: Device
    capacity: int
    times: dict[tuple[int, int], int]
    weight: float
    copies: GpuCopies = field(default_factory=GpuCopies)
    graphs: dict[int, list[_Graph]] = field(default_factory=dict)

    # -- copies ------------------------------------------------------------------------------

    def inputs(self, cls: RequestClass, hosts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A batch's inputs on the device: one copy per tensor, on the class's stream (a
        batch of consecutive slots is one host view, wrapped or not). With graphs for its
        size, the copy lands in the graph's own input rows instead."""
        n = hosts[0].shape[0] if hosts else 0
        dev = self.device
        # inference mode: a graph's input rows are inference tensors, written in place
        with torch.inference_mode(), dev.on(dev.stream(cls)):
            chain = self._chain(n)
            if chain is not None:
                for h, dst in zip(hosts, chain[0].ins):
                    dev.copy_into(dst[:n], h)
                    self._h2d(h)
                return tuple(chain[0].ins)
            out = tuple(dev.to_device(h) for h in hosts)
        for h in hosts:
            self._h2d(h)
        return out

    def _h2d(self, h: torch.Tensor) -> None:
        self.copies.h2d += 1
        self.copies.h2d_bytes += h.numel() * h.element_size()

    def outputs(self, cls: RequestClass, acts: tuple, dsts: tuple[torch.Tensor, ...]) -> None:
        """A finished batch's outputs into ``dsts`` (its pinned output slots): one copy per
        tensor on the class's stream after its last segment; returns once they landed."""
        dev = self.device
        with dev.on(dev.stream(cls)):
            for dst, y in zip(dsts, acts):
                dev.copy_into(dst, y[: dst.shape[0]].reshape(dst.shape))
                self.copies.d2h += 1
                self.copies.d2h_bytes += dst.numel() * dst.element_size()
            done = dev.event()
        dev.wait(done)
        self.copies.batches += 1

    def to_host(self, cls: RequestClass, acts: tuple, count: int) -> tuple[torch.Tensor, ...]:
        """A finished batch's outputs as host tensors (the direct path writes its own rows)."""
        outs = tuple(torch.empty((count, *y.shape[1:]), dtype=y.dtype) for y in acts)
        self.outputs(cls, acts, outs)
        return outs

    # -- segments ----------------------------------------------------------------------------

    def segments(self, model: SegmentedModel, cls: RequestClass, acts: tuple, first: int, count: int,
                 stop: Callable[[int], bool] | None) -> tuple[int | None, tuple]:
        """Launch segments from ``first`` on the class's stream until the end or until
        ``stop(i)`` says not to launch segment i: (i or None, the activations there, complete).

        At most ``launch_ahead`` segments are in flight; each one's GPU time is read when it
        is retired and feeds ``times``. A stop launches nothing more and drains what is in
        flight: the restore point is the boundary it stopped at. With graphs for the batch's
        size, segments are replays; a restore point is then cloned out of the graph's
        buffers, which the next batch of that size overwrites."""
        dev = self.device
        stream = dev.stream(cls)
        n = model.num_segments
        bound = launch_ahead(cls, self.capacity, segment_times(self.times, n, count))
        chain = self._chain(count)
        window: list[tuple[int, Any, Any]] = []
        with dev.on(stream):
            if chain is not None and first > 0:
                acts = self._enter(chain[first], acts)
            for i in range(first, n):
                if stop is not None and stop(i):
                    self._drain(window, count)
                    if chain is not None:
                        acts = tuple(a.clone() for a in acts)
                    return i, acts
                while len(window) >= bound:  # room for one more on the device
                    self._retire(window.pop(0), count)
                start = dev.event()
                if chain is not None:
                    chain[i].graph.replay()
                    acts = chain[i].outs
                else:
                    acts = model.run_segment(i, acts)
                window.append((i, start, dev.event()))
            self._drain(window, count)
        if chain is not None:
            self.copies.graph_batches += 1
        return None, acts

    def _enter(self, seg: _Graph, acts: tuple) -> tuple:
        """A restore point copied into a graph's input buffers (device to device)."""
        for dst, a in zip(seg.ins, acts):
            self.device.copy_into(dst[: a.shape[0]], a)
        return seg.ins

    def _retire(self, launched: tuple[int, Any, Any], count: int) -> None:
        i, start, end = launched
        self.device.wait(end)
        key = (i, count)
        self.times[key] = ewma(self.times.get(key), self.device.elapsed_ns(start, end), self.weight)

    def _drain(self, window: list, count: int) -> None:
        for launched in window:
            self._retire(launched, count)
        window.clear()

    def share(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Tensors made on another stream (a graph's input buffers, made where it was
        captured) are used on both class streams from now on."""
        for cls in (RequestClass.RT, RequestClass.BE):
            stream = self.device.stream(cls)
            for t in tensors:
                self.device.keep_on(t, stream)

    # -- graphs ------------------------------------------------------------------------------

    def _chain(self, count: int) -> list[_Graph] | None:
        size = graph_size_for(count, list(self.graphs))
        return None if size is None else self.graphs[size]


def capture_graphs(path: GpuPath, model: SegmentedModel, sizes: tuple[int, ...],
                   example: Callable[[int], tuple[torch.Tensor, ...]], device: torch.device) -> None:
    """Capture every segment of ``model`` at each batch size (``launch.graph_sizes``) into
    ``path.graphs``: a chain per size whose segment i reads segment i-1's output buffers,
    with a memory pool per size (its chain is replayed in capture order, one batch at a
    time). A capture that fails (an op CUDA graphs cannot hold: a host sync, dynamic shapes)
    leaves the model eager, and says why."""
    try:
        _capture(path, model, sizes, example, device)
    except Exception as e:  # a model graphs cannot hold runs eagerly: slower, still right
        log.warning("CUDA graphs off for this model: capture failed (%s: %s)", type(e).__name__, e)
        path.graphs.clear()


def _capture(path: GpuPath, model: SegmentedModel, sizes: tuple[int, ...],
             example: Callable[[int], tuple[torch.Tensor, ...]], device: torch.device) -> None:
    with torch.inference_mode():
        for size in sizes:
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            acts = example(size)
            chain: list[_Graph] = []
            for i in range(model.num_segments):
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
                    model.run_segment(i, acts)
                torch.cuda.current_stream(device).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    outs = model.run_segment(i, acts)
                chain.append(_Graph(g, acts, outs))
                acts = outs
            path.share(chain[0].ins)
            path.graphs[size] = chain
        torch.cuda.synchronize(device)


# -- pinned tensor queues -------------------------------------------------------------------


def pin_queue(cudart: Any, base: int, size: int) -> bool:
    """Page-lock a tensor queue's double mapping for DMA: True if pinned.

    The ring's ``size`` bytes of memfd are mapped twice, at ``base`` and ``base + size``. A
    batch's view is any ``[s, s + n)`` slots, so it may start in the first mapping and end
    in the second; for its one copy to be a DMA from page-locked memory, the whole range it
    spans must lie in one registration. So the 2·``size`` range is registered in one call:
    each physical page is locked once (both virtual pages map the same one, and locking is
    per physical page), and CUDA knows every address a view can have. Registering each half
    apart would make a wrapped view straddle two registrations, which CUDA copies as
    pageable memory. A driver that refuses the double mapping leaves the queue pageable:
    the copies still happen once per batch, synchronously."""
    err = cudart.cudaHostRegister(base, 2 * size, 0)
    return int(getattr(err, "value", err)) == 0


def unpin_queue(cudart: Any, base: int) -> bool:
    err = cudart.cudaHostUnregister(base)
    return int(getattr(err, "value", err)) == 0


def fatal_cuda_error(e: BaseException) -> bool:
    """An error after which this process's CUDA context is unusable (an illegal address, a
    device-side assert, a launch failure: CUDA's sticky errors): the worker answers the
    batch and exits, and the node starts a fresh process for the instance."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or (isinstance(e, RuntimeError) and "CUDA error" in str(e))

