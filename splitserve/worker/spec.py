"""What a worker process is told at start: JSON on its command line (control, not data)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class QueueFds:
    """The memfds of one class's tensor queues, in declared tensor order."""

    nslots: int
    inputs: list[int]
    outputs: list[int]


@dataclass(frozen=True)
class WorkerSpec:
    model: dict[str, Any]  # ModelConfig.to_dict()
    model_dir: str | None
    instance: int
    cpus: list[int]
    threads: int
    ctrl_fd: int
    flag_fd: int  # one page of shared memory: byte 0 is the preemption flag
    queues: dict[str, QueueFds]  # keyed by RequestClass value as a string
    cache_dir: str
    segment_capacity: int = 1  # REEF's device-queue capacity c
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        d = json.loads(text)
        d["queues"] = {k: QueueFds(**v) for k, v in d["queues"].items()}
        return cls(**d)

    def fds(self) -> list[int]:
        out = [self.ctrl_fd, self.flag_fd]
        for q in self.queues.values():
            out += q.inputs + q.outputs
        return out
