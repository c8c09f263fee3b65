"""A whole cluster on this machine, or the splitserve actors on an existing Ray cluster.

``LocalCluster`` is what ``splitserve cluster up`` and the tests run: a Ray head on
127.0.0.1 (no CPUs, so only the control actors land there; fast health checks), the
provider that starts serving raylets, the controller and the gateway. ``attach`` puts the
same actors on a Ray cluster someone else runs (``cluster up --address``), where the
provider asks Ray's autoscaler for nodes unless ``ClusterConfig.provider`` says ``local``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from splitserve.cluster.actors import raycompat
from splitserve.cluster.actors.controller import CONTROLLER_NAME, NAMESPACE, ControllerActor
from splitserve.cluster.actors.ingress import GATEWAY_NAME, GatewayActor, gateway_name
from splitserve.cluster.actors.node_server import NodeSpec
from splitserve.cluster.actors.provider import PROVIDER_NAME, provider_actor
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import InternalError

log = logging.getLogger(__name__)

_POLL_S = 0.2
GATEWAY_PORT_STRIDE = 10  # gateway i's ports: the first's plus this times i


@dataclass
class Handles:
    """The cluster's actors, as a driver holds them (``gateway``: the first gateway)."""

    address: str
    controller: Any
    gateway: Any
    provider: Any
    gateway_host: str
    gateway_port: int
    gateway_http_port: int | None  # None: the gateway serves no HTTP
    gateway_grpc_port: int | None  # None: the gateway serves no gRPC
    # the other gateways: each actor and its address (host, fast-path, HTTP and gRPC ports)
    more_gateways: list[tuple[Any, tuple[str, int, int | None, int | None]]] = field(default_factory=list)

    def addresses(self) -> list[tuple[str, int, int | None, int | None]]:
        """Every gateway's host, fast-path, HTTP and gRPC ports, the first gateway's first."""
        first = (self.gateway_host, self.gateway_port, self.gateway_http_port, self.gateway_grpc_port)
        return [first, *(address for _, address in self.more_gateways)]

    def gateways(self) -> list[Any]:
        """Every gateway's actor, the first gateway's first."""
        return [self.gateway, *(g for g, _ in self.more_gateways)]

    def fast_urls(self) -> list[str]:
        """Every gateway's fast-path URL: give a client all of them (it fails over)."""
        return [f"tcp://{host}:{port}" for host, port, _, _ in self.addresses()]

    def gateway_urls(self) -> list[str]:
        """Each gateway's client URLs, one string a gateway: the fast path over TCP, and HTTP
        and gRPC where it serves them."""
        return [", ".join([f"tcp://{host}:{port}"] + [f"{scheme}://{host}:{p}" for scheme, p in
                                                      (("http", http_port), ("grpc", grpc_port)) if p is not None])
                for host, port, http_port, grpc_port in self.addresses()]

    def urls(self) -> str:
        """Every gateway's client URLs."""
        return ", ".join(self.gateway_urls())


def attach(cfg: ClusterConfig, node_spec: NodeSpec, gateway_host: str, gateway_port: int,
           models: list[str], gateway_http_port: int | None = None, gateway_grpc_port: int | None = None,
           joined: bool = False, gateways: int = 1) -> Handles:
    """Create (or find) the provider, controller and ``gateways`` gateways on the cluster
    this driver is connected to, and start the controller's loop; ``joined``: a cluster
    someone else runs (``cfg.provider`` ``auto`` then means Ray's autoscaler). Gateway ``i``
    serves on each given port plus ``GATEWAY_PORT_STRIDE * i`` (0: any free port), so the
    default ports (8100, 8000, 8001) of one never meet another's."""
    address = raycompat.gcs_address()
    opts = dict(namespace=NAMESPACE, lifetime="detached", get_if_exists=True)
    provider = provider_actor(cfg, joined, address, name=PROVIDER_NAME, **opts)
    controller = ControllerActor.options(name=CONTROLLER_NAME, **opts).remote(cfg, node_spec, provider, models)
    ray.get(controller.start.remote())
    actors = []
    for i in range(gateways):
        ports = [p if not p else p + GATEWAY_PORT_STRIDE * i for p in (gateway_port, gateway_http_port, gateway_grpc_port)]
        actors.append(GatewayActor.options(name=gateway_name(i), **opts).remote(
            cfg, gateway_host, ports[0], controller, ports[1], ports[2], token=node_spec.token, name=gateway_name(i)))
    return _handles(address, controller, actors, provider)


