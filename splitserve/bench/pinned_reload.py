"""Reload from the pinned host tier against reload from disk, on a GPU: the time from "the
model's weights are not on the device" to "its first batch is answered".

* **disk**: the weights file is dropped from the page cache, then the model is mapped from
  it (``load_zoo_model``), moved to the device and runs one batch;
* **pinned**: the path an evicted GPU model takes in the server: a worker's binding of the
  model is parked (``Binding.park``: weights in page-locked host memory, device copies
  freed, ``empty_cache``), then its first batch copies them back segment by segment on a
  copy stream while it runs on the segments already there (``Binding.reload_run``), and
  the host copy goes after the answer (``Binding.settle``, untimed).

Each is run ``rounds`` times; the medians and their ratio are printed (goal: pinned at least
3x faster, PipeSwitch/Rafiqi). Without CUDA it says so and exits 0. ``scripts/gpu-check``
runs it as one step.

    python -m splitserve.bench.pinned_reload [--model resnet50_imagenet] [--rounds 5] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

GOAL = 3.0  # pinned reload at least this many times faster than from disk


def summarize(model: str, disk_s: Sequence[float], pinned_s: Sequence[float]) -> list[str]:
    """The figures: each way's median, and the ratio against the goal."""
    disk, pinned = statistics.median(disk_s), statistics.median(pinned_s)
    ratio = disk / pinned if pinned > 0 else float("inf")
    verdict = "meets" if ratio >= GOAL else "misses"
    return [f"{model}: reload to first answer, median of {len(disk_s)}: disk {disk * 1e3:.1f} ms, "
            f"pinned tier {pinned * 1e3:.1f} ms",
            f"pinned tier {ratio:.2f}x faster than disk ({verdict} the {GOAL:g}x goal)"]


def measure(model: str, rounds: int, batch: int, cache_dir: Path,
            device: str = "cuda") -> tuple[list[float], list[float]]:
    """Seconds per round from disk and from the pinned tier (``device`` is CUDA but for the
    CPU test of this code)."""
    import torch

    from splitserve.memory.weights import drop_page_cache
    from splitserve.modelconfig import ModelConfig
    from splitserve.models.catalog import zoo_entry, zoo_weights_path
    from splitserve.models.zoo import load_zoo_model
    from splitserve.protocol.header import RequestClass
    from splitserve.worker.binding import Binding
    from splitserve.worker.spec import BindSpec

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    shape = zoo_entry(model).inputs[0].shape
    x = torch.randn(batch, *shape, device=device)
    path = zoo_weights_path(model, 0, cache_dir)
    load_zoo_model(model, 0, cache_dir)  # writes the file once
    disk, pinned = [], []
    with torch.inference_mode():
        for _ in range(rounds):
            if path is not None:
                drop_page_cache(path)
            sync()
            t0 = time.perf_counter()
            m = load_zoo_model(model, 0, cache_dir).to(device)
            m(x)
            sync()
            disk.append(time.perf_counter() - t0)
        del m
    cfg = ModelConfig.from_dict({"name": model, "device": device, "cuda_graphs": "off", "max_batch_size": batch,
                                 "artifact": {"kind": "zoo", "arch": model, "seed": 0}})
    b = Binding(1, BindSpec(cfg.to_dict(), None, {}, cfg.capacity), cache_dir, 0.5)
    try:
        for _ in range(rounds):
            b.park()
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                b.reload_run(RequestClass.RT, (x,))
            sync()
            pinned.append(time.perf_counter() - t0)
            b.settle()
    finally:
        b.close()
    return disk, pinned


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50_imagenet")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mark", default="", help="print the summary as JSON after this marker (gpu-check)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        lines = ["skipped: no CUDA device here (the pinned tier's reload is a GPU measurement)"]
    else:
        with tempfile.TemporaryDirectory() as cache:
            lines = summarize(args.model, *measure(args.model, args.rounds, args.batch, Path(cache)))
    print("\n".join(lines))
    if args.mark:
        print(args.mark + json.dumps(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
