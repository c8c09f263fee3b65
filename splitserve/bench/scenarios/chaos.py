"""chaos: one answer per request under every fault.

Three phases against one server, in one run:

1. capacity: closed-loop clients on the fast path measure how many requests per second the
   server answers with the model mix;
2. no-fault: open-loop Poisson load at ``load_factor`` x that capacity, mixed RT/BE, spread
   over every transport (TCP, Unix, UDP, HTTP, gRPC);
3. chaos: the same load for ``duration_s`` while a ``FaultInjector`` kills workers with
   SIGKILL, holds stalled and non-reading connections open, sends malformed frames and
   datagrams, resizes and reconfigures a model and unloads/loads another.

A client-side ``Ledger`` records every request and every answer. The run reports lost
answers (no answer before ``answer_timeout_s``), duplicates, wrong answers (outputs that are
not the model's output for the request's own input), the RSS of the server and its workers
(sampled from /proc), and the p99 of admitted requests under faults against the no-fault
phase. Lost, duplicate, wrong or stray answers, or a dead server, end the run with
``EXIT_BROKEN``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from splitserve.bench.chaos_faults import FAULT_KINDS, FaultInjector, rss_kib
from splitserve.bench.chaos_ledger import CONN, LOST, OK, WRONG, Lane, Ledger, Oracle, WireLane, make_lane
from splitserve.bench.scenarios.base import COLOURS, Context, ScenarioOutput, fmt, md_table
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.transports import Target
from splitserve.bench.validate import Expected
from splitserve.protocol.header import RequestClass
from splitserve.worker.forkserver import node_workers

NAME = "chaos"
SUMMARY = "Mixed RT/BE load at 2x capacity over every transport while workers are killed and clients misbehave."
MODELS: tuple[str, ...] = ("vecadd1k", "lenet", "digits")
TRANSPORTS: tuple[str, ...] = ("tcp", "unix", "udp", "http-json", "http-binary", "grpc")
PHASES: tuple[str, ...] = ("capacity", "no-fault", "chaos")
_TICK_S = 0.25  # how often lanes are swept (losses, UDP retransmits, reconnects)
_RSS_EVERY_S = 0.5


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("vecadd1k", "lenet")
    transports: tuple[str, ...] = ("tcp", "unix", "udp", "http-binary", "grpc")
    duration_s: float = 300.0  # the chaos phase
    baseline_s: float = 60.0  # the no-fault phase, at the same load
    capacity_s: float = 10.0  # the closed-loop capacity probe
    capacity_clients: int = 16
    load_factor: float = 2.0  # offered load, in multiples of the measured capacity
    rt_share: float = 0.3  # share of requests sent real-time
    faults: tuple[str, ...] = FAULT_KINDS
    fault_interval_s: float = 5.0
    hold_s: float = 30.0  # stalled and non-reading connections stay open this long
    nonreader_mib: int = 64  # requests a non-reading client pipelines
    answer_timeout_s: float = 60.0  # a request unanswered this long is lost (slow is not lost: keep it long)
    call_timeout_s: float = 60.0  # bound on each fault (management calls included)
    lanes: int = 2  # connections per transport
    max_in_flight: int = 32  # per connection; past it arrivals are skipped (counted), not queued here
    rss_bound_mib: float = 1024.0  # the server process (front end, not its workers)
    p99_factor: float = 10.0  # chaos p99 of admitted requests within this x the no-fault p99

    @classmethod
    def quick(cls) -> Params:
        return cls(duration_s=45.0, baseline_s=10.0, capacity_s=4.0, fault_interval_s=2.5, hold_s=10.0,
                   nonreader_mib=16, answer_timeout_s=30.0, call_timeout_s=20.0)

    def check(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULT_KINDS)}")
        if min(self.duration_s, self.baseline_s, self.capacity_s, self.answer_timeout_s) <= 0:
            raise ValueError("duration_s, baseline_s, capacity_s and answer_timeout_s must be > 0")
        if not self.models or not self.transports:
            raise ValueError("chaos needs at least one model and one transport")
        if not self.faults or self.fault_interval_s <= 0 or len(self.faults) * self.fault_interval_s > self.duration_s:
            raise ValueError(f"chaos needs a fault, fault_interval_s > 0 and duration_s ({self.duration_s:g}) must hold one round "
                             f"of the {len(self.faults)} faults ({len(self.faults)} × {self.fault_interval_s:g} s)")
        if not 0 <= self.rt_share <= 1:
            raise ValueError(f"rt_share must be in [0, 1], got {self.rt_share}")


class _Run:
    """The state of one chaos run: clock, ledger, lanes, RSS samples, phase marks."""

    def __init__(self, p: Params, target: Target, transports: list[str], server_pid: int) -> None:
        self.p = p
        self.target = target
        self.transports = transports
        self.server_pid = server_pid
        self.t0 = time.perf_counter()
        self.ledger = Ledger()
        self.oracle = Oracle(p.models, seed=p.seed)
        self.rng = random.Random(p.seed)
        self.lanes: dict[str, list[Lane]] = {}
        self.rss: list[tuple[float, int, int]] = []  # (t, server KiB, workers KiB)
        self.phases: dict[str, tuple[float, float]] = {}
        self.skipped: dict[str, int] = {}
        self.server_died_at: float | None = None
        self.capacity_rps = 0.0
        self.rate = 0.0
        self._turn = 0
        self._connecting: set[Lane] = set()
        self._background: set[asyncio.Task[None]] = set()

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def connect(self, lane: Lane) -> None:
        lane.ready = False
        try:
            await lane.connect()
            if isinstance(lane, WireLane):
                for m in self.p.models:
                    await lane.lookup(m)
        except Exception as e:  # a lane that cannot connect now is tried again on the next tick
            raise ConnectionError(f"{lane.transport}: {type(e).__name__}: {e}") from e
        lane.ready = True

    async def open_lanes(self) -> None:
        for t in self.transports:
            self.lanes[t] = [make_lane(t, self.target.url(t), self.ledger, self.oracle, self.clock,
                                       self.p.max_in_flight, self.p.answer_timeout_s)
                             for _ in range(self.p.lanes)]
            await asyncio.gather(*(self.connect(lane) for lane in self.lanes[t]))

    async def close_lanes(self) -> None:
        for lanes in self.lanes.values():
            for lane in lanes:
                try:
                    await asyncio.wait_for(lane.close(), 10.0)
                except Exception:  # closing is best effort once the run is over
                    pass

    def _usable(self, lane: Lane) -> bool:
        return lane.ready and lane.usable() and not lane.full()

    def _reconnect(self, lane: Lane) -> None:
        if lane in self._connecting:
            return
        self._connecting.add(lane)

        async def again() -> None:
            try:
                await self.connect(lane)
            except ConnectionError:
                pass
            finally:
                self._connecting.discard(lane)

        task = asyncio.get_running_loop().create_task(again())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def ticker(self) -> None:
        """Sweeps lanes, reconnects broken stream lanes, samples RSS."""
        next_rss = 0.0
        while True:
            for lanes in self.lanes.values():
                for lane in lanes:
                    lane.sweep()
                    if not lane.usable() and lane.transport in ("tcp", "unix"):
                        self._reconnect(lane)
            now = self.clock()
            if now >= next_rss:
                next_rss = now + _RSS_EVERY_S
                server = rss_kib(self.server_pid)
                if server == 0 and self.server_died_at is None:
                    self.server_died_at = now
                self.rss.append((now, server, sum(rss_kib(c) for c in node_workers(self.server_pid))))
            await asyncio.sleep(_TICK_S)

    # -- sending ----------------------------------------------------------------------------

    def send(self, phase: str) -> asyncio.Future[None] | None:
        """One request on the next usable lane of a random transport; None when all are full."""
        t = self.rng.choice(self.transports)
        lanes = self.lanes[t]
        for k in range(len(lanes)):
            lane = lanes[(self._turn + k) % len(lanes)]
            if self._usable(lane):
                self._turn += 1
                break
        else:
            self.skipped[phase] = self.skipped.get(phase, 0) + 1
            return None
        model = self.rng.choice(self.p.models)
        cls = RequestClass.RT if self.rng.random() < self.p.rt_share else RequestClass.BE
        e = self.ledger.open(t, model, cls.name.lower(), phase, self.clock())
        return lane.submit(e, self.oracle.inputs(model, e.key), cls)

    async def closed_loop(self, phase: str, clients: int, duration_s: float) -> None:
        start = self.clock()
        self.phases[phase] = (start, start + duration_s)

        async def client() -> None:
            while self.clock() - start < duration_s:
                fut = self.send(phase)
                if fut is None:
                    await asyncio.sleep(0.01)
                    continue
                await fut  # resolved by an answer, a broken connection, or the sweep's timeout

        await asyncio.gather(*(client() for _ in range(clients)))

    async def open_loop(self, phase: str, rate: float, duration_s: float) -> None:
        """Poisson arrivals at ``rate``/s; an arrival more than a second late is skipped."""
        rng = np.random.default_rng(self.p.seed + len(self.phases))
        start = self.clock()
        self.phases[phase] = (start, start + duration_s)
        t = 0.0
        while True:
            t += float(rng.exponential(1.0 / rate))
            if t >= duration_s:
                break
            delay = start + t - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -1.0:
                self.skipped[phase] = self.skipped.get(phase, 0) + 1
                continue
            self.send(phase)

    async def drain(self) -> None:
        """Wait for every open request: answered, or lost once its answer timeout passed."""
        end = self.clock() + self.p.answer_timeout_s + 2 * _TICK_S + 1.0
        while self.ledger.outstanding() and self.clock() < end:
            await asyncio.sleep(_TICK_S)
        self.ledger.give_up_all(self.clock())


async def _drive(ctx: Context, r: _Run, token: str | None) -> FaultInjector:
    p = r.p
    await r.open_lanes()
    ticker = asyncio.get_running_loop().create_task(r.ticker())
    injector = FaultInjector(r.target.urls, r.server_pid, token, p.models, r.clock, p.hold_s, p.call_timeout_s,
                             p.nonreader_mib, p.faults)
    try:
        with ctx.task("measuring capacity (closed loop)", 1):
            await r.closed_loop("capacity", p.capacity_clients, p.capacity_s)
        r.capacity_rps = r.ledger.counts("capacity")["answers"].get(OK, 0) / p.capacity_s
        rate = max(1.0, p.load_factor * r.capacity_rps)
        r.rate = rate
        with ctx.task(f"no-fault load at {rate:,.0f} req/s", 1):
            await r.open_loop("no-fault", rate, p.baseline_s)
        with ctx.task(f"chaos: load at {rate:,.0f} req/s with faults", 1):
            await asyncio.gather(r.open_loop("chaos", rate, p.duration_s),
                                 injector.run(p.duration_s, p.fault_interval_s))
        with ctx.task("waiting for the last answers", 1):
            await r.drain()
    finally:
        await injector.close()
        ticker.cancel()
        await asyncio.gather(ticker, *r._background, return_exceptions=True)
        await r.close_lanes()
    return injector


def _timeline(r: _Run, injector: FaultInjector, bound_mib: float) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    es = r.ledger.entries
    end = max([e.done or e.sent for e in es] + [1.0])
    bins = np.arange(0.0, end + 1.0, 1.0)

    def rate(times: list[float]) -> np.ndarray:
        return np.histogram(times, bins)[0].astype(float)

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    x = bins[:-1]
    ax.plot(x, rate([e.sent for e in es]), color="#7f7f7f", lw=1, label="sent/s")
    ax.plot(x, rate([e.done for e in es if e.outcome == OK]), color=COLOURS["grpc"], lw=1.2, label="ok/s")
    ax.plot(x, rate([e.done for e in es if e.outcome and e.outcome.startswith("error")]), color="#ff7f0e", lw=1,
            label="error answers/s")
    ax.plot(x, rate([e.done for e in es if e.outcome == CONN]), color="#9467bd", lw=1, label="connection errors/s")
    bad = [e.sent for e in es if e.outcome in (LOST, WRONG) or e.answers > 1]
    if bad:
        ax.plot(x, rate(bad), color="#d62728", lw=1.5, label="lost, wrong or duplicate (by send time)/s")
    kinds = sorted({f.kind for f in injector.records})
    cmap = plt.get_cmap("tab10")
    for f in injector.records:
        c = cmap(kinds.index(f.kind) % 10)
        for a in (ax, ax2):
            a.axvline(f.t, color=c, lw=0.8, ls="--", alpha=0.7)
    for i, k in enumerate(kinds):
        ax.plot([], [], color=cmap(i % 10), ls="--", label=f"fault: {k}")
    for name, (a, b) in r.phases.items():
        ax.axvspan(a, b, color={"capacity": "#eeeeee", "no-fault": "#e8f4e8", "chaos": "#fbeaea"}[name], zorder=0)
        ax.text(a, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    ax.set_ylabel("requests/s")
    ax.set_yscale("symlog", linthresh=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("chaos: requests and errors per second, faults marked")
    if r.rss:
        t, s, w = (np.array(v, dtype=float) for v in zip(*r.rss))
        ax2.plot(t, s / 1024, color=COLOURS["tcp"], label="server RSS (MiB)")
        ax2.plot(t, (s + w) / 1024, color=COLOURS["udp"], label="server + workers RSS (MiB)")
        ax2.axhline(bound_mib, color="#d62728", lw=0.8, ls=":", label=f"server bound {bound_mib:g} MiB")
    ax2.set_xlabel("seconds since start")
    ax2.set_ylabel("MiB")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    target = ctx.target(load=p.models)
    if ctx.data_dir is None or not (ctx.data_dir / "server.json").is_file():
        raise ValueError("chaos needs the server's data directory (for its pid and token): let the benchmark "
                         "start the server, or pass --url with the path of its server.json")
    info = json.loads((ctx.data_dir / "server.json").read_text())
    token_file = ctx.data_dir / "token"
    token = token_file.read_text().strip() if token_file.is_file() else None
    transports = [t for t in ctx.validate(target, {m: Expected(m) for m in p.models}, p.transports)
                  if t in TRANSPORTS]
    if not transports:
        raise ValueError("no transport of this server could be reached")
    r = _Run(p, target, transports, int(info["pid"]))
    injector = asyncio.run(_drive(ctx, r, token))
    return _output(ctx, r, injector)


def _output(ctx: Context, r: _Run, injector: FaultInjector) -> ScenarioOutput:
    p = r.p
    led = r.ledger
    total = led.counts()
    phases = {ph: led.counts(ph) for ph in PHASES}
    for ph, c in phases.items():
        a, b = r.phases.get(ph, (0.0, 0.0))
        c["sent_rps"] = c["requests"] / (b - a) if b > a else None
        c["skipped_by_client"] = r.skipped.get(ph, 0)
    rss_server = max((s for _, s, _ in r.rss), default=0) / 1024
    rss_total = max((s + w for _, s, w in r.rss), default=0) / 1024
    base99, chaos99 = led.p99_ms("no-fault"), led.p99_ms("chaos")
    ratio = chaos99 / base99 if base99 and chaos99 else None
    broken: list[str] = []
    if total["lost"]:
        broken.append(f"{total['lost']} request(s) lost (no answer within {p.answer_timeout_s:g} s)")
    if total["duplicates"]:
        broken.append(f"{total['duplicates']} duplicate answer(s)")
    if total["wrong"]:
        broken.append(f"{total['wrong']} wrong answer(s)")
    if led.strays:
        broken.append(f"{len(led.strays)} answer(s) to requests never sent")
    if r.server_died_at is not None:
        broken.append(f"the server process died at {r.server_died_at:.1f} s")
    rss_ok = rss_server <= p.rss_bound_mib
    p99_ok = ratio is None or ratio <= p.p99_factor
    result: dict[str, Any] = {
        "capacity_rps": r.capacity_rps,
        "offered_rps": r.rate,
        "transports": r.transports,
        "requests": total["requests"],
        "answers": total["answers"],
        "duplicates": total["duplicates"],
        "lost": total["lost"],
        "wrong": total["wrong"],
        "stray_answers": len(led.strays),
        "late_answers": led.late,
        "phases": phases,
        "faults_injected": injector.by_kind(),
        "faults": [asdict(f) for f in injector.records],
        "findings": injector.findings(),
        "rss": {"server_peak_mib": rss_server, "server_and_workers_peak_mib": rss_total,
                "server_bound_mib": p.rss_bound_mib, "ok": rss_ok,
                "samples": [{"t": t, "server_kib": s, "workers_kib": w} for t, s, w in r.rss]},
        "p99_ms": {"no_fault": base99, "chaos": chaos99, "ratio": ratio, "bound_factor": p.p99_factor, "ok": p99_ok},
        "server_died_at": r.server_died_at,
        "broken": broken,
        "strays": [asdict(s) for s in led.strays[:50]],
        "duplicate_samples": led.duplicate_samples,
    }
    verdict = "**BROKEN**: " + "; ".join(broken) if broken else "every request got exactly one answer"
    rows = [(ph, c["requests"], fmt(c["sent_rps"], 0), c["skipped_by_client"], c["answers"].get(OK, 0),
             sum(v for k, v in c["answers"].items() if k.startswith("error")), c["answers"].get(CONN, 0),
             c["lost"], c["duplicates"], c["wrong"]) for ph, c in phases.items()]
    errs = md_table(("answer", "count"), sorted(total["answers"].items(), key=lambda kv: -kv[1]))
    faults = md_table(("t (s)", "fault", "target", "result", "took (s)"),
                      [(fmt(f.t, 1), f.kind, f.target, f.result[:160], fmt(f.took_s, 1)) for f in injector.records])
    findings = "\n".join(f"- {f}" for f in injector.findings()) or "none"
    report = f"""## Verdict

