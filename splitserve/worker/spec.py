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
    log_level: str  # ServerConfig.log_level
    segment_time_weight: float  # ServerConfig.segment_time_weight
    segment_capacity: int = 1  # REEF's device-queue capacity c
    # Profiled (segment, batch size, ns) for this worker's thread count: the starting point
    # of its segment-time estimates (REEF's padding budget) until it has measured its own.
    segment_times_ns: list[tuple[int, int, int]] = field(default_factory=list)

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
