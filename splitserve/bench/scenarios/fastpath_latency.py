"""fastpath-latency: the fast path over TCP next to a plain TCP echo of the same sizes.

Four paths (``--transports``): through the front end (``tcp``) and straight to the worker
that runs the model, over its Unix endpoint (``direct``: looked up at the front end's Unix
socket), its TCP one (``direct-tcp``: looked up over TCP, the way a client on another
machine goes) or a connection to the front end's TCP port that the front end handed over to
it (``direct-front``: the way a client goes that may reach that port only); server and
clients run on their defaults (the direct path offered, workers
polling ``direct_spin_us`` and clients ``poll_us`` while a core is free; the front-end rows'
client opts out with ``direct=False``). Single client: calls over each path and echo
round trips alternate in blocks of 50, in an order that goes round by one each block, so
all see the same machine state (the front end's path and the direct ones in two rounds of
their own, each with its echo: after a front-end block both sides of a direct call back
off a while, which a direct caller does not meet); a path's own
overhead is median(E2E - server compute) over the echo's median round trip, the echo client
polling for its answer as the fast-path client does by default (targets: at most 1.5x for
lenet and 1.2x for vecadd1k on the direct path, 2x otherwise). Throughput: 32 closed-loop connections against the echo, then 32 over each path, from a
separate generator process (target: at least 0.5x the echo's requests/s). Targets are
reported, not asserted.

The plain echo's server blocks, and where its thread runs moves its round trip (on the 2-core
VM ≈ 8.5 µs on its client's vCPU, ≈ 31 µs on the other, whose vCPU halts between calls): a
second echo server that polls as the workers do (``direct_spin_us``) takes its turns among
the direct paths' blocks, and each direct path's tax is also reported against it (the
``floor_ratio``, no target): the floor with both sides polling.

With ``client_poll_us`` (default 0: none) each direct path is measured a second time by a
client that polls up to that long (``Client(poll_us=...)``, rows "client polls"), next to an
echo client that polls the same way. Those rows have no throughput figure (the 32-connection
generator is the asyncio client, which does not poll). ``worker_spin_us`` sets the started
server's ``direct_spin_us`` (default: the server's own); ``-p worker_spin_us=0`` makes each
call pay the worker's wake-up.

Polling on a busy host: ``-p busy_cores=1`` keeps that many other processes spinning on a
CPU each for the whole run (on a 2-core host, the other core taken); ``-p polling=false``
turns polling off on both sides (the server's workers, every fast-path client and the
echo's). ``splitserve bench polling`` sets the two side by side in the same minutes (two
runs of this one at different times differ by more than what polling does).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.echo import HEADER_SIZE, EchoClient, EchoProcess
from splitserve.bench.inputs import as_call_arg
from splitserve.bench.scenarios.base import (
    Context,
    ScenarioOutput,
    fmt,
    md_table,
    note_generator_bottleneck,
    report_intro,
)
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import bottleneck, busy, closed_loop_run, gc_paused, lat_stats, workload
from splitserve.bench.transports import DIRECT, LABEL, POLLS, close_sync, open_sync, path_label
from splitserve.bench.validate import Expected
from splitserve.client.stream import DEFAULT_POLL_US
from splitserve.config import TransportSection

NAME = "fastpath-latency"
SUMMARY = ("Fast path round trip and 32-connection throughput, through the front end and direct to the worker, "
           "next to a plain TCP echo of the same sizes.")
MODELS: tuple[str, ...] = ("lenet", "vecadd1k", "matmul8k", "lstm", "digits")
# through the front end (TCP), and straight to the worker over Unix, over TCP (the server is
# started with fast_direct) and over a connection to the front end's TCP port handed over to it
TRANSPORTS: tuple[str, ...] = ("tcp", "direct", "direct-tcp", "direct-front")
_COLOURS = ("#2b7bba", "#d95f02", "#1b9e77")
LATENCY_TARGET = 2.0  # p50(E2E - compute) / echo p50, at most (a direct path, a model without its own)
# A direct path's own target for these models, and the front end's for every model
DIRECT_TARGETS = {"lenet": 1.5, "vecadd1k": 1.2}
FRONT_END_TARGET = 7.0


def latency_target(model: str, path: str) -> float:
    """The most p50(E2E - compute) / echo p50 may be for ``model`` over ``path``."""
    if path.removesuffix(POLLS) in DIRECT:
        return DIRECT_TARGETS.get(model, LATENCY_TARGET)
    return FRONT_END_TARGET
THROUGHPUT_TARGET = 0.5  # fast-path req/s / echo req/s, at least
# Calls per turn when alternating: long enough that one side's after-work (the server's
# bookkeeping after a reply) does not land on the other's timing, short enough to share drift.
BLOCK = 50


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet", "vecadd1k")
    transports: tuple[str, ...] = TRANSPORTS
    requests: int = 5000  # alternating fast-path and echo calls, each
    warmup: int = 200
    connections: int = 32
    duration_s: float = 5.0
    warmup_s: float = 0.5
    generators: int = 1
    client_poll_us: int = 0  # a second client on each direct path polling this long (0: none)
    worker_spin_us: int | None = None  # the started server's direct_spin_us (None: its default; 0: sleep at once)
    polling: bool = True  # False: no side polls (workers, fast-path clients, the echo client)
    busy_cores: int = 0  # other processes spinning on a CPU each for the whole run (a busy host)

    @classmethod
    def quick(cls) -> Params:
        return cls(requests=500, warmup=50, duration_s=1.5, warmup_s=0.3)


# ``_alternate``'s key of the echo whose server polls too (its other echoes are keyed by whether their client polls)
_FLOOR = "floor"

# The throughput figures of a path measured for latency only
_NO_RUN: dict[str, Any] = {"throughput_rps": None, "errors": None, "latency_ms": {"p99": None}}


def _alternate(clients: dict[str, Any], echoes: dict[bool, EchoClient], model: str, arg: Any, n: int, warmup: int,
               block: int = BLOCK, floor: EchoClient | None = None) -> dict[str, dict[str, np.ndarray]]:
    """``n`` calls over each client and ``n`` round trips of each echo client (``echoes``:
    by whether it polls; a path that polls is set against the echo that polls), in
    alternating blocks of ``block``, in an order that goes round by one each block (a fixed
    one gave whatever the block before leaves, e.g. a busy host, to the same path).
    ``floor``, an echo client of a server that polls too, takes its turns as the others do;
    its round trips are every path's ``floor_us``."""
    if floor is not None:
        echoes = {**echoes, _FLOOR: floor}  # type: ignore[dict-item]
    for _ in range(warmup):
        for client in clients.values():
            client.infer_result(model, arg)
        for echo in echoes.values():
            echo.call()
    fp = {t: np.empty(n) for t in clients}
    compute = {t: np.empty(n) for t in clients}
    ec = {polls: np.empty(n) for polls in echoes}
    clock = time.perf_counter

    def path(t: str, client: Any, start: int, stop: int) -> None:
        for i in range(start, stop):
            t0 = clock()
            r = client.infer_result(model, arg)
            fp[t][i] = clock() - t0
            compute[t][i] = r.compute_us

    def echo(polls: bool, ech: EchoClient, start: int, stop: int) -> None:
        for i in range(start, stop):
            t0 = clock()
            ech.call()
            ec[polls][i] = clock() - t0

    runs = [functools.partial(path, t, c) for t, c in clients.items()] + \
        [functools.partial(echo, polls, e) for polls, e in echoes.items()]
    with gc_paused():
        for k, start in enumerate(range(0, n, block)):
            stop = min(n, start + block)
            for run in runs[k % len(runs):] + runs[:k % len(runs)]:
                run(start, stop)
    return {t: {"fastpath_us": fp[t] * 1e6, "compute_us": compute[t], "echo_us": ec[t.endswith(POLLS)] * 1e6,
                **({"floor_us": ec[_FLOOR] * 1e6} if floor is not None else {})}
            for t in clients}


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.bench.inputs import make_inputs
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    spin_us = p.worker_spin_us if p.polling else 0
    target = ctx.target(load=p.models, direct=any(t in DIRECT for t in p.transports), spin_us=spin_us)
    usable = [t for t in ctx.validate(target, {m: Expected(m) for m in p.models}, p.transports) if t in TRANSPORTS]
    if not usable:
        raise RuntimeError(f"no fast path to measure: {ctx.unavailable}")
    echo = ctx.echo()
    results: dict[str, Any] = {}
    poll = {} if p.polling else {"poll_us": 0}  # the fast-path clients' default, or none
    # the floor with both sides polling: an echo server that polls as the workers do
    floor_spin = TransportSection.direct_spin_us if p.worker_spin_us is None else p.worker_spin_us
    with contextlib.ExitStack() as stack, busy(p.busy_cores), \
            ctx.task("round trips and throughput", (2 * len(usable) + 1) * len(p.models)) as advance:
        floor_server = stack.enter_context(EchoProcess.start(poll_us=floor_spin)) if p.polling and floor_spin and any(
            t in DIRECT for t in usable) else None
        for model in p.models:
            entry = zoo_entry(model)
            arg = as_call_arg(make_inputs(entry.inputs, 1, p.seed)[0])
            req, resp = HEADER_SIZE + entry.request_bytes, HEADER_SIZE + entry.response_bytes
            clients = {t: open_sync(t, target.url(t), **poll) for t in usable}
            polled = p.client_poll_us if any(t in DIRECT for t in usable) else 0
            echoes: dict[bool, EchoClient] = {}
            floor = None
            try:
                # polls as the fast-path client does on its defaults
                echoes[False] = EchoClient(echo.host, echo.port, req, resp,
                                           poll_us=DEFAULT_POLL_US if p.polling else 0)
                if polled:
                    clients.update({t + POLLS: open_sync(t, target.url(t), poll_us=polled)
                                    for t in usable if t in DIRECT})
                    echoes[True] = EchoClient(echo.host, echo.port, req, resp, poll_us=polled)
                # the front end's path and the direct ones apart, each against its own echo:
                # after a front-end block (three processes on the cores) both sides of a
                # direct call back off a while, which a direct caller does not meet
                times = {}
                if floor_server is not None:
                    floor = EchoClient(floor_server.host, floor_server.port, req, resp, poll_us=DEFAULT_POLL_US)
                for group, group_floor in (([t for t in clients if t.removesuffix(POLLS) not in DIRECT], None),
                                           ([t for t in clients if t.removesuffix(POLLS) in DIRECT], floor)):
                    if group:
                        times.update(_alternate({t: clients[t] for t in group}, echoes, model, arg, p.requests,
                                                p.warmup, floor=group_floor))
            finally:
                for client in clients.values():
                    close_sync(client)
                for ec in [*echoes.values(), *([floor] if floor is not None else [])]:
                    ec.close()
            advance(len(usable))
            echo_s = closed_loop_run(workload("echo", echo.url, model, model, p.seed), p.connections, p.duration_s,
                                     p.generators, p.warmup_s).summary(warmup_s=p.warmup_s)
            advance(1)
            cells = {}
            for tr in usable:
                fp_s = closed_loop_run(workload(tr, target.url(tr), model, model, p.seed), p.connections,
                                       p.duration_s, p.generators, p.warmup_s).summary(warmup_s=p.warmup_s)
                advance(1)
                cells[tr] = _cell(times[tr], fp_s, echo_s, req, resp, latency_target(model, tr))
                if tr + POLLS in times:
                    cells[tr + POLLS] = _cell(times[tr + POLLS], None, echo_s, req, resp, latency_target(model, tr))
            # the first transport's figures stay at the top level, as before the direct path
            results[model] = {**cells[usable[0]], "transports": cells}
    return _output(p, results)


