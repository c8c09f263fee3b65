"""Call-duration histograms: a worker's bins in its page and /metrics' families of both paths."""

from __future__ import annotations

import mmap

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.errors import Status
from splitserve.server.durations import CallDurations
from splitserve.worker.counters import (
    BINS,
    DURATION_BOUNDS_NS,
    PAGE_BYTES,
    DirectCalls,
    Duration,
    WorkerCounters,
    duration_bin,
)

US = 1000


def test_a_duration_counts_in_the_first_bucket_it_is_at_most():
    assert duration_bin(0) == 0
    assert duration_bin(DURATION_BOUNDS_NS[0]) == 0  # le: inclusive, as Prometheus' buckets
    assert duration_bin(DURATION_BOUNDS_NS[0] + 1) == 1
    assert duration_bin(DURATION_BOUNDS_NS[-1] + 1) == BINS - 1  # above them all: +Inf's own bin


def test_a_worker_bins_its_answered_and_failed_calls_per_class_and_a_new_binding_starts_from_zero():
    counters = WorkerCounters(mmap.mmap(-1, PAGE_BYTES))
    counters.calls_answered(1, 2, 2, 300 * US + 30 * 1_000_000, 20 * US, 250 * US, 5 * US)
    counters.durations_answered(1, [300 * US, 30 * 1_000_000], [10 * US, 10 * US], 255 * US)
    counters.call_failed(1, Status.DEADLINE_MISSED, 7 * 1_000_000)
    rt, be = counters.tally().calls
    assert rt == DirectCalls()
    assert be.bins(Duration.REQUEST)[duration_bin(300 * US)] == 1
    assert be.bins(Duration.REQUEST)[duration_bin(30 * 1_000_000)] == 1
    assert be.bins(Duration.REQUEST)[duration_bin(7 * 1_000_000)] == 1  # the failed one, at its error
    assert sum(be.bins(Duration.REQUEST)) == 3 and sum(be.bins(Duration.QUEUE)) == 2
    assert be.bins(Duration.COMPUTE)[duration_bin(255 * US)] == 2  # its batch's, once per call
    assert be.sum_ns(Duration.REQUEST) == 300 * US + 30 * 1_000_000 + 7 * 1_000_000
    assert (be + be).bins(Duration.QUEUE)[0] == 4  # tallies of several workers add up bin by bin
    counters.reset()
    assert counters.tally().calls == (DirectCalls(), DirectCalls())


def test_the_families_show_each_path_with_cumulative_buckets_and_sums_in_seconds():
    registry = CollectorRegistry()
    durations = CallDurations(registry)
    assert "# TYPE splitserve_request_duration_seconds histogram" in generate_latest(registry).decode()
    front = durations.series(Duration.REQUEST, "lenet", "rt", "front")
    durations.observe(front, 200 * US)
    durations.observe(front, 3 * 1_000_000)
    bins = [0] * BINS
    bins[duration_bin(40 * US)] = 5
    durations.add(Duration.REQUEST, "lenet", "rt", "direct", bins, 5 * 40 * US)
    samples = {(s.name, s.labels["path"], s.labels.get("le")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
               if f.name == "splitserve_request_duration_seconds"}
    assert samples[("splitserve_request_duration_seconds_count", "front", None)] == 2
    assert samples[("splitserve_request_duration_seconds_bucket", "front", "0.00025")] == 1
    assert samples[("splitserve_request_duration_seconds_bucket", "front", "+Inf")] == 2
    assert samples[("splitserve_request_duration_seconds_sum", "front", None)] == 0.0032
    assert samples[("splitserve_request_duration_seconds_bucket", "direct", "0.0001")] == 5
    assert samples[("splitserve_request_duration_seconds_sum", "direct", None)] == 0.0002
