"""The load generator against in-process fake senders, and the results folder."""

from __future__ import annotations

import asyncio
import json
import selectors
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from matplotlib.figure import Figure

from splitserve.bench import arrivals
from splitserve.bench.arrivals import Arrival
from splitserve.bench.loadgen import (
    Outcome,
    RunResult,
    Sample,
    closed_loop,
    merge_results,
    open_loop,
)
from splitserve.bench.results import ResultsDir, json_safe, machine_info, percentiles


class _InstantSelector(selectors.DefaultSelector):
    """Waiting for nothing but a timer moves the loop's clock to the timer instead of sleeping."""

    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0 if timeout is not None else None)
        if not ready and timeout:
            self.loop.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when every task waits on a timer, straight to the
    next one: ``asyncio.sleep`` takes no real time, and the load generator (given
    ``clock=loop.time``) measures send lags and latencies that no machine's load can change.
    The wall-clock measurement of the same is ``splitserve bench loadgen``."""

    def __init__(self) -> None:
        selector = _InstantSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


T = TypeVar("T")


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


def virtual_clock() -> float:
    return asyncio.get_running_loop().time()


def test_open_loop_keeps_its_schedule_under_a_slow_server() -> None:
    sent: list[Arrival] = []

    async def slow(a: Arrival) -> Outcome:
        sent.append(a)
        await asyncio.sleep(0.05)
        return Outcome(ok=True, server_total_s=0.05)

    schedule = arrivals.to_arrivals(arrivals.uniform(200.0, 1.0), "vgg19", "rt", "cam")
    result = run_virtual(open_loop(slow, schedule, clock=virtual_clock))

    assert len(result.samples) == 200
    assert sorted(a.t for a in sent) == [a.t for a in schedule]  # each sent exactly once
    # no request waited for an answer to another: each went at its time, each took the server's 50 ms
    assert [s.send_lag for s in result.samples] == pytest.approx([0.0] * 200, abs=1e-9)
    assert [s.latency for s in result.samples] == pytest.approx([0.05] * 200)
    # answers take 50 ms at 200 req/s: ten overlap, which closed loop would never do
    assert 10 <= result.max_in_flight <= 11
    assert not result.generator_bottleneck

    summary = result.summary()
    assert summary["count"] == summary["ok"] == 200 and summary["errors"] == 0
    assert summary["throughput_rps"] == pytest.approx(200 / (schedule[-1].t + 0.05))
    assert summary["latency_ms"]["p50"] == pytest.approx(50.0)
    assert summary["by_class"]["vgg19/rt"]["count"] == 200
    assert summary["server"]["total_ms"]["mean"] == pytest.approx(50.0)


def test_open_loop_latency_grows_while_sends_stay_on_time() -> None:
    async def slowing(a: Arrival) -> Outcome:
        # the server gets slower the longer the run goes: 2 ms at first, ~100 ms at the end
        await asyncio.sleep(0.002 + 0.1 * virtual_clock())
        return Outcome(ok=True)

    schedule = arrivals.to_arrivals(arrivals.uniform(200.0, 1.0), "m")
    result = run_virtual(open_loop(slowing, schedule, clock=virtual_clock))
    samples = result.samples
    early = np.mean([s.latency for s in samples[:20]])
    late = np.mean([s.latency for s in samples[-20:]])
    assert late > early + 0.05
    # coordinated omission avoided: sends did not slip although answers slowed down
    assert max(s.send_lag for s in samples) == pytest.approx(0.0, abs=1e-9)
    assert samples[-1].sent == pytest.approx(schedule[-1].t)


def test_open_loop_records_failures_and_the_in_flight_cap() -> None:
    async def flaky(a: Arrival) -> Outcome:
        await asyncio.sleep(0.01)
        if a.model == "bad":
            raise ConnectionRefusedError("refused")
        return Outcome(ok=False, error="QueueFull") if a.cls == "be" else Outcome(ok=True)

    schedule = arrivals.merge(
        arrivals.to_arrivals([0.0, 0.001], "bad"),
        arrivals.to_arrivals([0.0, 0.001, 0.002], "good", "be"),
        arrivals.to_arrivals([0.0, 0.001, 0.002], "good", "rt"),
    )
    result = asyncio.run(open_loop(flaky, schedule, max_in_flight=2))
    s = result.summary()
    assert s["count"] == 8 and s["ok"] == 3 and s["errors"] == 5
    assert s["error_kinds"] == {"QueueFull": 3, "ConnectionRefusedError: refused": 2}
    assert result.max_in_flight == 2
    assert result.generator_bottleneck and "in-flight cap of 2" in (result.bottleneck_reason or "")
    assert s["by_class"]["good/rt"]["ok"] == 3


def test_open_loop_drain_timeout_turns_missing_answers_into_errors() -> None:
    async def never(a: Arrival) -> Outcome:
        if a.model == "stuck":
            await asyncio.sleep(60)
        return Outcome(ok=True)

    schedule = arrivals.to_arrivals([0.0], "stuck") + arrivals.to_arrivals([0.0], "fine")
    result = asyncio.run(open_loop(never, schedule, drain_timeout_s=0.05))
    by_model = {s.model: s for s in result.samples}
    assert by_model["fine"].ok
    assert not by_model["stuck"].ok and by_model["stuck"].error == "no answer before the run ended"


def test_closed_loop_runs_at_most_n_requests_at_once() -> None:
    in_flight = 0
    peak = 0

    async def counting(a: Arrival) -> Outcome:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.005)
        in_flight -= 1
        return Outcome(ok=True)

    result = asyncio.run(closed_loop(counting, clients=4, requests_per_client=5, model="resnet152"))
    assert peak == 4 and result.max_in_flight == 4
    assert len(result.samples) == 20
    per_client: dict[str | None, int] = {}
    for s in result.samples:
        per_client[s.tag] = per_client.get(s.tag, 0) + 1
        assert s.scheduled == s.sent and s.cls == "be" and s.latency >= 0.004
    assert per_client == {f"client-{i}": 5 for i in range(4)}
    assert result.summary()["by_class"]["resnet152/be"]["ok"] == 20


def test_closed_loop_stops_after_its_duration() -> None:
    async def quick(a: Arrival) -> Outcome:
        await asyncio.sleep(1 / 64)  # a power of two: the sums of the virtual clock are exact
        return Outcome(ok=True)

    result = run_virtual(closed_loop(quick, clients=2, duration_s=8 / 64, clock=virtual_clock))
    assert [s.sent for s in result.samples] == [i / 64 for i in range(8) for _ in range(2)]
    with pytest.raises(ValueError, match="duration_s or requests_per_client"):
        asyncio.run(closed_loop(quick, clients=1))


def test_closed_loop_with_a_fake_clock() -> None:
    ticks = iter(np.arange(0.0, 100.0, 0.5))

    async def instant(a: Arrival) -> Outcome:
        return Outcome(ok=True)

    result = asyncio.run(closed_loop(instant, clients=1, requests_per_client=3, clock=lambda: float(next(ticks))))
    # start=0, then per request: sent, done -> latency of one tick each
    assert [s.latency for s in result.samples] == [0.5, 0.5, 0.5]


def _sample(t: float, done: float, ok: bool = True, model: str = "m", cls: str = "rt") -> Sample:
    return Sample(scheduled=t, sent=t, done=done, ok=ok, model=model, cls=cls, error=None if ok else "x")


def test_summary_numbers_and_warmup() -> None:
    samples = [_sample(i * 0.01, i * 0.01 + 0.001 * (i + 1)) for i in range(100)]
    result = RunResult(samples=samples)
    s = result.summary()
    lat_ms = [0.001 * (i + 1) * 1e3 for i in range(100)]
    assert s["latency_ms"]["p50"] == pytest.approx(np.percentile(lat_ms, 50))
    assert s["latency_ms"]["p99"] == pytest.approx(np.percentile(lat_ms, 99))
    assert s["latency_ms"]["max"] == pytest.approx(100.0)
    assert s["window_s"] == pytest.approx(0.99 + 0.1)
    assert s["throughput_rps"] == pytest.approx(100 / 1.09)
    warm = result.summary(warmup_s=0.5)
    assert warm["count"] == 50 and warm["latency_ms"]["max"] == pytest.approx(100.0)
    empty = RunResult().summary()
    assert empty["count"] == 0 and empty["latency_ms"]["p99"] is None and empty["throughput_rps"] is None


def test_percentiles_helper() -> None:
    assert percentiles([1.0, 2.0, 3.0, 4.0], [0, 50, 100]) == [1.0, 2.5, 4.0]
    assert all(np.isnan(v) for v in percentiles([], [50, 99]))


def test_to_dict_round_trips_and_merge_shifts_by_origin() -> None:
    a = RunResult(samples=[_sample(0.0, 0.01), _sample(0.5, 0.52, ok=False)], origin=100.0, max_in_flight=1)
    b = RunResult(samples=[_sample(0.1, 0.2, model="n", cls="be")], mode="closed", origin=100.25,
                  generator_bottleneck=True, bottleneck_reason="slow", max_in_flight=2)
    d = json.loads(json.dumps(json_safe(a.to_dict())))
    back = RunResult.from_dict(d)
    assert back.samples == a.samples and back.origin == a.origin
    merged = merge_results([RunResult.from_dict(a.to_dict()), b])
    assert merged.mode == "mixed" and merged.origin == 100.0 and merged.max_in_flight == 3
    assert merged.generator_bottleneck and merged.bottleneck_reason == "slow"
    assert [s.scheduled for s in merged.samples] == pytest.approx([0.0, 0.35, 0.5])
    assert merged.samples[1].done == pytest.approx(0.45)
    assert b.samples[0].scheduled == 0.1  # the inputs are left as they were


def test_results_dir_writes_json_report_and_png(tmp_path: Path) -> None:
    now = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    rd = ResultsDir(tmp_path, "openloop", params={"rate": 200, "seed": np.int64(3)}, now=now)
    assert rd.path == tmp_path / "openloop-20240501T120000Z"
    again = ResultsDir(tmp_path, "openloop", now=now)
    assert again.path != rd.path and again.path.is_dir()

    result = RunResult(samples=[_sample(0.0, 0.01)])
    path = rd.write_json({"run": result.to_dict(include_samples=False), "nan": float("nan")})
    doc = json.loads(path.read_text())
    assert doc["scenario"] == "openloop" and doc["params"] == {"rate": 200, "seed": 3}
    assert doc["machine"]["cores"] >= 1 and "cpu_model" in doc["machine"] and "python" in doc["machine"]
    assert "commit" in doc and doc["nan"] is None
    assert doc["run"]["summary"]["count"] == 1
    with pytest.raises(ValueError, match="reserved"):
        rd.write_json({"machine": 1})

    assert rd.write_report("# Open loop\n").read_text() == "# Open loop\n"
    fig = Figure(figsize=(3, 2))
    fig.add_subplot().plot([0, 1], [1, 2])
    png = rd.save_plot(fig, "latency")
    assert png.name == "latency.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_machine_info_keys() -> None:
    info = machine_info()
    assert {"hostname", "cores", "cpu_model", "memory_bytes", "python", "torch", "gpus"} <= set(info)
    assert isinstance(info["gpus"], list)


def test_cancelling_an_open_loop_run_leaves_no_request_behind() -> None:
    async def hang(a: Arrival) -> Outcome:
        await asyncio.sleep(60)
        return Outcome(ok=True)

    async def main() -> int:
        run = asyncio.create_task(open_loop(hang, arrivals.to_arrivals([0.0, 0.0, 5.0], "m")))
        await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return len(asyncio.all_tasks()) - 1  # all but main itself

    assert asyncio.run(main()) == 0


def test_a_closed_loop_client_measures_one_request_after_the_warmup_even_when_calls_outlast_the_run() -> None:
    """A call longer than the whole run (a loaded machine) left no request after the warmup,
    so the point had no throughput at all; each client now sends one after it, late."""
    now = 0.0

    async def slow(a: Arrival) -> Outcome:
        nonlocal now
        now += 2.0  # every call takes 2 s of the fake clock: the run is 1 s, its warmup 0.3 s
        return Outcome(ok=True)

    result = asyncio.run(closed_loop(slow, clients=1, duration_s=1.0, warmup_s=0.3, clock=lambda: now))
    assert [s.sent for s in result.samples] == [0.0, 2.0]
    assert result.summary(warmup_s=0.3)["throughput_rps"] == pytest.approx(0.5)
    plain = asyncio.run(closed_loop(slow, clients=1, duration_s=1.0, clock=lambda: now))
    assert len(plain.samples) == 1  # without a warmup, the first call is measured: nothing more is sent
