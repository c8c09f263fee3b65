"""Pure decisions of the GPU batch path: how far ahead a batch's segments are launched, which
batch sizes get CUDA graphs, and the measured segment times padding reads.

Stock CUDA cannot stop a kernel once launched (REEF resets the GPU's queues through a
modified driver; splitserve runs on the stock one). What a preemption can do is stop
*launching*: the real-time batch then waits for the best-effort segments already on the GPU
to drain. So the number of best-effort segments in flight is the preemption latency's bound,
and ``launch_ahead`` keeps it under a budget from the segments' measured GPU times. A
real-time batch is never preempted: it keeps the model's whole device-queue capacity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitserve.protocol.header import RequestClass

# Best-effort segments in flight may take this long to drain when real-time work arrives
# (the preemption latency stock CUDA allows): a few of a small model's segments, one of a
# large model's (which then runs with no launch ahead, as REEF-N with a queue of 1).
DRAIN_BUDGET_NS = 2_000_000

# Parameters of at most this many bytes make a model "small": launch overhead is a large
# part of its time, and a graph per batch size costs little memory.
GRAPH_MAX_PARAM_BYTES = 64 << 20


def launch_ahead(cls: RequestClass, capacity: int, segment_ns: Sequence[int | None],
                 budget_ns: int = DRAIN_BUDGET_NS) -> int:
    """Segments of one batch that may be on the GPU at once (launched, maybe unfinished).

    Real-time: ``capacity`` (the model's ``segment_capacity``). Best-effort: as many of its
    slowest measured segment as fit in ``budget_ns``, between 1 and ``capacity``; 1 while no
    segment of this batch size has been measured yet (the first batch measures them)."""
    if cls == RequestClass.RT:
        return capacity
    known = [t for t in segment_ns if t]
    if not known:
        return 1
    return max(1, min(capacity, budget_ns // max(known)))


def segment_times(times: Mapping[tuple[int, int], int], num_segments: int, count: int) -> list[int | None]:
    """Each segment's measured time at batch size ``count`` (None: not measured)."""
    return [times.get((i, count)) for i in range(num_segments)]


def ewma(old: int | None, sample: int, weight: float) -> int:
    """The new estimate of a segment's time after one more ``sample`` (``weight``: the newest's)."""
    return sample if old is None else old + int(weight * (sample - old))


def graph_sizes(mode: str, param_bytes: int, max_batch: int,
                max_param_bytes: int = GRAPH_MAX_PARAM_BYTES) -> tuple[int, ...]:
    """The batch sizes to capture CUDA graphs for at load (empty: run eagerly).

    ``mode`` is the model's ``cuda_graphs``: "off", "on" (whatever its size), or "auto"
    (only a small model, ``param_bytes`` at most ``max_param_bytes``). The sizes are the
    powers of two below ``max_batch`` and ``max_batch`` itself: a batch of n replays the
    smallest size >= n, so at most half of a replay is padding."""
    if mode == "off" or (mode == "auto" and param_bytes > max_param_bytes):
        return ()
    sizes = {max_batch}
    n = 1
    while n < max_batch:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes))


def graph_size_for(count: int, sizes: Sequence[int]) -> int | None:
    """The captured size a batch of ``count`` replays (the smallest >= count), None if none."""
    return next((s for s in sorted(sizes) if s >= count), None)
