"""bench protean's pure parts: PROTEAN's traces, the strict/BE mix, the p99 breakdown, the
SLO-crossing percentile, the ratios and the scheme table."""

from __future__ import annotations


import numpy as np
import pytest

from splitserve.bench import traces
from splitserve.bench.arrivals import from_rate_trace
from splitserve.bench.protean import analysis
from splitserve.bench.protean.schemes import SCHEMES, check_schemes, server_env
from splitserve.config import ServerConfig


@pytest.mark.parametrize(("make", "target"), [(traces.wiki_like, 316 / 303), (traces.twitter_like, 4561 / 2969)])
def test_traces_have_the_papers_peak_to_mean_at_the_asked_mean(make, target) -> None:
    for seed in range(5):
        points = make(120.0, 50.0, np.random.default_rng(seed))
        assert traces.mean_rate_of(points, 120.0) == pytest.approx(50.0)
        assert traces.peak_to_mean_of(points, 120.0) == pytest.approx(target)
    # the arrivals drawn from it follow: mean within Poisson noise of 50 req/s over 120 s
    times = from_rate_trace(make(120.0, 50.0, np.random.default_rng(0)), 120.0, np.random.default_rng(1))
    assert len(times) / 120.0 == pytest.approx(50.0, rel=0.05)


def test_twitter_like_is_more_erratic_than_wiki_like() -> None:
    def jitter(points: traces.RatePoints) -> float:
        rates = np.array([r for _, r in points])
        return float(np.mean(np.abs(np.diff(rates))) / rates.mean())

    rng = np.random.default_rng(3)
    assert jitter(traces.twitter_like(60.0, 10.0, rng)) > 3 * jitter(traces.wiki_like(60.0, 10.0, rng))


@pytest.mark.parametrize("make", [traces.wiki_like, traces.twitter_like])
def test_traces_are_seeded(make) -> None:
    assert make(30.0, 20.0, np.random.default_rng(7)) == make(30.0, 20.0, np.random.default_rng(7))
    assert make(30.0, 20.0, np.random.default_rng(7)) != make(30.0, 20.0, np.random.default_rng(8))


def test_fit_peak_to_mean_refuses_what_would_need_negative_rates() -> None:
    with pytest.raises(Exception, match="negative"):
        # the shape's own peak:mean is 2; stretching it to 2.5 takes its zero trough below 0
        traces.fit_peak_to_mean(np.array([0.0, 1.0, 1.0, 1.0, 2.0]), 1.0, 2.5)


def test_on_off_has_the_asked_mean_peak_and_gaps_and_is_seeded() -> None:
    for seed in range(5):
        points = traces.on_off_like(60.0, 20.0, np.random.default_rng(seed), peak_to_mean=3.0, period_s=12.0,
                                    burst_s=2.0, jitter=0.25)
        assert traces.mean_rate_of(points, 60.0) == pytest.approx(20.0)
        assert traces.peak_to_mean_of(points, 60.0) == pytest.approx(3.0)
        base = points[0][1]
        # 2 s of 60 every 12 s at 60 req/s: a base of (1200 - 5 * 2 * 60) / 50 = 12 req/s
        assert points[0][0] == 0.0 and base == pytest.approx(12.0)
        ends = [t for t, _ in points[1:]] + [60.0]
        bursts = [(t, end) for (t, r), end in zip(points, ends) if r > base]
        assert len(bursts) == 5 and all(end - t == pytest.approx(2.0) for t, end in bursts)
        assert bursts[0][0] >= 0.75 * 10.0  # the run starts with a gap
        assert all(b[0] - a[1] >= 0.75 * 10.0 - 1e-9 for a, b in zip(bursts, bursts[1:]))
        assert sorted({round(r, 9) for _, r in points}) == [12.0, 60.0]  # two levels, nothing between
    make = lambda seed: traces.on_off_like(60.0, 20.0, np.random.default_rng(seed))  # noqa: E731
    assert make(7) == make(7) and make(7) != make(8)
    # a burst cut at the end of the run still leaves the mean exact
    cut = traces.on_off_like(13.0, 10.0, np.random.default_rng(0), jitter=0.0)
    assert traces.mean_rate_of(cut, 13.0) == pytest.approx(10.0)


def test_on_off_refuses_bursts_that_leave_no_gap_or_need_a_negative_base() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(Exception, match="lower or shorter"):
        traces.on_off_like(60.0, 10.0, rng, peak_to_mean=7.0, period_s=12.0, burst_s=2.0)  # 7 x 1/6 > 1
    with pytest.raises(Exception, match="gap must remain"):
        traces.on_off_like(60.0, 10.0, rng, period_s=2.0, burst_s=2.0)
    with pytest.raises(Exception, match="one period"):
        traces.on_off_like(10.0, 10.0, rng, period_s=12.0)


