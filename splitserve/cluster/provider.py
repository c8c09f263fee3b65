"""Where serving nodes come from: the ``NodeProvider`` seam and its local implementation.

The controller asks a provider for a node in a market and gets its Ray node id back; it
retires nodes through it too. ``LocalRayletProvider`` starts raylets on 127.0.0.1 that join
the cluster (development, tests, ``splitserve cluster up``): each has one
``splitserve_node`` resource and the market label, and ``evict`` makes one vanish the way a
reclaimed VM does (docs/cluster.md §3.3). It runs inside a Ray actor on the head
(``ProviderActor``) so that the raylets it starts outlive any driver; a cloud provider
(Ray's autoscaler through ``request_resources`` with node types per market) is the other
implementation this seam is for, not built yet.

The seam lives here rather than in ``server/ports.py``: that module holds the seams of one
node, and a provider is a cluster-level part that no node module calls.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import ray

from splitserve.cluster import raycompat
from splitserve.cluster.pools import Market
from splitserve.errors import NotFound

log = logging.getLogger(__name__)


class NodeProvider(Protocol):
    """Called by the controller's reconciliation loop (through a Ray actor handle)."""

    def launch(self, market: str) -> str:
        """Start a node in ``market``; returns its Ray node id (hex) once it joined."""

    def terminate(self, node_id: str) -> None:
        """Stop a node the cluster is done with (after its node server drained)."""

    def evict(self, node_id: str) -> None:
        """The provider takes the node back at once (spot eviction, a lost VM)."""

    def markets(self) -> dict[str, str]:
        """Every node this provider started and still runs: node id -> market."""


class LocalRayletProvider:
    """Raylets on this machine, children of this process (the actor's)."""

    def __init__(self, address: str, cpus_per_node: int = 1) -> None:
        self.address = address
        self.cpus_per_node = cpus_per_node
        self._nodes: dict[str, tuple[Any, Market]] = {}

    def launch(self, market: str) -> str:
        m = Market.parse(market)
        node = raycompat.start_worker_node(self.address, self.cpus_per_node, {raycompat.MARKET_LABEL: str(m)})
        node_id = raycompat.node_id_of(node)
        self._nodes[node_id] = (node, m)
        log.info("started a %s raylet: node %s", m, node_id[:12])
        return node_id

    def terminate(self, node_id: str) -> None:
        node, _ = self._take(node_id)
        raycompat.stop_worker_node(node, graceful=True)
        log.info("stopped node %s", node_id[:12])

    def evict(self, node_id: str) -> None:
        node, _ = self._take(node_id)
        raycompat.kill_node_tree(node)
        log.info("evicted node %s (SIGKILL of its process tree)", node_id[:12])

    def markets(self) -> dict[str, str]:
        return {n: str(m) for n, (_, m) in self._nodes.items()}

    def shutdown(self) -> None:
        """Stop every node this provider started."""
        for node_id in list(self._nodes):
            self.terminate(node_id)

    def _take(self, node_id: str) -> tuple[Any, Market]:
        try:
            return self._nodes.pop(node_id)
        except KeyError:
            raise NotFound(f"node {node_id} was not started by this provider or is gone") from None


PROVIDER_NAME = "splitserve-provider"

# On the head (its ``splitserve_head`` resource), never restarted: its raylets die with it.
ProviderActor = ray.remote(num_cpus=0, resources={"splitserve_head": 0.01}, max_restarts=0)(LocalRayletProvider)
