"""Triton Inference Server via PyTriton, serving the benchmark's exported models.

Runs in the peer's own environment (``nvidia-pytriton``, torch, numpy; never splitserve):
``python triton_server.py MANIFEST READY_FILE HTTP_PORT GRPC_PORT METRICS_PORT``. Each model
in the manifest is splitserve's zoo model with its weights, saved by ``torch.export``; it is
bound with Triton's dynamic batcher (no queue delay, like splitserve's work-conserving
batching) and one instance on ``threads`` torch threads. Once Triton answers, the script
writes READY_FILE; SIGTERM stops Triton and the script.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

DTYPES = {"UINT8": np.uint8, "INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}


def infer_function(program: torch.nn.Module, inputs: list[str], outputs: list[str]):  # noqa: ANN201
    @batch
    def infer(**tensors: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            ys = program(*[torch.from_numpy(tensors[n]) for n in inputs])
        return {n: y.numpy() for n, y in zip(outputs, ys)}

    return infer


def main(manifest: str, ready: str, http: str, grpc: str, metrics: str) -> None:
    spec = json.loads(Path(manifest).read_text())
    torch.set_num_threads(spec["threads"])
    config = TritonConfig(http_address="127.0.0.1", http_port=int(http), grpc_address="127.0.0.1",
                          grpc_port=int(grpc), metrics_port=int(metrics), allow_metrics=False)
    stop = threading.Event()
    with Triton(config=config) as triton:
        for m in spec["models"]:
            program = torch.export.load(m["path"]).module()
            triton.bind(
                model_name=m["name"],
                infer_func=infer_function(program, [t["name"] for t in m["inputs"]],
                                          [t["name"] for t in m["outputs"]]),
                inputs=[Tensor(name=t["name"], dtype=DTYPES[t["datatype"]], shape=tuple(t["shape"]))
                        for t in m["inputs"]],
                outputs=[Tensor(name=t["name"], dtype=DTYPES[t["datatype"]], shape=tuple(t["shape"]))
                         for t in m["outputs"]],
                config=ModelConfig(max_batch_size=m["max_batch"],
                                   batcher=DynamicBatcher(max_queue_delay_microseconds=0)),
                strict=True,
            )
        triton.run()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after Triton's start, which may set its own
        Path(ready).write_text("ready\n")
        stop.wait()


if __name__ == "__main__":
    main(*sys.argv[1:6])
