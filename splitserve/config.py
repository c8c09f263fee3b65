"""Every server tunable in one place: a default, a ``SPLITSERVE_*`` environment name and a
one-line reason. ``ServerConfig`` is built once (CLI or tests) and passed down explicitly.

The tunables come in sections, one per subsystem (``config.transports.fast_port``,
``config.memory.spare_workers``), so a part can be handed the one section it reads. A
field keeps its name in its section, and its environment variable is ``SPLITSERVE_`` and
the field's name in capitals, whatever section it lives in."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from splitserve.errors import InvalidInput
from splitserve.placement.packrat import PlacementKind
from splitserve.protocol.header import HEADER_SIZE
from splitserve.placement.partition import Partitioning, StrictPlacement
from splitserve.scheduler.model_scheduler import ClassOrder, RtPolicy
from splitserve.scheduler.priority import PriorityMode
from splitserve.types import Choice


class OmpWaitPolicy(Choice, what="OpenMP wait policy"):
    """How a worker's idle OpenMP threads wait (``OMP_WAIT_POLICY`` of its process): ``auto`` is
    passive on a partitioned node, where several workers share a partition's cores and an
    actively spinning thread takes the core a co-located worker needs (measured: lenet alone
    176 ms per batch spinning vs 0.87 ms passive on a loaded 2-core machine), and OpenMP's
    own default (spin, then sleep) elsewhere, where a worker has its cores to itself."""

    AUTO = "auto"
    ACTIVE = "active"
    PASSIVE = "passive"


def env_setting(name: str, default: Any, kind: type, environ: Mapping[str, str] = os.environ) -> Any:
    """``SPLITSERVE_<NAME>`` parsed as ``kind``, or ``default`` where it is unset or empty."""
    raw = environ.get(f"SPLITSERVE_{name.upper()}")
    if raw is None or raw == "":
        return default
    if issubclass(kind, Choice):
        return kind.parse(raw, f"SPLITSERVE_{name.upper()}")
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError:
        raise InvalidInput(f"SPLITSERVE_{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


def env_optional(name: str, parse: Callable[[str, str], Any], environ: Mapping[str, str] = os.environ) -> Any:
    """``SPLITSERVE_<NAME>`` read by ``parse``, or None where it is unset or empty (a
    setting whose default is None)."""
    raw = environ.get(f"SPLITSERVE_{name.upper()}")
    return parse(raw, f"SPLITSERVE_{name.upper()}") if raw else None


def settings_env(values: Mapping[str, Any]) -> dict[str, str]:
    """The ``SPLITSERVE_*`` variables that set ``values`` (settings by field name) on a server
    started with them: ``from_env`` reads each back through its own parser."""
    return {f"SPLITSERVE_{name.upper()}": str(value) for name, value in values.items()}


def parse_bytes(raw: "str | int", what: str) -> int:
    """A size as a user writes it (``2GiB``, ``512MiB``, ``500MB``, or plain bytes)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(raw.strip() if isinstance(raw, str) else raw))
    except ValidationError:
        raise InvalidInput(f"{what}={raw!r} is not a size: write e.g. 2GiB, 512MiB, 500MB or plain bytes") from None


