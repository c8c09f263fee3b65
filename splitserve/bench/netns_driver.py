"""The Ray driver of a cluster on network-namespace hosts (``netns.py``), run on the head's host (a driver must run on a Ray node): it puts
the splitserve actors on the Ray cluster as ``splitserve cluster up --address`` does, prints
the gateway's ports as one JSON line, then answers ``status`` and ``gateway`` lines on stdin
with the controller's status and the gateway's stats (one JSON line each), and stops the
actors when stdin closes.

``python -m splitserve.bench.netns_driver RAY_ADDRESS GATEWAY_HOST NODES TOKEN CACHE_DIR [MODELS]``
(MODELS: built-in models, comma-separated; default lenet)
"""

from __future__ import annotations

import json
import logging
import os
import sys

import ray

from splitserve.cluster.actors.local import attach, stop_actors
from splitserve.cluster.actors.node_server import NodeSpec
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.pools import ProcurementPolicy


def main(address: str, gateway_host: str, nodes: str, token: str, cache_dir: str, models: str = "lenet") -> None:
    # the answers get stdout to themselves: Ray prints its workers' messages on fd 1
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    cfg = ClusterConfig.from_env(min_nodes=int(nodes), max_nodes=int(nodes), keep_alive_s=3600,
                                 procurement=ProcurementPolicy.ON_DEMAND_ONLY, reconcile_interval_s=0.5,
                                 autoscale_interval_s=0.5)
    spec = NodeSpec(token=token, cache_dir=cache_dir)  # data dirs in each host's TMPDIR: the tier's temp dir
    h = attach(cfg, spec, gateway_host, 0, models.split(","), 0, None, joined=True)
    print(json.dumps({"gateway_port": h.gateway_port, "http_port": h.gateway_http_port}), file=answers)
    try:
        for line in sys.stdin:
            ask = {"status": h.controller.status, "gateway": h.gateway.stats}[line.strip()]
            print(json.dumps(ray.get(ask.remote(), timeout=60)), file=answers)
    finally:
        stop_actors(h)


if __name__ == "__main__":
    main(*sys.argv[1:])
