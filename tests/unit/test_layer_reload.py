"""The pipelined reload on the CPU: a real LeNet, its weights copied out and freed, then
brought back through a fake pair of streams whose copy stream runs only as far as the
compute stream has waited for, so the test sees which weights were there when each segment
ran. tests/gpu/test_layer_reload.py runs the same on CUDA streams."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from splitserve.models.zoo_vision import lenet
from splitserve.worker.layer_reload import drop_device, pin_weights, reload_and_run


class LazyLanes:
    """Copies queue on the copy stream and happen only when the compute stream waits for an
    event recorded after them; the log says what the compute stream did in which order."""

    copy, compute = "copy", "compute"

    def __init__(self) -> None:
        self.current = "compute"
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        self.log: list[tuple[str, int]] = []

    @contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self.current == "copy", "weights are copied on the copy stream"
        self.pending.append((dst, src))

    def record(self) -> int:
        return len(self.pending)  # the event completes once every copy issued before it has

    def stream_wait(self, event: int) -> None:
        if self.current == "copy":  # the copy stream waits for compute's allocations: nothing to run here
            return
        while self.done < event:
            dst, src = self.pending[self.done]
            dst.copy_(src)
            self.done += 1
        self.log.append(("copies done", self.done))


def test_each_segment_runs_once_its_own_weights_are_back_and_answers_as_before() -> None:
    torch.manual_seed(0)
    model = lenet()
    x = torch.randint(0, 255, (4, 1, 28, 28), dtype=torch.uint8)
    with torch.no_grad():
        want = model(x)
        weights = pin_weights(model, lambda t: t)  # the CPU has nothing to page-lock
        assert weights.nbytes == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        drop_device(weights)
        assert all(t.numel() == 0 for t in model.parameters())
        lanes = LazyLanes()
        got = reload_and_run(model, weights, lanes, (x,))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    per_segment = [len(seg) for seg in weights.segments]
    # segment i ran with segments 0..i's copies done and no more: compute overlapped the rest
    assert [n for _, n in lanes.log] == [sum(per_segment[: i + 1]) for i in range(len(per_segment))]
    assert lanes.done == len(lanes.pending)
    with torch.no_grad():  # the weights stay back: a second batch needs no copy
        torch.testing.assert_close(model(x)[0], want[0], rtol=0, atol=0)