def _cell(t: dict[str, np.ndarray], fp_s: dict[str, Any] | None, echo_s: dict[str, Any], req: int,
          resp: int, target: float) -> dict[str, Any]:
    """A path's figures; ``fp_s`` None: its latency only (no throughput run of its own)."""
    overhead = lat_stats(t["fastpath_us"] - t["compute_us"])
    echo_lat = lat_stats(t["echo_us"])
    lat_ratio = overhead["p50"] / echo_lat["p50"] if echo_lat["p50"] else None
    floor = lat_stats(t["floor_us"]) if "floor_us" in t else None
    if fp_s is None:
        fp_s = echo_s = _NO_RUN
    tp_ratio = (fp_s["throughput_rps"] / echo_s["throughput_rps"]
                if fp_s["throughput_rps"] and echo_s["throughput_rps"] else None)
    return {
        "request_bytes": req, "response_bytes": resp,
        "fastpath_us": lat_stats(t["fastpath_us"]), "compute_us": lat_stats(t["compute_us"]),
        # one caller's sequential calls per second (its throughput)
        "one_client_rps": t["fastpath_us"].size / (float(t["fastpath_us"].sum()) / 1e6),
        "fastpath_minus_compute_us": overhead, "echo_us": echo_lat,
        "latency_ratio": lat_ratio, "latency_target": target,
        "latency_target_met": lat_ratio is not None and lat_ratio <= target,
        # against an echo whose server polls too (both sides polling): a floor that does not
        # move with where the echo's thread runs, as the plain echo's does; no target
        "floor_echo_us": floor,
        "floor_ratio": overhead["p50"] / floor["p50"] if floor and floor["p50"] else None,
        "fastpath_rps": fp_s["throughput_rps"], "echo_rps": echo_s["throughput_rps"],
        "fastpath_p99_ms_loaded": fp_s["latency_ms"]["p99"], "echo_p99_ms_loaded": echo_s["latency_ms"]["p99"],
        "fastpath_errors": fp_s["errors"],
        "throughput_ratio": tp_ratio, "throughput_target": THROUGHPUT_TARGET,
        "throughput_target_met": tp_ratio is not None and tp_ratio >= THROUGHPUT_TARGET,
        "generator_bottleneck": {k: v for k, v in (("fastpath", bottleneck(fp_s)), ("echo", bottleneck(echo_s))) if v},
        "samples_us": {"fastpath": t["fastpath_us"].tolist(), "echo": t["echo_us"].tolist()},
    }


