"""loadgen: the load generator's own accuracy on this machine, against an in-process server.

The server answers every call after ``service_ms`` (an ``asyncio.sleep``), so whatever is
late is the generator. Open loop at each rate: how late sends went out (send lag, p50, p99
and max), the rate achieved against the one asked for, the requests in flight at most, and
whether the run flagged itself a generator bottleneck. Closed loop: calls made against the
ideal ``clients × duration / service time``. No server process is started. The unit tests
check the same logic on a virtual clock; this is where its wall-clock timing is measured.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from splitserve.bench import arrivals
from splitserve.bench.arrivals import Arrival
from splitserve.bench.loadgen import Outcome, closed_loop, open_loop
from splitserve.bench.results import percentiles
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table
from splitserve.bench.scenarios.base import Params as BaseParams

NAME = "loadgen"
SUMMARY = "The load generator's send lag and achieved rate on this machine, against an in-process server."
MODELS: tuple[str, ...] = ()
TRANSPORTS: tuple[str, ...] = ()


@dataclass
class Params(BaseParams):
    rates: tuple[float, ...] = (200.0, 1000.0, 5000.0, 20000.0)  # open-loop requests per second
    duration_s: float = 5.0
    service_ms: float = 50.0  # every answer takes this long: many calls overlap
    clients: int = 8  # closed loop

    @classmethod
    def quick(cls) -> Params:
        return cls(rates=(200.0, 1000.0), duration_s=1.0)

    def check(self) -> None:
        if not self.rates or min(self.rates) <= 0 or self.duration_s <= 0 or self.service_ms <= 0 or self.clients < 1:
            raise ValueError("rates, duration_s and service_ms must be > 0 and clients >= 1")


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    service_s = p.service_ms / 1e3

    async def server(a: Arrival) -> Outcome:
        await asyncio.sleep(service_s)
        return Outcome(ok=True)

    open_rows: list[dict[str, Any]] = []
    with ctx.task("open and closed loop", len(p.rates) + 1) as advance:
        for rate in p.rates:
            schedule = arrivals.to_arrivals(arrivals.uniform(rate, p.duration_s), "fake")
            result = asyncio.run(open_loop(server, schedule))
            lag50, lag99 = percentiles([s.send_lag for s in result.samples], (50.0, 99.0))
            last_sent = max(s.sent for s in result.samples)
            open_rows.append({
                "rate": rate, "requests": len(result.samples),
                "send_lag_ms": {"p50": lag50 * 1e3, "p99": lag99 * 1e3,
                                "max": max(s.send_lag for s in result.samples) * 1e3},
                "sent_rps": (len(result.samples) - 1) / last_sent if last_sent > 0 else None,
                "throughput_rps": result.summary()["throughput_rps"], "max_in_flight": result.max_in_flight,
                "generator_bottleneck": result.bottleneck_reason if result.generator_bottleneck else None,
            })
            advance(1)
        closed = asyncio.run(closed_loop(server, clients=p.clients, duration_s=p.duration_s))
        advance(1)
    ideal = p.clients * p.duration_s / service_s
    closed_row = {"clients": p.clients, "calls": len(closed.samples), "ideal_calls": ideal,
                  "calls_over_ideal": len(closed.samples) / ideal}
    return _output(p, open_rows, closed_row)


def _plot(open_rows: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    rates = [r["rate"] for r in open_rows]
    for key in ("p50", "p99", "max"):
        ax.plot(rates, [max(r["send_lag_ms"][key], 1e-4) for r in open_rows], marker="o", label=key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("requests/s asked for")
    ax.set_ylabel("send lag (ms)")
    ax.set_title("how late the open loop sent", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _output(p: Params, open_rows: list[dict[str, Any]], closed_row: dict[str, Any]) -> ScenarioOutput:
    rows = [(fmt(r["rate"], 0), r["requests"], fmt(r["send_lag_ms"]["p50"], 3), fmt(r["send_lag_ms"]["p99"], 3),
             fmt(r["send_lag_ms"]["max"], 3), fmt(r["sent_rps"], 0), fmt(r["throughput_rps"], 0),
             r["max_in_flight"], r["generator_bottleneck"] or "-") for r in open_rows]
    report = [__doc__.split("\n\n", 1)[1].strip(), "",
              f"## Open loop ({p.duration_s:g} s per rate, answers after {p.service_ms:g} ms)", "",
              md_table(("asked req/s", "requests", "lag p50 ms", "lag p99 ms", "lag max ms", "sent req/s",
                        "answered req/s", "max in flight", "bottleneck"), rows), "",
              f"## Closed loop ({p.clients} clients, {p.duration_s:g} s)", "",
              f"{closed_row['calls']:,} calls against an ideal {closed_row['ideal_calls']:,.0f} "
              f"({closed_row['calls_over_ideal']:.3f} of it).", ""]
    summary = ["loadgen: " + ", ".join(f"{r['rate']:g} req/s sent at {fmt(r['sent_rps'], 0)}/s, lag p99 "
                                       f"{fmt(r['send_lag_ms']['p99'], 3)} ms" for r in open_rows) +
               f"; closed loop {closed_row['calls_over_ideal']:.3f} of the ideal calls"]
    result = {"open": open_rows, "closed": closed_row}
    return ScenarioOutput(result, "\n".join(report), {"send_lag": _plot(open_rows)}, summary)
