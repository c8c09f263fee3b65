"""The cluster controller: one detached, named Ray actor on the head (docs/cluster.md §2.7).

It owns the cluster's model registry (a model registered once is loaded on the nodes its
demand asks for, at least ``model_min_nodes``: ``actors/shares.py``), the node table and the
reconciliation loop. Every ``reconcile_interval_s``
it reads Ray's node table and draining nodes, and:

- a node Ray lists as dead leaves the table (billed to now, an eviction unless the cluster
  retired it); the gateway has already re-sent its work on its own health checks;
- a draining node (an eviction notice: Ray's PREEMPTION drain, from the provider or from the
  revocation emulator) keeps serving until a replacement serves or ``drain_lead_s`` before its
  deadline, whichever is first; ``drain_margin_s`` before the deadline it leaves the routes
  (the gateway re-sends what it still holds there) and is retired;
- node servers that came up get the registered models and join the routes;
- every ``autoscale_interval_s`` the pure autoscaler sets the node count from the requests
  the gateway holds and the strict SLO compliance its clients saw since the last decision
  (the gateway's cumulative outcomes, differenced by ``autoscale.SloWindow``), procurement
  (PROTEAN §4.5) picks each new node's market, and the cost ledger bills every node from its
  request to its end.

Ray carries only control calls; routes reach the gateway through ``routes``, a long poll.

It holds no data-path state, so a restart (Ray restarts the actor when its process dies)
rebuilds its view (``_recover``, before it answers any call): the models and the bill from
its store on the head (``cluster/actors/store.py``), the nodes from the provider's ``markets()``
and the node servers' named actors, taken back as ACTIVE once they hold every model, a
launch that was in flight (a provider node with no node server) as a node starting for an
adopted order, and eviction notices from the GCS in the next round. Routing-table versions
start above every earlier controller's (``store.next_generation``), so the gateway, which
served on its last table meanwhile, takes the new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import ray

from splitserve.cluster.actors import raycompat
from splitserve.cluster.actors.node_server import NodeEndpoint, NodeServerActor, NodeSpec, node_server_name
from splitserve.cluster.actors.model_registry import ModelRegistry
from splitserve.cluster.actors.probe import Reachability
from splitserve.cluster.actors.shares import ModelShares, reshare
from splitserve.cluster.actors.store import STORE_FILE, ControllerStore
from splitserve.cluster.gateway.core import NodeRoute, Routes
from splitserve.cluster.gateway.fleet import GatewayReports
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.cluster.policy.autoscale import ClusterAutoscaler, ClusterLoad, SloWindow
from splitserve.cluster.policy.cost import CostLedger
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.policy.procurement import Action, Cancel, Launch, Procurement
from splitserve.cluster.policy.revocation import RevocationEmulator, doomed_step, replacement_due
from splitserve.cluster.pools import Market
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import InvalidInput, SplitServeError, UnknownModel
from splitserve.slo import SloOutcome

log = logging.getLogger(__name__)

CONTROLLER_NAME = "splitserve-controller"
NAMESPACE = "splitserve"
_LONG_POLL_S = 1.0
# a gateway not heard from for this long is gone (it reports at every long poll)
_GATEWAY_STALE_S = 10 * _LONG_POLL_S
# Settings whose state outlives one decision (procurement's open orders, the revocation
# emulator's schedule, the cost ledger's prices): fixed for the cluster's life.
# The counters a restarted controller carries on (``status`` reports them), by part.
_COUNTED = {"procurement": ("fallbacks", "notice_fallbacks", "spot_retries", "swaps"),
            "revocation": ("notices", "spot_requests", "spot_failures")}

_FIXED = frozenset({"pricing", "on_demand_price_per_hour", "spot_price_per_hour", "bill_records", "procurement",
                    "spot_retry_timeout_s", "spot_return_s", "p_rev", "revocation_interval_s", "notice_min_s",
                    "notice_max_s", "revocation_seed"})


@dataclass
class _Node:
    node_id: str
    market: Market
    order: int | None  # the procurement order it fills while starting
    server: Any  # the NodeServer actor handle (None: a restarted controller found none to stop)
    starting: asyncio.Future | None = None  # the endpoint() call in flight while it starts
    endpoint: NodeEndpoint | None = None
    state: NodeState = NodeState.STARTING
    deadline: float | None = None  # an eviction notice's deadline (epoch s)
    ready_at: float = 0.0  # when it began serving
    models: frozenset[str] = frozenset()  # the registry's models this node was given (and loaded)
    coming: frozenset[str] = frozenset()  # the models a _give_models call is loading there now
    retiring: bool = False  # scale-in or notice: the cluster ends it
    unreachable: str | None = None  # why its advertised address does not answer the controller (None: it does)
    giving: asyncio.Lock = field(default_factory=asyncio.Lock)  # one _give_models at a time


def _settings(cfg: ClusterConfig) -> dict[str, Any]:
    """``cfg``'s settings that ``configure`` may change, as plain values (the store's JSON)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in _FIXED}


