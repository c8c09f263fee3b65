"""What a direct call's tax is made of on the caller's side: sleeping for the answer vs polling for it.

    PYTHONPATH=. .venv/bin/python benchmarks/client_wait.py [--model lenet] [--rounds 30]
        [--poll-us 1000]

It starts ``splitserve serve`` with ``fast_direct`` on, the model loaded and no spare worker,
and an echo server (``splitserve.bench.echo``), then times one call at a time, alternating
in blocks of 50, over:

- ``raw sleeps`` / ``raw polls``: a bare client on the worker's Unix endpoint with a pre-built
  frame (only the req_id patched), reading the answer with a blocking ``recv`` or polling
  with ``MSG_DONTWAIT`` until it is there;
- ``client sleeps`` / ``client polls``: ``Client(direct=True)``'s ``infer_result``, without
  and with ``poll_us`` (the host's load check included);
- ``echo sleeps`` / ``echo polls``: the echo of the same sizes, blocking or polling.

It prints p50 and p90 of E2E - the worker's compute (the echo: its round trip). The raw
client's two rows say what the wake-up after a sleep costs; the client's rows what the
library adds; the echo's that a bare round trip barely waits, so polling gains it little.
The worker's own poll is the server's setting: run it again with
``SPLITSERVE_DIRECT_SPIN_US=200`` in the environment to see both sides poll.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from splitserve.bench.echo import EchoClient, EchoProcess
from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.client.common import Endpoint
from splitserve.client import Client
from splitserve.launcher import start_server
from splitserve.models.catalog import zoo_entry
from splitserve.protocol.header import HEADER_SIZE, Header, Kind

_COMPUTE = slice(48, 52)  # compute_us in a RESPONSE header (protocol/header.py's layout)
BLOCK = 50


class _Raw:
    """A bare client on a worker's Unix endpoint: one pre-built frame, the answer read into one buffer."""

    def __init__(self, path: str, frame: bytes, answer_len: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.frame = bytearray(frame)
        self.buf = memoryview(bytearray(answer_len))
        self.next_id = 1

    def call(self, poll: bool) -> float:
        """One call; its E2E - compute in µs."""
        self.frame[8:16] = self.next_id.to_bytes(8, "little")
        self.next_id += 1
        t0 = time.perf_counter_ns()
        self.sock.sendall(self.frame)
        got = 0
        while got < len(self.buf):
            if not poll:
                got += self.sock.recv_into(self.buf[got:])
                continue
            try:
                got += self.sock.recv_into(self.buf[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        return (time.perf_counter_ns() - t0) / 1e3 - int.from_bytes(self.buf[_COMPUTE], "little")


def _timed_echo(echo: EchoClient) -> Callable[[], float]:
    def call() -> float:
        t0 = time.perf_counter_ns()
        echo.call()
        return (time.perf_counter_ns() - t0) / 1e3
    return call


def _timed_client(client: Client, model: str, arg: object) -> Callable[[], float]:
    def call() -> float:
        t0 = time.perf_counter_ns()
        r = client.infer_result(model, arg)
        return (time.perf_counter_ns() - t0) / 1e3 - r.compute_us
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--rounds", type=int, default=30, help="blocks of 50 calls per way")
    ap.add_argument("--poll-us", type=float, default=1000.0, help="the polling client's and echo's budget")
    a = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="client-wait-"))
    env = {**os.environ, "SPLITSERVE_FAST_DIRECT": "1", "SPLITSERVE_SPARE_WORKERS": "0"}
    server = start_server(data, "--load", a.model, env=env)
    echo_server = EchoProcess.start()
    entry = zoo_entry(a.model)
    arg = as_call_arg(make_inputs(entry.inputs, 1, 0)[0])
    req, resp = HEADER_SIZE + entry.request_bytes, HEADER_SIZE + entry.response_bytes
    try:
        with Client(server.unix, direct=True) as sleeps, Client(server.unix, direct=True, poll_us=a.poll_us) as polls, \
                EchoClient(echo_server.host, echo_server.port, req, resp) as echo_sleeps, \
                EchoClient(echo_server.host, echo_server.port, req, resp, poll_us=a.poll_us) as echo_polls:
            info = sleeps.lookup(a.model)
            path = Endpoint.parse(info.extra["direct"][0]).path
            x = b"".join(np.ones(t.shape, t.dtype).tobytes() for t in info.inputs)
            raw = _Raw(path, Header(Kind.REQUEST, func_id=info.func_id, payload_len=len(x)).pack() + x,
                       HEADER_SIZE + sum(t.nbytes for t in info.outputs))
            ways: dict[str, Callable[[], float]] = {
                "raw sleeps": lambda: raw.call(False), "raw polls": lambda: raw.call(True),
                "client sleeps": _timed_client(sleeps, a.model, arg), "client polls": _timed_client(polls, a.model, arg),
                "echo sleeps": _timed_echo(echo_sleeps), "echo polls": _timed_echo(echo_polls)}
            for call in ways.values():  # warm-up
                for _ in range(100):
                    call()
            taken: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(a.rounds):
                for w, call in ways.items():
                    taken[w] += [call() for _ in range(BLOCK)]
            raw.sock.close()
    finally:
        echo_server.stop()
        server.stop()
    print(f"{a.model}: E2E - compute (echo: round trip), µs, {a.rounds * BLOCK} calls each")
    for w, v in taken.items():
        print(f"  {w:14s} p50 {np.percentile(v, 50):7.1f}  p90 {np.percentile(v, 90):7.1f}")


if __name__ == "__main__":
    main()
