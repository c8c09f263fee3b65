"""The HTTP and gRPC tax of a 600 KB input (resnet18_imagenet, FP32 3x224x224) with and without
Triton's system shared-memory extension, measured with the real ``tritonclient``.

    PYTHONPATH=. .venv/bin/python benchmarks/shm_tax.py [--requests 30] [--out results/shm-tax.json]

It starts ``splitserve serve`` (HTTP and gRPC on free ports, the model loaded) in a child
process, then sends sequential calls: the input as binary tensor data / raw contents, or
written into a registered region (the client's copy into the region is timed, as the
normal path's encode is) with the output read back from another. A call's tax is its
end-to-end time minus the server's own ``compute_us``; the figure is the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm

from splitserve.launcher import start_server

MODEL, INPUT, OUTPUT = "resnet18_imagenet", "input", "logits"


def server_us(result: Any, key: str) -> int:
    """One of the server's own timings of the call (``compute_us``, ``total_us``...)."""
    response = result.get_response()
    if isinstance(response, dict):
        return int(response["parameters"][key])
    return response.parameters[key].int64_param


def timed(calls: dict[str, Callable[[], Any]], requests: int, warmup: int) -> dict[str, dict[str, float]]:
    """Per way of calling, medians in microseconds: end-to-end, the tax (end-to-end minus the
    server's compute), the server's part of it (its receive-to-answer time minus compute)
    and the rest (client and wire: end-to-end minus the server's receive-to-answer time).
    The ways take turns, call by call, so a busy machine weighs on each alike."""
    samples: dict[str, dict[str, list[float]]] = {
        way: {"e2e_us": [], "tax_us": [], "server_us": [], "client_and_wire_us": []} for way in calls}
    for i in range(warmup + requests):
        for way, call in calls.items():
            t0 = time.perf_counter()
            result = call()
            us = (time.perf_counter() - t0) * 1e6
            if i < warmup:
                continue
            compute, total = server_us(result, "compute_us"), server_us(result, "total_us")
            got = samples[way]
            got["e2e_us"].append(us)
            got["tax_us"].append(us - compute)
            got["server_us"].append(total - compute)
            got["client_and_wire_us"].append(us - total)
    return {way: {k: statistics.median(v) for k, v in got.items()} for way, got in samples.items()}


def run(requests: int, warmup: int) -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    out_bytes = 1000 * 4
    tag = os.getpid()
    with tempfile.TemporaryDirectory() as tmp, start_server(Path(tmp) / "data", "--load", MODEL, http=True,
                                                            grpc=True) as server:
        http = thttp.InferenceServerClient(server.http.removeprefix("http://"))
        grpc = tgrpc.InferenceServerClient(server.grpc.removeprefix("grpc://"))
        regions = [shm.create_shared_memory_region("in", f"/shm-tax-in-{tag}", x.nbytes),
                   shm.create_shared_memory_region("out", f"/shm-tax-out-{tag}", out_bytes)]
        try:
            http.register_system_shared_memory("in", f"/shm-tax-in-{tag}", x.nbytes)
            http.register_system_shared_memory("out", f"/shm-tax-out-{tag}", out_bytes)
            out: dict[str, Any] = {"model": MODEL, "input_bytes": x.nbytes, "requests": requests}
            for name, module, client in (("http", thttp, http), ("grpc", tgrpc, grpc)):
                def plain() -> Any:
                    t = module.InferInput(INPUT, list(x.shape), "FP32")
                    t.set_data_from_numpy(x)
                    return client.infer(MODEL, [t])

                def shared() -> Any:
                    shm.set_shared_memory_region(regions[0], [x])
                    t = module.InferInput(INPUT, list(x.shape), "FP32")
                    t.set_shared_memory("in", x.nbytes)
                    o = module.InferRequestedOutput(OUTPUT)
                    o.set_shared_memory("out", out_bytes)
                    result = client.infer(MODEL, [t], outputs=[o])
                    shm.get_contents_as_numpy(regions[1], np.float32, [1, 1000]).copy()
                    return result

                out[name] = timed({"plain": plain, "shm": shared}, requests, warmup)
                out[name]["tax_ratio"] = out[name]["plain"]["tax_us"] / out[name]["shm"]["tax_us"]
            http.unregister_system_shared_memory()
            return out
        finally:
            http.close()
            grpc.close()
            for r in regions:
                shm.destroy_shared_memory_region(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = run(args.requests, args.warmup)
    for proto in ("http", "grpc"):
        r = result[proto]
        print(f"{proto}: tax {r['plain']['tax_us']:.0f} us without shared memory, {r['shm']['tax_us']:.0f} us with "
              f"({r['tax_ratio']:.1f}x lower); of it in the server {r['plain']['server_us']:.0f} vs "
              f"{r['shm']['server_us']:.0f} us, client and wire {r['plain']['client_and_wire_us']:.0f} vs "
              f"{r['shm']['client_and_wire_us']:.0f} us")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
