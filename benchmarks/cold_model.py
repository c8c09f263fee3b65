"""How much slower a model's forward runs after its process slept than back to back.

    .venv/bin/python benchmarks/cold_model.py [--model lenet] [--calls 400] [--gaps 0,100,300,700,2000]

Each gap is a wait before every forward at batch 1, in rounds that go through the gaps in
turn: a gap under 300 µs is spun (the process keeps its CPU, as a polling worker does), one
of 300 µs or more slept (``time.sleep``, as a worker that waits in ``epoll_wait`` between
two of the front end's RUNs). It prints each gap's p50 forward time and its ratio to back to
back. On the 2-vCPU VM of docs/fastpath-breakdown.md (stop 45, two runs) lenet took
285 / 302 µs back to back, 1.03x that after a 100 µs spin, and 1.40-1.55x, 1.71-1.72x and
2.32-2.44x after sleeping 300 µs, 700 µs and 2 ms: a process that sleeps comes back to a
cold CPU, so the model of a front-end call, whose worker sleeps while the call crosses the
front end, reports about twice a direct call's compute.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from splitserve.models.catalog import zoo_entry
from splitserve.models.zoo import build_zoo_model

_SLEEP_FROM_US = 300  # gaps this long are slept, shorter ones spun


def _wait(gap_us: int) -> None:
    if gap_us >= _SLEEP_FROM_US:
        time.sleep(gap_us / 1e6)
        return
    end = time.perf_counter_ns() + gap_us * 1000
    while time.perf_counter_ns() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--calls", type=int, default=400, help="forwards per gap")
    ap.add_argument("--gaps", default="0,100,300,700,2000", help="µs before each forward, comma-separated")
    a = ap.parse_args()
    gaps = [int(g) for g in a.gaps.split(",")]
    if a.calls < 10 or any(g < 0 for g in gaps):
        ap.error("--calls is at least 10 and every gap at least 0")
    torch.set_num_threads(1)  # as a worker on one CPU runs it
    entry = zoo_entry(a.model)
    model = build_zoo_model(a.model).eval()
    xs = [torch.from_numpy(np.ones((1, *t.shape), t.dtype)) for t in entry.inputs]
    taken: dict[int, list[float]] = {g: [] for g in gaps}
    with torch.inference_mode():
        for _ in range(50):
            model(*xs)
        for _ in range(a.calls // 10):  # rounds of ten forwards per gap: the host's phases hit every gap alike
            for g in gaps:
                for _ in range(10):
                    _wait(g)
                    t0 = time.perf_counter_ns()
                    model(*xs)
                    taken[g].append((time.perf_counter_ns() - t0) / 1e3)
    base = np.median(taken[0]) if 0 in taken else None
    print(f"{a.model}: a forward at batch 1 after a wait, p50 µs")
    for g in gaps:
        p50 = np.median(taken[g])
        how = "back to back" if g == 0 else f"{'slept' if g >= _SLEEP_FROM_US else 'spun'} {g} µs"
        ratio = f"  {p50 / base:4.2f}x" if base else ""
        print(f"  {how:16s} {p50:8.1f}{ratio}")


if __name__ == "__main__":
    main()
