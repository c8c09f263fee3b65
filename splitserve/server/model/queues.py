"""A model's rings and tensor queues, one ring and one set of queues per request class.

The data half of a ``ModelPort``: the transports allocate slots here, receive into the
input views and read answers from the output views; workers map the same queues through
the file descriptors ``fds`` lists. ``bench.fuzz.fakes.FuzzRuntime`` serves from one too.
"""

from __future__ import annotations

from splitserve.errors import BadSize
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import CLASSES
from splitserve.tensorqueue import SlotRing, TensorQueue
from splitserve.worker.spec import QueueFds


class ModelQueues:
    """``nslots`` slots per class for ``config``'s tensors; ``label`` names the queues' memory."""

    def __init__(self, config: ModelConfig, nslots: int, label: str) -> None:
        self.config = config
        self.nslots = nslots
        self.rings: dict[RequestClass, SlotRing] = {c: SlotRing(nslots) for c in CLASSES}
        self.tqs: dict[RequestClass, tuple[list[TensorQueue], list[TensorQueue]]] = {
            c: (
                [TensorQueue(t.nbytes, nslots, name=f"{label}-{c.name}-in-{t.name}") for t in config.inputs],
                [TensorQueue(t.nbytes, nslots, name=f"{label}-{c.name}-out-{t.name}") for t in config.outputs],
            )
            for c in CLASSES
        }

    def alloc(self, cls: RequestClass, count: int) -> int:
        """``count`` consecutive slots of ``cls``'s ring; BadSize past ``max_batch_size``."""
        if count > self.config.max_batch_size:
            raise BadSize(f"{count} samples exceed max_batch_size {self.config.max_batch_size} of "
                          f"{self.config.name!r}")
        return self.rings[cls].alloc(count)

    def input_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return [q.view(seq, count) for q in self.tqs[cls][0]]

    def output_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return [q.view(seq, count) for q in self.tqs[cls][1]]

    def plan_room(self, cls: RequestClass, count: int, movable: dict[int, int]) -> list[int] | None:
        return self.rings[cls].plan_room(count, movable)

    def release(self, cls: RequestClass, seq: int, count: int) -> None:
        self.rings[cls].release(seq, count)

    def fds(self) -> dict[str, QueueFds]:
        """What a worker maps: per class (its number as text), the slots and each queue's fd."""
        return {str(int(c)): QueueFds(self.nslots, [q.fd for q in ins], [q.fd for q in outs])
                for c, (ins, outs) in self.tqs.items()}

    def close(self) -> None:
        """Release the shared memory (after the model's workers are gone)."""
        for ins, outs in self.tqs.values():
            for q in ins + outs:
                q.close()
