"""What a worker process is told: at start, JSON on its command line (its process); later,
in a LOAD message, the model to bind (control, not data: tensor data stays in the queues
the memfds name)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class QueueFds:
    """The memfds of one class's tensor queues, in declared tensor order."""

    nslots: int
    inputs: list[int]
    outputs: list[int]


@dataclass(frozen=True)
class DirectSpec:
    """A bound worker's own fast-path endpoint (``worker/direct.py``): where it listens and
    the limits it applies, which are the front end's stream limits (``ServerConfig``)."""

    path: str  # its Unix socket, in the node's private run directory
    func_id: int  # the model it serves: frames naming another are refused UNKNOWN_MODEL
    max_connections: int  # ServerConfig.transports.direct_max_connections
    max_in_flight: int  # ServerConfig.transports.fast_max_in_flight, per connection
    out_high_water: int  # ServerConfig.transports.fast_out_high_water
    out_low_water: int  # ServerConfig.transports.fast_out_low_water
    max_pending_out: int  # ServerConfig.transports.fast_max_pending_out
    frame_timeout_s: float  # ServerConfig.transports.frame_timeout_s
    reads_per_wakeup: int  # ServerConfig.transports.fast_reads_per_wakeup
    rt_only: bool  # the node refuses best-effort calls (preemption rt-only)
    suspend_poll_s: float  # ServerConfig.transports.direct_suspend_poll_s
    stage_bytes: int  # ServerConfig.transports.direct_stage_bytes
    slo_us: int = 0  # the model's SLO for real-time calls that name none (0: none)
    # Also listen on TCP at this address (the node's fast-path host; the OS picks the port,
    # reported in LOADED): None for a Unix endpoint only. One connection limit covers both.
    tcp_host: str | None = None
    # ServerConfig.transports.direct_spin_us: the loop's poll before it sleeps (``splitserve/spin.py``)
    spin_us: int = 0
    # ServerConfig.transports.direct_compiled: ``_directlane`` takes one-call reads and writes answers, where built
    compiled: bool = True
    # The instance's batch (Packrat's per-instance b; 0: the model's max_batch_size) and, for a
    # Packrat model, its aggregation timeout (``worker/direct_batching.py``)
    batch: int = 0
    aggregate_s: float | None = None
    # ServerConfig.batching.max_call_age_s: a best-effort batch held (suspended) this long
    # after its oldest call arrived is answered INTERNAL, as the front end's watchdog does
    max_call_age_s: float = 600.0
    # ServerConfig.transports.front_end_spin_us: the loop's poll after a front-end batch
    front_end_spin_us: int = 0


@dataclass(frozen=True)
class BindSpec:
    """What binds a worker to one model: its config, artifact directory, tensor queues and
    where the instance sits (CPUs, threads).

    The worker maps the queues once per binding and loads the weights from the artifact
    (never from the control socket); the fds belong to the worker from then on. The
    placement comes with the binding, not the process, because a spare process is started
    before anyone knows which instance it will serve."""

    model: dict[str, Any]  # ModelConfig.to_dict()
    model_dir: str | None
    queues: dict[str, QueueFds]  # keyed by RequestClass value as a string
    segment_capacity: int = 1  # REEF's device-queue capacity c
    # Profiled (segment, batch size, ns) for the worker's thread count: the starting point
    # of its segment-time estimates (REEF's padding budget) until it has measured its own.
    segment_times_ns: list[tuple[int, int, int]] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)  # the instance's CPUs (empty: leave the affinity as it is)
    threads: int = 1  # torch's intra-op threads for the instance
    # Run one batch of zeros at max_batch_size after the load and report the memory it
    # took (LOADED's private_bytes): asked only while the model's size is not yet known.
    measure: bool = False
    direct: DirectSpec | None = None  # also serve fast-path frames on an endpoint of its own
    # The one GPU partition the worker may see (``placement.devices``): a GPU-… or MIG-… UUID,
    # set as CUDA_VISIBLE_DEVICES before the worker first touches CUDA; None for a CPU model.
    visible_devices: str | None = None
    # Preemption idle and a best-effort model: every thread of the worker under SCHED_IDLE
    # (``worker/sched_class.py``); False puts a reused worker's threads back to normal.
    idle: bool = False

    def fds(self) -> list[int]:
        """Every queue fd, class by class (in key order), inputs before outputs."""
        out: list[int] = []
        for key in sorted(self.queues):
            q = self.queues[key]
            out += q.inputs + q.outputs
        return out

    def with_fds(self, fds: list[int]) -> "BindSpec":
        """The same binding with its fds replaced, in ``fds()`` order (on the receiving side
        of SCM_RIGHTS the numbers differ). ValueError if the count does not match."""
        if len(fds) != len(self.fds()):
            raise ValueError(f"binding names {len(self.fds())} queue fds but {len(fds)} were passed")
        it = iter(fds)
        queues = {}
        for key in sorted(self.queues):
            q = self.queues[key]
            queues[key] = QueueFds(q.nslots, [next(it) for _ in q.inputs], [next(it) for _ in q.outputs])
        return replace(self, queues=queues)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BindSpec":
        """The binding ``to_dict`` described; ValueError or TypeError if ``d`` is malformed."""
        d = dict(d)
        d["queues"] = {str(k): QueueFds(**v) for k, v in d["queues"].items()}
        d["segment_times_ns"] = [(int(i), int(b), int(ns)) for i, b, ns in d.get("segment_times_ns", [])]
        if d.get("direct") is not None:
            d["direct"] = DirectSpec(**d["direct"])
        return cls(**d)


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's start: its process (sockets, cache, settings). It starts bound to
    nothing, on one thread; a LOAD binds a model and places it (``BindSpec``)."""

    ctrl_fd: int
    flag_fd: int  # one page of shared memory: byte 0 is the preemption flag
    cache_dir: str
    log_level: str  # ServerConfig.log_level
    segment_time_weight: float  # ServerConfig.reef.segment_time_weight

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        return cls(**json.loads(text))

    def fds(self) -> list[int]:
        """The fds the process inherits: its control socket and preemption page."""
        return [self.ctrl_fd, self.flag_fd]
