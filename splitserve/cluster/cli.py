"""``splitserve cluster up|status|down`` (needs the ``cluster`` extra: Ray).

``up`` without ``--address`` runs a whole cluster on this machine (a Ray head on 127.0.0.1
and ``--nodes`` serving raylets) in the foreground until Ctrl-C or ``cluster down``; with
``--address`` it puts the splitserve actors on an existing Ray cluster and returns, and
nodes come from that cluster: the machines that joined it with a ``splitserve_node``, and its
autoscaler's (``--provider``; docs/cluster.md, "Run on N machines"); a head with token
authentication is joined with the token Ray finds (``raycompat.join``). The
gateway serves the fast path on ``--gateway-port``, HTTP (Open Inference Protocol v2) on
``--gateway-http-port`` and gRPC (the same protocol's GRPCInferenceService) on
``--gateway-grpc-port``: clients use the same URLs and clients as for one node. The
management token is ``DATA_DIR/token``, given to every node.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

import ray
import typer
from rich.console import Console
from rich.table import Table

from splitserve.cluster.actors import raycompat
from splitserve.cluster.actors.local import LocalCluster, attach, find, stop_actors
from splitserve.cli.serve import serve
from splitserve.cluster.actors.node_server import NodeSpec
from splitserve.cluster.node_settings import node_env, read_node_config
from splitserve.cluster.pools import NodeProviderKind
from splitserve.cluster.config import ClusterConfig
from splitserve.config import default_data_dir, env_cache_dir
from splitserve.errors import InvalidInput
from splitserve.placement.partition import Partitioning
from splitserve.scheduler.priority import PriorityMode
from splitserve.server.management import TOKEN_FILE, ensure_token_file

cluster_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Many nodes behind one or more gateways, on Ray (needs the cluster extra).")
console = Console()
STATE_FILE = "cluster.json"


NODE_PANEL = "Node settings (every node, as `serve` takes them)"


def _serve_option(name: str) -> Any:
    """``serve``'s own option ``name`` (its flag and help), in the node settings' panel."""
    option = copy.copy(inspect.signature(serve).parameters[name].default)
    option.rich_help_panel = NODE_PANEL
    return option


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
    node_host: Optional[str] = typer.Option(None, help="Address every node server binds (default: each node's "
                                                       "Ray address; a node's splitserve.io/bind-address label wins)."),
    node_advertise: Optional[str] = typer.Option(None, help="Address every node server advertises to the gateway "
                                                            "(default: each node's Ray address; a node's "
                                                            "splitserve.io/advertise-address label wins)."),
    data_dir: Optional[Path] = typer.Option(None, help="Token and cluster state (default: ./.splitserve)."),
    model: list[str] = typer.Option(["lenet"], help="Built-in models the cluster serves from the start."),
    provider: Optional[NodeProviderKind] = typer.Option(
        None, help="Where nodes come from: local (raylets on the head's machine) or autoscaler (the Ray cluster's: "
                   "machines that joined with a splitserve_node, market from their splitserve.io/market label, else "
                   "on-demand; and Ray's autoscaler v2's, node types per market); auto, the default "
                   "(SPLITSERVE_CLUSTER_PROVIDER): autoscaler with --address, else local."),
    node_config: Optional[Path] = typer.Option(
        None, help="A TOML file of `serve` settings every node runs with (by name, at the top or under their "
                   "section's table); the node flags below override it.", rich_help_panel=NODE_PANEL),
    memory_budget: Optional[str] = _serve_option("memory_budget"),
    max_resident_models: Optional[int] = _serve_option("max_resident_models"),
    partitioning: Optional[Partitioning] = _serve_option("partitioning"),
    preemption: Optional[PriorityMode] = _serve_option("preemption"),
    fast_direct: Optional[bool] = _serve_option("fast_direct"),
) -> None:
    """Start a cluster (local: head + NODES raylets on 127.0.0.1) and its gateway."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    flags = dict(memory_budget_bytes=memory_budget, max_resident_models=max_resident_models,
                 partitioning=partitioning, preemption=preemption, fast_direct=fast_direct)
    try:
        env = node_env({**(read_node_config(node_config) if node_config else {}),
                        **{k: v for k, v in flags.items() if v is not None}})
    except InvalidInput as e:
        raise typer.BadParameter(str(e)) from None
    d = _data_dir(data_dir)
    chosen = {} if provider is None else {"provider": provider}
    cfg = ClusterConfig.from_env(min_nodes=nodes, max_nodes=max(nodes, ClusterConfig.from_env().max_nodes), **chosen)
    if address is None and cfg.provider is NodeProviderKind.AUTOSCALER:
        raise typer.BadParameter("--provider autoscaler needs --address: the local cluster has no autoscaler")
    http_port = None if gateway_http_port < 0 else gateway_http_port
    grpc_port = None if gateway_grpc_port < 0 else gateway_grpc_port
    cache = env_cache_dir()
    spec = NodeSpec(host=node_host, advertise=node_advertise, token=ensure_token_file(d / TOKEN_FILE),
                    cache_dir=str(cache) if cache else None, tmp_root=tempfile.gettempdir(), env=env)
    if address is not None:
        _join(address, logging_level=logging.WARNING)
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
    _join(addr, logging_level=logging.WARNING, log_to_driver=False)
    return doc


def _join(address: str, **init_options: object) -> None:
    """Connect to the Ray cluster at ``address`` (its token found as Ray keeps it), or say why not."""
    try:
        raycompat.join(address, **init_options)
    except ConnectionError as e:
        console.print(f"[red]cannot join the Ray cluster at {address}:[/] {e}", highlight=False)
        raise typer.Exit(1) from None


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
        state = f"{n['state']}: {n['reason']}" if n.get("reason") else n["state"]
        t.add_row(n["node"][:12], n["market"], state, ",".join(n["models"]), str(n["in_flight"]),
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
