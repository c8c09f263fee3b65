"""The call-duration histograms of /metrics, for both paths a call may take.

``splitserve_queue_duration_seconds``, ``splitserve_compute_duration_seconds`` and
``splitserve_request_duration_seconds``, per model, class and ``path``: ``front`` for calls
the front end answered, observed one by one as they are answered, and ``direct`` for calls
a worker answered straight to its client, whose bins the workers keep in their pages
(``worker.counters.Duration``) and the node adds at each scrape. Both use the buckets of
``DURATION_BUCKETS_S``, so a dashboard's quantile over a model sums the two paths.

The counts are plain integers written on the node's loop (an observation is a bisect and
two additions, where prometheus-client's histogram child takes a lock per observation);
the registry reads them through ``collect`` at a scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector

from splitserve.worker.counters import BINS, DURATION_BUCKETS_S, Duration, duration_bin

# Each duration's family: its name and help text
FAMILIES = {
    Duration.QUEUE: ("splitserve_queue_duration_seconds", "Time from a call's header in to its batch's start"),
    Duration.COMPUTE: ("splitserve_compute_duration_seconds", "Worker compute time of the call's batch"),
    Duration.REQUEST: ("splitserve_request_duration_seconds", "Time from header in to answer out"),
}
_BOUNDS = tuple(str(b) for b in DURATION_BUCKETS_S) + ("+Inf",)
_LABELS = ("model", "class", "path")


class _Series:
    """One histogram series: a count per bin (not cumulative) and the sum of what it holds (ns)."""

    __slots__ = ("bins", "sum_ns")

    def __init__(self) -> None:
        self.bins = [0] * BINS
        self.sum_ns = 0


class CallDurations(Collector):
    """The three duration histograms of every model, class and path (registered in
    ``registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._series: dict[tuple[Duration, str, str, str], _Series] = {}
        registry.register(self)

    def series(self, kind: Duration, model: str, cls: str, path: str) -> _Series:
        """``kind``'s series of ``model``, class label ``cls`` and ``path`` (made empty the first time)."""
        key = (kind, model, cls, path)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _Series()
        return s

    def observe(self, s: _Series, ns: int) -> None:
        """One call's duration of ``ns`` into ``s`` (a series from ``series``, kept by the caller)."""
        s.bins[duration_bin(ns)] += 1
        s.sum_ns += ns

    def add(self, kind: Duration, model: str, cls: str, path: str, bins: Sequence[int], sum_ns: int) -> None:
        """Calls counted elsewhere (a worker's page): ``bins`` more in each bin, ``sum_ns`` more in the sum."""
        s = self.series(kind, model, cls, path)
        for i, n in enumerate(bins):
            s.bins[i] += n
        s.sum_ns += sum_ns

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for kind, (name, doc) in FAMILIES.items():
            family = HistogramMetricFamily(name, doc, labels=_LABELS)
            for (k, model, cls, path), s in sorted(self._series.items(), key=lambda kv: kv[0][1:]):
                if k is kind:
                    family.add_metric([model, cls, path], list(zip(_BOUNDS, accumulate(s.bins))), s.sum_ns / 1e9)
            yield family

    def describe(self) -> list:
        # the families exist from the start: a scrape before the first call shows their types
        return [HistogramMetricFamily(name, doc, labels=_LABELS) for name, doc in FAMILIES.values()]
