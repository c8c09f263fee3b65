"""Peer: PyTriton (Triton Inference Server driven from Python) serving the zoo's LeNet.

Optional, never part of the test command. PyTriton ships Triton binaries that need the system
(Debian) Python 3.11, so it goes into its own virtual environment made from /usr/bin/python3.11
(see benchmarks/README.md). Then::

    python benchmarks/peers/pytriton_lenet.py --http-port 8020          # serves until Ctrl-C
    python benchmarks/peers/drive.py v2 http://127.0.0.1:8020 --model lenet

Triton speaks the Open Inference Protocol v2 over HTTP, so the driver talks to it with
splitserve's own HTTP client (binary tensor extension), exactly as it talks to splitserve.
Dynamic batching up to 8, no queue delay: the same policy as splitserve's ``lenet_b8``.
"""

from __future__ import annotations

import argparse

import numpy as np

MAX_BATCH = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http-port", type=int, default=8020)
    ap.add_argument("--grpc-port", type=int, default=8021)
    ap.add_argument("--metrics-port", type=int, default=8022)
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH)
    ap.add_argument("--queue-delay-us", type=int, default=0)
    args = ap.parse_args()

    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    from splitserve.models import build_zoo_model

    torch.set_num_threads(1)  # as a splitserve worker runs it
    model = build_zoo_model("lenet", seed=0)

    @batch
    def infer(image: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            (logits,) = model(torch.from_numpy(image))
        return {"logits": logits.numpy()}

    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    with Triton(config=config) as triton:
        triton.bind(
            model_name="lenet",
            infer_func=infer,
            inputs=[Tensor(name="image", dtype=np.uint8, shape=(1, 28, 28))],
            outputs=[Tensor(name="logits", dtype=np.float32, shape=(10,))],
            config=ModelConfig(max_batch_size=args.max_batch,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=args.queue_delay_us)),
        )
        print(f"PyTriton LeNet on http://127.0.0.1:{args.http_port} (OIP v2); Ctrl-C stops", flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