def _handles(address: str, controller: Any, gateways: list[Any], provider: Any) -> Handles:
    addresses = ray.get([g.address.remote() for g in gateways])
    return Handles(address, controller, gateways[0], provider, *addresses[0],
                   more_gateways=list(zip(gateways[1:], addresses[1:])))


def find() -> Handles:
    """The actors of the cluster this driver is connected to (``cluster status``/``down``)."""
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        gateways = [ray.get_actor(GATEWAY_NAME, namespace=NAMESPACE)]
        provider = ray.get_actor(PROVIDER_NAME, namespace=NAMESPACE)
    except ValueError as e:
        raise InternalError(f"no splitserve cluster on this Ray cluster: {e}") from None
    while True:  # the others, named in turn
        try:
            gateways.append(ray.get_actor(gateway_name(len(gateways)), namespace=NAMESPACE))
        except ValueError:
            break
    return _handles(raycompat.gcs_address(), controller, gateways, provider)


def wait_serving(controller: Any, count: int, timeout_s: float, gateways: Sequence[Any] = ()) -> dict:
    """Block until ``count`` nodes are ACTIVE and every one of ``gateways`` routes each active
    node's models there (the routes reach a gateway on its next poll: until then a call it
    takes is refused as not ready); returns the controller's status."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = ray.get(controller.status.remote())
        active = {n["node"]: set(n["models"]) for n in status["nodes"] if n["state"] == "active"}
        routed = ray.get([g.stats.remote() for g in gateways])
        if len(active) >= count and all(_routes_to(stats, active) for stats in routed):
            return status
        if time.monotonic() > deadline:
            raise InternalError(f"{count} nodes were not serving through every gateway within {timeout_s} s: "
                                f"{status['nodes']}")
        time.sleep(_POLL_S)


def _routes_to(gateway_stats: dict, active: dict[str, set[str]]) -> bool:
    """The gateway sends each active node's models there (``active``: node -> its models)."""
    routed = gateway_stats["models"]
    return all(models <= set(routed.get(node, ())) for node, models in active.items())


def stop_actors(h: Handles) -> None:
    """Retire every node, then stop the gateway and the provider's nodes (or requests)."""
    ray.get(h.controller.stop_all.remote())
    gateways = h.gateways()
    ray.get([g.stop.remote() for g in gateways])
    ray.get(h.provider.shutdown.remote())
    for actor in (*gateways, h.controller, h.provider):
        ray.kill(actor, no_restart=True)


class LocalCluster:
    """A Ray head on 127.0.0.1 plus the splitserve actors; ``stop`` tears all of it down."""

    def __init__(self, cfg: ClusterConfig, temp_dir: str, node_spec: NodeSpec, gateway_port: int = 0,
                 models: tuple[str, ...] = ("lenet",), gateway_http_port: int | None = None,
                 gateway_grpc_port: int | None = 0, gateways: int = 1) -> None:
        self.cfg = cfg
        self.gateways = gateways
        self.temp_dir = temp_dir
        self.node_spec = node_spec
        self.gateway_port = gateway_port
        self.gateway_http_port = gateway_http_port
        # on by default (a free port), so the tests' cluster serves gRPC without asking
        self.gateway_grpc_port = gateway_grpc_port
        self.models = list(models)
        self.head: Any = None
        self.handles: Handles | None = None

    def start(self, timeout_s: float = 120.0) -> Handles:
        """Start the head, the actors, and ``cfg.min_nodes`` serving nodes (waits for them)."""
        raycompat.use_loopback()
        self.head = raycompat.start_head(self.temp_dir, raycompat.FAST_HEALTH_CHECKS)
        ray.init(address=self.head.address, logging_level=logging.WARNING, log_to_driver=False)
        self.handles = attach(self.cfg, self.node_spec, "127.0.0.1", self.gateway_port, self.models,
                              self.gateway_http_port, self.gateway_grpc_port, gateways=self.gateways)
        wait_serving(self.handles.controller, self.cfg.min_nodes, timeout_s, self.handles.gateways())
        return self.handles

    def stop(self) -> None:
        """Every actor, raylet and head process this cluster started; nothing else."""
        try:
            if self.handles is not None:
                stop_actors(self.handles)
        finally:
            ray.shutdown()
            if self.head is not None:
                self.head.shutdown()
