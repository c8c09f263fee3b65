"""Reload from the pinned host tier against reload from disk, on a GPU: the time from "the
model's weights are not on the device" to "its first batch is answered".

* **disk**: the weights file is dropped from the page cache, then the model is mapped from
  it (``load_zoo_model``), moved to the device and runs one batch;
* **pinned**: the weights wait in page-locked host memory (``worker.layer_reload``); they
  are copied back segment by segment on a copy stream while the batch runs on the segments
  already there.

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


def measure(model: str, rounds: int, batch: int, cache_dir: Path) -> tuple[list[float], list[float]]:
    """Seconds per round from disk and from the pinned tier (CUDA only)."""
    import torch

    from splitserve.memory.weights import drop_page_cache
    from splitserve.models.catalog import zoo_entry, zoo_weights_path
    from splitserve.models.zoo import load_zoo_model
    from splitserve.worker.layer_reload import CudaLanes, drop_device, pin_weights, reload_and_run

    shape = zoo_entry(model).inputs[0].shape
    x = torch.randn(batch, *shape, device="cuda")
    path = zoo_weights_path(model, 0, cache_dir)
    load_zoo_model(model, 0, cache_dir)  # writes the file once
    disk, pinned = [], []
    with torch.no_grad():
        for _ in range(rounds):
            if path is not None:
                drop_page_cache(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = load_zoo_model(model, 0, cache_dir).cuda()
            m(x)
            torch.cuda.synchronize()
            disk.append(time.perf_counter() - t0)
        weights = pin_weights(m, lambda t: t.pin_memory())
        compute = torch.cuda.Stream()
        lanes = CudaLanes(torch.device("cuda"), compute)
        for _ in range(rounds):
            drop_device(weights)
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            compute.wait_stream(torch.cuda.current_stream())
            reload_and_run(m, weights, lanes, (x,))
            compute.synchronize()
            pinned.append(time.perf_counter() - t0)
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
