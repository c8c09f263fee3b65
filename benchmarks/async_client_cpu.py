"""The asyncio fast-path client's CPU per call next to the asyncio echo client's: one
process's ``time.process_time`` over closed-loop calls from many connections, as
``splitserve bench fastpath-latency``'s throughput runs make them.

    PYTHONPATH=. .venv/bin/python benchmarks/async_client_cpu.py [--compare OTHER_TREE] [--calls 6000]

It starts ``splitserve serve`` with ``fast_direct`` on (``vecadd1k`` and ``lenet`` loaded)
and ``python -m splitserve.bench.echo``, then measures, in a child process per round, the
client library on ``PYTHONPATH`` (and, with ``--compare``, the one in OTHER_TREE, the
rounds alternating): ``--connections`` clients, one connection each (an ``AsyncClient``, or
an ``AsyncEchoClient`` of the model's sizes), each sending its next call when the last is
answered, until ``--calls`` are answered. The figure is the child's CPU per call; its busy
share says whether the process was the bottleneck (then CPU per call is 1 / its req/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PATHS = ("echo", "tcp", "direct", "direct-tcp")


async def _closed_loop(clients: list[Any], call: Any, calls: int) -> dict[str, float]:
    left = calls

    async def one(c: Any) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call(c)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(c) for c in clients))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_us": cpu / calls * 1e6, "rps": calls / wall, "busy": cpu / wall}


async def _measure(path: str, urls: dict[str, str], model: str, connections: int, calls: int) -> dict[str, float]:
    from splitserve.bench.echo import HEADER_SIZE, AsyncEchoClient
    from splitserve.client import AsyncClient

    if path == "echo":
        async with AsyncClient(urls["tcp"]) as c:
            info = await c.lookup(model)
        host, port = urls["echo"].split("://", 1)[1].rsplit(":", 1)
        req = HEADER_SIZE + sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in info.inputs)
        resp = HEADER_SIZE + sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in info.outputs)
        clients = [await AsyncEchoClient(host, int(port), req, resp).connect() for _ in range(connections)]

        async def call(c: Any) -> None:
            await c.call()
    else:
        url = urls["unix" if path == "direct" else "tcp"]
        clients = [await AsyncClient(url, direct=path != "tcp").connect() for _ in range(connections)]
        info = await clients[0].lookup(model)
        x = [np.ones(t.shape, t.dtype) for t in info.inputs]

        async def call(c: Any) -> None:
            await c.infer_result(model, x)
    try:
        await _closed_loop(clients, call, min(calls, 20 * connections))  # warm-up: lookups, connections
        return await _closed_loop(clients, call, calls)
    finally:
        for c in clients:
            await c.close()


def _child(args: argparse.Namespace) -> None:
    urls = json.loads(args.child)
    out = {path: asyncio.run(_measure(path, urls, args.model, args.connections, args.calls)) for path in PATHS}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", help="another checkout whose client to measure in alternate rounds")
    ap.add_argument("--models", default="vecadd1k,lenet")
    ap.add_argument("--model", default="vecadd1k", help=argparse.SUPPRESS)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # JSON of the URLs: measure with this process's client
    a = ap.parse_args()
    if a.child:
        _child(a)
        return
    from splitserve.bench.echo import EchoProcess
    from splitserve.launcher import start_server

    here = str(Path(__file__).resolve().parents[1])
    trees = {"this": os.environ.get("PYTHONPATH") or here, **({"other": a.compare} if a.compare else {})}
    models = a.models.split(",")
    data = Path(tempfile.mkdtemp(prefix="async-client-cpu-"))
    server = start_server(data, *sum((["--load", m] for m in models), []),
                          env={**os.environ, "SPLITSERVE_FAST_DIRECT": "1"})
    echo = EchoProcess.start()
    rows: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
    try:
        urls = json.dumps({"tcp": server.tcp, "unix": server.unix, "echo": echo.url})
        for _ in range(a.rounds):
            for model in models:
                for name, tree in trees.items():
                    got = subprocess.run([sys.executable, __file__, "--child", urls, "--model", model,
                                          "--connections", str(a.connections), "--calls", str(a.calls)],
                                         env={**os.environ, "PYTHONPATH": tree}, check=True, capture_output=True,
                                         text=True).stdout
                    for path, r in json.loads(got.splitlines()[-1]).items():
                        rows.setdefault(model, {}).setdefault(path, {}).setdefault(name, []).append(r)
    finally:
        echo.stop()
        server.stop()
    for model, paths in rows.items():
        print(f"\n{model}: CPU µs per call (median of {a.rounds} rounds) [busy share], req/s")
        for path, by_tree in paths.items():
            cells = []
            for name, rs in by_tree.items():
                cpu = statistics.median(r["cpu_us"] for r in rs)
                rps = statistics.median(r["rps"] for r in rs)
                busy = statistics.median(r["busy"] for r in rs)
                cells.append(f"{name}: {cpu:6.1f} µs [{busy:.0%}] {rps:7.0f}/s")
            print(f"  {path:10s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