def _with_settings(cfg: ClusterConfig, saved: dict[str, Any]) -> ClusterConfig:
    """``cfg`` with the settings a ``configure`` saved (those it could change, of this version's fields)."""
    names = {f.name for f in fields(cfg)} - _FIXED
    return replace(cfg, **{k: v for k, v in saved.items() if k in names}).checked() if saved else cfg


def _autoscaler(cfg: ClusterConfig) -> ClusterAutoscaler:
    return ClusterAutoscaler(cfg.min_nodes, cfg.max_nodes, cfg.requests_per_node, cfg.slo_target, cfg.keep_alive_s)


class Controller:
    """The cluster's control plane (an async Ray actor; one loop, no locks)."""

    def __init__(self, cfg: ClusterConfig, node_spec: NodeSpec, provider: Any, builtin_models: list[str],
                 clock: Callable[[], float] = time.time, address: str | None = None,
                 store: ControllerStore | None = None,
                 find_server: Callable[[str], Any | None] | None = None,
                 reach: Callable[[NodeEndpoint], Awaitable[str | None]] | None = None) -> None:
        """``store``: where the models and the bill outlive this actor (default: a file in the
        head's Ray session directory); ``find_server``: a node server's live actor by its
        name (default: Ray's named actors), for ``_recover``; ``reach``: why a node's endpoint
        is unreachable from here, or None (default: ``probe.Reachability`` from this node)."""
        self.node_spec = node_spec
        self.provider = provider
        self.clock = clock
        self.address = address or raycompat.gcs_address()  # the GCS of the Ray cluster it runs on
        self.store = store or ControllerStore(Path(raycompat.session_dir()) / STORE_FILE)
        # Ray restarts the actor with the settings the cluster started with: configure's changes are stored
        self.cfg = cfg = _with_settings(cfg, self.store.settings())
        self._find_server = find_server or (lambda name: raycompat.named_actor(name, NAMESPACE))
        self.registry = ModelRegistry(last_id=self.store.last_func_id())
        for name, fid, spec in self.store.models():
            self.registry.add(name, spec, fid)
        for name in builtin_models:
            if name not in self.registry.ids:
                self.store.add_model(name, self.registry.add(name, None), None)
        self.nodes: dict[str, _Node] = {}
        bill = self.store.bill()
        self.cost = CostLedger(cfg.bill_records) if bill is None else CostLedger.from_state(bill)
        self._saved_bill = bill
        self.autoscaler = _autoscaler(cfg)
        # placement's view of the cluster: the clock, the nodes, the registry, the gateway's demand
        self._shares_view = lambda: (self.clock(), self.nodes.values(), self.registry.ids, self._gateway)
        self.shares = ModelShares(cfg, node_spec.env, self._shares_view)
        # what demand asked of placement lately: a restart does not unload what the keep-alive holds
        self._saved_placement = self.store.placement()
        self.shares.placement.restore(self._saved_placement)
        self.procurement = Procurement.of(cfg)
        self.revocation = RevocationEmulator.of(cfg, clock())
        self._saved_counters = self.store.counters()
        for part, names in _COUNTED.items():
            for name, value in self._saved_counters.get(part, {}).items():
                if name in names:
                    setattr(getattr(self, part), name, int(value))
        # above every version an earlier controller published: the gateway takes this one's tables
        self._routes = Routes(self.store.next_generation() << 32)
        self._changed = asyncio.Event()
        self._gateway: dict[str, Any] = {}  # the gateways' stats, added up
        self._gateways = GatewayReports(_GATEWAY_STALE_S)
        # Withdrawn launches, by order *and* market: protean's fallback withdraws an order's spot
        # request and asks on-demand under the same order, and only the spot node is unwanted.
        self._cancelled: set[tuple[int, Market]] = set()
        self._target = cfg.min_nodes
        self._next_autoscale = 0.0
        self._slo_window = SloWindow()
        self._last_window = {"met": 0, "total": 0}  # strict outcomes in the autoscaler's last window
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._recovered = asyncio.Event()  # set once _recover is done: the calls wait for it
        self._checking_servers = False
        self._reach = reach or Reachability(raycompat.current_node_ip())

    # -- the API (called through Ray) --------------------------------------------------------

    async def start(self) -> None:
        """Rebuild the view (``_recover``) and start the reconciliation loop (idempotent). A
        controller that Ray restarted does this on the first call it gets, the gateway's
        long poll within a second."""
        await self._started()

    async def _started(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        await self._recovered.wait()

    async def _run(self) -> None:
        try:
            await self._recover()
        except Exception:  # noqa: BLE001 - what it could not take back, the loop replaces
            log.exception("rebuilding the node table failed; the reconcile loop goes on without it")
        finally:
            self._recovered.set()
        await self._loop()

    async def _recover(self) -> None:
        """Take back what an earlier controller left: every node the provider runs. One with a
        node server (a named, detached actor) serves on and becomes ACTIVE once it holds every
        model (already there: a quick, idempotent call); one without (its launch was in flight)
        gets its node server and an adopted order, so the autoscaler does not buy it twice.
        Open bill records of nodes no longer there end now. Bounded by
        ``controller_recover_timeout_s``: a node not back by then joins later, through the loop,
        and is out of the routes meanwhile (the gateway re-sends its work)."""
        now = self.clock()
        markets = await asyncio.wait_for(self.provider.markets.remote(), self.cfg.controller_recover_timeout_s)
        adopting = []
        for node_id, market in markets.items():
            m = Market.parse(market)
            if node_id in self.nodes:
                continue
            server = self._find_server(node_server_name(node_id))
            record = self.cost.record(node_id)
            if record is not None and record.ended_at is not None:
                # retired (or lost) before the restart, and the provider still runs it: end it again
                self._spawn(self._retire(_Node(node_id, m, None, server), evicted=False))
                continue
            if record is None:
                self.cost.requested(node_id, str(m), m, self.cfg.prices.of(m), now)
            if server is None:
                log.info("node %s (%s) has no node server: its launch was in flight; starting one", node_id[:12], m)
                self._place(node_id, m, self.procurement.adopt(m, now))
                continue
            n = self.nodes[node_id] = _Node(node_id, m, None, server,
                                            starting=asyncio.ensure_future(server.endpoint.remote()))
            adopting.append(self._spawn(self._adopt(n)))
        for r in self.cost.records():
            if r.ended_at is None and r.node not in self.nodes:
                self.cost.ended(r.node, now)  # gone while no controller watched: billed to now
        if adopting:
            await asyncio.wait(adopting, timeout=self.cfg.controller_recover_timeout_s)
        self._save_state()
        self._publish()
        log.info("controller generation %d: %d models, %d nodes taken back (%d serving)", self._routes.version >> 32,
                 len(self.registry.ids), len(self.nodes),
                 sum(n.state is NodeState.ACTIVE for n in self.nodes.values()))

    async def _adopt(self, n: _Node) -> None:
        assert n.starting is not None
        await asyncio.wait([n.starting])
        await self._check_started(n)

    async def register(self, spec: ModelSpec) -> int:
        """Register ``spec`` on the nodes the plan gives it (``model_min_nodes`` until demand
        asks for more); returns its cluster func id. The registry holds it from the start, so
        a node that joins meanwhile, or later, gets it when its share has it; a node that
        refuses it rolls the registration back."""
        await self._started()
        if spec.name in self.registry.ids:
            raise InvalidInput(f"model {spec.name!r} is already registered in the cluster")
        if spec.name in self.registry.removing:
            raise InvalidInput(f"model {spec.name!r} is being unregistered from the cluster's nodes; register it "
                               "again once that is done")
        fid = self.registry.add(spec.name, spec)
        self.store.add_model(spec.name, fid, spec)
        ready = [n for n in self.nodes.values() if n.endpoint is not None and n.state is not NodeState.DEAD
                 and not n.retiring]
        results = await asyncio.gather(*(self._give_models(n) for n in ready), return_exceptions=True)
        for n, r in zip(ready, results):
            # a node retired meanwhile (scale-in, an eviction) no longer needs the model
            if isinstance(r, BaseException) and n.node_id in self.nodes and not n.retiring:
                self.registry.remove(spec.name)
                self.store.remove_model(spec.name)
                for other in self.nodes.values():
                    other.models = other.models - {spec.name}
                self._publish()
                raise r
        self._publish()
        log.info("registered %s in the cluster (func id %d) on %d nodes", spec.name, fid,
                 sum(spec.name in n.models for n in ready))
        return fid

    async def unregister(self, name: str) -> None:
        """Stop serving ``name`` in the cluster: it leaves the registry and the routes at once
        (the gateway dispatches it no more), then every node with a server unregisters it
        (each under its ``giving`` lock, so a registration going on there ends first). A
        built-in model is refused: every node has it."""
        await self._started()
        if name not in self.registry.ids:
            raise UnknownModel(f"no model named {name!r} in the cluster; models: "
                               f"{', '.join(sorted(self.registry.ids)) or 'none'}")
        if self.registry.specs[name] is None:
            raise InvalidInput(f"model {name!r} is built in on every node, not registered at run time; it cannot "
                               "be deleted")
        self.registry.remove(name)
        self.store.remove_model(name)
        self.registry.removing.add(name)
        self._publish()
        try:
            nodes = [n for n in self.nodes.values() if n.endpoint is not None and n.state is not NodeState.DEAD]
            results = await asyncio.gather(*(self._take_model(n, name) for n in nodes), return_exceptions=True)
        finally:
            self.registry.removing.discard(name)
        for n, r in zip(nodes, results):
            if isinstance(r, BaseException):
                log.warning("node %s did not unregister %s: %s", n.node_id[:12], name, r)
        self._publish()
        log.info("unregistered %s from the cluster (%d nodes)", name, len(nodes))

    async def _take_model(self, n: _Node, name: str) -> None:
        async with n.giving:
            try:
                await n.server.remove_models.remote([name])
            finally:
                # gone from the node's share either way, so a new registration of the name is given again
                n.models = n.models - {name}

    async def _give_models(self, n: _Node) -> None:
        """Register and load on ``n`` every model of its share (``shares.of``) that it lacks, again
        until it lacks none: a model registered while a call is out goes in the next one.
        Whoever calls it (a node joining, a registration, a new plan), the node ends with its share."""
        async with n.giving:
            while missing := sorted(self.shares.of(n) - n.models):
                specs = [spec for name in missing if (spec := self.registry.specs[name]) is not None]
                n.coming = frozenset(missing)  # placed there already: another node's plan meanwhile counts them
                try:
                    await n.server.ensure_models.remote(specs, tuple(missing))
                finally:
                    n.coming = frozenset()
                n.models = n.models | (set(missing) & self.registry.ids.keys())

    async def routes(self, version: int, gateway_stats: dict | None = None, gateway: str = "") -> str | None:
        """Long poll: the routing table as JSON once it is newer than ``version`` (None after
        a second without a change, or while a restarted controller still rebuilds its view:
        the gateway serves on its last table). The gateway's stats ride along (the
        autoscaler's input), named by ``gateway``: the cluster's gateways' are added up."""
        try:
            await asyncio.wait_for(self._started(), _LONG_POLL_S)
        except TimeoutError:
            return None
        if gateway_stats is not None:
            first = self._gateways.record(gateway, gateway_stats, self.clock())
            self._gateway = self._gateways.merged(self.clock())
            if first:  # a restarted controller (or a new gateway): its counts so far are no window of this one's
                self._slo_window.take(*_strict_counts(self._gateway))
        if self._routes.version <= version:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), _LONG_POLL_S)
            except TimeoutError:
                return None
        return self._routes.to_json()

    async def configure(self, cfg: ClusterConfig) -> None:
        """Take ``cfg``'s autoscaling settings at run time (node limits, requests per node, SLO
        target, keep-alive, the loop's intervals, drain timings; the gateway keeps its own); the next
        round acts on them. A change to procurement, revocations or prices is refused: their
        state (open orders, the eviction schedule, the bill) belongs to the settings the
        cluster started with."""
        await self._started()
        fixed = [f.name for f in fields(cfg) if f.name in _FIXED and getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if fixed:
            raise InvalidInput(f"these settings cannot change while the cluster runs: {', '.join(fixed)}")
        self.cfg = cfg.checked()
        self.store.save_settings(_settings(cfg))
        self.autoscaler = _autoscaler(cfg)
        self.shares.configure(cfg)
        self._next_autoscale = 0.0
        log.info("autoscaling: %d to %d nodes, %d requests per node, keep-alive %.1f s", cfg.min_nodes,
                 cfg.max_nodes, cfg.requests_per_node, cfg.keep_alive_s)

    async def status(self) -> dict:
        """Nodes (market, state, models, in flight), the target, the cost so far."""
        await self._started()
        now = self.clock()
        in_flight = self._gateway.get("in_flight", {})
        return {
            "target": self._target,
            "slo_window": self._last_window | {"scale_ups": self.autoscaler.slo_scale_ups},
            "nodes": [{"node": n.node_id, "market": str(n.market),
                       "state": "unreachable" if n.unreachable else str(n.state), "reason": n.unreachable,
                       "models": sorted(n.models), "in_flight": in_flight.get(n.node_id, 0),
                       "deadline": n.deadline, "endpoint": None if n.endpoint is None else
                       f"{n.endpoint.host}:{n.endpoint.fast_port}"} for n in self.nodes.values()],
            "models": dict(self.registry.ids),
            "gateway": self._gateway,
            "gateways": self._gateways.names(),
            "cost": self.cost.summary(now),
            "bill": self.cost.to_list(),  # the nodes running and the newest bill_records ended
            "bill_earlier": self.cost.folded(),  # per market: the ended nodes no longer listed
            "fallbacks": self.procurement.fallbacks,
            "notice_fallbacks": self.procurement.notice_fallbacks,
            "swaps": self.procurement.swaps,
            "revocations": {"notices": self.revocation.notices, "spot_requests": self.revocation.spot_requests,
                            "spot_failures": self.revocation.spot_failures},
        }

    async def stop_all(self) -> None:
        """Retire every node (``cluster down``), those a restarted controller takes back too."""
        await self._started()
        if self._loop_task is not None:
            self._loop_task.cancel()
        await asyncio.gather(*(self._retire(n, evicted=False) for n in list(self.nodes.values())),
                             return_exceptions=True)
        self.store.clear()  # the cluster is gone: a later `cluster up` on this Ray session starts empty

    # -- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._reconcile(self.clock())
            except Exception:  # noqa: BLE001 - one bad round must not stop the control plane
                log.exception("reconciliation failed; trying again next round")
            await asyncio.sleep(self.cfg.reconcile_interval_s)

    async def _reconcile(self, now: float) -> None:
        ray_nodes = await asyncio.to_thread(raycompat.nodes)
        alive = {n.node_id for n in ray_nodes if n.alive}
        draining = await asyncio.to_thread(raycompat.draining_nodes, self.address)
        for n in list(self.nodes.values()):
            if n.node_id not in alive:
                self._end(n, now, evicted=not n.retiring)
            elif n.node_id in draining and n.deadline is None:
                self._noticed(n, draining[n.node_id] or now + self.cfg.notice_min_s, now)
        for n in list(self.nodes.values()):
            if n.state is NodeState.STARTING and n.starting is not None and n.starting.done():
                # a task: its models' loads take seconds, and the loop must go on meanwhile (deaths,
                # notices and the status calls that report them)
                self._spawn(self._check_started(n))
        self._drain_doomed(now)
        live_spot = [n.node_id for n in self.nodes.values() if n.market is Market.SPOT and n.deadline is None
                     and n.state is NodeState.ACTIVE]
        for notice in self.revocation.tick(now, live_spot):
            log.info("revocation emulator: notice for %s, deadline in %.1f s", notice.node[:12], notice.deadline - now)
            await asyncio.to_thread(raycompat.drain_node, self.address, notice.node, notice.deadline - now,
                                    "splitserve revocation emulator")
        if not self._checking_servers:
            self._checking_servers = True  # one check at a time: cleared when it ends
            self._spawn(self._check_servers())
        if now >= self._next_autoscale:
            self._next_autoscale = now + self.cfg.autoscale_interval_s
            self._autoscale(now)
        self._save_state()

    async def _check_servers(self) -> None:
        """Ask each serving node's server whether its ``splitserve serve`` child lives. A node
        whose child died (not the node: Ray still lists it) answers nothing on its fast path;
        the gateway has re-sent its work on the link's loss, and the node is retired here, so
        the autoscaler orders its replacement. A call not answered within
        ``node_stats_timeout_s`` (the server busy loading models) proves nothing."""
        try:
            # a server loading models answers nothing else meanwhile: not asked, so calls do not pile up there
            serving = [n for n in self.nodes.values() if n.state is NodeState.ACTIVE and not n.retiring
                       and not n.giving.locked()]
            answers = await asyncio.gather(*(asyncio.wait_for(n.server.stats.remote(), self.cfg.node_stats_timeout_s)
                                             for n in serving), return_exceptions=True)
            for n, stats in zip(serving, answers):
                if isinstance(stats, dict) and not stats.get("alive", True) and not n.retiring:
                    log.warning("node %s: its splitserve serve (pid %s) exited; replacing the node", n.node_id[:12],
                                stats.get("pid"))
                    n.retiring = True
                    self._spawn(self._retire(n, evicted=False))
        finally:
            self._checking_servers = False

    def _save_state(self) -> None:
        """The bill, the counters and placement's counts, where changed since last saved."""
        state = self.cost.to_state()
        if state != self._saved_bill:
            self.store.save_bill(state)
            self._saved_bill = state
        counters = {part: {name: getattr(getattr(self, part), name) for name in names}
                    for part, names in _COUNTED.items()}
        if counters != self._saved_counters:
            self.store.save_counters(counters)
            self._saved_counters = counters
        placement = {m: list(c) for m, c in self.shares.placement.counts().items()}
        if placement != self._saved_placement:
            self.store.save_placement(placement)
            self._saved_placement = placement

    def _staying(self) -> list[_Node]:
        return [n for n in self.nodes.values() if n.deadline is None and not n.retiring
                and n.state is NodeState.ACTIVE]

    def _autoscale(self, now: float) -> None:
        met, total = self._slo_window.take(*_strict_counts(self._gateway))
        self._last_window = {"met": met, "total": total}
        load = ClusterLoad(int(self._gateway.get("held", 0)), len(self._staying()), self.procurement.open_orders,
                           met, total)
        self._target = self.autoscaler.tick(now, load)
        have = len(self._staying()) + self.procurement.open_orders
        due = replacement_due(self.cfg, (n.deadline for n in self.nodes.values() if n.deadline is not None
                                         and n.state is NodeState.ACTIVE and not n.retiring))
        while have < self._target:
            self._act(self.procurement.open(now, due), now)
            have += 1
        while have > self._target and (order := self.procurement.newest()) is not None:
            self._act(self.procurement.close(order), now)
            have -= 1
        surplus = have - self._target
        # the dearest first: on-demand before spot
        for n in sorted(self._staying(), key=lambda n: n.market is Market.SPOT)[:max(0, surplus)]:
            log.info("scale-in: draining node %s (%s)", n.node_id[:12], n.market)
            self._drain_out(n)
        self._act(self.procurement.tick(now), now)
        self._act(self.procurement.swap(now, {n.node_id: n.ready_at for n in self._staying()
                                              if n.market is Market.ON_DEMAND}), now)
        plan = self.shares.plan()
        for n in self._staying():  # each serving node to its share of the models, one move at a time
            if not n.giving.locked() and plan.get(n.node_id) != n.models:
                self._spawn(reshare(n, self._give_models, self.shares.of, self._publish))

    def _act(self, actions: list[Action], now: float) -> None:
        for a in actions:
            if isinstance(a, Launch):
                if a.market is Market.SPOT and self.revocation.spot_request_fails():
                    log.info("order %d: the spot request failed (emulated)", a.order)
                    self._act(self.procurement.failed(a.order, now), now)
                    continue
                self._spawn(self._launch(a.order, a.market))
            elif isinstance(a, Cancel):
                self._cancelled.add((a.order, a.market))

    async def _launch(self, order: int, market: Market) -> None:
        requested = self.clock()
        try:
            node_id = await self.provider.launch.remote(str(market))
        except ray.exceptions.RayError as e:
            log.warning("order %d: no %s node: %s", order, market, e)
            # a provider that keeps failing is asked again at the loop's pace, not in a hot loop
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            if (order, market) in self._cancelled:
                self._cancelled.discard((order, market))
            else:
                self._act(self.procurement.failed(order, self.clock()), self.clock())
            return
        self.cost.requested(node_id, str(market), market, self.cfg.prices.of(market), requested)
        n = self._place(node_id, market, order)
        if (order, market) in self._cancelled:
            self._cancelled.discard((order, market))
            n.order = None
            await self._retire(n, evicted=False)

    def _place(self, node_id: str, market: Market, order: int | None) -> _Node:
        """Start ``node_id``'s node server (detached and named: a restarted controller finds it)."""
        server = NodeServerActor.options(name=node_server_name(node_id), namespace=NAMESPACE, lifetime="detached",
                                         **raycompat.on_node(node_id)).remote(self.node_spec)
        n = self.nodes[node_id] = _Node(node_id, market, order, server,
                                        starting=asyncio.ensure_future(server.endpoint.remote()))
        return n

    async def _check_started(self, n: _Node) -> None:
        """A node whose server came up gets the registry's models, then serves: it is ready
        (billed so, and ACTIVE) once they are warm, not when its server answered."""
        if n.starting is None or not n.starting.done():
            return
        starting, n.starting = n.starting, None
        try:
            n.endpoint = starting.result()
            if not await self._reachable(n, starting):
                return
            await self._give_models(n)
        except (ray.exceptions.RayError, SplitServeError) as e:
            log.warning("node %s did not start its server: %s", n.node_id[:12], e)
            order, n.order = n.order, None
            if order is not None:
                self._act(self.procurement.failed(order, self.clock()), self.clock())
            await self._retire(n, evicted=False)
            return
        if n.retiring or self.nodes.get(n.node_id) is not n:
            return  # retired or gone while its models loaded
        now = self.clock()
        replaced = None
        if n.order is not None:
            replaced = self.nodes.get(self.procurement.replaces(n.order) or "")
            self.procurement.ready(n.order)
            n.order = None
        record = self.cost.record(n.node_id)
        if record is not None and record.ready_at is not None:
            n.ready_at = record.ready_at  # taken back by a restarted controller: it served before
        else:
            n.ready_at = now
            self.cost.ready(n.node_id, now)
        self._set_state(n, NodeState.ACTIVE, now)
        log.info("node %s (%s) serves at %s:%d", n.node_id[:12], n.market, n.endpoint.host, n.endpoint.fast_port)
        if replaced is not None and replaced in self._staying():
            log.info("node %s (%s) is replaced by spot node %s", replaced.node_id[:12], replaced.market,
                     n.node_id[:12])
            self._drain_out(replaced)

    async def _reachable(self, n: _Node, started: asyncio.Future) -> bool:
        """Whether the gateway reaches ``n`` where it advertises. One it cannot stays out of the
        routes and active count, ``status`` says why, its order opens again, and the next round
        checks again (``started`` stays its endpoint)."""
        reason = await self._reach(n.endpoint)
        if reason is None and n.unreachable is not None:
            log.info("node %s answers at %s:%d now", n.node_id[:12], n.endpoint.host, n.endpoint.fast_port)
        elif reason is not None and n.unreachable is None:
            log.warning("node %s is unreachable: %s", n.node_id[:12], reason)
        n.unreachable = reason
        if reason is None:
            return True
        n.starting, order, n.order = started, n.order, None
        if order is not None:
            self._act(self.procurement.failed(order, self.clock()), self.clock())
        return False

    def _noticed(self, n: _Node, deadline: float, now: float) -> None:
        n.deadline = deadline
        log.warning("eviction notice for node %s (%s): deadline in %.1f s", n.node_id[:12], n.market, deadline - now)
        if n.order is not None:  # still starting: its order is open again
            self._act(self.procurement.failed(n.order, now), now)
            n.order = None
        self._next_autoscale = now  # order the replacement this round

    def _drain_doomed(self, now: float) -> None:
        """Doomed nodes stop taking work once a replacement serves (or at the lead), and end
        once drained and idle, or at the margin, when the gateway re-sends what they still hold
        (``revocation.doomed_step``: the simulator's rule too)."""
        replacement_serves = len(self._staying()) >= self._target
        for n in list(self.nodes.values()):
            if n.deadline is None or n.retiring:
                continue
            step = doomed_step(self.cfg, now, n.deadline, n.state is NodeState.ACTIVE, n.state is NodeState.DRAINING,
                               replacement_serves, not self._idle(n))
            if step.stop_taking_work:
                self._set_state(n, NodeState.DRAINING, now)
            if step.end:
                n.retiring = True
                self._spawn(self._retire(n, evicted=step.evicted))

    def _idle(self, n: _Node) -> bool:
        return int(self._gateway.get("in_flight", {}).get(n.node_id, 0)) == 0

    def _drain_out(self, n: _Node) -> None:
        """Scale-in or a swap: ``n`` leaves the plan at once, serves on until the nodes that stay
        hold its models (bounded by ``node_start_timeout_s``), then takes no new work and is
        retired once idle: a model it alone held is never left without a node."""
        n.retiring = True
        self._spawn(self._retire_when_idle(n))

    async def _retire_when_idle(self, n: _Node) -> None:
        """Scale-in: the node leaves once the nodes that stay hold its models, then once the
        gateway holds nothing on it (bounded by the margin)."""
        until = self.clock() + self.cfg.node_start_timeout_s
        while n.models - {m for o in self._staying() for m in o.models} and self.clock() < until:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
        self._set_state(n, NodeState.DRAINING, self.clock())
        until = self.clock() + max(self.cfg.drain_margin_s, self.cfg.reconcile_interval_s * 4)
        while not self._idle(n) and self.clock() < until:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
        await self._retire(n, evicted=False)

    async def _retire(self, n: _Node, evicted: bool) -> None:
        n.retiring = True
        self._end(n, self.clock(), evicted)
        try:
            if n.server is not None:
                await n.server.stop.remote()
                ray.kill(n.server, no_restart=True)
        except ray.exceptions.RayError as e:
            log.info("node server on %s was already gone: %s", n.node_id[:12], e)
        try:
            await self.provider.terminate.remote(n.node_id)
        except ray.exceptions.RayError as e:
            log.info("node %s was already gone: %s", n.node_id[:12], e)

    def _end(self, n: _Node, now: float, evicted: bool) -> None:
        if self.nodes.pop(n.node_id, None) is None:
            return
        if evicted:
            log.warning("node %s (%s) is gone", n.node_id[:12], n.market)
        self.cost.ended(n.node_id, now, evicted=evicted)
        self.revocation.gone(n.node_id)
        if n.order is not None:
            self._act(self.procurement.failed(n.order, now), now)
        self._publish()

    def _set_state(self, n: _Node, state: NodeState, now: float) -> None:
        n.state = state
        if state is NodeState.DRAINING:
            self.cost.drained(n.node_id, now)
        self._publish()

    def _publish(self) -> None:
        nodes = tuple(NodeRoute(n.node_id, n.endpoint.host, n.endpoint.fast_port, n.market, n.state, n.models,
                                n.endpoint.http_port)
                      for n in self.nodes.values() if n.endpoint is not None and n.state is not NodeState.STARTING)
        self._routes = Routes(self._routes.version + 1, nodes, tuple(sorted(self.registry.ids.items())))
        self._changed.set()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _strict_counts(gateway_stats: dict) -> tuple[int, int]:
    """(met, total) of the strict calls the gateway answered since its process started."""
    slo = gateway_stats.get("slo", {})
    return int(slo.get(SloOutcome.MET, 0)), sum(int(n) for n in slo.values())


ControllerActor = ray.remote(num_cpus=0, resources={"splitserve_head": 0.01}, max_restarts=-1)(  # on the head,
    raycompat.at_node_niceness(Controller))  # detached and named: tools and a restarted driver find it
