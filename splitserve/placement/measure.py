"""One isolated measuring process of the profiler (``python -m splitserve.placement.measure JOB``).

Pinned to its CPUs with its thread count, it loads one model and then works in one of two modes.

``sweep`` (``profile_model``): times each batch size segment by segment after a warm-up until
the mean is stable (standard error under 3% of the mean) or the time budget is spent, and
prints one JSON line per batch size, with the peak memory one batch added (its footprint).

``loop`` (``profile_colocation``): warms up at one batch size and prints ``{"ready": ...}``;
then, for each window its parent writes on stdin (``{"t0", "w0", "w1"}`` on the machine's
monotonic clock, which every process shares), it sleeps until ``t0``, runs batches back to
back until ``w1`` has passed and prints the mean latency of the batches that ran wholly
inside ``[w0, w1]``. Several such processes given the same window run with full overlap:
each is busy from ``t0`` until after ``w1``, so every measured batch had every co-runner
busy beside it. End of stdin ends the process.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _status_kb(field: str) -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(field.encode() + b":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field} line")


def _reset_peak_rss() -> bool:
    """Set VmHWM back to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Give freed heap memory back to the OS, so that a batch's allocations fault in anew
    (and show in the peak) instead of reusing what an earlier batch left in malloc's arenas."""
    gc.collect()
    libc = ctypes.CDLL(None)  # this process's own symbols: no library search (find_library runs ldconfig)
    if hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


def peak_added(run: Callable[[], Any], device: Any = None) -> int | None:
    """Bytes of memory ``run()`` added at its peak: CUDA's peak allocation on a GPU (a
    ``torch.device`` of type cuda), the rise of the peak RSS (VmHWM) over the RSS before it
    on the CPU. None where it cannot be measured (the peak cannot be reset), rather than a
    number that is some earlier peak."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    _trim_heap()
    if not _reset_peak_rss():
        run()
        return None
    base = _status_kb("VmHWM")  # equal to VmRSS right after the reset
    run()
    return max(0, _status_kb("VmHWM") - base) * 1024


def _load(job: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """Pin this process, set its threads and load the job's model: (torch, config, model, device)."""
    os.sched_setaffinity(0, job["cpus"])
    import torch

    from splitserve.modelconfig import ModelConfig
    from splitserve.models.loader import load_artifact

    torch.set_num_threads(job["threads"])
    cfg = ModelConfig.from_dict(job["config"])
    art = cfg.artifact
    path = Path(job["model_dir"]) / art.file if job["model_dir"] and art.file else None
    device = torch.device(cfg.device)
    model = load_artifact(art.kind, path, art.arch, seed=art.seed, cache_dir=Path(job["cache_dir"]))
    return torch, cfg, model.eval().to(device), device


def _inputs(torch: Any, cfg: Any, batch: int, gen: Any, device: Any) -> tuple[Any, ...]:
    xs = []
    for spec in cfg.inputs:
        shape = (batch, *spec.shape)
        if spec.dtype.kind == "f":
            x = torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype.name))
        else:  # small non-negative integers are valid for every zoo model (ids, pixels, masks)
            x = torch.randint(0, 2, shape, generator=gen).to(getattr(torch, spec.dtype.name))
        xs.append(x.to(device))
    return tuple(xs)


def _runner(torch: Any, model: Any, xs: tuple[Any, ...], device: Any) -> Callable[[], None]:
    """One whole batch, finished on its device when it returns."""
    def run() -> None:
        model(*xs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def sweep(job: dict[str, Any]) -> None:
    torch, cfg, model, device = _load(job)
    gen = torch.Generator().manual_seed(0)
    for b in job["batches"]:
        xs = _inputs(torch, cfg, b, gen, device)
        run = _runner(torch, model, xs, device)
        runs: list[list[float]] = []
        with torch.inference_mode():
            run()  # warm-up: pages the weights in, lazy inits, the allocator's first growth
            footprint = peak_added(run, device)  # the second batch: what one batch adds in steady state
            start = time.perf_counter()
            while True:
                acts = tuple(xs)
                segs = []
                for i in range(model.num_segments):
                    t0 = time.perf_counter()
                    acts = model.run_segment(i, acts)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    segs.append(time.perf_counter() - t0)
                runs.append(segs)
                totals = [sum(r) for r in runs]
                n = len(totals)
                if n >= job["min_iters"]:
                    mean = statistics.fmean(totals)
                    sem = statistics.stdev(totals) / n ** 0.5 if n > 1 else mean
                    if sem < 0.03 * mean or n >= job["max_iters"] or time.perf_counter() - start > job["budget_s"]:
                        break
        per_seg = [statistics.fmean(col) for col in zip(*runs)]
        print(json.dumps({"batch": b, "mean_s": statistics.fmean(totals), "iters": n, "segments_s": per_seg,
                          "footprint_bytes": footprint}), flush=True)


def loop(job: dict[str, Any]) -> None:
    torch, cfg, model, device = _load(job)
    xs = _inputs(torch, cfg, job["batch"], torch.Generator().manual_seed(0), device)
    run = _runner(torch, model, xs, device)
    with torch.inference_mode():
        run()
        t0 = time.monotonic()
        run()
        print(json.dumps({"ready": True, "warm_s": time.monotonic() - t0}), flush=True)
        for line in sys.stdin:
            window = json.loads(line)
            time.sleep(max(0.0, window["t0"] - time.monotonic()))
            inside: list[float] = []
            while True:
                start = time.monotonic()
                if start > window["w1"]:
                    break
                run()
                end = time.monotonic()
                if start >= window["w0"] and end <= window["w1"]:
                    inside.append(end - start)
            print(json.dumps({"mean_s": statistics.fmean(inside) if inside else None, "iters": len(inside)}),
                  flush=True)


def main() -> int:
    job = json.loads(sys.argv[1])
    (loop if job.get("mode") == "loop" else sweep)(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
