"""One isolated measuring process of the profiler (``python -m splitserve.placement.measure JOB``).

Pinned to its CPUs with its thread count, it times each batch size segment by segment
after a warm-up until the mean is stable (standard error under 3% of the mean) or the
time budget is spent, and prints one JSON line per batch size.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    job = json.loads(sys.argv[1])
    os.sched_setaffinity(0, job["cpus"])
    import torch

    from splitserve.modelconfig import ModelConfig
    from splitserve.models import load_artifact

    torch.set_num_threads(job["threads"])
    cfg = ModelConfig.from_dict(job["config"])
    art = cfg.artifact
    path = Path(job["model_dir"]) / art.file if job["model_dir"] and art.file else None
    model = load_artifact(art.kind, path, art.arch, seed=art.seed, cache_dir=Path(job["cache_dir"])).eval()
    gen = torch.Generator().manual_seed(0)
    for b in job["batches"]:
        xs = []
        for spec in cfg.inputs:
            shape = (b, *spec.shape)
            if spec.dtype.kind == "f":
                xs.append(torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype.name)))
            else:  # small non-negative integers are valid for every zoo model (ids, pixels, masks)
                xs.append(torch.randint(0, 2, shape, generator=gen).to(getattr(torch, spec.dtype.name)))
        runs: list[list[float]] = []
        with torch.inference_mode():
            for _ in range(2):  # warm-up: allocator, caches, lazy inits
                model(*xs)
            start = time.perf_counter()
            while True:
                acts = tuple(xs)
                segs = []
                for i in range(model.num_segments):
                    t0 = time.perf_counter()
                    acts = model.run_segment(i, acts)
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
        print(json.dumps({"batch": b, "mean_s": statistics.fmean(totals), "iters": n, "segments_s": per_seg}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