{verdict}.

Capacity (closed loop, fast path): {fmt(r.capacity_rps, 0)} req/s; offered {fmt(r.rate, 0)} req/s
({p.load_factor:g}x) over {', '.join(r.transports)}, {int(p.rt_share * 100)}% real-time.

{md_table(("phase", "requests", "sent/s", "skipped (client full)", "ok", "error answers", "connection errors",
           "lost", "duplicates", "wrong"), rows)}

Answers by kind (all phases):

{errs}

- **RSS**: server peak {fmt(rss_server, 0)} MiB (bound {p.rss_bound_mib:g} MiB: {"ok" if rss_ok else "**EXCEEDED**"}),
  server and workers peak {fmt(rss_total, 0)} MiB.
- **p99 of admitted requests**: no-fault {fmt(base99, 1)} ms, chaos {fmt(chaos99, 1)} ms, ratio {fmt(ratio, 2)}
  (bound {p.p99_factor:g}x: {"ok" if p99_ok else "**EXCEEDED**"}).
- Stray answers (for no request sent): {len(led.strays)}; answers after the client gave up: {led.late}.

## Faults

{faults}

### Server reactions that break a promise

{findings}

![timeline](timeline.png)
"""
    summary = [f"capacity {fmt(r.capacity_rps, 0)} req/s, offered {fmt(r.rate, 0)} req/s",
               f"requests {total['requests']}, faults {sum(injector.by_kind().values())} "
               f"({', '.join(f'{k} {v}' for k, v in injector.by_kind().items())})",
               "answers " + ", ".join(f"{k} {v}" for k, v in total["answers"].items()),
               f"duplicates {total['duplicates']}, lost {total['lost']}, wrong {total['wrong']}, "
               f"stray {len(led.strays)}",
               f"RSS peak server {fmt(rss_server, 0)} MiB (bound {p.rss_bound_mib:g}), with workers "
               f"{fmt(rss_total, 0)} MiB; p99 no-fault {fmt(base99, 1)} ms, chaos {fmt(chaos99, 1)} ms"]
    return ScenarioOutput(result, report, {"timeline": _timeline(r, injector, p.rss_bound_mib)}, summary, broken)
