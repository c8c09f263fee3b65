"""What a hand-over between two processes costs on this host: on one CPU, across two, after a compute.

    .venv/bin/python benchmarks/cross_cpu_wake.py [--holds 0,300,600] [--calls 200] [--rounds 20]

The caller is pinned to the first CPU it may use. For each server placement (the caller's own
CPU, another one) and each hold, a server process pinned there answers an 8-byte message over
a Unix stream socket after keeping its CPU busy for the hold (0: at once; a hold stands for a
model computing). The caller blocks in ``recv`` meanwhile, as a client or a front end that
does not poll does. Blocks of ``--calls`` calls go round the servers in an order rotated by
one each round, so every server meets the host's same minutes. It prints each pair's p50 of
round trip minus hold, in µs.

On one CPU a hand-over is a context switch. Across two it is a wake-up of a CPU that went
idle, and in a VM an idle vCPU halts: its wake-up goes through the hypervisor. After a hold
the caller's CPU has been idle long enough to halt. A front-end call of
``docs/fastpath-breakdown.md`` hands over between the front end and its worker, on another
CPU, twice (the front end and its client can share one); the plain echo that the ratios
there divide by hands over across CPUs or not, depending on where its thread runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import time

import numpy as np

_MSG = struct.Struct("<Q")  # the hold in µs; the answer echoes it


def _serve(sock: socket.socket, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    buf = bytearray(_MSG.size)
    while sock.recv_into(buf, _MSG.size, socket.MSG_WAITALL) == _MSG.size:
        (hold_us,) = _MSG.unpack(buf)
        until = time.perf_counter_ns() + hold_us * 1000
        while time.perf_counter_ns() < until:  # busy, as a model computing keeps its CPU
            pass
        sock.sendall(buf)


def _server(cpu: int, earlier: list[tuple[socket.socket, int]]) -> tuple[socket.socket, int]:
    """A forked server pinned to ``cpu``: the caller's end of its socket, and its pid. The
    child closes the caller's ends of the ``earlier`` servers' sockets, or they would not
    see their caller close them."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code, whatever happens
        code = 1
        try:
            for sock, _ in [*earlier, (ours, 0)]:
                sock.close()
            _serve(theirs, cpu)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    return ours, pid


def _call(sock: socket.socket, msg: bytes, buf: bytearray) -> None:
    sock.sendall(msg)
    if sock.recv_into(buf, len(buf), socket.MSG_WAITALL) != len(buf):
        raise ConnectionError("the server closed its socket")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holds", default="0,300,600", help="µs each server keeps its CPU before it answers")
    ap.add_argument("--calls", type=int, default=200, help="calls a block")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    holds = [int(h) for h in a.holds.split(",")]
    if a.calls < 1 or a.rounds < 1 or any(h < 0 for h in holds):
        ap.error("--calls and --rounds are at least 1, every hold at least 0")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs to compare a hand-over on one CPU with one across two")
    mine, other = cpus[0], cpus[1]
    os.sched_setaffinity(0, {mine})
    pairs = [(where, cpu, hold) for hold in holds for where, cpu in (("same CPU", mine), ("other CPU", other))]
    servers: list[tuple[socket.socket, int]] = []
    for _, cpu, _ in pairs:
        servers.append(_server(cpu, servers))
    buf = bytearray(_MSG.size)
    times: list[list[float]] = [[] for _ in pairs]
    try:
        for i, (sock, _) in enumerate(servers):  # a block each to warm up
            for _ in range(a.calls):
                _call(sock, _MSG.pack(pairs[i][2]), buf)
        for r in range(a.rounds):
            for k in range(len(pairs)):
                i = (k + r) % len(pairs)
                sock, msg, hold = servers[i][0], _MSG.pack(pairs[i][2]), pairs[i][2]
                for _ in range(a.calls):
                    t0 = time.perf_counter_ns()
                    _call(sock, msg, buf)
                    times[i].append((time.perf_counter_ns() - t0) / 1e3 - hold)
    finally:
        for sock, pid in servers:
            sock.close()
            os.waitpid(pid, 0)
    print(f"caller on CPU {mine}; p50 of round trip - hold, µs ({a.rounds} rounds of {a.calls} calls each)")
    for (where, cpu, hold), t in zip(pairs, times):
        print(f"  hold {hold:>5} µs, server on the {where:<9} (CPU {cpu}): {np.median(t):8.1f}")


if __name__ == "__main__":
    main()
