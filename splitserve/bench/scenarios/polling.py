"""polling: what polling for the next message costs on a busy host and gives on a quiet one.

Servers run side by side on the same models, all offering the direct path: ``pairs`` on the
defaults, whose workers poll up to ``direct_spin_us`` for their next call while a core is
free, and as many started with ``direct_spin_us=0`` (their workers sleep at once), started in
the order on, off, off, on. Each is called by a client on its defaults too: the first kind by
a client that polls for its answers (``poll_us``'s default), the second by one that does not
(``poll_us=0``). Polling on is both sides polling; off is neither. Both are measured in the
same minutes, so the ratio is the figure to read. (Two servers of the same kind differ by a
few % on a 2-core VM: more than one each keeps one server's luck out of a side's figure.)

Per phase and model:
- one client: sequential calls alternate in blocks of 50 between on and off, going round the
  pairs (a caller's calls/s each way, and its p50), and between the two halves of polling:
  the worker alone (a client that does not poll, on a polling server) and the client alone
  (a polling client, on a server that does not poll), each against off, so that what a busy
  host costs is laid at each side's door;
- 32 connections from a generator process (the asyncio client, which does not poll: the
  workers' polls are what differ), on and off in turn, ``rounds`` times each per pair (req/s,
  medians).

Phases: ``quiet`` (nothing else runs) and ``busy`` (``busy_cores`` other processes spin on a
CPU each; by default all cores but one). Goal: on a busy host polling loses at most 5 % of
the throughput of not polling (on/off >= 0.95); on a quiet one it should gain. Targets are
reported, not asserted. The scenario starts its own servers (``--url`` is refused).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.inputs import as_call_arg
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import busy, closed_loop_run, gc_paused, lat_stats, workload
from splitserve.bench.transports import DIRECT, Target, close_sync, open_sync
from splitserve.bench.validate import Expected

NAME = "polling"
SUMMARY = ("Polling on vs off in the same minutes, servers of each kind side by side: one client's calls/s and 32 "
           "connections' req/s on a quiet host and with the other cores busy (goal: at most 5 % lost when busy).")
MODELS: tuple[str, ...] = ("lenet", "vecadd1k", "matmul8k", "lstm", "digits")
TRANSPORTS: tuple[str, ...] = DIRECT
PHASES: tuple[str, ...] = ("quiet", "busy")
BUSY_TARGET = 0.95  # on/off throughput with the other cores busy, at least
BLOCK = 50  # one client's calls per turn
# One client's sides: who polls (the server's workers, the client), and the servers it calls
SIDES: dict[str, tuple[str, bool]] = {"on": ("on", True), "worker": ("on", False), "client": ("off", True),
                                      "off": ("off", False)}


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet", "vecadd1k")
    transports: tuple[str, ...] = ("direct",)
    phases: tuple[str, ...] = PHASES
    requests: int = 3000  # one client's calls each way, per phase and model
    warmup: int = 200
    connections: int = 32
    duration_s: float = 2.0  # one 32-connection run
    warmup_s: float = 0.3
    rounds: int = 2  # 32-connection runs each way per server pair, alternating
    pairs: int = 2  # servers each way: one server's own speed (where its memory landed) is not a side's
    busy_cores: int = 0  # spinning processes in the busy phase (0: all cores but one)

    @classmethod
    def quick(cls) -> Params:
        return cls(requests=400, warmup=40, duration_s=1.0, warmup_s=0.2, rounds=1, pairs=1)

    def check(self) -> None:
        unknown = set(self.phases) - set(PHASES)
        if unknown or not self.phases:
            raise ValueError(f"phases: choose from {', '.join(PHASES)}")
        if self.requests < 1 or self.rounds < 1 or self.pairs < 1 or self.busy_cores < 0:
            raise ValueError("requests, rounds and pairs must be at least 1, busy_cores at least 0")


def spinners(p: Params) -> int:
    """How many processes spin in the busy phase."""
    return p.busy_cores or max(1, (os.cpu_count() or 2) - 1)


def _alternate(clients: dict[str, list[Any]], model: str, arg: Any, n: int, warmup: int) -> dict[str, np.ndarray]:
    """``n`` sequential calls each way (``clients``: by side, one per server of the side's
    kind), alternating in blocks of ``BLOCK``: every side's block in turn, the order going
    round by one from block to block and the servers by one once every side has gone first
    (so each server pair sees every order): µs per call."""
    for side in clients.values():
        for client in side:
            for _ in range(warmup):
                client.infer_result(model, arg)
    sides = list(clients)
    pairs = min(len(c) for c in clients.values())
    times = {side: np.empty(n) for side in sides}
    clock = time.perf_counter
    with gc_paused():
        for k, start in enumerate(range(0, n, BLOCK)):
            # which side goes first moves every block (a block's place in the turn biases it otherwise)
            for side in sides[k % len(sides):] + sides[: k % len(sides)]:
                client, out = clients[side][k // len(sides) % pairs], times[side]
                for i in range(start, min(n, start + BLOCK)):
                    t0 = clock()
                    client.infer_result(model, arg)
                    out[i] = clock() - t0
    return {side: t * 1e6 for side, t in times.items()}


def _throughput(p: Params, targets: dict[str, list[Target]], transport: str, model: str) -> dict[str, list[float]]:
    """32-connection req/s each way, ``rounds`` runs each per server pair, the side that goes
    first swapping from one pair and round to the next."""
    rps: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(p.rounds):
        for pair in range(p.pairs):
            for side in ("on", "off") if (r + pair) % 2 == 0 else ("off", "on"):
                url = targets[side][pair].url(transport)
                run = closed_loop_run(workload(transport, url, model, model, p.seed), p.connections, p.duration_s, 1,
                                      p.warmup_s)
                summary = run.summary(warmup_s=p.warmup_s)
                if summary["errors"]:
                    raise RuntimeError(f"{model} over {transport} ({side}): {summary['errors']} call(s) failed")
                rps[side].append(summary["throughput_rps"])
    return rps


def _cell(seq: dict[str, np.ndarray], rps: dict[str, list[float]]) -> dict[str, Any]:
    one = {side: t.size / (float(t.sum()) / 1e6) for side, t in seq.items()}
    many = {side: statistics.median(v) for side, v in rps.items()}
    return {
        "one_client_rps": one, "one_client_ratio": one["on"] / one["off"],
        "one_side_ratio": {side: one[side] / one["off"] for side in ("worker", "client")},
        "one_client_us": {side: lat_stats(t) for side, t in seq.items()},
        "connections_rps": many, "connections_runs": rps, "connections_ratio": many["on"] / many["off"],
    }


@contextmanager
def _phase(name: str, p: Params) -> Iterator[None]:
    with busy(spinners(p)) if name == "busy" else nullcontext():
        yield


def _servers(ctx: Context, p: Params) -> dict[str, list[Target]]:
    """``pairs`` servers each way, started on, off, off, on, ...: a server's place in the start
    order (what memory and caches it got) is not one side's."""
    targets: dict[str, list[Target]] = {"on": [], "off": []}
    for i in range(2 * p.pairs):
        side = "on" if i % 4 in (0, 3) else "off"
        targets[side].append(ctx.target(load=p.models, direct=True, spin_us=None if side == "on" else 0))
    return targets


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.bench.inputs import make_inputs
    from splitserve.models.catalog import zoo_entry

    if ctx.urls:
        raise ValueError("the polling benchmark starts its own servers (polling and not): drop --url")
    p: Params = ctx.params  # type: ignore[assignment]
    targets = _servers(ctx, p)
    expected = {m: Expected(m) for m in p.models}
    usable = list(p.transports)
    for target in (*targets["on"], *targets["off"]):
        usable = [t for t in ctx.validate(target, expected, usable) if t in DIRECT]
    if not usable:
        raise RuntimeError(f"no direct path to measure: {ctx.unavailable}")
    ctx.server_info = {"started_by_bench": True, "on": [t.urls for t in targets["on"]],
                       "off": [t.urls for t in targets["off"]], "direct_spin_us": {"on": None, "off": "0"}}
    results: dict[str, Any] = {}
    with ctx.task("polling on and off", len(p.phases) * len(p.models) * len(usable)) as advance:
        for phase in p.phases:
            with _phase(phase, p):
                for model in p.models:
                    arg = as_call_arg(make_inputs(zoo_entry(model).inputs, 1, p.seed)[0])
                    for tr in usable:
                        clients: dict[str, list[Any]] = {}
                        try:
                            for side, (servers, polls) in SIDES.items():
                                clients[side] = [open_sync(tr, t.url(tr), **({} if polls else {"poll_us": 0}))
                                                 for t in targets[servers]]
                            seq = _alternate(clients, model, arg, p.requests, p.warmup)
                        finally:
                            for side_clients in clients.values():
                                for client in side_clients:
                                    close_sync(client)
                        rps = _throughput(p, targets, tr, model)
                        results.setdefault(phase, {}).setdefault(model, {})[tr] = _cell(seq, rps)
                        advance(1)
    return _output(p, results)


