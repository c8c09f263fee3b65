"""A model's weights in page-locked host memory, and the reload from there pipelined layer
by layer: segment ``i``'s parameters are copied on a copy stream while the compute stream
already runs the segments before it (PipeSwitch's pipelined model transmission).

``pin_weights`` takes a copy of every parameter and buffer, segment by segment, into
page-locked host tensors; ``drop_device`` then frees the device copies (the model keeps its
modules, each tensor an empty placeholder on the device). ``reload_and_run`` allocates each
tensor again, issues every segment's copies on the copy stream, one event after each
segment's, and runs the first batch on the compute stream, each segment waiting (on the
device, not in this thread) only for its own segment's event. The device is reached
through ``Lanes``, a small seam: ``CudaLanes`` on a GPU, ``HostLanes`` where the model's
device is host memory (every copy done when issued); the CPU tests also use a fake whose
copy stream runs only as far as the compute stream has waited, which shows the pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from splitserve.models.segmented import Acts, SegmentedModel


class Lanes(Protocol):
    """Two streams of one device, the copies between them ordered by events."""

    copy: Any  # the stream the weights are copied on
    compute: Any  # the stream the batch runs on

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Issue what is inside on ``stream``."""

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One asynchronous copy on the current stream."""

    def record(self) -> Any:
        """An event recorded on the current stream now."""

    def stream_wait(self, event: Any) -> None:
        """The current stream waits for ``event`` on the device (this thread does not)."""


class CudaLanes:
    """``Lanes`` on a CUDA device: a dedicated copy stream and the given compute stream."""

    def __init__(self, device: torch.device, compute: Any) -> None:
        self.copy = torch.cuda.Stream(device)
        self.compute = compute

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def stream_wait(self, event: Any) -> None:
        torch.cuda.current_stream().wait_event(event)


class HostLanes:
    """``Lanes`` for a model on the CPU: one lane, every copy done when it is issued."""

    copy = compute = None

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        return None

    def stream_wait(self, event: Any) -> None:
        """Nothing to wait for: the copies are done."""


@dataclass
class PinnedWeights:
    """A model's tensors (parameters and buffers) per segment, each with its page-locked host copy."""

    segments: list[list[tuple[torch.Tensor, torch.Tensor]]]  # (the model's tensor, its pinned copy)

    @property
    def nbytes(self) -> int:
        """Page-locked bytes held."""
        return sum(h.numel() * h.element_size() for seg in self.segments for _, h in seg)


def _tensors(segment: torch.nn.Module) -> list[torch.Tensor]:
    return [*segment.parameters(), *segment.buffers()]


def pin_weights(model: SegmentedModel, pin: Callable[[torch.Tensor], torch.Tensor]) -> PinnedWeights:
    """Copies of ``model``'s tensors, segment by segment, in host memory ``pin`` page-locks
    (``Tensor.pin_memory`` on a GPU)."""
    return PinnedWeights([[(t, pin(t.detach().to("cpu", copy=True))) for t in _tensors(seg)]
                          for seg in model.segments])


def drop_device(weights: PinnedWeights) -> None:
    """Free the device copies (the caller then returns the cached blocks: ``empty_cache``)."""
    for seg in weights.segments:
        for t, _ in seg:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def reload_and_run(model: SegmentedModel, weights: PinnedWeights, lanes: Lanes, acts: Acts) -> Acts:
    """Bring the weights back from page-locked memory and run ``acts`` through the model,
    segment ``i`` starting as soon as its own weights are there; the outputs."""
    with lanes.on(lanes.compute):  # allocated where they are used: the allocator's blocks belong to compute
        for seg in weights.segments:
            for t, h in seg:
                t.data = torch.empty(h.shape, dtype=h.dtype, device=t.device)
        allocated = lanes.record()
    events = []
    with lanes.on(lanes.copy):
        # a block just handed out may still be read by work queued on compute before it
        lanes.stream_wait(allocated)
        for seg in weights.segments:
            for t, h in seg:
                lanes.copy_into(t.data, h)
            events.append(lanes.record())
    with lanes.on(lanes.compute):
        for i, ev in enumerate(events):
            lanes.stream_wait(ev)
            acts = model.run_segment(i, acts)
    return acts
