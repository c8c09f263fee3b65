"""Every server tunable in one place: a default, a ``SPLITSERVE_*`` environment name and a
one-line reason. ``ServerConfig`` is built once (CLI or tests) and passed down explicitly."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from splitserve.cluster.pools import TABLE3, Market, NodeProviderKind, PricePreset, Prices, ProcurementPolicy
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


def _env(name: str, default: Any, kind: type) -> Any:
    raw = os.environ.get(f"SPLITSERVE_{name.upper()}")
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


def parse_bytes(raw: "str | int", what: str) -> int:
    """A size as a user writes it (``2GiB``, ``512MiB``, ``500MB``, or plain bytes)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(raw.strip() if isinstance(raw, str) else raw))
    except ValidationError:
        raise InvalidInput(f"{what}={raw!r} is not a size: write e.g. 2GiB, 512MiB, 500MB or plain bytes") from None


def _parse_int(raw: str, what: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidInput(f"{what}={raw!r} is not a valid int") from None


def _parse_float(raw: str, what: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise InvalidInput(f"{what}={raw!r} is not a valid float") from None


# Fields whose default is None read their SPLITSERVE_* variable with these parsers.
_OPTIONAL_PARSERS = {"memory_budget_bytes": parse_bytes, "max_resident_models": _parse_int,
                     "partition_memory_bytes": parse_bytes, "protean_t_low": _parse_float,
                     "protean_t_high": _parse_float}


def default_data_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_DATA_DIR") or Path.cwd() / ".splitserve")


def env_cache_dir() -> Path | None:
    """``SPLITSERVE_CACHE_DIR`` (trained weights), or None where it is not set. The one
    place it is read: the server's default and the zoo's in-process default both use it."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(env) if env else None


@dataclass(frozen=True)
class ServerConfig:
    """Server-wide settings. Ports set to 0 pick a free port; None (or -1, the way a flag or
    a SPLITSERVE_*_PORT variable says it) turns a front end off."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    fast_port: int | None = 8100  # fast path over TCP
    udp_port: int | None = 8101  # fast path over UDP
    unix_path: Path | None = None  # fast path over a Unix socket (default: data_dir/fast.sock)
    http_port: int | None = 8000  # Open Inference Protocol over HTTP
    grpc_port: int | None = 8001  # Open Inference Protocol over gRPC
    data_dir: Path = field(default_factory=default_data_dir)  # registry, repository, token, cache
    repository: Path | None = None  # extra model repository (directories with config.toml)
    load: tuple[str, ...] = ()  # models to load at start-up; others load on first use
    queue_slots: int = 256  # default tensor-queue slots per model and class (bounded queue)
    udp_segment: int = 60000  # payload bytes per UDP datagram (below the 65507 B limit)
    udp_response_cache: int = 1024  # answered UDP requests remembered for retransmits
    worker_start_timeout_s: float = 120.0  # a worker that is not ready by then is killed and restarted
    worker_restart_backoff_s: float = 0.2  # first delay before restarting a dead worker
    max_upload_bytes: int = 512 << 20  # model registration upload limit
    stop_grace_s: float = 5.0  # HTTP and gRPC calls in flight get this long to finish at shutdown
    preemption: PriorityMode = PriorityMode.REEF  # how RT and BE work share the node: reef | seq | concurrent | rt-only
    rt_policy: RtPolicy = RtPolicy.FIFO  # order among waiting real-time requests: fifo | edf (earliest deadline first)
    placement: PlacementKind = PlacementKind.FIXED  # placement of models whose config names none: fixed | packrat
    log_level: str = "INFO"  # logging level of the server and its worker processes (DEBUG, INFO, WARNING, ERROR)
    cache_dir: Path | None = field(default_factory=env_cache_dir)  # trained/derived weights (None: data_dir/cache)
    # -- fast path: misbehaving clients (slow, stalled, non-reading, malformed) --
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
    # -- HTTP and gRPC front ends: decoding off the fast path's loop, body limits, uploads --
    codec_threads: int = 2  # threads that decode HTTP/gRPC requests and encode responses, off the fast path's loop
    codec_max_pending: int = 16  # large bodies received, decoded or encoded at once; more are refused (503 / UNAVAILABLE)
    codec_inline_bytes: int = 64 << 10  # bodies below this are decoded on the loop (a thread hop costs more)
    json_chars_per_value: int = 32  # infer body limit per tensor value: the longest JSON number plus separators
    management_body_bytes: int = 64 << 10  # JSON body limit of management and repository-index calls
    allow_code_artifacts: bool = False  # accept TorchScript and torch.export uploads (they can run code here)
    # -- liveness and lifecycle: every accepted call gets one answer, every wait has an end --
    worker_start_attempts: int = 3  # consecutive crashed or timed-out starts before the model is FAILED
    worker_restart_backoff_max_s: float = 5.0  # restart delays double from worker_restart_backoff_s up to this
    load_retry_s: float = 30.0  # a FAILED model refuses calls this long; then a request (or a load) retries
    drain_timeout_s: float = 60.0  # a retired instance's batch may run this long; then its worker is killed
    stop_timeout_s: float = 30.0  # stop() and unload end by then: leftovers get SHUTTING_DOWN or WORKER_FAILED
    max_call_age_s: float = 600.0  # the watchdog answers a call older than this INTERNAL (a server bug)
    watchdog_period_s: float = 5.0  # how often the watchdog looks for over-age calls
    # -- tunables that were constants in the code: workers, coordinator, estimates, front-end limits --
    worker_reap_timeout_s: float = 10.0  # a worker whose control socket closed gets this long to exit before SIGKILL
    coordinator_events: int = 200_000  # scheduling events kept for /v2/scheduler/events; the oldest are dropped
    batch_time_weight: float = 0.25  # weight of the newest sample in a model's batch-time EWMA (REEF's expected end)
    segment_time_weight: float = 0.25  # weight of the newest sample in a worker's segment-time EWMA (padding budget)
    max_labels: int = 100_000  # lines of a labels file given at registration
    max_top_k: int = 1000  # largest top_k a /classify call may ask for
    http_start_poll_s: float = 0.01  # how often start-up looks whether the embedded HTTP server listens yet
    # placement: the node's resource manager
    packrat_default_share: float = 0.5  # share of the free CPUs a Packrat model without placement.threads takes at load
    fixed_cpus_shared: bool = True  # fixed instances without configured cpus share CPUs among themselves (never Packrat's)
    placement_history: int = 100  # changes of placement each model remembers for /v2/models/{name}/placement
    # memory manager (Rafiqi)
    memory_budget_bytes: int | None = None  # bytes resident models may take (None: no limit, no manager)
    max_resident_models: int | None = None  # models resident at once (None: no limit)
    max_concurrent_loads: int = 1  # models loading at once under a memory manager (Rafiqi: one)
    spare_workers: int = 1  # node-wide idle worker processes (torch imported) that a load binds
    recycle_slack_bytes: int = 32 << 20  # a worker this close to a fresh spare's anonymous RSS after UNLOAD is reused
    evict_drop_cache: bool = False  # drop an evicted model's weight file from the page cache (an honest disk tier)
    # Triton and KServe drop-in: gRPC streaming
    grpc_stream_max_in_flight: int = 64  # unanswered calls per ModelStreamInfer stream; reading pauses at the cap
    # -- Triton and KServe drop-in: system shared memory --
    shm_max_regions: int = 64  # client shared-memory regions registered at once; more are refused
    shm_max_bytes: int = 16 << 30  # bytes of all registered regions together (each is mapped); past it a register is refused
    # -- request classes: one class model for REEF and PROTEAN (rt = PROTEAN's strict) --
    class_order: ClassOrder = ClassOrder.PRIORITY  # who goes first: priority (rt, then be) | arrival (oldest, any class)
    # -- PROTEAN in the node (p-node): partitions, per-batch placement, autoscaling, geometry changes --
    partitioning: Partitioning = Partitioning.NONE  # carve the worker cores into partitions: none | static | colocate | protean
    geometry: str = ""  # static geometry: partition core counts like "1,1" or "4,2,1" (empty: derived from the cores)
    strict_placement: StrictPlacement = StrictPlacement.AUTO  # partition of an rt batch: auto | eta | largest | balanced
    partition_memory_bytes: int | None = None  # memory the partitions share by cores (None: memory_budget_bytes, else RAM)
    partition_warm_instances: int = 1  # warm instances per partition per model: any partition takes any batch at once
    partition_autoscale_s: float = 0.5  # how often the autoscaler compares pending batches with instances
    protean_monitor_interval_s: float = 2.0  # Algorithm 2's monitor interval W (not given: splitserve's choice)
    protean_ewma_weight: float = 0.5  # weight of the newest sample in the BE demand forecast (not given)
    protean_wait_limit: int = 3  # mismatching intervals tolerated before a geometry change (paper: 3)
    protean_reconfig_fraction: float = 0.3  # share of partition groups changed at once (paper: ~30 %)
    protean_require_same_target: bool = False  # count only mismatches towards one target (not given: pseudo-code)
    protean_t_low: float | None = None  # override of T_low in BE requests (None: derived from the slowdown model)
    protean_t_high: float | None = None  # override of T_high in BE requests (None: derived from the slowdown model)
    protean_keep_alive_s: float = 600.0  # surplus instances retire after this long of continuous surplus (paper: ~10 min)
    protean_unknown_fbr: float = 1.0  # FBR of a model with no fitted FBR (not given: splitserve's choice)
    # -- PROTEAN on a real node (p-run): bounds found by running bench protean --
    worker_omp_wait_policy: OmpWaitPolicy = OmpWaitPolicy.AUTO  # idle OpenMP threads of workers: auto (passive when partitioned) | active | passive
    partition_max_instances: int = 2  # autoscaler's ceiling per model and partition: more only time-slice its cores, at a cold start each
    # -- PROTEAN wait-for-free (p-wait): a strict batch may wait for a partition instead of co-running --
    protean_wait_for_free: bool = True  # strict waits for a busy partition when predicted to end sooner than a co-run (not in the paper)
    # -- PROTEAN best-effort fit (p-befit): BE keeps off partitions where strict work runs --
    protean_be_max_wait_s: float = 0.5  # BE waits rather than join a running strict batch, until its oldest request waited this long (0: never; not in the paper)
    # -- fast path at the limit (issue 15) --
    fast_stage_trace: int = 0  # fast-path calls whose per-stage timestamps GET /v2/debug/stages keeps (0: none kept)
    # -- direct data path (issue 15, direct): the worker that runs the model takes its fast-path calls itself --
    fast_direct: bool = False  # bound workers also listen for fast-path frames on a Unix socket of their own, and TCP (direct_tcp); LOOKUP names them
    direct_max_connections: int = 64  # direct connections per worker; one more is told so and closed
    direct_admit: int = 4096  # calls a worker may hold from its direct connections; past it they are not read
    direct_suspend_poll_s: float = 0.001  # how often a worker looks whether its suspended direct BE batch may resume
    direct_poll_s: float = 0.005  # how often the node reads its workers' pages for REEF (turns their doorbells on and off)
    # -- direct data path over TCP (issue 15, f-tcp): remote clients reach the workers too --
    direct_tcp: bool = True  # with fast_direct and a TCP fast path, bound workers also listen on TCP on `host` (LOOKUP's direct_tcp)
    # -- direct path, leaner worker (issue 15, f-wlean): less of the worker's own time per call --
    direct_stage_bytes: int = 32768  # per direct connection: a read takes up to this much (a small frame is one recv)
    # -- direct path, compiled lane (issue 15): a plain call's intake and a batch's answers in C --
    direct_compiled: bool = True  # _directlane.c, where built: one-call reads taken, outputs copied, answers packed and sent
    # -- direct path, fewer wake-ups (issue 15): a worker polls briefly for its next call before it sleeps --
    direct_spin_us: int = 0  # poll this long while calls come this close and no task waits for a CPU (0: never; splitserve/spin.py): for workers whose cores are their own
    # -- GPU partitions (issue 12): whole GPUs and MIG slices, read through NVML --
    gpu_admin: bool = False  # let splitserve change MIG geometries (nvidia-smi): only on machines you administer; off, it prints the plan
    gpu_command_timeout_s: float = 120.0  # each nvidia-smi command of an applied MIG plan may run this long
    gpu_listing_max_age_s: float = 30.0  # GET /v2/partitions' GPU listing is read again (off the loop) once this old

    def __post_init__(self) -> None:
        # Names given as strings (flags, tests, code) become their enum here, so an
        # unknown one is refused where it is given, with the valid ones listed.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, Choice):
                object.__setattr__(self, f.name, type(f.default).parse(value, f.name))
            elif f.name.endswith("_port") and isinstance(value, int) and value < 0:
                object.__setattr__(self, f.name, None)

    @classmethod
    def from_env(cls, **overrides: Any) -> "ServerConfig":
        """Defaults, then SPLITSERVE_* variables, then explicit overrides (CLI flags).

        Every override given is applied, ``None`` included (a port of ``None`` is off);
        callers leave out what the user did not set."""
        base = cls()
        values: dict[str, Any] = {}
        for f in fields(cls):
            current = getattr(base, f.name)
            if isinstance(current, (bool, int, float, str)) and not isinstance(current, tuple):
                values[f.name] = _env(f.name, current, type(current))
        for name, parse in _OPTIONAL_PARSERS.items():
            raw = os.environ.get(f"SPLITSERVE_{name.upper()}")
            if raw:
                values[name] = parse(raw, f"SPLITSERVE_{name.upper()}")
        values.update(overrides)
        # protean isolates rt work by partition instead of preempting it: concurrent unless
        # the user chose a preemption mode (a flag or SPLITSERVE_PREEMPTION)
        chosen = "preemption" in overrides or bool(os.environ.get("SPLITSERVE_PREEMPTION"))
        if not chosen and Partitioning.parse(values.get("partitioning", base.partitioning)) is Partitioning.PROTEAN:
            values["preemption"] = PriorityMode.CONCURRENT
        cfg = replace(base, **values)
        return cfg.checked()

    def checked(self) -> "ServerConfig":
        if self.queue_slots < 2:
            raise InvalidInput("queue_slots must be at least 2")
        if not 1024 <= self.udp_segment <= 65507 - 64:
            raise InvalidInput("udp_segment must be between 1024 and 65443 bytes")
        if self.codec_threads < 1 or self.codec_max_pending < 1 or self.json_chars_per_value < 1:
            raise InvalidInput("codec_threads, codec_max_pending and json_chars_per_value must be at least 1")
        if self.log_level not in logging.getLevelNamesMapping():
            raise InvalidInput(f"log_level {self.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
        if self.frame_timeout_s <= 0:
            raise InvalidInput("frame_timeout_s must be positive")
        if not 0 < self.fast_out_low_water < self.fast_out_high_water <= self.fast_max_pending_out:
            raise InvalidInput("need 0 < fast_out_low_water < fast_out_high_water <= fast_max_pending_out")
        if self.direct_spin_us < 0:
            raise InvalidInput("direct_spin_us must be 0 (never poll) or a number of µs")
        if self.direct_stage_bytes < HEADER_SIZE:
            raise InvalidInput(f"direct_stage_bytes must be at least a header's {HEADER_SIZE} B")
        if self.fast_stage_trace < 0:
            raise InvalidInput("fast_stage_trace must be 0 (off) or a number of calls")
        for name in ("side_buffer_bytes", "fast_max_in_flight", "fast_reads_per_wakeup", "fast_max_lookup",
                     "udp_rcvbuf", "udp_response_cache_bytes", "coordinator_events", "max_labels", "max_top_k",
                     "placement_history", "grpc_stream_max_in_flight", "shm_max_regions", "shm_max_bytes",
                     "direct_max_connections", "direct_admit"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be at least 1")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise InvalidInput("memory_budget_bytes must be at least 1 byte (leave it unset for no limit)")
        if self.max_resident_models is not None and self.max_resident_models < 1:
            raise InvalidInput("max_resident_models must be at least 1 (leave it unset for no limit)")
        if self.max_concurrent_loads < 1 or self.spare_workers < 0 or self.recycle_slack_bytes < 0:
            raise InvalidInput("max_concurrent_loads must be at least 1, spare_workers and recycle_slack_bytes at "
                               "least 0")
        if self.class_order is ClassOrder.ARRIVAL and self.preemption is PriorityMode.REEF:
            raise InvalidInput("class_order=arrival does not go with preemption=reef (reef preempts best-effort work "
                               "for real-time work: that is class priority); use preemption seq, concurrent or "
                               "rt-only, or class_order=priority")
        if self.worker_start_attempts < 1:
            raise InvalidInput("worker_start_attempts must be at least 1")
        for name in ("worker_start_timeout_s", "drain_timeout_s", "stop_timeout_s", "max_call_age_s",
                     "watchdog_period_s", "worker_reap_timeout_s", "http_start_poll_s", "direct_suspend_poll_s",
                     "direct_poll_s", "gpu_command_timeout_s", "gpu_listing_max_age_s"):
            if not getattr(self, name) > 0:
                raise InvalidInput(f"{name} must be positive")
        if self.geometry and self.partitioning is Partitioning.NONE:
            raise InvalidInput(f"geometry {self.geometry!r} needs partitioning static, colocate or protean")
        if self.partition_memory_bytes is not None and self.partition_memory_bytes < 1:
            raise InvalidInput("partition_memory_bytes must be at least 1 byte (leave it unset for the default)")
        if self.partition_warm_instances < 1 or self.protean_wait_limit < 0:
            raise InvalidInput("partition_warm_instances must be at least 1 and protean_wait_limit at least 0")
        if self.partition_max_instances < self.partition_warm_instances:
            raise InvalidInput(f"partition_max_instances ({self.partition_max_instances}) must be at least "
                               f"partition_warm_instances ({self.partition_warm_instances})")
        for name in ("partition_autoscale_s", "protean_monitor_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidInput(f"{name} must be positive")
        if not self.protean_keep_alive_s >= 0:  # 0 is immediate scale-down (PROTEAN §4.2's comparison)
            raise InvalidInput("protean_keep_alive_s must be 0 (immediate scale-down) or more")
        for name in ("batch_time_weight", "segment_time_weight", "packrat_default_share", "protean_ewma_weight",
                     "protean_reconfig_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidInput(f"{name} must be in (0, 1]")
        return self

    @property
    def memory_managed(self) -> bool:
        """Whether a memory manager decides residency (a byte budget or a model count is set)."""
        return self.memory_budget_bytes is not None or self.max_resident_models is not None

    @property
    def cache_path(self) -> Path:
        return self.cache_dir or self.data_dir / "cache"

    @property
    def omp_wait_policy(self) -> str | None:
        """``OMP_WAIT_POLICY`` for the node's workers (None: OpenMP's default)."""
        policy = self.worker_omp_wait_policy
        if policy is OmpWaitPolicy.AUTO:
            return "PASSIVE" if self.partitioning is not Partitioning.NONE else None
        return policy.value.upper()

    @property
    def unix_socket(self) -> Path:
        return self.unix_path or self.data_dir / "fast.sock"

    @property
    def direct_dir(self) -> Path:
        """Where workers put their direct endpoints (inside the private data directory)."""
        return self.data_dir / "direct"

    @property
    def direct_tcp_host(self) -> str | None:
        """The address workers' TCP direct endpoints bind (the fast path's own, never a
        wider one), or None when they have none: the direct path off, no TCP fast path, or
        ``direct_tcp`` off."""
        if not (self.fast_direct and self.direct_tcp) or self.fast_port is None:
            return None
        return self.host


# -- cluster (issue 13, c-pure): node pools and prices, procurement, revocations, dispatch, health, autoscaling --
# Fields whose default is None read their SPLITSERVE_CLUSTER_* variable with these parsers.
_CLUSTER_OPTIONAL_PARSERS = {"on_demand_price_per_hour": _parse_float, "spot_price_per_hour": _parse_float}


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster-wide settings (docs/cluster.md), each also a ``SPLITSERVE_CLUSTER_*`` variable.
    Times are seconds of the cluster's clock (trace time in the simulator)."""

    # node pools and prices
    pricing: PricePreset = PricePreset.AWS  # price preset: aws | azure | gcp (PROTEAN Table 3, $/h per 8xA100 node)
    on_demand_price_per_hour: float | None = None  # override of the preset's on-demand price
    spot_price_per_hour: float | None = None  # override of the preset's spot price
    min_nodes: int = 1  # serving nodes kept however idle the cluster is
    max_nodes: int = 8  # serving nodes at most (PROTEAN §5: 8 workers)
    # procurement (PROTEAN §4.5)
    procurement: ProcurementPolicy = ProcurementPolicy.PROTEAN  # protean | spot-only | on-demand-only
    spot_launch_s: float = 60.0  # a spot node's request to serving with its models warm (emulated boot)
    on_demand_launch_s: float = 60.0  # the same for an on-demand node
    spot_retry_timeout_s: float = 120.0  # protean buys on-demand after a spot request pending this long; spot-only asks again
    # revocations (PROTEAN §5; interval and replacement failures are not given: splitserve's assumptions)
    p_rev: float = 0.0  # chance that a live spot node gets a notice per interval (paper: 0, 0.354, 0.708)
    revocation_interval_s: float = 60.0  # how often each live spot node may get a notice
    notice_min_s: float = 30.0  # shortest notice before an eviction (providers: 30-120 s)
    notice_max_s: float = 120.0  # longest notice before an eviction
    revocation_seed: int = 0  # seed of the revocation emulator: one seed, one eviction schedule
    drain_lead_s: float = 15.0  # a doomed node whose replacement is not serving stops taking work this long before eviction
    drain_margin_s: float = 5.0  # work still on a doomed node this long before its eviction is sent elsewhere
    # dispatch and the gateway's ledger
    node_window: int = 64  # requests in flight per node at most (queued there or running); all full: QUEUE_FULL
    two_choices_above: int = 8  # with more candidates than this, dispatch compares two seeded random ones
    max_attempts: int = 3  # sends of one request (first and re-sends) before it is answered WORKER_FAILED
    ledger_capacity: int = 65536  # requests the gateway holds unanswered at most; more are refused QUEUE_FULL
    # health checks from the gateway
    ping_interval_s: float = 1.0  # a node not heard from for this long has missed a ping
    ping_misses: int = 3  # missed pings that make a node DEAD (one makes it SUSPECT: no new work)
    # autoscaling (PROTEAN §4.2 at cluster level)
    keep_alive_s: float = 600.0  # surplus nodes retire only after this long of continuous surplus (paper: ~10 min)
    requests_per_node: int = 32  # queued and running requests one node should carry; more asks for nodes
    slo_target: float = 0.99  # strict SLO compliance below this asks for one more node
    autoscale_interval_s: float = 1.0  # how often the autoscaler and procurement look at the cluster
    # the Ray half (c-ray): gateway, node servers, controller
    gateway_client_in_flight: int = 1024  # unanswered calls per client connection; more pause its reading
    gateway_held_bytes: int = 256 << 20  # request payload bytes the gateway holds unanswered; more are refused QUEUE_FULL
    gateway_routes_bytes: int = 4 << 20  # longest routing-table line the gateway process reads from its actor
    gateway_dispatch_wait_s: float = 5.0  # a request with no node serving its model waits this long, then MODEL_NOT_READY
    reconcile_interval_s: float = 0.5  # how often the controller reads Ray's node table and draining nodes
    node_start_timeout_s: float = 120.0  # a node server whose `splitserve serve` is not up by then is replaced
    node_stats_timeout_s: float = 2.0  # a node server's stats() call that takes longer counts as missed
    # c-http: the controller's bill
    bill_records: int = 256  # ended node records the bill lists; older ones are folded into per-market totals
    # c-obs: the gateway's /metrics
    metrics_scrape_timeout_s: float = 1.0  # a node's /metrics not read in full by then is left out of the gateway's
    metrics_scrape_bytes: int = 4 << 20  # the most of a node's /metrics the gateway reads; a longer one is left out
    # c-raypro: nodes from Ray's own autoscaler (`cluster up --address`)
    provider: NodeProviderKind = NodeProviderKind.AUTO  # auto (local; autoscaler with --address) | local | autoscaler
    launch_timeout_s: float = 90.0  # a node asked of Ray's autoscaler that has not joined by then is a failed launch
    terminate_timeout_s: float = 30.0  # how long retiring a node waits for Ray's autoscaler to take it away
    # c-flat: compliance under fallbacks
    dispatch_prefer_below: int = 16  # in flight on a node below which its class's market is preferred (~2 full batches)
    spot_return_s: float = 120.0  # protean asks spot to replace an on-demand node that served this long (0: never)
    # c-restart: a restarted controller, the gateway's long poll
    controller_recover_timeout_s: float = 10.0  # a restarted controller publishes routes without nodes not back by then
    routes_poll_timeout_s: float = 30.0  # the gateway's wait for one routes call (a controller restarting), then again
    # c-reg: models registered and unregistered at the gateway
    registration_timeout_s: float = 270.0  # a registration at the gateway (every node loads the model) waits this long

    def __post_init__(self) -> None:
        for f in fields(self):
            if isinstance(f.default, Choice):
                object.__setattr__(self, f.name, type(f.default).parse(getattr(self, f.name), f.name))

    @classmethod
    def from_env(cls, **overrides: Any) -> "ClusterConfig":
        """Defaults, then SPLITSERVE_CLUSTER_* variables, then explicit overrides."""
        base = cls()
        values: dict[str, Any] = {}
        for f in fields(cls):
            current = getattr(base, f.name)
            if isinstance(current, (bool, int, float, str)):
                values[f.name] = _env(f"cluster_{f.name}", current, type(current))
        for name, parse in _CLUSTER_OPTIONAL_PARSERS.items():
            raw = os.environ.get(f"SPLITSERVE_CLUSTER_{name.upper()}")
            if raw:
                values[name] = parse(raw, f"SPLITSERVE_CLUSTER_{name.upper()}")
        values.update(overrides)
        return replace(base, **values).checked()

    def checked(self) -> "ClusterConfig":
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise InvalidInput(f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes} and {self.max_nodes}")
        if not 0 <= self.p_rev <= 1:
            raise InvalidInput(f"p_rev must be a probability in [0, 1], got {self.p_rev}")
        if not 0 < self.notice_min_s <= self.notice_max_s:
            raise InvalidInput(f"need 0 < notice_min_s <= notice_max_s, got {self.notice_min_s}, {self.notice_max_s}")
        if not 0 <= self.drain_margin_s <= self.drain_lead_s < self.notice_min_s:
            raise InvalidInput("need 0 <= drain_margin_s <= drain_lead_s < notice_min_s, got "
                               f"{self.drain_margin_s}, {self.drain_lead_s}, {self.notice_min_s}")
        if not 0 < self.slo_target <= 1:
            raise InvalidInput(f"slo_target must be in (0, 1], got {self.slo_target}")
        for name in ("spot_launch_s", "on_demand_launch_s", "spot_retry_timeout_s", "revocation_interval_s",
                     "ping_interval_s", "autoscale_interval_s", "reconcile_interval_s", "node_start_timeout_s",
                     "node_stats_timeout_s", "metrics_scrape_timeout_s", "launch_timeout_s", "terminate_timeout_s",
                     "controller_recover_timeout_s", "routes_poll_timeout_s", "registration_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidInput(f"{name} must be positive")
        for name in ("node_window", "two_choices_above", "max_attempts", "ledger_capacity", "ping_misses",
                     "requests_per_node", "gateway_client_in_flight", "gateway_held_bytes", "gateway_routes_bytes",
                     "metrics_scrape_bytes", "dispatch_prefer_below"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be at least 1")
        if self.spot_return_s < 0:
            raise InvalidInput("spot_return_s must be at least 0 (0: protean never moves back to spot)")
        if self.keep_alive_s < 0:
            raise InvalidInput("keep_alive_s must be at least 0 (0: scale down at once)")
        if self.bill_records < 0:
            raise InvalidInput("bill_records must be at least 0 (0: only the nodes still running are listed)")
        self.prices  # noqa: B018 - refuses a non-positive override here, at start-up
        return self

    @property
    def prices(self) -> Prices:
        """The preset's prices with the overrides applied."""
        preset = TABLE3[self.pricing]
        od, spot = self.on_demand_price_per_hour, self.spot_price_per_hour
        return Prices(on_demand=preset.on_demand if od is None else od, spot=preset.spot if spot is None else spot)

    def launch_s(self, market: Market) -> float:
        """Seconds from a request for a node in ``market`` to the node serving."""
        return self.spot_launch_s if market is Market.SPOT else self.on_demand_launch_s
