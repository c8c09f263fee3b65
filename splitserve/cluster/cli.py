"""``splitserve cluster up|status|down`` (needs the ``cluster`` extra: Ray).

``up`` without ``--address`` runs a whole cluster on this machine (a Ray head on 127.0.0.1
and ``--nodes`` serving raylets) in the foreground until Ctrl-C or ``cluster down``; with
``--address`` it puts the splitserve actors on an existing Ray cluster and returns, and
nodes come from that cluster's autoscaler (``--provider``; docs/cluster.md). The
gateway serves the fast path on ``--gateway-port``, HTTP (Open Inference Protocol v2) on
``--gateway-http-port`` and gRPC (the same protocol's GRPCInferenceService) on
``--gateway-grpc-port``: clients use the same URLs and clients as for one node. The
management token is ``DATA_DIR/token``, given to every node.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Optional

import ray
import typer
from rich.console import Console
from rich.table import Table

from splitserve.cluster.actors import raycompat
from splitserve.cluster.actors.local import LocalCluster, attach, find, stop_actors
from splitserve.cluster.actors.node_server import NodeSpec
from splitserve.cluster.pools import NodeProviderKind
from splitserve.cluster.config import ClusterConfig
from splitserve.config import default_data_dir, env_cache_dir
from splitserve.server.management import TOKEN_FILE, ensure_token_file

cluster_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Many nodes behind one or more gateways, on Ray (needs the cluster extra).")
console = Console()
STATE_FILE = "cluster.json"


def _data_dir(data_dir: Optional[Path]) -> Path:
    d = data_dir or default_data_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


@cluster_app.command()
def up(
    nodes: int = typer.Option(2, help="Serving nodes to start with (the cluster's min_nodes)."),
    address: Optional[str] = typer.Option(None, help="Join this Ray cluster (GCS host:port) instead of a local one."),
    gateway_host: str = typer.Option("127.0.0.1", help="Address the gateway binds; loopback unless you mean otherwise."),
    gateway_port: int = typer.Option(8100, help="The gateway's fast-path TCP port (0: any free port)."),
    gateway_http_port: int = typer.Option(8000, help="The gateway's HTTP port, Open Inference Protocol v2 "
                                                     "(0: any free port; -1: no HTTP)."),
    gateway_grpc_port: int = typer.Option(8001, help="The gateway's gRPC port, Open Inference Protocol v2 "
                                                     "(0: any free port; -1: no gRPC)."),
    gateways: int = typer.Option(1, min=1, help="Gateways to run, each a process of its own; the i-th (from 0) "
                                                "serves on each gateway port plus 10*i. Give clients every "
                                                "fast-path URL: they fail over when theirs goes."),
    node_host: str = typer.Option("127.0.0.1", help="Address each node server binds."),
    data_dir: Optional[Path] = typer.Option(None, help="Token and cluster state (default: ./.splitserve)."),
    model: list[str] = typer.Option(["lenet"], help="Built-in models the cluster serves from the start."),
    provider: Optional[NodeProviderKind] = typer.Option(
        None, help="Where nodes come from: local (raylets on the head's machine) or autoscaler (Ray's, node types "
                   "per market); auto, the default (SPLITSERVE_CLUSTER_PROVIDER): autoscaler with --address, else local."),
) -> None:
    """Start a cluster (local: head + NODES raylets on 127.0.0.1) and its gateway."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    d = _data_dir(data_dir)
    chosen = {} if provider is None else {"provider": provider}
    cfg = ClusterConfig.from_env(min_nodes=nodes, max_nodes=max(nodes, ClusterConfig.from_env().max_nodes), **chosen)
    if address is None and cfg.provider is NodeProviderKind.AUTOSCALER:
        raise typer.BadParameter("--provider autoscaler needs --address: the local cluster has no autoscaler")
    http_port = None if gateway_http_port < 0 else gateway_http_port
    grpc_port = None if gateway_grpc_port < 0 else gateway_grpc_port
    cache = env_cache_dir()
    spec = NodeSpec(host=node_host, token=ensure_token_file(d / TOKEN_FILE), cache_dir=str(cache) if cache else None,
                    tmp_root=tempfile.gettempdir())
    if address is not None:
        if address.startswith("127."):
            raycompat.use_loopback()
        ray.init(address=address, logging_level=logging.WARNING)
        h = attach(cfg, spec, gateway_host, gateway_port, model, http_port, grpc_port, joined=True, gateways=gateways)
        console.print(f"splitserve on Ray at {address}: gateway {h.urls()}")
        return
    local = LocalCluster(cfg, tempfile.mkdtemp(prefix="ssray-"), spec, gateway_port, tuple(model), http_port,
                         grpc_port, gateways)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    state = d / STATE_FILE
    try:
        h = local.start()
        state.write_text(json.dumps({"address": h.address, "gateway": h.urls(), "pid": os.getpid()}))
        console.print(f"cluster up: Ray at {h.address}, {nodes} nodes; gateway {h.urls()}; "
                      "Ctrl-C or `splitserve cluster down` stops it")
        stop.wait()
    finally:
        state.unlink(missing_ok=True)
        local.stop()


def _connect(address: Optional[str], data_dir: Optional[Path]) -> dict:
    state = _data_dir(data_dir) / STATE_FILE
    doc = json.loads(state.read_text()) if state.exists() else {}
    addr = address or doc.get("address")
    if addr is None:
        raise typer.BadParameter("no cluster here: give --address or run `splitserve cluster up` first")
    if addr.startswith("127."):
        raycompat.use_loopback()
    ray.init(address=addr, logging_level=logging.WARNING, log_to_driver=False)
    return doc


@cluster_app.command()
def status(
    address: Optional[str] = typer.Option(None, help="The Ray cluster (default: the local one `up` started)."),
    data_dir: Optional[Path] = typer.Option(None, help="Where `up` left its state (default: ./.splitserve)."),
    as_json: bool = typer.Option(False, "--json", help="The controller's whole status as JSON."),
) -> None:
    """Nodes (market, state, models, requests in flight), the gateway, and the cost so far."""
    _connect(address, data_dir)
    h = find()
    st = ray.get(h.controller.status.remote())
    if as_json:
        console.print_json(json.dumps(st))
        return
    t = Table("node", "market", "state", "models", "in flight", "endpoint")
    for n in st["nodes"]:
        t.add_row(n["node"][:12], n["market"], n["state"], ",".join(n["models"]), str(n["in_flight"]),
                  n["endpoint"] or "-")
    console.print(t)
    gw = st["gateway"]
    for urls in h.gateway_urls():
        console.print(f"gateway {urls}")
    console.print(f"target {st['target']} nodes; gateways hold {gw.get('held', 0)} requests, delivered "
                  f"{gw.get('delivered', 0)}, re-sent {gw.get('resent', 0)}; cost so far "
                  f"${st['cost']['dollars']:.4f} ({st['cost']['evictions']} evictions, {st['fallbacks']} fallbacks)")


@cluster_app.command()
def down(
    address: Optional[str] = typer.Option(None, help="The Ray cluster (default: the local one `up` started)."),
    data_dir: Optional[Path] = typer.Option(None, help="Where `up` left its state (default: ./.splitserve)."),
) -> None:
    """Stop the cluster (local: everything `up` started; --address: the splitserve actors and nodes)."""
    state = _data_dir(data_dir) / STATE_FILE
    if address is None and state.exists():
        os.kill(int(json.loads(state.read_text())["pid"]), signal.SIGTERM)
        console.print("asked the local cluster to stop")
        return
    _connect(address, data_dir)
    stop_actors(find())
    console.print("splitserve actors stopped")
