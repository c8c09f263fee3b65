"""What touching memory costs a process after it slept, against back to back.

    .venv/bin/python benchmarks/cold_pages.py [--mib 64] [--gaps 0,0.0005,0.002,0.01,0.05,0.2,1] [--rounds 3]

A buffer of ``--mib`` MiB is written once, then one byte of each of its pages is read
(numpy's gather and sum: no Python per page) after each gap, slept with ``time.sleep``; the
gaps take turns, ``--rounds`` times each. It prints the best and worst ns per page of each
gap. On a host whose memory stays warm for a sleeping process every gap reads alike, a
few ns a page (a cache or TLB miss at worst, ~100 ns). On the 2-vCPU VM of
docs/fastpath-breakdown.md (stop 45, a Firecracker guest; two runs) it was 7-50 ns back to
back and after sleeping up to 2 ms, and 25-73 ns, 200-394 ns, 670-866 ns and 2.2-3.0 µs
after sleeping 10 ms, 50 ms, 200 ms and 1 s: something below the process (the host, or
the guest kernel's DAMON, whose ``kdamond`` runs a ``pageout`` scheme there) takes a
sleeping process's memory away by the second, and every page it touches again costs a
fault. A server on such a host pays it on every wake-up, in proportion to the
memory its wake-up touches: the node's 6 µs look at its workers' pages took 0.6-0.9 ms after
50 ms asleep and 7-10 ms after a second.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

_PAGE = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--gaps", default="0,0.0005,0.002,0.01,0.05,0.2,1", help="seconds slept, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    gaps = [float(g) for g in a.gaps.split(",")]
    if a.mib < 1 or a.rounds < 1 or any(g < 0 for g in gaps):
        ap.error("--mib and --rounds are at least 1 and every gap at least 0")
    buf = np.ones(a.mib << 20, np.uint8)
    pages = np.arange(0, buf.size, _PAGE)

    def touch() -> float:
        t0 = time.perf_counter_ns()
        int(buf[pages].sum())
        return (time.perf_counter_ns() - t0) / len(pages)

    touch()
    taken: dict[float, list[float]] = {g: [] for g in gaps}
    for _ in range(a.rounds):
        for g in gaps:
            if g:
                time.sleep(g)
            else:
                touch()  # back to back: right after a touch
            taken[g].append(touch())
    print(f"one byte of each page of {a.mib} MiB, read after a sleep: ns per page (best .. worst of {a.rounds})")
    for g in gaps:
        how = "back to back" if g == 0 else f"slept {g * 1e3:g} ms"
        print(f"  {how:16s} {min(taken[g]):8.1f} .. {max(taken[g]):8.1f}")


if __name__ == "__main__":
    main()