def test_capacity_is_the_median_of_interleaved_loops_each_without_its_warm_up() -> None:
    # answers every 0.1 s from 0.1 s; the first 0.5 s are left out: 10 answers over 1 s
    done = [0.1 * i for i in range(1, 16)]
    assert analysis.closed_loop_rps(done, 0.5) == pytest.approx(10.0)
    assert analysis.closed_loop_rps([], 0.5) == analysis.closed_loop_rps([0.2], 0.5) == 0.0
    # round 2 ran in a quiet spell (an outlier 40 % up): the medians keep it out
    loops = {"a": [100.0, 140.0, 96.0], "b": [50.0, 70.0, 52.0]}
    got = analysis.steady_capacity(loops, {"a": 0.5, "b": 0.5})
    assert got["rps"] == {"a": 100.0, "b": 52.0}
    assert got["mix_rps"] == pytest.approx(analysis.capacity_of_mix({"a": 100.0, "b": 52.0}, {"a": 0.5, "b": 0.5}))
    assert got["mix_rps_by_round"][1] == pytest.approx(analysis.capacity_of_mix({"a": 140.0, "b": 70.0},
                                                                                 {"a": 0.5, "b": 0.5}))
    assert len(got["mix_rps_by_round"]) == 3
    with pytest.raises(ValueError, match="same number"):
        analysis.steady_capacity({"a": [1.0], "b": [1.0, 2.0]}, {"a": 0.5, "b": 0.5})


def test_resizes_are_counted_per_burst_on_the_servers_clock() -> None:
    resizes = [{"from": 2, "to": 3, "asked_at": 101.0}, {"from": 3, "to": 4, "asked_at": 110.5},
               {"from": 4, "to": 2, "asked_at": 113.0}, {"from": 2, "to": 4, "asked_at": 122.0},
               {"from": 4, "to": None, "asked_at": 123.0}]
    # bursts at 10 s and 22 s of the trace; the trace started at 100 s of the server's clock
    assert analysis.resizes_by_burst(resizes, [[10.0, 12.0], [22.0, 24.0]], 100.0) == [
        {"started": 1, "retired": 0, "pending": 0}, {"started": 1, "retired": 2, "pending": 0},
        {"started": 2, "retired": 0, "pending": 1}]


