"""fastpath-breakdown: where one fast-path call's time goes, stage by stage.

A single client makes sequential calls and stamps its own stages (encode, the answer's
arrival, decode) on ``perf_counter``; the server, started with ``fast_stage_trace``, keeps
its stamps per call (``GET /v2/debug/stages``: the frame's first byte read, payload
complete, batch handed to a worker, the worker's start and compute, DONE read, answer
written). CLOCK_MONOTONIC is one clock for every process on the host, so the two sets join
by ``req_id`` into consecutive stages that add up to the call's end-to-end time. A plain TCP
echo of the same sizes is timed in the same run for scale. With ``profile`` set and py-spy
found (on PATH, or the path given), the server process is sampled during the calls and its
hottest frames are listed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.echo import HEADER_SIZE, EchoClient
from splitserve.bench.ownserver import get_json, own_server
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import gc_paused
from splitserve.bench.transports import Target, close_sync, open_sync
from splitserve.bench.validate import Expected
from splitserve.client.common import encode_inputs
from splitserve.client.frames import _request_header, _result
from splitserve.protocol.header import unpack_header
from splitserve.worker.forkserver import node_workers

NAME = "fastpath-breakdown"
SUMMARY = "Per-stage breakdown of one fast-path call (client, front end, hand-off, worker, way back)."
MODELS: tuple[str, ...] = ("lenet", "vecadd1k", "matmul8k", "lstm", "digits")
TRANSPORTS: tuple[str, ...] = ("tcp", "unix")

# (name, from stamp, to stamp): consecutive, so the stages of a call add up to its E2E time.
# c_* stamps are the client's; the rest the server's (``server/stages.py``).
STAGES: tuple[tuple[str, str, str], ...] = (
    ("client encode", "c_start", "c_encoded"),
    ("send, wire, front-end wake-up", "c_encoded", "t_first"),
    ("front end: parse, admit, payload", "t_first", "t_rx"),
    ("scheduling", "t_rx", "t_dispatch"),
    ("hand-off to worker, its wake-up", "t_dispatch", "t_start_w"),
    ("compute (worker)", "t_start_w", "t_end_w"),
    ("DONE back to front end", "t_end_w", "t_done"),
    ("front end: answer", "t_done", "t_tx"),
    ("answer's write, wire, client wake-up", "t_tx", "c_received"),
    ("client decode", "c_received", "c_end"),
)


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet", "vecadd1k")
    transports: tuple[str, ...] = ("tcp",)
    requests: int = 3000
    warmup: int = 200
    profile: bool = True  # sample the server with py-spy while timing, if py-spy is found
    pyspy: str = ""  # py-spy's path ("": look on PATH)

    @classmethod
    def quick(cls) -> Params:
        return cls(requests=500, warmup=50)


class _Stamped:
    """A blocking fast-path call with the client's stamps: the same encode, header and
    decode as ``client.stream.Client``, on a socket of its own."""

    def __init__(self, url: str, info: Any) -> None:
        scheme, _, rest = url.partition("://")
        if scheme == "tcp":
            host, port = rest.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(rest)
        self.info = info
        self.hdr = bytearray(HEADER_SIZE)

    def _recv_exact(self, buf: bytearray) -> None:
        mv = memoryview(buf)
        while len(mv):
            n = self.sock.recv_into(mv)
            if n == 0:
                raise ConnectionError("server closed the connection")
            mv = mv[n:]

    def call(self, x: Any, req_id: int) -> dict[str, float]:
        clock = time.perf_counter
        c_start = clock()
        arrays, count, batched = encode_inputs(self.info, x)
        parts = [_request_header(self.info, req_id, arrays, None, None, None), *arrays]
        c_encoded = clock()
        self.sock.sendmsg(parts)
        self._recv_exact(self.hdr)
        rh = unpack_header(self.hdr)
        payload = bytearray(rh.payload_len)
        self._recv_exact(payload)
        c_received = clock()
        _result(self.info, rh, payload, count, batched)
        return {"c_start": c_start, "c_encoded": c_encoded, "c_received": c_received, "c_end": clock()}

    def close(self) -> None:
        self.sock.close()


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far (schedstat: ns on a CPU); 0 once it is gone."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except OSError:
        pass
    return total


def _pyspy(p: Params) -> str | None:
    return (p.pyspy or shutil.which("py-spy")) if p.profile else None


def _hot_frames(raw: Path, top: int = 12) -> list[tuple[str, float]]:
    """The frames py-spy saw on top of the stack most often, with their share of samples."""
    leaf: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        frame = stack.rsplit(";", 1)[-1]
        name, _, where = frame.partition(" (")
        leaf[f"{name} ({os.path.basename(where.rstrip(')'))})"] += int(n)
    return [(k, v / total) for k, v in leaf.most_common(top)] if total else []


def _measure(ctx: Context, url: str, http: str, model: str, p: Params, server_pid: int) -> dict[str, Any]:
    from splitserve.bench.inputs import as_call_arg, make_inputs
    from splitserve.models.catalog import zoo_entry

    entry = zoo_entry(model)
    x = as_call_arg(make_inputs(entry.inputs, 1, p.seed)[0])
    lookup = open_sync("tcp" if url.startswith("tcp") else "unix", url)
    try:
        info = lookup.lookup(model)
    finally:
        close_sync(lookup)
    c = _Stamped(url, info)
    echo = ctx.echo()
    base = int.from_bytes(os.urandom(3), "little") << 24
    spy, raw = _pyspy(p), ctx.results.path / f"pyspy-{model}-{url.partition(':')[0]}.raw"
    prof = None
    try:
        with EchoClient(echo.host, echo.port, HEADER_SIZE + entry.request_bytes,
                        HEADER_SIZE + entry.response_bytes) as ec:
            for i in range(p.warmup):
                c.call(x, base + i)
                ec.call()
            if spy:
                prof = subprocess.Popen([spy, "record", "-p", str(server_pid), "-r", "500", "-f", "raw",
                                         "--nonblocking", "-o", str(raw)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client: dict[int, dict[str, float]] = {}
            echo_us = np.empty(p.requests)
            # CPU per call, which the machine's noise moves far less than wall time: the
            # fast-path calls and the echo calls alternate, so each side's CPU is its own.
            workers = node_workers(server_pid)
            fe0, w0, e0 = _cpu_ns(server_pid), sum(map(_cpu_ns, workers)), _cpu_ns(echo.proc.pid)
            client_cpu = echo_cpu_client = 0.0
            with gc_paused():
                for i in range(p.requests):
                    rid = base + p.warmup + i
                    c0 = time.thread_time()
                    client[rid] = c.call(x, rid)
                    c1 = time.thread_time()
                    t0 = time.perf_counter()
                    ec.call()
                    echo_us[i] = (time.perf_counter() - t0) * 1e6
                    client_cpu += c1 - c0
                    echo_cpu_client += time.thread_time() - c1
            cpu = {"front end": (_cpu_ns(server_pid) - fe0) / 1e3 / p.requests,
                   "workers": (sum(map(_cpu_ns, workers)) - w0) / 1e3 / p.requests,
                   "client": client_cpu * 1e6 / p.requests,
                   "echo server": (_cpu_ns(echo.proc.pid) - e0) / 1e3 / p.requests,
                   "echo client": echo_cpu_client * 1e6 / p.requests}
    finally:
        c.close()
        if prof is not None:
            prof.send_signal(2)  # py-spy writes its output on SIGINT
            try:
                prof.wait(timeout=30)
            except subprocess.TimeoutExpired:
                prof.kill()
                prof.wait()
    server = {r["req_id"]: r for r in get_json(f"{http}/v2/debug/stages")["calls"]}
    rows = []
    for rid, cs in client.items():
        s = server.get(rid)
        if s is None:  # pushed out of the server's ring: the ring is sized for the run
            continue
        rows.append({**cs, **s, "t_end_w": s["t_start_w"] + s["compute_ns"] / 1e9})
    per_stage = {name: lat(np.array([(r[b] - r[a]) * 1e6 for r in rows])) for name, a, b in STAGES}
    e2e = np.array([(r["c_end"] - r["c_start"]) * 1e6 for r in rows])
    compute = np.array([r["compute_ns"] / 1e3 for r in rows])
    return {"joined": len(rows), "stages_us": per_stage, "e2e_us": lat(e2e), "e2e_minus_compute_us": lat(e2e - compute),
            "echo_us": lat(echo_us), "cpu_us_per_call": cpu,
            "hot_frames": _hot_frames(raw) if prof is not None and raw.exists() else []}


def lat(a: np.ndarray) -> dict[str, float | None]:
    if a.size == 0:
        return {"p50": None, "mean": None, "p99": None}
    return {"p50": float(np.median(a)), "mean": float(a.mean()), "p99": float(np.percentile(a, 99))}


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    trace = (p.requests + p.warmup) * len(p.models) * len(p.transports)
    args = [a for m in p.models for a in ("--load", m)]
    results: dict[str, Any] = {}
    with own_server(ctx, "traced", args, env={"SPLITSERVE_FAST_STAGE_TRACE": str(trace)}) as server:
        ctx.validate(Target(server.urls), {m: Expected(m) for m in p.models}, p.transports)
        with ctx.task("stamped calls", len(p.models) * len(p.transports)) as advance:
            for transport in p.transports:
                for model in p.models:
                    url = server.urls[transport]
                    results[f"{model} {transport}"] = _measure(ctx, url, server.urls["http"], model, p,
                                                               server.proc.pid)
                    advance(1)
    if p.profile and not _pyspy(p):
        ctx.notes.append("py-spy was not found (PATH or --pyspy): no profile")
    return _output(results)


def _plot(results: dict[str, Any]) -> Any:
    """One stacked bar per run: the mean time of each stage (means add up to the mean E2E)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 1.2 + 0.6 * len(results)))
    ax = fig.subplots()
    keys = list(results)
    left = np.zeros(len(keys))
    for name, _, _ in STAGES:
        width = np.array([results[k]["stages_us"][name]["mean"] or 0.0 for k in keys])
        ax.barh(keys, width, left=left, label=name)
        left += width
    ax.set_xlabel("mean µs per call")
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(keys) < 3 else -0.2))
    fig.tight_layout()
    return fig