def _verdict(phase: str, ratio: float) -> str:
    if phase != "busy":
        return ""
    return " ok" if ratio >= BUSY_TARGET else " MISSED"


def _plot(results: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    cells = [(f"{phase}\n{model} ({tr})", c) for phase, models in results.items() for model, paths in models.items()
             for tr, c in paths.items()]
    fig = Figure(figsize=(1.6 * len(cells) + 3, 3.6))
    ax = fig.subplots()
    x = np.arange(len(cells))
    bars = [("one client", "#2b7bba", lambda c: c["one_client_ratio"]),
            ("one client, the worker alone polls", "#9ecae1", lambda c: c["one_side_ratio"]["worker"]),
            ("one client, the client alone polls", "#6baed6", lambda c: c["one_side_ratio"]["client"]),
            ("32 connections", "#d95f02", lambda c: c["connections_ratio"])]
    width = 0.8 / len(bars)
    for j, (label, color, value) in enumerate(bars):
        ax.bar(x + (j - (len(bars) - 1) / 2) * width, [value(c) for _, c in cells], width, label=label, color=color)
    ax.axhline(1.0, color="#7f7f7f", linewidth=0.8)
    ax.axhline(BUSY_TARGET, color="#d62728", linestyle=":", linewidth=0.8, label=f"busy goal ({BUSY_TARGET:g}x)")
    ax.set_xticks(x, [label for label, _ in cells], fontsize=8)
    ax.set_ylabel("throughput, polling on / off")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), "", f"Busy phase: {spinners(p)} spinning process(es) on "
              f"{os.cpu_count()} CPU(s).", ""]
    rows, lines = [], []
    for phase, models in results.items():
        for model, paths in models.items():
            for tr, c in paths.items():
                one, many = c["one_client_rps"], c["connections_rps"]
                r1, rn, alone = c["one_client_ratio"], c["connections_ratio"], c["one_side_ratio"]
                rows.append((phase, f"{model} ({tr})", fmt(one["on"], 0), fmt(one["off"], 0),
                             fmt(r1, 3, "x") + _verdict(phase, r1), fmt(alone["worker"], 3, "x"),
                             fmt(alone["client"], 3, "x"),
                             fmt(c["one_client_us"]["on"]["p50"]), fmt(c["one_client_us"]["off"]["p50"]),
                             fmt(many["on"], 0), fmt(many["off"], 0), fmt(rn, 3, "x") + _verdict(phase, rn)))
                goal = f" (goal >= {BUSY_TARGET:g}x)" if phase == "busy" else ""
                lines.append(f"{phase}, {model} over {tr}: polling on/off one client {fmt(r1, 3)}x (the worker alone "
                             f"{fmt(alone['worker'], 3)}x, the client alone {fmt(alone['client'], 3)}x), "
                             f"{p.connections} connections {fmt(rn, 3)}x{goal}")
    report.append(md_table(("host", "model (path)", "one client calls/s on", "off", "on/off", "worker alone / off",
                            "client alone / off", "p50 µs on", "off", f"{p.connections} conns req/s on", "off",
                            "on/off"), rows))
    return ScenarioOutput({"phases": results, "busy_processes": spinners(p), "target_busy": BUSY_TARGET},
                          "\n".join(report), {"polling": _plot(results)} if results else {}, lines)