def parse_int(raw: str, what: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidInput(f"{what}={raw!r} is not a valid int") from None


def parse_float(raw: str, what: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise InvalidInput(f"{what}={raw!r} is not a valid float") from None


# Fields whose default is None read their SPLITSERVE_* variable with these parsers.
_OPTIONAL_PARSERS = {"memory_budget_bytes": parse_bytes, "device_budget_bytes": parse_bytes,
                     "max_resident_models": parse_int, "partition_memory_bytes": parse_bytes, "protean_t_low": parse_float,
                     "protean_t_high": parse_float}


def default_data_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_DATA_DIR") or Path.cwd() / ".splitserve")


def env_cache_dir() -> Path | None:
    """``SPLITSERVE_CACHE_DIR`` (trained weights), or None where it is not set. The one
    place it is read: the server's default and the zoo's in-process default both use it."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(env) if env else None


class _Section:
    """A frozen group of tunables: choices given by name become their enum, and a port
    below 0 (the way a flag or a variable says "off") becomes None."""

    def __post_init__(self) -> None:
        # Names given as strings (flags, tests, code) become their enum here, so an
        # unknown one is refused where it is given, with the valid ones listed.
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(f.default, Choice):
                object.__setattr__(self, f.name, type(f.default).parse(value, f.name))
            elif f.name.endswith("_port") and isinstance(value, int) and value < 0:
                object.__setattr__(self, f.name, None)

    def checked(self) -> None:
        """Refuses values out of range, with what to set instead; nothing to check by default."""


def _at_least_one(section: object, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(section, name) < 1:
            raise InvalidInput(f"{name} must be at least 1")


def _positive(section: object, names: tuple[str, ...]) -> None:
    for name in names:
        if not getattr(section, name) > 0:
            raise InvalidInput(f"{name} must be positive")


def _weights(section: object, names: tuple[str, ...]) -> None:
    for name in names:
        if not 0 < getattr(section, name) <= 1:
            raise InvalidInput(f"{name} must be in (0, 1]")


@dataclass(frozen=True)
class TransportSection(_Section):
    """The fast path (TCP, UDP, Unix socket), its limits against misbehaving clients (slow,
    stalled, non-reading, malformed), and the direct path where workers take calls themselves."""

    fast_port: int | None = 8100  # fast path over TCP
    udp_port: int | None = 8101  # fast path over UDP
    unix_path: Path | None = None  # fast path over a Unix socket (default: data_dir/fast.sock)
    udp_segment: int = 60000  # payload bytes per UDP datagram (below the 65507 B limit)
    udp_response_cache: int = 1024  # answered UDP requests remembered for retransmits
    frame_timeout_s: float = 5.0  # a partial frame (stream or UDP) this old, counted from its first byte, is abandoned
    side_buffer_bytes: int = 256 << 20  # server-wide bytes of slow requests moved off their rings; past it the oldest is dropped
    fast_max_in_flight: int = 1024  # calls in flight per stream connection; reading pauses at the cap
    fast_out_high_water: int = 4 << 20  # unsent response bytes at which a stream connection stops being read
    fast_out_low_water: int = 1 << 20  # unsent response bytes below which reading resumes
    fast_max_pending_out: int = 256 << 20  # unsent response bytes past which a peer is disconnected
    fast_reads_per_wakeup: int = 256  # recv calls per readiness event, so one busy connection cannot starve others
    fast_max_lookup: int = 4096  # largest LOOKUP payload (a model name) on a stream
    udp_rcvbuf: int = 8 << 20  # SO_RCVBUF of the UDP socket: room for bursts of segments
    udp_response_cache_bytes: int = 64 << 20  # bytes of answered UDP requests remembered for retransmits
    fast_stage_trace: int = 0  # fast-path calls whose per-stage timestamps GET /v2/debug/stages keeps (0: none kept)
    fast_direct: bool = True  # bound workers also listen for fast-path frames on a Unix socket of their own, and TCP (direct_tcp); LOOKUP names them (off: every call through the front end)
    direct_max_connections: int = 64  # direct connections per worker; one more is told so and closed
    direct_admit: int = 4096  # calls a worker may hold from its direct connections; past it they are not read
    direct_suspend_poll_s: float = 0.001  # how often a worker looks whether its suspended direct BE batch may resume
    direct_poll_s: float = 0.005  # how often the node reads its workers' pages: direct use (LRU, Packrat's estimator), REEF's doorbells
    direct_idle_poll_s: float = 0.05  # the longest wait between two such reads while they find nothing (server/direct_watch.py)
    direct_tcp: bool = True  # with fast_direct and a TCP fast path, bound workers also listen on TCP on `host` (LOOKUP's direct_tcp)
    direct_stage_bytes: int = 32768  # per direct connection: a read takes up to this much (a small frame is one recv)
    direct_compiled: bool = True  # _directlane.c, where built: one-call reads taken, outputs copied, answers packed and sent
    direct_spin_us: int = 200  # poll this long while calls come this close and no task waits for a CPU (0: never; splitserve/spin.py)
    front_end_spin_us: int = 1000  # a worker's poll after a front-end batch, as direct_spin_us (0: never; splitserve/spin.py)

    def checked(self) -> None:
        if not 1024 <= self.udp_segment <= 65507 - 64:
            raise InvalidInput("udp_segment must be between 1024 and 65443 bytes")
        if self.frame_timeout_s <= 0:
            raise InvalidInput("frame_timeout_s must be positive")
        if not 0 < self.fast_out_low_water < self.fast_out_high_water <= self.fast_max_pending_out:
            raise InvalidInput("need 0 < fast_out_low_water < fast_out_high_water <= fast_max_pending_out")
        if self.direct_spin_us < 0:
            raise InvalidInput("direct_spin_us must be 0 (never poll) or a number of µs")
        if self.front_end_spin_us < 0:
            raise InvalidInput("front_end_spin_us must be 0 (never poll) or a number of µs")
        if self.direct_stage_bytes < HEADER_SIZE:
            raise InvalidInput(f"direct_stage_bytes must be at least a header's {HEADER_SIZE} B")
        if self.fast_stage_trace < 0:
            raise InvalidInput("fast_stage_trace must be 0 (off) or a number of calls")
        _at_least_one(self, ("side_buffer_bytes", "fast_max_in_flight", "fast_reads_per_wakeup", "fast_max_lookup",
                             "udp_rcvbuf", "udp_response_cache_bytes", "direct_max_connections", "direct_admit"))
        _positive(self, ("direct_suspend_poll_s", "direct_poll_s"))
        if not self.direct_idle_poll_s >= self.direct_poll_s:  # NaN too
            raise InvalidInput("direct_idle_poll_s must be at least direct_poll_s")


@dataclass(frozen=True)
class BatchingSection(_Section):
    """The coordinator: each model's bounded queues, its event log, and the watchdog that
    answers every accepted call."""

    queue_slots: int = 256  # default tensor-queue slots per model and class (bounded queue)
    coordinator_events: int = 200_000  # scheduling events kept for /v2/scheduler/events; the oldest are dropped
    max_call_age_s: float = 600.0  # the watchdog answers a call older than this INTERNAL (a server bug)
    watchdog_period_s: float = 5.0  # how often the watchdog looks for over-age calls

    def checked(self) -> None:
        if self.queue_slots < 2:
            raise InvalidInput("queue_slots must be at least 2")
        _at_least_one(self, ("coordinator_events",))
        _positive(self, ("max_call_age_s", "watchdog_period_s"))


@dataclass(frozen=True)
class MemorySection(_Section):
    """The memory manager (Rafiqi): which models stay resident, and the spare workers a load binds."""

    memory_budget_bytes: int | None = None  # bytes resident models may take (None: no limit, no manager)
    max_resident_models: int | None = None  # models resident at once (None: no limit)
    device_budget_bytes: int | None = None  # device bytes resident models may take on each GPU / MIG device (None: no limit)
    max_concurrent_loads: int = 1  # models loading at once under a memory manager (Rafiqi: one)
    spare_workers: int = 1  # node-wide idle worker processes (torch imported) that a load binds
    recycle_slack_bytes: int = 32 << 20  # a worker this close to a fresh spare's anonymous RSS after UNLOAD is reused
    evict_drop_cache: bool = False  # drop an evicted model's weight file from the page cache (an honest disk tier)
    pinned_tier_bytes: int = 4 << 30  # page-locked host bytes evicted GPU models' weights wait in (0: off; LRU)

    def checked(self) -> None:
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise InvalidInput("memory_budget_bytes must be at least 1 byte (leave it unset for no limit)")
        if self.device_budget_bytes is not None and self.device_budget_bytes < 1:
            raise InvalidInput("device_budget_bytes must be at least 1 byte (leave it unset for no limit)")
        if self.max_resident_models is not None and self.max_resident_models < 1:
            raise InvalidInput("max_resident_models must be at least 1 (leave it unset for no limit)")
        if self.max_concurrent_loads < 1 or self.spare_workers < 0 or self.recycle_slack_bytes < 0 \
                or self.pinned_tier_bytes < 0:
            raise InvalidInput("max_concurrent_loads must be at least 1, spare_workers, recycle_slack_bytes and "
                               "pinned_tier_bytes at least 0")

    @property
    def managed(self) -> bool:
        """Whether a memory manager decides residency (a byte budget, a device budget or a model count is set)."""
        return (self.memory_budget_bytes is not None or self.max_resident_models is not None
                or self.device_budget_bytes is not None)


@dataclass(frozen=True)
class PackratSection(_Section):
    """Placement, the node's resource manager: fixed CPUs or Packrat's threads-and-batch choice."""

    placement: PlacementKind = PlacementKind.FIXED  # placement of models whose config names none: fixed | packrat
    packrat_default_share: float = 0.5  # share of the free CPUs a Packrat model without placement.threads takes at load
    fixed_cpus_shared: bool = True  # fixed instances without configured cpus share CPUs among themselves (never Packrat's)
    placement_history: int = 100  # changes of placement each model remembers for /v2/models/{name}/placement

    def checked(self) -> None:
        _at_least_one(self, ("placement_history",))
        _weights(self, ("packrat_default_share",))


@dataclass(frozen=True)
class ProteanSection(_Section):
    """PROTEAN in the node: partitions, per-batch placement of strict and best-effort work,
    autoscaling of instances per partition, and geometry changes."""

    partitioning: Partitioning = Partitioning.NONE  # carve the worker cores into partitions: none | static | colocate | protean
    geometry: str = ""  # static geometry: partition core counts like "1,1" or "4,2,1" (empty: derived from the cores)
    strict_placement: StrictPlacement = StrictPlacement.AUTO  # partition of an rt batch: auto | eta | largest | balanced
    partition_memory_bytes: int | None = None  # memory the partitions share by cores (None: memory_budget_bytes, else RAM)
    partition_warm_instances: int = 1  # warm instances per partition per model: any partition takes any batch at once
    partition_autoscale_s: float = 0.5  # how often the autoscaler compares pending batches with instances
    partition_max_instances: int = 2  # autoscaler's ceiling per model and partition: more only time-slice its cores, at a cold start each
    protean_monitor_interval_s: float = 2.0  # Algorithm 2's monitor interval W (not given: splitserve's choice)
    protean_ewma_weight: float = 0.5  # weight of the newest sample in the BE demand forecast (not given)
    protean_wait_limit: int = 3  # mismatching intervals tolerated before a geometry change (paper: 3)
    protean_reconfig_fraction: float = 0.3  # share of partition groups changed at once (paper: ~30 %)
    protean_require_same_target: bool = False  # count only mismatches towards one target (not given: pseudo-code)
    protean_t_low: float | None = None  # override of T_low in BE requests (None: derived from the slowdown model)
    protean_t_high: float | None = None  # override of T_high in BE requests (None: derived from the slowdown model)
    protean_keep_alive_s: float = 600.0  # surplus instances retire after this long of continuous surplus (paper: ~10 min)
    protean_unknown_fbr: float = 1.0  # FBR of a model with no fitted FBR (not given: splitserve's choice)
    protean_wait_for_free: bool = True  # strict waits for a busy partition when predicted to end sooner than a co-run (not in the paper)
    protean_be_max_wait_s: float = 0.5  # BE waits rather than join a running strict batch, until its oldest request waited this long (0: never; not in the paper)

    def checked(self) -> None:
        if self.geometry and self.partitioning is Partitioning.NONE:
            raise InvalidInput(f"geometry {self.geometry!r} needs partitioning static, colocate or protean")
        if self.partition_memory_bytes is not None and self.partition_memory_bytes < 1:
            raise InvalidInput("partition_memory_bytes must be at least 1 byte (leave it unset for the default)")
        if self.partition_warm_instances < 1 or self.protean_wait_limit < 0:
            raise InvalidInput("partition_warm_instances must be at least 1 and protean_wait_limit at least 0")
        if self.partition_max_instances < self.partition_warm_instances:
            raise InvalidInput(f"partition_max_instances ({self.partition_max_instances}) must be at least "
                               f"partition_warm_instances ({self.partition_warm_instances})")
        _positive(self, ("partition_autoscale_s", "protean_monitor_interval_s"))
        if not self.protean_keep_alive_s >= 0:  # 0 is immediate scale-down (PROTEAN §4.2's comparison)
            raise InvalidInput("protean_keep_alive_s must be 0 (immediate scale-down) or more")
        _weights(self, ("protean_ewma_weight", "protean_reconfig_fraction"))


@dataclass(frozen=True)
class ReefSection(_Section):
    """How real-time and best-effort work share the node (REEF's preemption, the class order)
    and the running estimates REEF's expected end is built from."""

    preemption: PriorityMode = PriorityMode.REEF  # how RT and BE work share the node: reef | idle | seq | concurrent | rt-only
    rt_policy: RtPolicy = RtPolicy.FIFO  # order among waiting real-time requests: fifo | edf (earliest deadline first)
    class_order: ClassOrder = ClassOrder.PRIORITY  # who goes first: priority (rt, then be) | arrival (oldest, any class)
    batch_time_weight: float = 0.25  # weight of the newest sample in a model's batch-time EWMA (REEF's expected end)
    segment_time_weight: float = 0.25  # weight of the newest sample in a worker's segment-time EWMA (padding budget)

    def checked(self) -> None:
        if self.class_order is ClassOrder.ARRIVAL and self.preemption is PriorityMode.REEF:
            raise InvalidInput("class_order=arrival does not go with preemption=reef (reef preempts best-effort work "
                               "for real-time work: that is class priority); use preemption seq, concurrent or "
                               "rt-only, or class_order=priority")
        _weights(self, ("batch_time_weight", "segment_time_weight"))


@dataclass(frozen=True)
class FrontendSection(_Section):
    """The HTTP and gRPC front ends (Open Inference Protocol, the Triton and KServe drop-in):
    ports, decoding off the fast path's loop, body limits, uploads, shared memory."""

    http_port: int | None = 8000  # Open Inference Protocol over HTTP
    grpc_port: int | None = 8001  # Open Inference Protocol over gRPC
    stop_grace_s: float = 5.0  # HTTP and gRPC calls in flight get this long to finish at shutdown
    max_upload_bytes: int = 512 << 20  # model registration upload limit
    codec_threads: int = 2  # threads that decode HTTP/gRPC requests and encode responses, off the fast path's loop
    codec_max_pending: int = 16  # large bodies received, decoded or encoded at once; more are refused (503 / UNAVAILABLE)
    codec_inline_bytes: int = 64 << 10  # bodies below this are decoded on the loop (a thread hop costs more)
    json_chars_per_value: int = 32  # infer body limit per tensor value: the longest JSON number plus separators
    management_body_bytes: int = 64 << 10  # JSON body limit of management and repository-index calls
    allow_code_artifacts: bool = False  # accept TorchScript and torch.export uploads (they can run code here)
    max_labels: int = 100_000  # lines of a labels file given at registration
    max_top_k: int = 1000  # largest top_k a /classify call may ask for
    http_start_poll_s: float = 0.01  # how often start-up looks whether the embedded HTTP server listens yet
    grpc_stream_max_in_flight: int = 64  # unanswered calls per ModelStreamInfer stream; reading pauses at the cap
    shm_max_regions: int = 64  # client shared-memory regions registered at once; more are refused
    shm_max_bytes: int = 16 << 30  # bytes of all registered regions together (each is mapped); past it a register is refused
    otlp_endpoint: str = ""  # OTLP/HTTP collector for traced calls' spans (http://host:4318/v1/traces); "": none
    # TorchServe's APIs are on http_port too; these also serve them on TorchServe's own ports (None: off)
    ts_inference_port: int | None = None  # TorchServe's inference API (theirs: 8080)
    ts_management_port: int | None = None  # TorchServe's management API (theirs: 8081)
    model_store: Path | None = None  # .mar archives POST /models may name (None: data_dir/model-store)
    ts_allow_remote_urls: bool = False  # POST /models may download a .mar from an http(s) URL

    def checked(self) -> None:
        if self.codec_threads < 1 or self.codec_max_pending < 1 or self.json_chars_per_value < 1:
            raise InvalidInput("codec_threads, codec_max_pending and json_chars_per_value must be at least 1")
        _at_least_one(self, ("max_labels", "max_top_k", "grpc_stream_max_in_flight", "shm_max_regions",
                             "shm_max_bytes"))
        _positive(self, ("http_start_poll_s",))


@dataclass(frozen=True)
class WorkerSection(_Section):
    """Worker processes' lifecycle: every start, drain and stop has an end."""

    worker_start_timeout_s: float = 120.0  # a worker that is not ready by then is killed and restarted
    worker_restart_backoff_s: float = 0.2  # first delay before restarting a dead worker
    worker_restart_backoff_max_s: float = 5.0  # restart delays double from worker_restart_backoff_s up to this
    worker_start_attempts: int = 3  # consecutive crashed or timed-out starts before the model is FAILED
    load_retry_s: float = 30.0  # a FAILED model refuses calls this long; then a request (or a load) retries
    drain_timeout_s: float = 60.0  # a retired instance's batch may run this long; then its worker is killed
    stop_timeout_s: float = 30.0  # stop() and unload end by then: leftovers get SHUTTING_DOWN or WORKER_FAILED
    worker_reap_timeout_s: float = 10.0  # a worker whose control socket closed gets this long to exit before SIGKILL
    fork_workers: bool = True  # fork workers from the node's fork server (torch imported once) rather than start interpreters
    worker_omp_wait_policy: OmpWaitPolicy = OmpWaitPolicy.AUTO  # idle OpenMP threads of workers: auto (passive when partitioned) | active | passive

    def checked(self) -> None:
        if self.worker_start_attempts < 1:
            raise InvalidInput("worker_start_attempts must be at least 1")
        _positive(self, ("worker_start_timeout_s", "drain_timeout_s", "stop_timeout_s", "worker_reap_timeout_s"))


@dataclass(frozen=True)
class GpuSection(_Section):
    """GPU partitions: whole GPUs and MIG slices, read through NVML."""

    gpu_admin: bool = False  # let splitserve change MIG geometries (nvidia-smi): only on machines you administer; off, it prints the plan
    gpu_command_timeout_s: float = 120.0  # each nvidia-smi command of an applied MIG plan may run this long
    gpu_listing_max_age_s: float = 30.0  # GET /v2/partitions' GPU listing is read again (off the loop) once this old
    zoo_device: str = "cpu"  # device of the built-in zoo models: cpu, cuda (a GPU per instance, least used first) or cuda:N

    def checked(self) -> None:
        from splitserve.placement.devices import parse_device

        _positive(self, ("gpu_command_timeout_s", "gpu_listing_max_age_s"))
        parse_device(self.zoo_device)


@dataclass(frozen=True)
class ServerConfig:
    """Server-wide settings: where the node listens and keeps its files, and one section per
    subsystem. Ports set to 0 pick a free port; None (or -1, the way a flag or a
    SPLITSERVE_*_PORT variable says it) turns a front end off.

    ``ServerConfig.of(fast_port=0, spare_workers=0)`` builds one from fields' names alone,
    whatever their section; ``from_env`` does the same on top of the environment."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    data_dir: Path = field(default_factory=default_data_dir)  # registry, repository, token, cache
    repository: Path | None = None  # extra model repository (directories with config.toml)
    load: tuple[str, ...] = ()  # models to load at start-up, those that fit ("*": all registered); others on first use
    log_level: str = "INFO"  # logging level of the server and its worker processes (DEBUG, INFO, WARNING, ERROR)
    cache_dir: Path | None = field(default_factory=env_cache_dir)  # trained/derived weights (None: data_dir/cache)
    transports: TransportSection = field(default_factory=TransportSection)
    batching: BatchingSection = field(default_factory=BatchingSection)
    memory: MemorySection = field(default_factory=MemorySection)
    packrat: PackratSection = field(default_factory=PackratSection)
    protean: ProteanSection = field(default_factory=ProteanSection)
    reef: ReefSection = field(default_factory=ReefSection)
    frontends: FrontendSection = field(default_factory=FrontendSection)
    workers: WorkerSection = field(default_factory=WorkerSection)
    gpu: GpuSection = field(default_factory=GpuSection)

    # section name -> its class, in the order `serve --help` lists them
    SECTIONS: ClassVar[dict[str, type[_Section]]] = {
        "transports": TransportSection, "batching": BatchingSection, "memory": MemorySection,
        "packrat": PackratSection, "protean": ProteanSection, "reef": ReefSection, "frontends": FrontendSection,
        "workers": WorkerSection, "gpu": GpuSection}

    @classmethod
    def section_of(cls, name: str) -> str | None:
        """The section a field lives in, None for the node-wide ones (``host``, ``data_dir``...)."""
        return _SECTION_OF.get(name)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every tunable's name: the node-wide ones and each section's."""
        return frozenset(f.name for f in _all_fields())

    def setting(self, name: str) -> Any:
        """The value of the field ``name``, whatever its section (configs compared by name)."""
        section = _SECTION_OF.get(name)
        return getattr(self if section is None else getattr(self, section), name)

    @classmethod
    def of(cls, **values: Any) -> "ServerConfig":
        """A config from fields' names (``fast_port=0``), each put in its section; unchecked,
        like the constructor."""
        return cls().replaced(**values)

    def replaced(self, **values: Any) -> "ServerConfig":
        """This config with the named fields changed, whatever their section; unchecked."""
        node: dict[str, Any] = {}
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            section = _SECTION_OF.get(name)
            if section is None:
                if name not in _NODE_FIELDS:
                    raise TypeError(f"ServerConfig has no field {name!r}")
                node[name] = value
            else:
                changes.setdefault(section, {})[name] = value
        for section, change in changes.items():
            node[section] = replace(getattr(self, section), **change)
        return replace(self, **node)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: Any) -> "ServerConfig":
        """Defaults, then SPLITSERVE_* variables (of ``environ``: the process's own unless
        given, e.g. the environment a cluster gives its nodes), then explicit overrides (CLI
        flags), each by its field's name whatever its section.

        Every override given is applied, ``None`` included (a port of ``None`` is off);
        callers leave out what the user did not set."""
        values: dict[str, Any] = {}
        for f in _all_fields():
            current = f.default
            if isinstance(current, (bool, int, float, str)) and not isinstance(current, tuple):
                values[f.name] = env_setting(f.name, current, type(current), environ)
        for name, parse in _OPTIONAL_PARSERS.items():
            if (value := env_optional(name, parse, environ)) is not None:
                values[name] = value
        values.update(overrides)
        # protean isolates rt work by partition instead of preempting it: concurrent unless
        # the user chose a preemption mode (a flag or SPLITSERVE_PREEMPTION)
        chosen = "preemption" in overrides or bool(environ.get("SPLITSERVE_PREEMPTION"))
        if not chosen and Partitioning.parse(values.get("partitioning", Partitioning.NONE)) is Partitioning.PROTEAN:
            values["preemption"] = PriorityMode.CONCURRENT
        return cls.of(**values).checked()

    def checked(self) -> "ServerConfig":
        if self.log_level not in logging.getLevelNamesMapping():
            raise InvalidInput(f"log_level {self.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
        for section in self.SECTIONS:
            getattr(self, section).checked()
        return self

    @property
    def cache_path(self) -> Path:
        return self.cache_dir or self.data_dir / "cache"

    @property
    def omp_wait_policy(self) -> str | None:
        """``OMP_WAIT_POLICY`` for the node's workers (None: OpenMP's default)."""
        policy = self.workers.worker_omp_wait_policy
        if policy is OmpWaitPolicy.AUTO:  # idle: a spinning best-effort pool would hold its core
            passive = self.protean.partitioning is not Partitioning.NONE or self.reef.preemption is PriorityMode.IDLE
            return "PASSIVE" if passive else None
        return policy.value.upper()

    @property
    def model_store_path(self) -> Path:
        """Where the .mar archives TorchServe's ``POST /models`` names are."""
        return self.frontends.model_store or self.data_dir / "model-store"

    @property
    def unix_socket(self) -> Path:
        return self.transports.unix_path or self.data_dir / "fast.sock"

    @property
    def direct_dir(self) -> Path:
        """Where workers put their direct endpoints (inside the private data directory)."""
        return self.data_dir / "direct"

    @property
    def direct_tcp_host(self) -> str | None:
        """The address workers' TCP direct endpoints bind (the fast path's own, never a
        wider one), or None when they have none: the direct path off, no TCP fast path, or
        ``direct_tcp`` off."""
        t = self.transports
        if not (t.fast_direct and t.direct_tcp) or t.fast_port is None:
            return None
        return self.host


_SECTION_OF: dict[str, str] = {f.name: name for name, kind in ServerConfig.SECTIONS.items() for f in fields(kind)}
_NODE_FIELDS = frozenset(f.name for f in fields(ServerConfig))


def _all_fields() -> list[Any]:
    """Every tunable's dataclass field: the node-wide ones, then each section's."""
    node = [f for f in fields(ServerConfig) if f.name not in ServerConfig.SECTIONS]
    return node + [f for kind in ServerConfig.SECTIONS.values() for f in fields(kind)]


def env_fields() -> frozenset[str]:
    """The settings a ``SPLITSERVE_*`` variable sets (``from_env`` reads no other: paths,
    lists and ports that default to off are flags only)."""
    scalar = {f.name for f in _all_fields() if isinstance(f.default, (bool, int, float, str))}
    return frozenset(scalar | _OPTIONAL_PARSERS.keys())
