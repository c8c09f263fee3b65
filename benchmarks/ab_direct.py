"""A direct call's tax on two source trees of splitserve, in the same minutes.

    cd /tmp && /path/to/.venv/bin/python /path/to/benchmarks/ab_direct.py \\
        --tree before=/tmp/old --tree after=/work/main [--model lenet] [--rounds 30] [--sessions 2] [--spin-us 200]

Each ``--tree NAME=PATH`` is a checkout with its C extensions built in place (``git worktree
add /tmp/old <commit>`` then ``python -c "from setuptools import setup; setup()" build_ext
--inplace`` there). One ``splitserve serve`` starts per tree, its processes importing that
tree (``PYTHONPATH``), with ``fast_direct`` on, the model loaded, no spare worker and the
worker polling ``--spin-us`` before it sleeps; a bare client on each worker's Unix endpoint
sends a pre-built frame (only the req_id patched) and polls for the answer
(``benchmarks/client_wait.py``'s raw polling client), in blocks of 50 calls alternating
between the trees, the order of a round going round by one each round. It prints p25, p50
and p75 of E2E - the worker's compute per tree, and each session's p50.

A session starts the servers, measures its rounds and stops them; each session starts the
trees in an order rotated by one from the last. The server started first was measured
slower, by 30-45 µs a call through the front end, whichever tree it ran
(docs/fastpath-breakdown.md, stop 44): a fixed start order would put that on one tree.

The host's phases (a shared VM's compute moved by 50 % between minutes in the runs of
docs/fastpath-breakdown.md) shift both trees alike, so a difference between them is the
code's. Run it from a directory that holds neither tree: ``python -m`` puts the working
directory first on the path, so a server started inside a checkout imports that checkout
whatever ``PYTHONPATH`` says.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

import numpy as np

from splitserve.client.common import Endpoint
from splitserve.client import Client
from splitserve.launcher import start_server
from splitserve.protocol.header import HEADER_SIZE, Header, Kind

BLOCK = 50


def _raw_client_type() -> type:
    """client_wait.py's raw client (a script beside this one, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("client_wait", Path(__file__).with_name("client_wait.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._Raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (two or more)")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--rounds", type=int, default=30, help="blocks of 50 calls per tree")
    ap.add_argument("--spin-us", type=int, default=200, help="the workers' poll before they sleep")
    ap.add_argument("--sessions", type=int, default=2, help="server starts, each in an order rotated by one")
    a = ap.parse_args()
    if a.sessions < 1 or a.rounds < 1:
        ap.error("--sessions and --rounds must be at least 1")
    trees = dict(t.split("=", 1) for t in a.tree)
    for path in trees.values():
        if Path(os.getcwd()).resolve().is_relative_to(Path(path).resolve()):
            raise SystemExit(f"run it from outside {path}: the servers would import the working directory")
    raw_type = _raw_client_type()
    env = {**os.environ, "SPLITSERVE_FAST_DIRECT": "1", "SPLITSERVE_SPARE_WORKERS": "0",
           "SPLITSERVE_DIRECT_SPIN_US": str(a.spin_us)}
    names = list(trees)
    taken: dict[str, list[float]] = {name: [] for name in names}
    sessions: list[dict[str, float]] = []
    for k in range(a.sessions):
        order = _rotated(names, k)
        got = _session(order, trees, env, a.model, a.rounds, raw_type)
        sessions.append({name: float(np.percentile(v, 50)) for name, v in got.items()})
        for name, v in got.items():
            taken[name] += v
    print(f"{a.model}: E2E - compute, µs, {a.sessions * a.rounds * BLOCK} calls per tree in {a.sessions} sessions "
          f"(raw polling client, worker polls {a.spin_us} µs)")
    for name, v in taken.items():
        p25, p50, p75 = np.percentile(v, [25, 50, 75])
        per = " / ".join(f"{s[name]:.1f}" for s in sessions)
        print(f"  {name:12s} p25 {p25:6.1f}  p50 {p50:6.1f}  p75 {p75:6.1f}   p50 by session {per}")


def _rotated(names: list[str], k: int) -> list[str]:
    """``names`` rotated left by ``k``."""
    k %= len(names)
    return names[k:] + names[:k]


def _session(order: list[str], trees: dict[str, str], env: dict[str, str], model: str, rounds: int,
             raw_type: type) -> dict[str, list[float]]:
    """Start a server per tree in ``order``, measure ``rounds`` rounds, stop them."""
    servers = {}
    raws = {}
    try:
        for name in order:
            servers[name] = start_server(Path(tempfile.mkdtemp(prefix=f"ab-{name}-")), "--load", model,
                                         env={**env, "PYTHONPATH": trees[name]})
            with Client(servers[name].unix, direct=True) as c:
                info = c.lookup(model)
            x = b"".join(np.ones(t.shape, t.dtype).tobytes() for t in info.inputs)
            raws[name] = raw_type(Endpoint.parse(info.extra["direct"][0]).path,
                                  Header(Kind.REQUEST, func_id=info.func_id, payload_len=len(x)).pack() + x,
                                  HEADER_SIZE + sum(t.nbytes for t in info.outputs))
        for raw in raws.values():  # warm-up
            for _ in range(200):
                raw.call(True)
        taken: dict[str, list[float]] = {name: [] for name in order}
        for r in range(rounds):
            for name in _rotated(order, r):
                taken[name] += [raws[name].call(True) for _ in range(BLOCK)]
        return taken
    finally:
        for raw in raws.values():
            raw.sock.close()
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
