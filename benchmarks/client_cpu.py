"""The sync fast-path client's own CPU per call: ``time.thread_time`` over sequential calls
(the calling thread is the one that sends and reads), through the front end and direct.

    PYTHONPATH=. .venv/bin/python benchmarks/client_cpu.py [--url tcp://127.0.0.1:PORT] [--calls 2000]
    PYTHONPATH=. .venv/bin/python benchmarks/client_cpu.py --scripted [--calls 10000]

``--scripted`` needs no server: a peer in this thread writes each answer before the call
is made, so the call never blocks, and the figure is the library's Python per call (the
same two system calls a bare client makes are measured apart and taken off).

Without ``--url`` it starts ``splitserve serve`` with ``fast_direct`` on and ``vecadd1k``
loaded, and stops it at the end. With ``--url`` (a server started with
``SPLITSERVE_FAST_DIRECT=1``) it measures the client library on ``PYTHONPATH`` against it,
which is how two versions of the client are compared on one server.

Where the client on ``PYTHONPATH`` has both wires (``Client(compiled=...)``), the direct
path and ``--scripted`` are measured with each: the compiled one (``splitserve._fastwire``)
and the pure-Python one.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import socket

import numpy as np

from splitserve.client.common import Endpoint
from splitserve.client import Client
from splitserve.launcher import start_server
from splitserve.protocol.header import HEADER_SIZE, Header, Kind


def bare(url: str, model: str, calls: int, rounds: int) -> dict[str, float]:
    """The floor: the same direct calls from a loop that sends a pre-built frame (only the
    req_id patched) and reads the answer into a pre-allocated buffer, no checks, no decode."""
    with Client(url, direct=True) as c:
        info = c.lookup(model)
        ep = Endpoint.parse(info.extra["direct"][0])
    x = b"".join(np.ones(t.shape, t.dtype).tobytes() for t in info.inputs)
    frame = bytearray(Header(Kind.REQUEST, func_id=info.func_id, payload_len=len(x)).pack() + x)
    answer = memoryview(bytearray(HEADER_SIZE + sum(t.nbytes for t in info.outputs)))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(ep.path)
    cpu = []
    with sock:
        for r in range(rounds + 1):
            t0 = time.thread_time()
            for i in range(calls if r else 200):
                frame[8:16] = (r * calls + i + 1).to_bytes(8, "little")
                sock.sendall(frame)
                got = 0
                while got < len(answer):
                    got += sock.recv_into(answer[got:])
            if r:
                cpu.append((time.thread_time() - t0) / calls * 1e6)
    return {"cpu_us": statistics.median(cpu)}


def _wires() -> dict[str, dict[str, Any]]:
    """The client's wires to measure, by label, as ``Client`` keywords ({"": {}} for a
    client that has one)."""
    if "compiled" not in inspect.signature(Client).parameters:
        return {"": {}}
    from splitserve.client import stream

    return {**({", C wire": {"compiled": True}} if stream._fastwire is not None else {}),
            ", Python wire": {"compiled": False}}


def measure(url: str, model: str, direct: bool, calls: int, rounds: int, **kw: Any) -> dict[str, float]:
    """Median over ``rounds`` of the client's CPU and wall time per call, in µs."""
    cpu, wall = [], []
    with Client(url, direct=direct, **kw) as c:
        info = c.lookup(model)
        x = [np.ones(t.shape, t.dtype) for t in info.inputs]
        for _ in range(200):
            c.infer(model, x)
        for _ in range(rounds):
            t0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                c.infer(model, x)
            cpu.append((time.thread_time() - t0) / calls * 1e6)
            wall.append((time.perf_counter() - w0) / calls * 1e6)
        endpoints = c.direct_endpoints(model)
    return {"cpu_us": statistics.median(cpu), "wall_us": statistics.median(wall), "direct_endpoints": endpoints}


def scripted(calls: int, rounds: int, **kw: Any) -> dict[str, float]:
    """The library's own CPU per vecadd1k-shaped call, system calls excluded (see the module doc)."""
    body = json.dumps({"name": "m", "func_id": 3, "max_batch_size": 8,
                       "inputs": [{"name": n, "datatype": "FP32", "shape": [1024]} for n in ("a", "b")],
                       "outputs": [{"name": "y", "datatype": "FP32", "shape": [1024]}]}).encode()
    path = os.path.join(tempfile.mkdtemp(prefix="client-cpu-"), "peer.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    c = Client(f"unix://{path}", **kw)
    conn, _ = listener.accept()
    c._ids = itertools.count(1)  # known ids, so that every answer can be written before its call
    conn.sendall(Header(Kind.LOOKUP_REPLY, req_id=1, payload_len=len(body)).pack() + body)
    c.lookup("m")
    x = [np.ones(1024, np.float32)] * 2
    answers = [Header(Kind.RESPONSE, req_id=i, payload_len=4096).pack() + bytes(4096) for i in range(2, calls + 2)]
    sink = bytearray(1 << 16)

    def loop(call: Any) -> float:
        t = time.thread_time()
        for frame in answers:
            conn.send(frame)
            call()
            conn.recv_into(sink)
        return time.thread_time() - t

    def bare_io() -> None:  # what a bare client's two system calls cost here
        c.sock.send(answers[0][:HEADER_SIZE])
        c.sock.recv_into(sink)

    per_call = []
    with listener, conn, c:
        for _ in range(rounds):
            c._ids = itertools.count(2)
            lib = loop(lambda: c.infer("m", x))
            per_call.append((lib - loop(bare_io)) / calls * 1e6)
    return {"cpu_us": statistics.median(per_call), "min_cpu_us": min(per_call)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server's tcp:// URL (started with SPLITSERVE_FAST_DIRECT=1)")
    ap.add_argument("--model", default="vecadd1k")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scripted", action="store_true", help="no server: the library's own Python per call")
    a = ap.parse_args()
    if a.scripted:
        print(json.dumps({f"scripted, syscalls excluded{w}": scripted(a.calls, a.rounds, **kw)
                          for w, kw in _wires().items()}, indent=1))
        return
    server = None
    if a.url is None:
        data = Path(tempfile.mkdtemp(prefix="client-cpu-"))
        server = start_server(data, "--load", a.model, env={**os.environ, "SPLITSERVE_FAST_DIRECT": "1"})
        a.url = server.tcp
    try:
        out = {"front end": measure(a.url, a.model, False, a.calls, a.rounds)}
        out.update({f"direct{w}": measure(a.url, a.model, True, a.calls, a.rounds, **kw) for w, kw in _wires().items()})
        out["direct, bare loop"] = bare(a.url, a.model, a.calls, a.rounds)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