def _output(results: dict[str, Any]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines = []
    keys = list(results)
    rows = []
    for name, _, _ in STAGES:
        rows.append((name, *(f"{fmt(results[k]['stages_us'][name]['p50'])} / {fmt(results[k]['stages_us'][name]['mean'])}"
                             for k in keys)))
    rows.append(("**E2E**", *(f"{fmt(results[k]['e2e_us']['p50'])} / {fmt(results[k]['e2e_us']['mean'])}" for k in keys)))
    rows.append(("E2E - compute", *(f"{fmt(results[k]['e2e_minus_compute_us']['p50'])} / "
                                    f"{fmt(results[k]['e2e_minus_compute_us']['mean'])}" for k in keys)))
    rows.append(("TCP echo (same run)", *(f"{fmt(results[k]['echo_us']['p50'])} / {fmt(results[k]['echo_us']['mean'])}"
                                          for k in keys)))
    report += ["Each cell: p50 / mean µs per stage (medians do not add up; means do).", "",
               md_table(("stage", *keys), rows), "",
               "CPU time per call (µs, all threads; the front end's includes the py-spy sampling's "
               "interruptions when profiling):", "",
               md_table(("process", *keys), [(name, *(fmt(results[k]["cpu_us_per_call"][name]) for k in keys))
                                             for name in next(iter(results.values()))["cpu_us_per_call"]]), ""]
    for k, r in results.items():
        ratio = (r["e2e_minus_compute_us"]["p50"] / r["echo_us"]["p50"]
                 if r["e2e_minus_compute_us"]["p50"] and r["echo_us"]["p50"] else None)
        lines.append(f"{k}: p50 E2E {fmt(r['e2e_us']['p50'])} µs, E2E - compute {fmt(r['e2e_minus_compute_us']['p50'])} "
                     f"µs = {fmt(ratio, 2)}x echo ({r['joined']} calls joined)")
        if r["hot_frames"]:
            report += [f"## py-spy, server process, {k}: top of stack", "",
                       md_table(("frame", "share of samples"), [(f, f"{100 * s:.1f} %") for f, s in r["hot_frames"]]),
                       ""]
    return ScenarioOutput({"runs": results}, "\n".join(report), {"fastpath_breakdown": _plot(results)} if results else {},
                          lines)
