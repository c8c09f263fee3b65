"""Numbers of one scheme's run, from client samples, server events and profiles (pure).

Latency is end to end from the request's arrival time in the trace (client queueing counts,
PROTEAN §1.1's stricter reading). A request answered with an error counts as missing its SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.results import percentiles

COMPONENTS: tuple[str, ...] = ("minimum", "deficiency", "interference", "queueing")


@dataclass(frozen=True, slots=True)
class StrictSample:
    """One answered strict request: seconds end to end (from its arrival), seconds its batch
    computed (the reply's compute_us), and the cores of the partition its batch ran on."""

    e2e_s: float
    compute_s: float
    cores: int


def compliance(latencies_s: Sequence[float], errors: int, slo_s: float) -> float | None:
    """Share (0-1) of strict requests answered within ``slo_s``; errors are misses."""
    n = len(latencies_s) + errors
    if n == 0:
        return None
    return sum(1 for v in latencies_s if v <= slo_s) / n


def crossing_percentile(latencies_s: Sequence[float], errors: int, slo_s: float) -> float | None:
    """The percentile (0-100) at which the latency CDF crosses the SLO (PROTEAN Fig. 8): the
    highest p whose p-th percentile is still within ``slo_s``. None when no request misses
    (the CDF never crosses), so "crosses at p99.9" and "never crosses" stay different."""
    share = compliance(latencies_s, errors, slo_s)
    if share is None or share >= 1.0:
        return None
    return 100.0 * share


def split(sample: StrictSample, solo: Callable[[int], float], whole_cores: int) -> dict[str, float]:
    """One request's latency in PROTEAN's four parts (Fig. 2/6), which add up to its e2e.

    minimum: solo time at the batch on the whole node; deficiency: solo on its partition minus
    that; interference: what its batch computed beyond solo on the partition; queueing: e2e
    minus compute (client and server queues, transfers, cold starts). A batch that computed
    faster than a profile point (a partial batch) spends its time in the first parts only.
    """
    whole, own = solo(whole_cores), solo(sample.cores)
    c = sample.compute_s
    return {
        "minimum": min(whole, c),
        "deficiency": max(min(own, c) - whole, 0.0),
        "interference": max(c - own, 0.0),
        "queueing": sample.e2e_s - c,
    }


def tail_breakdown(samples: Sequence[StrictSample], solo: Callable[[int], float], whole_cores: int,
                   q: float = 99.0) -> dict[str, float] | None:
    """The ``q``-th percentile latency split into the four parts, in seconds: each part's share
    of the mean latency of the requests at or above that percentile, applied to the percentile
    itself, so the bar is as tall as the p99 and the parts are the tail's."""
    if not samples:
        return None
    e2e = np.array([s.e2e_s for s in samples])
    (pq,) = percentiles(e2e, (q,))
    tail = [s for s in samples if s.e2e_s >= pq] or [max(samples, key=lambda s: s.e2e_s)]
    parts = [split(s, solo, whole_cores) for s in tail]
    total = sum(s.e2e_s for s in tail)
    if total <= 0:
        return None
    return {k: pq * sum(p[k] for p in parts) / total for k in COMPONENTS}


def batch_partitions(events: Iterable[Mapping[str, Any]], model: str) -> list[tuple[float, int]]:
    """``(done time, partition)`` of every finished batch of ``model`` in a scheduler event log,
    in time order; the partition comes from the batch's start event (-1 where none is logged)."""
    started: dict[tuple[int, int], int] = {}
    out: list[tuple[float, int]] = []
    for e in sorted(events, key=lambda e: e["t"]):
        if e.get("model") != model:
            continue
        key = (int(e.get("instance", 0)), int(e["batch"]))
        if e["kind"] in ("start", "resume"):
            started[key] = int(e.get("partition", -1))
        elif e["kind"] == "done":
            out.append((float(e["t"]), started.pop(key, int(e.get("partition", -1)))))
    return out


def partition_of(done_s: float, batches: Sequence[tuple[float, int]]) -> int:
    """The partition of the batch that answered a reply received at ``done_s`` (server clock):
    the latest batch of the model done no later than that. -1 when none is.

    Replies carry no batch id, so this matches by time; two batches of one model finishing
    within a reply's delivery time of each other can be confused, which moves a request's
    deficiency, never its total."""
    times = [t for t, _ in batches]
    i = int(np.searchsorted(times, done_s, side="right")) - 1
    return batches[i][1] if i >= 0 else -1


def dist_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/max in ms of seconds; None when empty."""
    if not len(values_s):
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = percentiles(values_s, (50.0, 90.0, 99.0))
    return {"n": len(values_s), "p50": p50 * 1e3, "p90": p90 * 1e3, "p99": p99 * 1e3,
            "max": float(np.max(values_s)) * 1e3}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def ratios(runs: Mapping[str, Mapping[str, Any]], reference: str) -> dict[str, dict[str, float | None]]:
    """PROTEAN's headline ratios per other scheme: violations(other)/violations(reference),
    p99(reference)/p99(other), and each scheme's queue share of its own p99."""
    ref = runs.get(reference)
    out: dict[str, dict[str, float | None]] = {}
    for name, m in runs.items():
        bd = m.get("strict_p99_breakdown_ms") or {}
        p99 = m["strict"]["p99_ms"]
        row: dict[str, float | None] = {"queue_share_of_p99": ratio(bd.get("queueing"), p99)}
        if ref is not None and name != reference:
            row["violations_vs_reference"] = ratio(m["strict"]["violations"], ref["strict"]["violations"])
            row["reference_p99_over_p99"] = ratio(ref["strict"]["p99_ms"], p99)
        out[name] = row
    return out


def capacity_of_mix(capacities: Mapping[str, float], shares: Mapping[str, float]) -> float:
    """Requests/s the node serves of a mix where ``shares[m]`` of the requests go to model
    ``m`` and model ``m`` alone is served at ``capacities[m]`` req/s: each request of ``m``
    takes 1/capacity of the node, so the mix's capacity is the weighted harmonic mean."""
    cost = sum(share / capacities[m] for m, share in shares.items() if share > 0)
    if cost <= 0:
        raise ValueError("the mix has no requests")
    return 1.0 / cost


def prom_counter(text: str, name: str, labels: Mapping[str, str]) -> dict[str, float]:
    """Samples of counter ``name`` (without its ``_total``) in Prometheus text whose labels
    include ``labels``, keyed by their other labels (``outcome=met``), summed over the rest."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name != f"{name}_total" or any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in labels)
            out[key] = out.get(key, 0.0) + float(s.value)
    return out
