"""Prometheus metrics (prometheus-client), per model and per class (rt / be).

The counters a user sums per model (requests, failures, samples, batches) count both paths,
told apart by the label ``path``: ``front`` for calls the front end answered, counted as
they are answered, and ``direct`` for calls a worker answered straight to its client
(``fast_direct``), read from the workers' pages at each scrape. A call is counted on
exactly one of them. So do the duration histograms (``server.durations``)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.errors import SplitServeError
from splitserve.protocol.header import RequestClass
from splitserve.server.durations import CallDurations
from splitserve.slo import SloOutcome
from splitserve.worker.counters import BINS, DURATION_BUCKETS_S, DirectTally, Duration

K = TypeVar("K", bound=Hashable)
_BUCKETS = DURATION_BUCKETS_S


def class_label(cls: RequestClass) -> str:
    return "rt" if cls == RequestClass.RT else "be"


class CallTimes(Protocol):
    """What a call's metrics are made of (``server.monitor.Call`` has it all); metrics sit
    below every other part of the node, so they name no server type."""

    cls: RequestClass
    count: int
    t_ready: float
    t_rx: float
    t_dispatch: float
    t_work: float
    compute_ns: int


@dataclass(frozen=True)
class ModelGauges:
    """One model's live state for the gauges, taken by its runtime just before a scrape."""

    name: str
    queue_depth: Mapping[RequestClass, int]
    ready_instances: int
    failed: bool
    direct: DirectTally | None = None  # its workers' direct calls (None: the direct path is off)


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("model", "class")
        self.requests = Counter("splitserve_requests", "Requests answered with their result, by path (front, direct)",
                                (*labels, "path"), registry=r)
        self.failures = Counter("splitserve_request_failures", "Requests answered with an error, by path",
                                (*labels, "status", "path"), registry=r)
        self.inferences = Counter("splitserve_inference_count", "Samples inferred (answered calls'), by path",
                                  (*labels, "path"), registry=r)
        self.executions = Counter("splitserve_execution_count", "Batches executed, by path", ("model", "path"),
                                  registry=r)
        self.preemptions = Counter("splitserve_preemptions", "Best-effort batches preempted", ("model",), registry=r)
        self.preemption_latency = Histogram(
            "splitserve_preemption_latency_seconds", "Preemption flag raised to the worker stopped at a segment boundary",
            ("model",), buckets=_BUCKETS, registry=r)
        self.durations = CallDurations(r)  # queue, compute and request, per model, class and path
        self.queue_depth = Gauge("splitserve_queue_depth", "Requests waiting for a batch", labels, registry=r)
        self.instances = Gauge("splitserve_instances", "Ready worker instances", ("model",), registry=r)
        self.watchdog_expired = Counter(
            "splitserve_watchdog_expired", "Calls the watchdog answered INTERNAL after max_call_age_s (a server bug)",
            ("model", "state"), registry=r)
        self.dropped_answers = Counter(
            "splitserve_dropped_answers", "Answers not sent: after the watchdog's (late) or a second one (duplicate)",
            ("model", "reason"), registry=r)
        # The direct path (ServerConfig.transports.fast_direct): calls the workers took without the front end,
        # read from their pages at each scrape, so gauges of monotonic totals.
        self.direct_calls = Gauge("splitserve_direct_calls", "Direct calls by what became of them: received, "
                                  "answered, failed, in_flight_rt, in_flight_be", ("model", "state"), registry=r)
        self.direct_busy = Gauge("splitserve_direct_busy_seconds", "Time workers spent running direct batches",
                                 ("model",), registry=r)
        self.direct_batches = Gauge("splitserve_direct_batches", "Direct batches run", ("model",), registry=r)
        self.direct_connections = Gauge("splitserve_direct_connections", "Direct connections open", ("model",),
                                        registry=r)
        self.handoffs = Counter("splitserve_handoffs", "Client connections the front end handed over to a worker "
                                "(HANDOFF: the client could not reach the worker's own port)", ("model",), registry=r)
        self.model_failed = Gauge("splitserve_model_failed", "1 while the model is FAILED (its load failed)",
                                  ("model",), registry=r)
        # memory manager (Rafiqi)
        self.memory_budget = Gauge("splitserve_memory_budget_bytes", "Bytes resident models may take (unset: no limit)",
                                   registry=r)
        self.memory_reserved = Gauge("splitserve_memory_reserved_bytes",
                                     "Bytes held or reserved by resident, loading and evicting models", registry=r)
        self.model_resident_bytes = Gauge("splitserve_model_resident_bytes", "Bytes the model's residency holds",
                                          ("model",), registry=r)
        self.model_loads = Counter("splitserve_model_loads", "Loads of the model's weights", ("model",), registry=r)
        # PROTEAN in the node: instances the autoscaler added beyond the warm ones, and geometry changes
        self.cold_starts = Counter("splitserve_cold_starts", "Instances the autoscaler started for pending batches",
                                   ("model",), registry=r)
        self.geometry_changes = Counter("splitserve_geometry_changes", "Re-carvings of the node's partitions",
                                        ("origin", "outcome"), registry=r)
        self.model_evictions = Counter("splitserve_model_evictions", "Evictions of the model's weights", ("model",),
                                       registry=r)
        self.model_load_seconds = Histogram("splitserve_model_load_seconds", "A load, from its start to serving",
                                            ("model",), buckets=_BUCKETS, registry=r)
        self.worker_spares = Gauge("splitserve_worker_spares", "Idle worker processes, bound to no model", registry=r)
        # request classes: soft SLOs of real-time calls (PROTEAN's compliance)
        self.slo_requests = Counter("splitserve_slo_requests", "Calls with a soft SLO, by what became of it: "
                                    "met, missed (served late) or dropped (answered with an error)",
                                    ("model", "class", "outcome"), registry=r)
        # The same counts per model for the statistics JSON; they outlive a model's runtime, as the series do.
        self._slo_tallies: dict[str, dict[str, int]] = {}
        # The direct path's running totals (its workers count them in their pages) already
        # added to the series, per (kind, model): each read adds what came since.
        self._direct_seen: dict[tuple[str, str], dict] = {}
        # Per (model, class): the front end's [calls answered, samples] since the last scrape,
        # then its duration series. ``refresh`` adds the counts to their series: a Counter's
        # ``inc`` takes a lock and two checks (≈ 1.5 µs), three times a call on the loop.
        self._children: dict[tuple[str, RequestClass], tuple] = {}
        self._front_batches: dict[str, int] = {}  # per model, front-end batches run since the last scrape

    def executed(self, model: str) -> None:
        """A front-end batch of ``model`` ran."""
        self._front_batches[model] = self._front_batches.get(model, 0) + 1

    def observe_call(self, model: str, call: CallTimes, error: SplitServeError | None) -> None:
        children = self._children.get((model, call.cls))
        if children is None:  # labels() takes a lock and hashes: resolve once per series
            cls = class_label(call.cls)
            children = self._children[(model, call.cls)] = (
                [0, 0], *(self.durations.series(d, model, cls, "front") for d in (Duration.QUEUE, Duration.COMPUTE,
                                                                                  Duration.REQUEST)))
        tally, queue, compute, request = children
        observe = self.durations.observe
        if error is None:
            tally[0] += 1
            tally[1] += call.count
            observe(queue, max(0, round((call.t_dispatch - call.t_rx) * 1e9)))
            observe(compute, call.compute_ns)
        else:
            self.failures.labels(model, class_label(call.cls), error.status.name, "front").inc()
        observe(request, max(0, round((call.t_work - call.t_ready) * 1e9)))

    def count_slo(self, model: str, cls: RequestClass, outcome: SloOutcome) -> None:
        """A call with an SLO was answered."""
        self.slo_requests.labels(model, class_label(cls), outcome).inc()
        self.slo_tally(model)[outcome] += 1

    def _direct_since(self, kind: str, model: str, totals: Mapping[K, int]) -> dict[K, int]:
        """What ``totals`` (running totals of ``model``'s direct path) grew by since the last
        read of this ``kind`` (a total not there is 0); one smaller than last time means they
        all count afresh (a new runtime counts from zero)."""
        seen = self._direct_seen.get((kind, model), {})
        afresh = any(totals.get(key, 0) < n for key, n in seen.items())
        self._direct_seen[(kind, model)] = dict(totals)
        return {key: new for key, n in totals.items() if (new := n - (0 if afresh else seen.get(key, 0))) > 0}

    def count_direct_slo(self, model: str, totals: Mapping[SloOutcome, int]) -> None:
        """Add to ``model``'s SLO series and tally what its direct path counted since the
        last call: ``totals`` are its workers' running totals (real-time calls)."""
        for outcome, new in self._direct_since("slo", model, totals).items():
            self.slo_requests.labels(model, class_label(RequestClass.RT), outcome).inc(new)
            self.slo_tally(model)[outcome] += new

    def _count_direct(self, model: str, tally: DirectTally) -> None:
        """Add to ``model``'s ``path="direct"`` counters what its workers answered since the last scrape."""
        totals: dict[tuple[Counter, tuple[str, ...]], int] = {(self.executions, (model, "direct")): tally.counts.batches}
        for cls, calls in zip((RequestClass.RT, RequestClass.BE), tally.calls):
            label = class_label(cls)
            totals[(self.requests, (model, label, "direct"))] = calls.ok
            totals[(self.inferences, (model, label, "direct"))] = calls.samples
            for status, n in calls.failures_by_status().items():
                totals[(self.failures, (model, label, status.name, "direct"))] = n
        for (counter, labels), new in self._direct_since("calls", model, totals).items():
            counter.labels(*labels).inc(new)
        # the durations: each bin, and the sum (at index BINS), a running total of its own
        binned: dict[tuple[Duration, str, int], int] = {}
        for cls, calls in zip((RequestClass.RT, RequestClass.BE), tally.calls):
            label = class_label(cls)
            for d in Duration:
                binned.update({(d, label, i): n for i, n in enumerate((*calls.bins(d), calls.sum_ns(d)))})
        grown: dict[tuple[Duration, str], list[int]] = {}
        for (d, label, i), new in self._direct_since("durations", model, binned).items():
            grown.setdefault((d, label), [0] * (BINS + 1))[i] = new
        for (d, label), s in grown.items():
            self.durations.add(d, model, label, "direct", s[:BINS], s[BINS])

    def slo_tally(self, model: str) -> dict[str, int]:
        """``model``'s SLO outcomes so far, ``{"met": n, "missed": n, "dropped": n}`` (live:
        later calls update the same dict)."""
        tally = self._slo_tallies.get(model)
        if tally is None:
            tally = self._slo_tallies[model] = {o.value: 0 for o in SloOutcome}
        return tally

    def _count_front(self) -> None:
        """Add to the ``path="front"`` counters what the front end counted since the last scrape."""
        for (model, cls), (tally, *_) in self._children.items():
            if tally[0]:
                label = class_label(cls)
                self.requests.labels(model, label, "front").inc(tally[0])
                self.inferences.labels(model, label, "front").inc(tally[1])
                tally[0] = tally[1] = 0
        for model, n in self._front_batches.items():
            if n:
                self.executions.labels(model, "front").inc(n)
                self._front_batches[model] = 0

    def refresh(self, models: Iterable[ModelGauges]) -> None:
        """Update gauges from live state, and counters from the counts kept beside them, just
        before a scrape."""
        self._count_front()
        for m in models:
            for c, depth in m.queue_depth.items():
                self.queue_depth.labels(m.name, class_label(c)).set(depth)
            self.instances.labels(m.name).set(m.ready_instances)
            self.model_failed.labels(m.name).set(1 if m.failed else 0)
            self.executions.labels(m.name, "front")  # make the series exist before the first batch
            if m.direct is not None:
                self.executions.labels(m.name, "direct")
                self._count_direct(m.name, m.direct)
                d = m.direct.counts
                for state in ("received", "answered", "failed", "in_flight_rt", "in_flight_be"):
                    self.direct_calls.labels(m.name, state).set(getattr(d, state))
                self.direct_busy.labels(m.name).set(d.busy_ns / 1e9)
                self.direct_batches.labels(m.name).set(d.batches)
                self.direct_connections.labels(m.name).set(d.connections)

    def render(self) -> bytes:
        return generate_latest(self.registry)
