"""Numbers of one scheme's run, from client samples, server events and profiles (pure).

Latency is end to end from the request's arrival time in the trace (client queueing counts,
PROTEAN §1.1's stricter reading). A request answered with an error counts as missing its SLO.
"""

from __future__ import annotations

import bisect
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


def closed_loop_rps(done_s: Sequence[float], warmup_s: float) -> float:
    """Requests/s of a closed loop from its answers' times (seconds from its start): the
    answers after ``warmup_s`` over the time from then to the last one (0.0 when none came).
    The warm-up is left out because the loop starts with every client sending at once."""
    kept = [t for t in done_s if t > warmup_s]
    span = max(kept, default=warmup_s) - warmup_s
    return len(kept) / span if span > 0 else 0.0


def steady_capacity(loops: Mapping[str, Sequence[float]], shares: Mapping[str, float]) -> dict[str, Any]:
    """The node's capacity from ``loops[m]``, model ``m``'s req/s in each round of closed loops
    (the rounds interleave the models, so a spell of background load on a shared host moves
    one round of each, not every loop of one): each model's median, the mix's capacity from
    those medians, and each round's mix (its spread is what the median kept out)."""
    rounds = {len(v) for v in loops.values()}
    if len(rounds) != 1 or 0 in rounds:
        raise ValueError("every model needs the same number of capacity loops, at least one")
    per_model = {m: float(np.median(v)) for m, v in loops.items()}
    by_round = [capacity_of_mix({m: v[i] for m, v in loops.items()}, shares) for i in range(rounds.pop())]
    return {"rps": per_model, "mix_rps": capacity_of_mix(per_model, shares), "mix_rps_by_round": by_round}


def resizes_by_burst(resizes: Sequence[Mapping[str, Any]], bursts_s: Sequence[Sequence[float]],
                     offset: float) -> list[dict[str, int]]:
    """The autoscaler's resizes (``GET /v2/partitions`` ``resizes``, server clock) per burst of
    an on/off trace: entry 0 is before the first burst, entry i from burst i's start to the
    next one's (the burst and the gap after it), each with the instances resizes asked then
    ``started`` and ``retired`` (a resize still under way, ``to`` None, counts in ``pending``).
    ``offset`` puts trace times on the server's clock."""
    starts = [b[0] + offset for b in bursts_s]
    out = [{"started": 0, "retired": 0, "pending": 0} for _ in range(len(starts) + 1)]
    for r in resizes:
        i = bisect.bisect_right(starts, r["asked_at"])
        if r["to"] is None:
            out[i]["pending"] += 1
            continue
        change = r["to"] - r["from"]
        out[i]["started" if change > 0 else "retired"] += abs(change)
    return out


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
