"""The cluster's tunables: node pools and prices, procurement, revocations, dispatch,
health and autoscaling, each a ``SPLITSERVE_CLUSTER_*`` variable with a default and a
one-line reason (the node's own are ``splitserve.config``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from splitserve.cluster.pools import TABLE3, Market, NodeProviderKind, PricePreset, Prices, ProcurementPolicy
from splitserve.config import env_optional, env_setting, parse_float
from splitserve.errors import InvalidInput
from splitserve.types import Choice

# Fields whose default is None read their SPLITSERVE_CLUSTER_* variable with these parsers.
_CLUSTER_OPTIONAL_PARSERS = {"on_demand_price_per_hour": parse_float, "spot_price_per_hour": parse_float}


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
    requests_per_node: int = 32  # requests (queued, running) per node; more ask for nodes, and a model's for copies
    model_min_nodes: int = 2  # nodes each model is loaded on however idle (fewer nodes: all): one lost leaves it served
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
    registration_timeout_s: float = 270.0  # a registration at the gateway (its nodes load the model) waits this long

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
                values[f.name] = env_setting(f"cluster_{f.name}", current, type(current))
        for name, parse in _CLUSTER_OPTIONAL_PARSERS.items():
            if (value := env_optional(f"cluster_{name}", parse)) is not None:
                values[name] = value
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
                     "requests_per_node", "model_min_nodes", "gateway_client_in_flight", "gateway_held_bytes", "gateway_routes_bytes",
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
