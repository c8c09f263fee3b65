"""A front-end call with the worker's poll after a front-end batch at several budgets, side by side.

    .venv/bin/python benchmarks/front_end_spin.py [--model lenet] [--spins 0,1000] [--client-poll-us 0,1000]
        [--rounds 20] [--busy] [--http]

One ``splitserve serve`` starts per ``--spins`` value (``SPLITSERVE_FRONT_END_SPIN_US``: the
worker's poll for its next message after a front-end batch; 0 sleeps at once), in the order
given: the server started first is slower for reasons not found (docs/fastpath-breakdown.md,
stop 44), so run it twice with the order reversed. Each server gets one client per
``--client-poll-us`` (``Client(url, direct=False, poll_us=...)``: 0 is how a remote caller, an
HTTP or gRPC client, waits), and the calls go in blocks of 50 that go round the
(server, client) pairs, the order of a round turned by one each round. It prints, per pair,
the p50 of E2E, of the compute the worker reports and of E2E - compute. ``--busy`` keeps one
more process spinning for the whole run (on 2 cores, the other core taken). ``--http``: one
``HttpClient`` per server instead (the v2 binary infer, which does not poll).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from splitserve.client import Client
from splitserve.client.http import HttpClient
from splitserve.launcher import start_server

BLOCK = 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--spins", default="0,1000", help="front_end_spin_us of each server, in start order")
    ap.add_argument("--client-poll-us", default="0,1000", help="each server's clients' poll_us")
    ap.add_argument("--rounds", type=int, default=20, help="blocks of 50 calls per (server, client)")
    ap.add_argument("--busy", action="store_true", help="one more process spins for the whole run")
    ap.add_argument("--http", action="store_true", help="an HTTP client per server (v2 binary infer)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="trained weights (SPLITSERVE_CACHE_DIR)")
    a = ap.parse_args()
    spins = [int(s) for s in a.spins.split(",")]
    polls = [0] if a.http else [int(p) for p in a.client_poll_us.split(",")]
    env = {**os.environ, "SPLITSERVE_SPARE_WORKERS": "0"}
    with contextlib.ExitStack() as stack:
        if a.busy:
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            stack.callback(spinner.kill)
        servers = {}
        for spin in spins:
            servers[spin] = start_server(Path(tempfile.mkdtemp(prefix=f"fes-{spin}-")), "--load", a.model, http=a.http,
                                         cache_dir=a.cache_dir, env={**env, "SPLITSERVE_FRONT_END_SPIN_US": str(spin)})
            stack.callback(servers[spin].stop)
        clients: dict[tuple[int, int], Client | HttpClient] = {}
        for spin, server in servers.items():
            for poll in polls:
                clients[spin, poll] = stack.enter_context(
                    HttpClient(server.http) if a.http else Client(server.tcp, direct=False, poll_us=poll))
        info = next(iter(clients.values())).lookup(a.model)
        x = [np.ones(t.shape, t.dtype) for t in info.inputs]
        for c in clients.values():  # warm-up
            for _ in range(200):
                c.infer_result(a.model, x)
        keys = list(clients)
        e2e: dict[tuple[int, int], list[float]] = {k: [] for k in keys}
        compute: dict[tuple[int, int], list[float]] = {k: [] for k in keys}
        for r in range(a.rounds):
            turn = r % len(keys)
            for k in keys[turn:] + keys[:turn]:
                c = clients[k]
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    res = c.infer_result(a.model, x)
                    e2e[k].append((time.perf_counter() - t0) * 1e6)
                    compute[k].append(res.compute_us)
    print(f"{a.model} through the front end ({'HTTP' if a.http else 'TCP'}), {a.rounds * BLOCK} calls per pair, p50 µs"
          f"{' (one more process spinning)' if a.busy else ''}")
    for spin, poll in keys:
        e, cp = np.array(e2e[spin, poll]), np.array(compute[spin, poll])
        print(f"  front_end_spin_us {spin:5d}, client poll_us {poll:5d}: E2E {np.median(e):7.1f}"
              f"  compute {np.median(cp):6.1f}  E2E - compute {np.median(e - cp):6.1f}")


if __name__ == "__main__":
    main()