def test_mix_has_exactly_the_strict_share_and_switches_the_be_model() -> None:
    rng = np.random.default_rng(0)
    times = np.sort(rng.uniform(0.0, 60.0, 1001))
    schedule = traces.switch_schedule(60.0, 20.0, ["a", "b", "c"], rng)
    mix = traces.strict_be_mix(times, "s", schedule, 0.5, rng)
    strict = [a for a in mix if a.cls == "rt"]
    assert len(strict) == round(0.5 * 1001) and {a.model for a in strict} == {"s"}
    assert [t for t, _ in schedule] == [0.0, 20.0, 40.0]
    assert all(x[1] != y[1] for x, y in zip(schedule, schedule[1:]))  # every boundary is a switch
    for a in mix:
        if a.cls == "be":
            assert a.model == schedule[int(a.t // 20.0)][1]
    assert traces.strict_be_mix(times, "s", schedule, 0.5, np.random.default_rng(1)) != mix
    assert traces.strict_be_mix(times, "s", schedule, 0.75, np.random.default_rng(5)) == \
        traces.strict_be_mix(times, "s", schedule, 0.75, np.random.default_rng(5))


def test_breakdown_parts_add_up_to_the_latency() -> None:
    solo = {1: 0.030, 2: 0.020}.__getitem__
    # compute 0.040 on a 1-core partition: 20 minimum, 10 deficiency, 10 interference; queue 60
    parts = analysis.split(analysis.StrictSample(0.100, 0.040, 1), solo, 2)
    assert parts == pytest.approx({"minimum": 0.020, "deficiency": 0.010, "interference": 0.010, "queueing": 0.060})
    # a partial batch faster than solo on its partition: no interference, deficiency only up to compute
    parts = analysis.split(analysis.StrictSample(0.050, 0.025, 1), solo, 2)
    assert parts == pytest.approx({"minimum": 0.020, "deficiency": 0.005, "interference": 0.0, "queueing": 0.025})
    # on the whole node there is no deficiency
    parts = analysis.split(analysis.StrictSample(0.030, 0.025, 2), solo, 2)
    assert parts["deficiency"] == 0.0 and sum(parts.values()) == pytest.approx(0.030)


def test_tail_breakdown_is_as_tall_as_p99_and_made_of_the_tail() -> None:
    solo = {1: 0.030, 2: 0.020}.__getitem__
    fast = [analysis.StrictSample(0.025, 0.020, 2)] * 99
    slow = [analysis.StrictSample(0.200, 0.050, 1)] * 2
    bd = analysis.tail_breakdown(fast + slow, solo, 2)
    assert bd is not None
    p99 = float(np.percentile([s.e2e_s for s in fast + slow], 99))
    assert sum(bd.values()) == pytest.approx(p99)
    # the tail is the slow requests: queueing 150 of 200 ms
    assert bd["queueing"] / p99 == pytest.approx(0.75)
    assert analysis.tail_breakdown([], solo, 2) is None


def test_crossing_percentile_on_synthetic_latencies() -> None:
    lat = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert analysis.crossing_percentile(lat, 0, 0.080) == pytest.approx(80.0)
    assert analysis.compliance(lat, 0, 0.080) == pytest.approx(0.80)
    # an error is a miss: 80 of 101
    assert analysis.crossing_percentile(lat, 1, 0.080) == pytest.approx(100 * 80 / 101)
    assert analysis.crossing_percentile(lat, 0, 0.100) is None  # never crosses
    assert analysis.compliance([], 0, 0.1) is None


def test_requests_are_matched_to_the_batch_and_partition_that_answered_them() -> None:
    events = [
        {"t": 1.0, "kind": "start", "model": "s", "instance": 0, "batch": 1, "cls": "rt", "partition": 0},
        {"t": 1.1, "kind": "start", "model": "s", "instance": 1, "batch": 2, "cls": "rt", "partition": 1},
        {"t": 1.2, "kind": "start", "model": "be", "instance": 0, "batch": 1, "cls": "be", "partition": 1},
        {"t": 1.3, "kind": "done", "model": "s", "instance": 1, "batch": 2, "cls": "rt"},
        {"t": 1.5, "kind": "done", "model": "s", "instance": 0, "batch": 1, "cls": "rt"},
    ]
    batches = analysis.batch_partitions(events, "s")
    assert batches == [(1.3, 1), (1.5, 0)]
    assert analysis.partition_of(1.31, batches) == 1
    assert analysis.partition_of(1.6, batches) == 0
    assert analysis.partition_of(0.5, batches) == -1


def test_ratios_and_capacity_of_a_mix() -> None:
    runs = {"protean": {"strict": {"violations": 2, "p99_ms": 50.0}, "strict_p99_breakdown_ms": {"queueing": 10.0}},
            "timeshare": {"strict": {"violations": 20, "p99_ms": 200.0},
                          "strict_p99_breakdown_ms": {"queueing": 150.0}}}
    r = analysis.ratios(runs, "protean")
    assert r["timeshare"] == {"queue_share_of_p99": 0.75, "violations_vs_reference": 10.0,
                              "reference_p99_over_p99": 0.25}
    assert r["protean"] == {"queue_share_of_p99": 0.2}
    # half the requests at 100 req/s, half at 50 req/s: 2/3 of 100
    assert analysis.capacity_of_mix({"a": 100.0, "b": 50.0}, {"a": 0.5, "b": 0.5}) == pytest.approx(200 / 3)


def test_server_slo_counter_is_read_per_outcome() -> None:
    text = ('# HELP splitserve_slo_requests_total SLO outcomes\n# TYPE splitserve_slo_requests_total counter\n'
            'splitserve_slo_requests_total{model="s",class="rt",outcome="met"} 5.0\n'
            'splitserve_slo_requests_total{model="s",class="rt",outcome="missed"} 2.0\n'
            'splitserve_slo_requests_total{model="o",class="rt",outcome="met"} 7.0\n')
    assert analysis.prom_counter(text, "splitserve_slo_requests", {"model": "s", "class": "rt"}) == \
        {"outcome=met": 5.0, "outcome=missed": 2.0}


def test_every_scheme_is_server_config_overrides_only() -> None:
    fields = ServerConfig.field_names()
    for name, overrides in SCHEMES.items():
        for key, value in server_env(overrides).items():
            assert key.startswith("SPLITSERVE_")
            field = key[len("SPLITSERVE_"):].lower()
            assert field in overrides and str(overrides[field]) == value
        # once p-node and p-classes are merged, every key is a ServerConfig field
        missing = set(overrides) - fields
        if not missing:
            ServerConfig.from_env(**overrides)  # and a valid value for it
    assert SCHEMES["protean"] == {"partitioning": "protean"}
    assert SCHEMES["timeshare"] == {"partitioning": "colocate", "class_order": "arrival", "preemption": "seq"}
    assert SCHEMES["smart-static"]["strict_placement"] == "largest"
    assert check_schemes(["timeshare", "protean"]) == ("protean", "timeshare")
    with pytest.raises(ValueError, match="choose from"):
        check_schemes(["molecule"])


def test_crowded_setting_is_mostly_strict_and_the_eta_ablation() -> None:
    from splitserve.bench.protean.scenario import Params

    p = Params(scenario="crowded").resolved()
    assert (p.strict_share, p.load, p.schemes) == (0.75, 0.6, ("protean", "smart-static", "protean-no-wait"))
    # what the user set is kept
    p = Params(scenario="crowded", strict_share=0.4, schemes=("protean", "naive")).resolved()
    assert (p.strict_share, p.schemes) == (0.4, ("protean", "naive"))
    assert Params().resolved() == Params()
    # what ran is what the report's header and result.json record
    from splitserve.bench.runner import build_params

    p = build_params("protean", overrides={"scenario": "crowded"})
    assert (p.strict_share, p.load) == (0.75, 0.6)
    with pytest.raises(ValueError, match="unknown schemes"):
        Params(schemes=("protean", "oracle")).check()


def _server_docs(partitioning: str, strict_placement: str, cores: list[int], mode: str, class_order: str,
                 starts: list[tuple[float, float, str, int]], keep_alive_s: float = 600.0,
                 wait_for_free: bool = True, be_max_wait_s: float = 0.5) -> tuple[dict, dict]:
    """/v2/partitions and /v2/scheduler/events bodies: ``starts`` are (start, done, cls, partition)."""
    cpus, parts = 0, []
    for i, n in enumerate(cores, start=1):
        parts.append({"id": i, "cpus": list(range(cpus, cpus + n)), "mem_bytes": n})
        cpus += n
    events = []
    for b, (t0, t1, cls, part) in enumerate(starts):
        events += [{"t": t0, "kind": "start", "model": "m", "instance": b, "batch": b, "cls": cls, "partition": part},
                   {"t": t1, "kind": "done", "model": "m", "instance": b, "batch": b, "cls": cls, "partition": part}]
    return ({"partitioning": partitioning, "strict_placement": strict_placement, "partitions": parts,
             "keep_alive_s": keep_alive_s, "wait_for_free": wait_for_free, "be_max_wait_s": be_max_wait_s,
             "changes": []},
            {"mode": mode, "class_order": class_order, "events": events})


def test_a_server_that_ignored_its_schemes_settings_is_caught() -> None:
    from splitserve.bench.protean.schemes import settings_problems

    ok = _server_docs("colocate", "balanced", [2], "seq", "arrival", [(0, 1, "rt", 1), (1, 2, "be", 1)])
    assert settings_problems("timeshare", SCHEMES["timeshare"], *ok, geometry=[2]) == []
    # a default server (no partitions, priority order, batches at once) is every kind of wrong
    ignored = _server_docs("none", "balanced", [], "reef", "priority", [(0, 2, "rt", -1), (1, 3, "be", -1)])
    problems = "\n".join(settings_problems("timeshare", SCHEMES["timeshare"], *ignored))
    for what in ("partitioning", "preemption", "class_order", "one partition", "partitions [-1]", "2 batches"):
        assert what in problems
    # smart-static keeps every strict batch on the largest partition; keep-alive 0 must show
    stray = _server_docs("static", "largest", [1, 1], "concurrent", "priority", [(0, 1, "rt", 2)])
    assert "off the largest partition 1" in "".join(settings_problems("smart-static", SCHEMES["smart-static"],
                                                                      *stray))
    kept = _server_docs("protean", "eta", [1, 1], "concurrent", "priority", [(0, 1, "rt", 1)])
    assert settings_problems("protean-no-keepalive", SCHEMES["protean-no-keepalive"], *kept) == [
        "protean-no-keepalive: protean_keep_alive_s is 600.0, not 0"]
    # the ablation of splitserve's waits must run without either
    assert settings_problems("protean-no-wait", SCHEMES["protean-no-wait"], *kept) == [
        "protean-no-wait: protean_wait_for_free is True, not False",
        "protean-no-wait: protean_be_max_wait_s is 0.5, not 0"]
    assert settings_problems("protean-be-spill", SCHEMES["protean-be-spill"], *kept) == [
        "protean-be-spill: protean_be_max_wait_s is 0.5, not 0"]
