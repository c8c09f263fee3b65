"""How much slower a worker's per-call Python runs right after the model than back to back.

    taskset -c 1 .venv/bin/python benchmarks/cold_python.py [--model lenet] [--calls 2000]

One step of the direct worker's answer, the batch's output into its answer rows, is timed
right after each of: the model's forward at batch 1, 300 µs of C work that touches almost no
memory (sha256 of 64 bytes, over and over), a 300 µs sleep, a sum over 4 MiB, and the same
step (back to back). p50 of each, µs, for both ways a worker takes that step
(``worker/direct.py``): the Python path's ``copy_`` of the reshaped output, and the
compiled lane's ``outputs`` (the output's numpy view checked and copied in C). On the
2-vCPU VM of docs/fastpath-breakdown.md, the step as it was while it still ran in Python
(the output checked and viewed as bytes) took 1.9 µs back to back and 8.4 µs after lenet's
forward: the Python between a call's compute and its answer runs several times slower than
its profile in a loop says,
which is why lenet's tax is above vecadd1k's with the same code, and why the worker's
per-call steps went to C.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import time

import numpy as np
import torch

from splitserve import _directlane
from splitserve.models.catalog import zoo_entry
from splitserve.models.zoo import build_zoo_model
from splitserve.worker.counters import WorkerCounters

_SMALL = b"x" * 64


def _burn(us: int) -> None:
    """``us`` of CPU in C code that touches almost no memory."""
    end = time.perf_counter_ns() + us * 1000
    h = hashlib.sha256()
    while time.perf_counter_ns() < end:
        for _ in range(50):
            h.update(_SMALL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    entry = zoo_entry(a.model)
    model = build_zoo_model(a.model).eval()
    xs = [torch.from_numpy(np.ones((1, *t.shape), t.dtype)) for t in entry.inputs]
    # the answer rows of one batch of one sample, as a worker's direct endpoint holds them
    rows = [np.empty((1, *t.shape), t.dtype) for t in entry.outputs]
    dsts = tuple(torch.from_numpy(r) for r in rows)
    inputs = [np.empty(t.nbytes, np.uint8) for t in entry.inputs]
    lane = _directlane.Lane(0, [t.nbytes for t in entry.inputs], 1, bytes(256), [inputs, inputs],
                            [t.nbytes for t in entry.outputs], [rows, rows],
                            *WorkerCounters(mmap.mmap(-1, mmap.PAGESIZE)).lane_counts())
    big = np.ones(1 << 20, np.float32)

    def python_step(ys: tuple) -> None:
        for y, dst in zip(ys, dsts):
            dst.copy_(y.reshape(dst.shape))

    def compiled_step(ys: tuple) -> None:
        if not lane.outputs(0, 1, ys):
            raise SystemExit(f"{a.model}'s outputs are not what the lane copies (dtype, size)")

    ways = {"Python (copy_)": python_step, "compiled (lane.outputs)": compiled_step}
    befores = ("after the model", "after 300 µs of C work", "after a 300 µs sleep", "after a 4 MiB sum",
               "back to back")
    taken: dict[tuple[str, str], list[float]] = {(w, b): [] for w in ways for b in befores}

    def timed(way: str, before: str, ys: tuple) -> None:
        t0 = time.perf_counter_ns()
        ways[way](ys)
        taken[way, before].append((time.perf_counter_ns() - t0) / 1e3)

    with torch.inference_mode():
        for _ in range(a.calls):
            for way in ways:
                ys = model(*xs)
                timed(way, befores[0], ys)
                _burn(300)
                timed(way, befores[1], ys)
                time.sleep(0.0003)
                timed(way, befores[2], ys)
                big.sum()
                timed(way, befores[3], ys)
                ways[way](ys)
                timed(way, befores[4], ys)
    print(f"{a.model}: one answer step (the output into its answer rows), p50 µs")
    print(f"  {'':24s} " + " ".join(f"{w:>24s}" for w in ways))
    for b in befores:
        print(f"  {b:24s} " + " ".join(f"{np.median(taken[w, b][100:]):24.2f}" for w in ways))


if __name__ == "__main__":
    main()
