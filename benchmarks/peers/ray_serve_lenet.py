"""Peer: Ray Serve serving the zoo's LeNet (seed 0) with ``@serve.batch``, for comparison.

Optional, never part of the test command. Needs ``ray[serve]`` next to splitserve in a separate
environment (see benchmarks/README.md), then::

    python benchmarks/peers/ray_serve_lenet.py --port 8010            # serves until Ctrl-C
    python benchmarks/peers/drive.py raw http://127.0.0.1:8010/lenet   # our load generator

The endpoint takes the raw 784-byte UINT8 image as the request body and answers the 40 raw
bytes of the FP32 logits, the same payloads as splitserve's fast path, so the comparison
measures the serving stack and not an encoding.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

MAX_BATCH = 8


def build_app(max_batch: int, wait_s: float):
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
    class LeNet:
        def __init__(self) -> None:
            import torch

            from splitserve.models import build_zoo_model

            torch.set_num_threads(1)  # as a splitserve worker runs it
            self.torch = torch
            self.model = build_zoo_model("lenet", seed=0)

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_s)
        async def infer(self, images: list[np.ndarray]) -> list[bytes]:
            x = self.torch.from_numpy(np.stack(images))
            with self.torch.inference_mode():
                (logits,) = self.model(x)
            return [row.tobytes() for row in logits.numpy()]

        async def __call__(self, request: Request) -> Response:
            body = await request.body()
            image = np.frombuffer(body, dtype=np.uint8).reshape(1, 28, 28)
            return Response(await self.infer(image), media_type="application/octet-stream")

    return LeNet.bind()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8010)
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH)
    ap.add_argument("--batch-wait-ms", type=float, default=0.0, help="@serve.batch batch_wait_timeout_s, in ms")
    args = ap.parse_args()

    import ray
    from ray import serve

    # Loopback only: the node address must be 127.0.0.1 or Ray picks the host's external address.
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(args.max_batch, args.batch_wait_ms / 1000.0), name="lenet", route_prefix="/lenet")
    print(f"Ray Serve LeNet on http://127.0.0.1:{args.port}/lenet (max batch {args.max_batch}); Ctrl-C stops",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
