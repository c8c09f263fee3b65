"""A server's start to ready with models loaded: workers forked from the node's fork server
against workers started as new interpreters, alternating.

    PYTHONPATH=. .venv/bin/python benchmarks/server_start.py [--models lenet,vecadd1k,resnet18] [--rounds 4]

Each round starts one server of each kind (``SPLITSERVE_FORK_WORKERS`` 1 and 0, no spare
workers), with ``--load`` for every model, times ``launcher.start_server`` until the server is
ready (its start-up models loaded), and stops it. It prints each kind's times and median. All
servers share one weight cache (``--cache-dir``, default a new one), which an untimed server
fills first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from splitserve.launcher import start_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="lenet,vecadd1k,resnet18")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args()
    load = [a for m in args.models.split(",") for a in ("--load", m)]
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="ss-start-cache-"))
    warm = Path(tempfile.mkdtemp(prefix="ss-start-"))
    start_server(warm, *load, cache_dir=cache).stop()  # the weights written once, untimed
    shutil.rmtree(warm, ignore_errors=True)
    times: dict[str, list[float]] = {"forked": [], "new interpreters": []}
    for _ in range(args.rounds):
        for kind, fork in (("forked", "1"), ("new interpreters", "0")):
            data = Path(tempfile.mkdtemp(prefix="ss-start-"))
            env = {**os.environ, "SPLITSERVE_FORK_WORKERS": fork, "SPLITSERVE_SPARE_WORKERS": "0"}
            t0 = time.perf_counter()
            server = start_server(data, *load, cache_dir=cache, env=env)
            times[kind].append(time.perf_counter() - t0)
            server.stop()
            shutil.rmtree(data, ignore_errors=True)
    for kind, ts in times.items():
        print(f"{kind}: start to ready {', '.join(f'{t:.2f}' for t in ts)} s; median {statistics.median(ts):.2f} s")


if __name__ == "__main__":
    main()
