"""How much slower a worker's per-call Python runs right after the model than back to back.

    taskset -c 1 .venv/bin/python benchmarks/cold_python.py [--model lenet] [--calls 2000]

One step of the direct worker's answer (``worker/direct.py::_out_bytes``: the output tensor
checked and viewed as bytes) is timed right after each of: the model's forward at batch 1,
300 µs of C work that touches almost no memory (sha256 of 64 bytes, over and over), a 300 µs
sleep, a sum over 4 MiB, and the same step (back to back). p50 of each, µs. On the 2-vCPU
VM of issue 15 the step took 1.4 µs back to back and 7.5 µs after lenet's forward or a
sleep: the Python between a call's compute and its answer runs several times slower than
its profile in a loop says, which is why lenet's tax is above vecadd1k's with the same code.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import torch

from splitserve.models.catalog import zoo_entry
from splitserve.models.zoo import build_zoo_model
from splitserve.worker.direct import _out_bytes

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
    (spec,) = entry.outputs[:1]
    dtype = torch.from_numpy(np.empty(0, spec.dtype)).dtype
    big = np.ones(1 << 20, np.float32)

    def step(y: torch.Tensor) -> float:
        t0 = time.perf_counter_ns()
        _out_bytes(y, dtype, spec.nbytes, spec)
        return (time.perf_counter_ns() - t0) / 1e3

    taken: dict[str, list[float]] = {"after the model": [], "after 300 µs of C work": [], "after a 300 µs sleep": [],
                                     "after a 4 MiB sum": [], "back to back": []}
    with torch.inference_mode():
        for _ in range(a.calls):
            out = model(*xs)
            y = out[0] if isinstance(out, (tuple, list)) else out
            taken["after the model"].append(step(y))
            _burn(300)
            taken["after 300 µs of C work"].append(step(y))
            time.sleep(0.0003)
            taken["after a 300 µs sleep"].append(step(y))
            big.sum()
            taken["after a 4 MiB sum"].append(step(y))
            step(y)
            taken["back to back"].append(step(y))
    print(f"{a.model}: one answer step (_out_bytes), p50 µs")
    for k, v in taken.items():
        print(f"  {k:24s} {np.median(v[100:]):6.2f}")


if __name__ == "__main__":
    main()
