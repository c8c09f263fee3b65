"""What an idle node costs its host: wake-ups and CPU a second, per setting, side by side.

    .venv/bin/python benchmarks/idle_node.py [--model lenet] [--seconds 10] [--rounds 2] \\
        [--variant fixed=SPLITSERVE_DIRECT_IDLE_POLL_S=0.005] [--variant backed-off=] [--http]

Each ``--variant NAME=ENV,...`` is a server started with those environment settings (none:
the defaults), the model loaded, no call made. After a settling second, every thread of the
server process is read from ``/proc/<pid>/task/*``: its context switches (``status``) and
its CPU time in ns (``schedstat``, the scheduler's own count, not the clock ticks of
``stat``) before and after ``--seconds``. The variants take turns, ``--rounds`` times each,
and each round's figures are printed, then the medians. With no ``--variant`` it compares
the look at the workers' pages on a fixed 5 ms (``direct_idle_poll_s`` = ``direct_poll_s``)
with the default back-off (``server/direct_watch.py``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from splitserve.launcher import start_server

_DEFAULT = ("fixed=SPLITSERVE_DIRECT_IDLE_POLL_S=0.005", "backed-off=")


def _threads(pid: int) -> tuple[int, int]:
    """(context switches, CPU ns) of every thread of ``pid`` now."""
    switches = cpu = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return switches, cpu


def _variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, env = spec.partition("=")
    pairs = [kv.partition("=") for kv in env.split(",") if kv]
    if not name or any(not sep for _, sep, _ in pairs):
        raise SystemExit(f"--variant NAME=ENV=VALUE,... not {spec!r}")
    return name, {key: value for key, _, value in pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", action="append", help="NAME=ENV=VALUE,... (repeat; none: fixed against backed-off)")
    ap.add_argument("--http", action="store_true", help="the HTTP and gRPC front ends on too")
    a = ap.parse_args()
    if a.seconds <= 0 or a.rounds < 1:
        ap.error("--seconds must be positive and --rounds at least 1")
    variants = dict(_variant(v) for v in (a.variant or _DEFAULT))
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for r in range(a.rounds):
        for name, env in variants.items():
            server = start_server(Path(tempfile.mkdtemp(prefix=f"idle-{name}-")), "--load", a.model, http=a.http,
                                  grpc=a.http, log_level="WARNING", env={**os.environ, **env})
            try:
                time.sleep(1.0)
                s0, c0 = _threads(server.proc.pid)
                time.sleep(a.seconds)
                s1, c1 = _threads(server.proc.pid)
            finally:
                server.stop()
            per_s = ((s1 - s0) / a.seconds, (c1 - c0) / a.seconds / 1e6)
            got[name].append(per_s)
            print(f"round {r + 1} {name:12s} {per_s[0]:7.0f} wake-ups/s  {per_s[1]:6.1f} ms CPU/s")
    print(f"{a.model}, idle {a.seconds:g} s a round, medians over {a.rounds} rounds:")
    for name, v in got.items():
        print(f"  {name:12s} {np.median([x[0] for x in v]):7.0f} wake-ups/s  {np.median([x[1] for x in v]):6.1f} ms CPU/s")


if __name__ == "__main__":
    main()
