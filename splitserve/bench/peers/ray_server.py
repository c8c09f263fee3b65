"""Ray Serve, serving the benchmark's exported models with ``@serve.batch``.

Runs in the peer's own environment (``ray[serve]``, torch, numpy; never splitserve):
``python ray_server.py MANIFEST READY_FILE HTTP_PORT``. Each model in the manifest (splitserve's
zoo model with its weights, saved by ``torch.export``) is one application at
``/<model>``: POST one sample's raw bytes (the model's input dtype and shape), get its first
output's raw float32 bytes back. Requests are batched by ``@serve.batch`` up to the model's
max batch without waiting for more (like splitserve's work-conserving batching), on one
replica with ``threads`` torch threads. Once every application is up the script writes
READY_FILE; SIGTERM shuts Serve and Ray down.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

DTYPES = {"UINT8": np.uint8, "INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}
# requests a replica accepts at once: enough for the largest batch and the next one queueing
MAX_ONGOING = 128


@serve.deployment(num_replicas=1, max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class Model:
    def __init__(self, path: str, dtype: str, shape: list[int], max_batch: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.program = torch.export.load(path).module()
        self.dtype = DTYPES[dtype]
        self.shape = tuple(shape)
        self.run.set_max_batch_size(max_batch)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)  # __init__ sets the model's max batch
    async def run(self, samples: list[np.ndarray]) -> list[bytes]:
        with torch.inference_mode():
            (y, *_) = self.program(torch.from_numpy(np.stack(samples)))
        return [row.numpy().astype(np.float32).tobytes() for row in y]

    async def __call__(self, request: Request) -> Response:
        x = np.frombuffer(await request.body(), self.dtype).reshape(self.shape)
        return Response(await self.run(x), media_type="application/octet-stream")


def main(manifest: str, ready: str, http: str) -> None:
    spec = json.loads(Path(manifest).read_text())
    stop = threading.Event()
    # A loopback node address: the machine may have no other, and nothing outside needs to reach
    # it. The replica asks for no CPUs, so Ray's count only sizes its pool of idle workers.
    ray.init(num_cpus=spec["threads"], include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(http)})
        for m in spec["models"]:
            (t,) = m["inputs"]
            serve.run(Model.bind(m["path"], t["datatype"], t["shape"], m["max_batch"], spec["threads"]),
                      name=m["name"], route_prefix=f"/{m['name']}")
        # after ray.init, whose core worker installs a SIGTERM handler of its own
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        Path(ready).write_text("ready\n")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
