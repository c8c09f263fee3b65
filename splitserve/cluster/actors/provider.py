"""Where serving nodes come from: the ``NodeProvider`` seam and its local implementation.

The controller asks a provider for a node in a market and gets its Ray node id back; it
retires nodes through it too. ``LocalRayletProvider`` starts raylets on 127.0.0.1 that join
the cluster (development, tests, ``splitserve cluster up``): each has one
``splitserve_node`` resource and the market label, and ``evict`` makes one vanish the way a
reclaimed VM does (docs/cluster.md §3.3). It runs inside a Ray actor on the head
(``ProviderActor``) so that the raylets it starts outlive any driver. ``AutoscalerProvider``
serves on a Ray cluster someone else runs: the machines that joined it with one
``splitserve_node`` resource, and those Ray's own autoscaler adds where its node types per
market have one (and a ``splitserve.io/market`` label): a fleet of machines, a real cloud
cluster, or KubeRay. ``provider_actor`` builds the one a ``ClusterConfig`` names.

The seam lives here rather than in ``server/ports.py``: that module holds the seams of one
node, and a provider is a cluster-level part that no node module calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import ray

from splitserve.cluster.actors import raycompat
from splitserve.cluster.pools import Market, NodeProviderKind
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import NotFound, Refused, ResourcesUnavailable
from splitserve.types import Choice

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


_POLL_S = 0.25  # how often a launch or a terminate looks at Ray's node table


class LaunchStep(Choice, what="launch step"):
    """What a launch for a market does first (``launch_step``)."""

    CLAIM = "claim"  # a joined node of that market nobody uses: take it now
    ASK = "ask"  # ask Ray's autoscaler for one, then wait for it to join
    WAIT = "wait"  # wait for a machine to join by hand
    REFUSE = "refuse"  # none can come: fail now, so procurement moves on without waiting


def market_of(labels: Mapping[str, str]) -> Market | None:
    """A joined node's market: its ``splitserve.io/market`` label, on-demand where it has
    none (a machine someone runs is kept until they stop it), None where the label names no
    market (the node is not used)."""
    value = labels.get(raycompat.MARKET_LABEL)
    if value is None:
        return Market.ON_DEMAND
    return Market(value) if value in set(Market) else None


def launch_step(market: Market, unclaimed: Collection[Market], autoscaled: bool) -> LaunchStep:
    """The first step of a launch for ``market``, given the markets of the joined nodes no
    launch has claimed and whether Ray's autoscaler can add a node: a joined node is used at
    once; without an autoscaler, a spot node that is not there cannot come (a machine joins
    unlabelled, as on-demand, unless its owner labels it), so no order waits for one."""
    if market in unclaimed:
        return LaunchStep.CLAIM
    if autoscaled:
        return LaunchStep.ASK
    return LaunchStep.REFUSE if market is Market.SPOT else LaunchStep.WAIT


class AutoscalerProvider:
    """The nodes of a Ray cluster someone else runs: machines that joined with a
    ``splitserve_node`` resource (``ray start --resources``), and those Ray's autoscaler adds
    (v2: v1 ignores the label selectors that name a market).

    ``launch(market)`` claims a joined node of that market (``market_of`` its labels) that no
    launch has claimed yet, at once where one is there (``launch_step``). Else, where Ray's
    autoscaler can add nodes with a ``splitserve_node``, it raises this provider's wanted
    total for the market by one and asks the autoscaler for all of it
    (``request_resources`` replaces the previous request), then waits for such a node; with
    no autoscaler, an on-demand launch waits for a machine to join and a spot launch fails at
    once. One that gets no node within ``launch_timeout_s`` is withdrawn and raises
    ``ResourcesUnavailable``, which the controller reports to procurement as a failed
    request (protean then asks for on-demand). ``terminate`` lowers the total and drains a
    node the autoscaler made as idle through the GCS, so the raylet exits and the autoscaler
    removes its instance at once instead of after its idle timeout; a node its owner joined
    is only released (its machine stays in the Ray cluster, for the next launch).

    ``evict`` is refused: a cloud takes a node back by itself, not at splitserve's request.
    That arrives as Ray's PREEMPTION drain (a spot notice; Ray's own SIGTERM handling of
    ``ray start --block`` sends one), which the controller already reads from the GCS, or
    as the node's death, which it sees in Ray's node table. Nothing here holds the node's
    processes (the autoscaler's instances run elsewhere, or inside Ray's monitor for the
    fake provider), so there is nothing safe to kill; the emulated notice
    (``raycompat.drain_node``) is the way to test an eviction on this provider.

    Calls run concurrently (a threaded actor): a launch waiting for its node must not hold
    up another market's launch or a terminate.
    """

    def __init__(self, address: str, launch_timeout_s: float, terminate_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not raycompat.autoscaler_adds_nodes():
            log.info("Ray's autoscaler adds no nodes with a %s here (autoscaler v1, which ignores market labels, "
                     "or no node type with one): serving on the machines that join with it", raycompat.NODE_RESOURCE)
        self.address = address
        self.launch_timeout_s = launch_timeout_s
        self.terminate_timeout_s = terminate_timeout_s
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._wanted: Counter[str] = Counter()  # per market: nodes asked of the autoscaler, claimed or awaited
        self._claimed: dict[str, Market] = {}  # node id -> market, the nodes launches returned
        self._found: set[str] = set()  # claimed as they were, not asked for: released, never drained

    def launch(self, market: str) -> str:
        m = Market.parse(market)
        with self._lock:
            self._forget_dead()
            found = self._unclaimed(m)
            step = launch_step(m, {m} if found else set(), raycompat.autoscaler_adds_nodes())
            if found is not None and step is LaunchStep.CLAIM:
                return self._claim(found, m, asked=False)
            if step is LaunchStep.REFUSE:
                raise ResourcesUnavailable(f"no {m} node can come: none joined unclaimed, and Ray's autoscaler adds no "
                                           f"nodes with a {raycompat.NODE_RESOURCE} here")
            if step is LaunchStep.ASK:
                self._wanted[m] += 1
                self._ask()
        deadline = self.clock() + self.launch_timeout_s
        while True:
            with self._lock:
                node_id = self._unclaimed(m)
                if node_id is not None:
                    return self._claim(node_id, m, asked=step is LaunchStep.ASK)
                if self.clock() > deadline:
                    if step is LaunchStep.ASK:
                        self._wanted[m] -= 1
                        self._ask()
                    raise ResourcesUnavailable(f"no {m} node joined within {self.launch_timeout_s:g} s (no capacity, "
                                               "no node type with that market label, or no machine joined)")
            self.sleep(_POLL_S)

    def _claim(self, node_id: str, m: Market, asked: bool) -> str:
        """``node_id`` is this provider's; one it did not ask the autoscaler for is only released later."""
        self._claimed[node_id] = m
        if not asked:
            self._found.add(node_id)
        log.info("took a %s node%s: %s", m, " from Ray's autoscaler" if asked else "", node_id[:12])
        return node_id

    def terminate(self, node_id: str) -> None:
        with self._lock:
            m = self._claimed.pop(node_id, None)
            if m is None:
                raise NotFound(f"node {node_id} was not launched by this provider or is gone")
            if node_id in self._found:
                self._found.discard(node_id)
                log.info("released node %s: its machine stays in the Ray cluster", node_id[:12])
                return
            self._wanted[m] -= 1
            self._ask()
        deadline = self.clock() + self.terminate_timeout_s
        accepted, why = False, ""
        while self._alive(node_id):
            if not accepted:
                # refused while the node server's last processes exit: ask again
                accepted, why = raycompat.drain_idle(self.address, node_id, "splitserve: node retired")
            if self.clock() > deadline:
                # no longer requested, so Ray's autoscaler still removes it after its idle timeout
                log.warning("node %s did not leave within %g s (%s); Ray's idle timeout will remove it", node_id[:12],
                            self.terminate_timeout_s, why or "drained, still listed")
                return
            self.sleep(_POLL_S)
        log.info("node %s left the cluster", node_id[:12])

    def evict(self, node_id: str) -> None:
        raise Refused("Ray's autoscaler has no eviction at splitserve's request: a cloud takes nodes back by itself "
                      "(Ray's PREEMPTION drain or the node's death); emulate a notice with a drain instead")

    def markets(self) -> dict[str, str]:
        with self._lock:
            return {n: str(m) for n, m in self._claimed.items()}

    def shutdown(self) -> None:
        """Withdraw every request (``cluster down``: the controller has retired the nodes)."""
        with self._lock:
            self._wanted.clear()
            self._claimed.clear()
            self._found.clear()
            self._ask()

    def _ask(self) -> None:
        raycompat.request_nodes({str(m): n for m, n in self._wanted.items() if n > 0})

    def _unclaimed(self, m: Market) -> str | None:
        """A live node of market ``m`` with a ``splitserve_node`` that no launch has claimed."""
        for n in raycompat.nodes():
            if (n.alive and n.node_id not in self._claimed and n.resources.get(raycompat.NODE_RESOURCE, 0) >= 1
                    and market_of(n.labels) is m):
                return n.node_id
        return None

    def _alive(self, node_id: str) -> bool:
        return any(n.node_id == node_id and n.alive for n in raycompat.nodes())

    def _forget_dead(self) -> None:
        """Nodes that died (evicted, lost) are no longer wanted: the controller orders their
        replacements itself, so asking for them again would buy one node twice."""
        alive = {n.node_id for n in raycompat.nodes() if n.alive}
        for node_id in [n for n in self._claimed if n not in alive]:
            m = self._claimed.pop(node_id)
            if node_id in self._found:
                self._found.discard(node_id)
            else:
                self._wanted[m] -= 1


PROVIDER_NAME = "splitserve-provider"

# On the head (its ``splitserve_head`` resource), never restarted: its raylets die with it.
ProviderActor = ray.remote(num_cpus=0, resources={"splitserve_head": 0.01}, max_restarts=0)(
    raycompat.at_node_niceness(LocalRayletProvider))
# Threaded: launches wait for nodes for up to launch_timeout_s each, side by side.
AutoscalerProviderActor = ray.remote(num_cpus=0, resources={"splitserve_head": 0.01}, max_restarts=0,
                                     max_concurrency=32)(raycompat.at_node_niceness(AutoscalerProvider))


def provider_actor(cfg: ClusterConfig, joined: bool, address: str, **options: Any) -> Any:
    """Create (or find, with ``get_if_exists``) the provider actor ``cfg.provider`` names on
    the cluster at ``address``; ``joined``: a cluster someone else runs (``cluster up
    --address``), where ``auto`` means Ray's autoscaler."""
    if cfg.provider.resolve(joined) is NodeProviderKind.AUTOSCALER:
        return AutoscalerProviderActor.options(**options).remote(address, cfg.launch_timeout_s,
                                                                 cfg.terminate_timeout_s)
    return ProviderActor.options(**options).remote(address)
