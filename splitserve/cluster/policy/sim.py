"""A discrete-event cluster built from the pure parts, for PROTEAN Fig. 9 at the paper's scale.

The simulator owns only what a real cluster would do physically: time, node boots, batches
running on nodes. Every decision is made by the modules the
Ray half uses: ``Dispatcher`` (which node), ``Ledger`` (one answer per request, re-sends),
``ClusterAutoscaler`` (how many nodes), ``Procurement`` (which market), the
``RevocationEmulator`` (notices, failed spot requests; ``doomed_step``, what a noticed node
does) and the ``CostLedger`` (dollars).

The model of a node (splitserve's, where the paper leaves it open; docs/cluster.md):

- a node holds the one simulated model warm once it is ready (``launch_s`` after its
  request, boot and model load together) and runs one batch at a time, strict requests
  before best-effort ones, each batch up to ``batch`` requests of one class, a batch of
  ``b`` taking ``batch_time_s[b - 1]``;
- a node with an eviction notice is replaced at once (it no longer counts as serving) but
  takes new work until its replacement serves ("once the new VM is acquired, we redirect
  the incoming traffic to it", §4.5) or until ``drain_lead_s`` before its eviction; then it
  ends as soon as it holds nothing (billed to then, as the controller retires it), and
  ``drain_margin_s`` before the eviction at the latest, what it still holds sent elsewhere
  (an eviction);
- a node drained for scale-in ends once it holds nothing; the dearest nodes go first;
- a request no node can take (no node serving, or every window full) is answered at once
  with the error (``MODEL_NOT_READY``, ``QUEUE_FULL``); a strict one counts as a miss.

Pure and deterministic: arrivals come in, a ``random.Random`` per seed drives dispatch and
the emulator, nothing reads a clock or does I/O. Hours of trace run in seconds.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from splitserve.cluster.policy.autoscale import ClusterAutoscaler, ClusterLoad, SloWindow
from splitserve.cluster.policy.cost import CostLedger
from splitserve.cluster.policy.dispatch import Dispatcher, NodeState, NodeView
from splitserve.cluster.policy.ledger import Deliver, Drop, Entry, Ledger, Outcome, Resend
from splitserve.cluster.policy.procurement import Action, Cancel, Launch, Procurement
from splitserve.cluster.policy.revocation import Notice, RevocationEmulator, doomed_step, replacement_due
from splitserve.cluster.pools import Market
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import InvalidInput, SplitServeError
from splitserve.protocol.header import RequestClass
from splitserve.slo import SloOutcome, slo_outcome

MODEL = "model"


@dataclass(frozen=True)
class Workload:
    """What the simulated cluster serves: arrival times (s, ascending) and whether each is
    strict, the batch size and batch times of the one model, and the strict SLO."""

    times: Sequence[float]
    strict: Sequence[bool]
    batch: int
    batch_time_s: Sequence[float]  # [b - 1]: seconds a batch of b takes on one node
    slo_s: float

    def __post_init__(self) -> None:
        if len(self.times) != len(self.strict):
            raise InvalidInput("times and strict must have the same length")
        if self.batch < 1 or len(self.batch_time_s) != self.batch or min(self.batch_time_s) <= 0:
            raise InvalidInput("batch_time_s needs one positive time per batch size 1..batch")
        if not self.slo_s > 0:
            raise InvalidInput(f"slo_s must be positive, got {self.slo_s}")


@dataclass
class _Node:
    node: str
    market: Market
    order: int
    state: NodeState = NodeState.STARTING
    rt: deque[Entry] = field(default_factory=deque)
    be: deque[Entry] = field(default_factory=deque)
    running: list[Entry] = field(default_factory=list)
    batch_seq: int = 0  # the running batch's number: a done event for an older one is stale
    noticed: bool = False  # an eviction notice (else a draining node is scaled in)
    deadline: float = 0.0  # of the eviction, once noticed
    ready_at: float = 0.0  # when it began serving

    def held(self) -> int:
        return len(self.rt) + len(self.be) + len(self.running)


@dataclass
class _Tally:
    strict_latency: list[float] = field(default_factory=list)
    be_latency: list[float] = field(default_factory=list)
    strict_errors: int = 0
    be_errors: int = 0
    strict_met: int = 0

    @property
    def strict_total(self) -> int:
        return len(self.strict_latency) + self.strict_errors


class ClusterSim:
    """One run: a ``ClusterConfig`` (policy, P_rev, prices, limits) on a ``Workload``."""

    def __init__(self, cfg: ClusterConfig, work: Workload, seed: int) -> None:
        self.cfg = cfg
        self.work = work
        self.ledger = Ledger(cfg.ledger_capacity, cfg.max_attempts)
        self.dispatcher = Dispatcher(cfg.node_window, cfg.two_choices_above, random.Random(seed),
                                     cfg.dispatch_prefer_below)
        self.autoscaler = ClusterAutoscaler(cfg.min_nodes, cfg.max_nodes, cfg.requests_per_node, cfg.slo_target,
                                            cfg.keep_alive_s)
        self.procurement = Procurement.of(cfg)
        # its own stream, the controller's: the eviction schedule does not depend on how dispatch drew
        self.revocation = RevocationEmulator.of(cfg)
        self.cost = CostLedger()
        self.now = 0.0
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._nodes: dict[str, _Node] = {}
        self._names = count(1)
        self._launches: dict[int, str] = {}  # order -> node id of its pending request
        self._views: list[NodeView] | None = None
        self._target = cfg.min_nodes
        self._tally = _Tally()
        self._slo_window = SloWindow()
        self.requeued = 0
        self.notices: list[Notice] = []
        self.timeline: list[tuple[float, int, int]] = []  # (t, serving, billed) at each tick that changed them

    # -- the run ---------------------------------------------------------------------------

    def run(self, start: float, horizon_s: float) -> dict[str, Any]:
        """Serve every arrival (shifted by ``start``, the first nodes' boot), then run on
        until every accepted request is answered or ``horizon_s`` more seconds pass."""
        self._reconcile()
        self._push(self.cfg.autoscale_interval_s, "tick", None)
        times, strict = self.work.times, self.work.strict
        i, n = 0, len(times)
        end = start + (times[-1] if n else 0.0)
        while True:
            t_arr = start + times[i] if i < n else float("inf")
            if self._events and self._events[0][0] <= t_arr:
                t, _, kind, arg = heapq.heappop(self._events)
                self.now = t
                if t > end + horizon_s or (i >= n and kind == "tick" and not len(self.ledger)):
                    break
                getattr(self, f"_on_{kind}")(arg)
            elif i < n:
                self.now = t_arr
                self._arrive(t_arr, RequestClass.RT if strict[i] else RequestClass.BE)
                i += 1
            else:
                break
        for node in self._nodes.values():
            if node.state is not NodeState.DEAD:
                self.cost.ended(node.node, self.now)
        for order in list(self._launches):
            self.cost.ended(self._launches.pop(order), self.now)
        return self._result(n)

    def _push(self, delay: float, kind: str, arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (self.now + delay, self._seq, kind, arg))

    # -- requests --------------------------------------------------------------------------

    def _arrive(self, at: float, cls: RequestClass) -> None:
        entry = self.ledger.accept(MODEL, cls, None, at)
        self._dispatch(entry, frozenset())

    def _dispatch(self, entry: Entry, exclude: frozenset[str]) -> None:
        try:
            node = self.dispatcher.choose(MODEL, entry.cls, self._node_views(), self.ledger.in_flight(), exclude)
        except SplitServeError as e:
            self._outcome(self.ledger.fail(entry.req_id, e))
            return
        self.ledger.sent(entry.req_id, node)
        n = self._nodes[node]
        (n.rt if entry.cls is RequestClass.RT else n.be).append(entry)
        if not n.running:
            self._start_batch(n)

    def _start_batch(self, n: _Node) -> None:
        queue = n.rt or n.be
        if not queue or n.state in (NodeState.DEAD, NodeState.STARTING):
            return
        size = min(self.work.batch, len(queue))
        n.running = [queue.popleft() for _ in range(size)]
        n.batch_seq += 1
        self._push(self.work.batch_time_s[size - 1], "batch_done", (n.node, n.batch_seq))

    def _on_batch_done(self, arg: tuple[str, int]) -> None:
        name, seq = arg
        n = self._nodes.get(name)
        if n is None or seq != n.batch_seq:
            return  # the node is gone, or its batch was taken back
        done, n.running = n.running, []
        for entry in done:
            self._outcome(self.ledger.answered(entry.req_id, name, self.now))
        self._start_batch(n)
        if n.noticed:
            self._doomed()
        elif n.state is NodeState.DRAINING and not n.held():
            self._end(n, evicted=False)

    def _outcome(self, out: Outcome) -> None:
        if isinstance(out, Resend):
            self._dispatch(out.entry, out.exclude)
        elif isinstance(out, Deliver):
            self._record(out)
        else:
            assert isinstance(out, Drop)

    def _record(self, d: Deliver) -> None:
        t = self._tally
        strict = d.entry.cls is RequestClass.RT
        latency = self.now - d.entry.accepted_at
        if strict:
            if slo_outcome(d.entry.accepted_at + self.work.slo_s, self.now, d.error) is SloOutcome.MET:
                t.strict_met += 1
            if d.error is None:
                t.strict_latency.append(latency)
            else:
                t.strict_errors += 1
        elif d.error is None:
            t.be_latency.append(latency)
        else:
            t.be_errors += 1

    # -- nodes -----------------------------------------------------------------------------

    def _node_views(self) -> list[NodeView]:
        if self._views is None:
            warm = frozenset({MODEL})
            self._views = [NodeView(n.node, n.market, n.state, warm) for n in self._nodes.values()
                           if n.state is NodeState.ACTIVE]
        return self._views

    def _set_state(self, n: _Node, state: NodeState) -> None:
        n.state = state
        self._views = None

    def _act(self, actions: Sequence[Action]) -> None:
        for a in actions:
            if isinstance(a, Launch):
                if a.market is Market.SPOT and self.revocation.spot_request_fails():
                    self._act(self.procurement.failed(a.order, self.now))
                    continue
                name = f"{a.market}-{next(self._names)}"
                self._nodes[name] = _Node(name, a.market, a.order)
                self._launches[a.order] = name
                self.cost.requested(name, "node", a.market, self.cfg.prices.of(a.market), self.now)
                self._push(self.cfg.launch_s(a.market), "ready", (a.order, name))
            else:
                assert isinstance(a, Cancel)
                name = self._launches.pop(a.order)
                self.cost.ended(name, self.now)
                self._set_state(self._nodes.pop(name), NodeState.DEAD)

    def _on_ready(self, arg: tuple[int, str]) -> None:
        order, name = arg
        if self._launches.get(order) != name:
            return  # withdrawn meanwhile
        del self._launches[order]
        replaced = self.procurement.replaces(order)
        self.procurement.ready(order)
        n = self._nodes[name]
        n.ready_at = self.now
        self._set_state(n, NodeState.ACTIVE)
        self.cost.ready(name, self.now)
        old = self._nodes.get(replaced) if replaced is not None else None
        if old is not None and old in self._staying():  # a swap: the on-demand node goes as on scale-in
            self._drain_out(old)
        self._doomed()  # "once the new VM is acquired, we redirect the incoming traffic to it" (§4.5)

    def _notice(self, notice: Notice) -> None:
        """A doomed node follows ``doomed_step`` (the controller's rule): it serves on until a
        replacement serves or ``drain_lead_s`` before its eviction, ends once drained and
        idle, and at ``drain_margin_s`` before its eviction whatever it holds."""
        n = self._nodes[notice.node]
        n.noticed = True
        n.deadline = notice.deadline
        self.notices.append(notice)
        for lead in (self.cfg.drain_lead_s, self.cfg.drain_margin_s):
            self._push(max(0.0, notice.deadline - lead - self.now), "doomed", None)
        self._reconcile()  # its replacement is ordered now
        self._doomed()

    def _doomed(self) -> None:
        """Apply ``doomed_step`` to every node under a notice."""
        replacement_serves = len(self._staying()) >= self._target
        for n in [n for n in self._nodes.values() if n.noticed]:
            step = doomed_step(self.cfg, self.now, n.deadline, n.state is NodeState.ACTIVE,
                               n.state is NodeState.DRAINING, replacement_serves, n.held() > 0)
            if step.stop_taking_work:
                self._set_state(n, NodeState.DRAINING)
                self.cost.drained(n.node, self.now)
            if step.end:
                self._end(n, evicted=step.evicted)

    def _on_doomed(self, _: None) -> None:
        self._doomed()

    def _requeue(self, n: _Node) -> None:
        """Take back what ``n`` holds and send it elsewhere (a batch it runs is abandoned)."""
        n.rt.clear()
        n.be.clear()
        n.running = []
        n.batch_seq += 1
        taken = self.ledger.node_lost(n.node, self.now)
        self.requeued += sum(isinstance(o, Resend) for o in taken)
        for out in taken:
            self._outcome(out)

    def _end(self, n: _Node, evicted: bool) -> None:
        if n.held():
            self._requeue(n)
        self._set_state(n, NodeState.DEAD)
        self.cost.ended(n.node, self.now, evicted=evicted)
        self.revocation.gone(n.node)
        del self._nodes[n.node]

    # -- control: every autoscale interval -------------------------------------------------

    def _on_tick(self, _: None) -> None:
        live_spot = [n.node for n in self._nodes.values() if n.market is Market.SPOT and n.state is NodeState.ACTIVE]
        for notice in self.revocation.tick(self.now, live_spot):
            self._notice(notice)
        t = self._tally
        serving = len(self._staying())
        load = ClusterLoad(len(self.ledger), serving, self.procurement.open_orders,
                           *self._slo_window.take(t.strict_met, t.strict_total))
        self._target = self.autoscaler.tick(self.now, load)
        self._reconcile()
        self._doomed()
        self._act(self.procurement.tick(self.now))
        self._act(self.procurement.swap(self.now, {n.node: n.ready_at for n in self._staying()
                                                   if n.market is Market.ON_DEMAND}))
        self._push(self.cfg.autoscale_interval_s, "tick", None)
        counts = (sum(n.state is NodeState.ACTIVE for n in self._nodes.values()), len(self._nodes))
        if not self.timeline or self.timeline[-1][1:] != counts:
            self.timeline.append((self.now, *counts))

    def _staying(self) -> list[_Node]:
        """ACTIVE nodes without an eviction notice: the ones the cluster can count on."""
        return [n for n in self._nodes.values() if n.state is NodeState.ACTIVE and not n.noticed]

    def _reconcile(self) -> None:
        """Open or close orders and drain nodes until serving + starting meets the target."""
        active = self._staying()
        have = len(active) + self.procurement.open_orders
        due = replacement_due(self.cfg, (n.deadline for n in self._nodes.values()
                                         if n.noticed and n.state is NodeState.ACTIVE))
        for _ in range(self._target - have):
            self._act(self.procurement.open(self.now, due))
        surplus = have - self._target
        while surplus > 0 and (order := self.procurement.newest()) is not None:
            self._act(self.procurement.close(order))
            surplus -= 1
        prices = self.cfg.prices
        for n in sorted(active, key=lambda n: (-prices.of(n.market), n.held(), n.node))[:max(0, surplus)]:
            self._drain_out(n)

    def _drain_out(self, n: _Node) -> None:
        """Scale-in or a swap: ``n`` takes no new work and ends once it holds nothing."""
        self._set_state(n, NodeState.DRAINING)
        self.cost.drained(n.node, self.now)
        if not n.held():
            self._end(n, evicted=False)

    # -- the numbers -----------------------------------------------------------------------

    def _result(self, arrivals: int) -> dict[str, Any]:
        import numpy as np

        t = self._tally
        strict_total = t.strict_total

        def p99(xs: list[float]) -> float | None:
            return float(np.percentile(xs, 99)) * 1e3 if xs else None

        return {
            "requests": arrivals,
            "answered": self.ledger.delivered,
            "lost": len(self.ledger),
            "strict": {"requests": strict_total, "errors": t.strict_errors, "met": t.strict_met,
                       "compliance": t.strict_met / strict_total if strict_total else None,
                       "p99_ms": p99(t.strict_latency)},
            "be": {"requests": len(t.be_latency) + t.be_errors, "errors": t.be_errors, "p99_ms": p99(t.be_latency)},
            "evictions": self.cost.summary(self.now)["evictions"],
            "notices": len(self.notices),
            "notice_times": [(n.at, n.deadline) for n in self.notices],
            "nodes_over_time": self.timeline,
            "fallbacks": self.procurement.fallbacks,
            "notice_fallbacks": self.procurement.notice_fallbacks,
            "swaps": self.procurement.swaps,
            "spot_requests": self.revocation.spot_requests,
            "spot_failures": self.revocation.spot_failures,
            "spot_retries": self.procurement.spot_retries,
            "requeued": self.requeued,
            "duplicates_dropped": self.ledger.dropped,
            "slo_scale_ups": self.autoscaler.slo_scale_ups,
            "cost": self.cost.summary(self.now),
            "end_s": self.now,
        }


def simulate(cfg: ClusterConfig, work: Workload, seed: int, start: float | None = None,
             horizon_s: float = 600.0) -> dict[str, Any]:
    """One run of ``work`` on a cluster configured by ``cfg``; arrivals begin once the first
    nodes can serve (``start``, default the slower market's launch time)."""
    sim = ClusterSim(cfg, work, seed)
    first = max(cfg.spot_launch_s, cfg.on_demand_launch_s) if start is None else start
    return sim.run(first, horizon_s)