def _plot(results: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(results) + 3.5, 3.8))
    axes = fig.subplots(1, len(results) + 1, squeeze=False)[0]
    for ax, (model, r) in zip(axes, results.items()):
        paths = list(r["transports"])
        curves = [(r["transports"][t]["samples_us"]["fastpath"], path_label(t),
                   _COLOURS[paths.index(t.removesuffix(POLLS)) % len(_COLOURS)], ":" if t.endswith(POLLS) else "-")
                  for t in paths]
        echoes = [(r["transports"][t]["samples_us"]["echo"], "TCP echo" + (", client polls" if t.endswith(POLLS) else ""),
                   "#7f7f7f", ":" if t.endswith(POLLS) else "-")
                  for t in (paths[0], next((t for t in paths if t.endswith(POLLS)), None)) if t is not None]
        for samples, label, colour, style in [*curves, *echoes]:
            xs = np.sort(np.asarray(samples))
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, style, label=label, color=colour)
        ax.set_xscale("log")
        ax.set_xlabel("round trip (µs)")
        ax.set_ylabel("fraction of calls")
        ax.set_title(f"{model}: {r['request_bytes']} B in, {r['response_bytes']} B out", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    models = list(results)
    x = np.arange(len(models))
    transports = [t for t in next(iter(results.values()))["transports"] if not t.endswith(POLLS)]
    width = 0.8 / (len(transports) + 1)
    for i, t in enumerate(transports):
        ax.bar(x + (i - len(transports) / 2) * width, [results[m]["transports"][t]["fastpath_rps"] or 0 for m in models],
               width, label=LABEL[t], color=_COLOURS[i % len(_COLOURS)])
    ax.bar(x + len(transports) / 2 * width, [results[m]["echo_rps"] or 0 for m in models], width, label="TCP echo",
           color="#7f7f7f")
    ax.set_xticks(x, models)
    ax.set_ylabel("req/s")
    ax.set_title("throughput, 32 connections", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _output(p: Params, results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    rows, lines, gen_notes = [], [], []
    for model, cell in results.items():
        for tr, r in cell["transports"].items():
            name = path_label(tr, short=True)
            lat = f"{model} over {name}: p50(E2E - compute) / echo p50 = {fmt(r['latency_ratio'], 2)}x " \
                  f"(target <= {r['latency_target']:g}x: {'met' if r['latency_target_met'] else 'missed'})"
            row = (f"{model} ({name})", fmt(r["fastpath_us"]["p50"]), fmt(r["fastpath_us"]["p99"]),
                   fmt(r["compute_us"]["p50"]), fmt(r["fastpath_minus_compute_us"]["p50"]),
                   fmt(r["echo_us"]["p50"]), fmt(r["echo_us"]["p99"]),
                   fmt(r["latency_ratio"], 2, "x") + f" (<= {r['latency_target']:g}x)"
                   + (" ok" if r["latency_target_met"] else " MISSED"))
            if tr.endswith(POLLS):  # latency only
                rows.append((*row, "-", "-", "-"))
                lines.append(lat + " (the echo client polls too)")
                continue
            rows.append((*row, fmt(r["fastpath_rps"], 0), fmt(r["echo_rps"], 0),
                         fmt(r["throughput_ratio"], 2, "x") + (" ok" if r["throughput_target_met"] else " MISSED")))
            if r["floor_ratio"] is not None:
                lat += (f"; {fmt(r['floor_ratio'], 2)}x an echo whose server polls too "
                        f"(p50 {fmt(r['floor_echo_us']['p50'])} µs)")
            lines.append(lat + f"; one client {fmt(r['one_client_rps'], 0)} calls/s"
                         f"; throughput {fmt(r['fastpath_rps'], 0)} vs echo {fmt(r['echo_rps'], 0)} req/s = "
                         f"{fmt(r['throughput_ratio'], 2)}x (target >= {THROUGHPUT_TARGET:g}x: "
                         f"{'met' if r['throughput_target_met'] else 'missed'})")
            gen_notes += [f"{model} over {name}, {k}: {v}" for k, v in r["generator_bottleneck"].items()]
    report += [md_table(("model (path)", "fast path p50 µs", "p99 µs", "server compute p50", "p50(E2E - compute)",
                         "echo p50 µs", "echo p99 µs", "latency ratio (target)", "fast path req/s",
                         "echo req/s", "throughput ratio (>= 0.5x)"), rows), ""]
    note_generator_bottleneck(report, lines, gen_notes, counted="in {n} run(s)")

    def slim(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k not in ("samples_us", "transports")}

    out = {m: {**slim(r), "transports": {t: slim(c) for t, c in r["transports"].items()}} for m, r in results.items()}
    return ScenarioOutput({"models": out}, "\n".join(report), {"fastpath_latency": _plot(results)} if results else {},
                          lines)
