"""Which node serves a request (docs/cluster.md §2.5); which nodes hold which model is
``placement.py``'s.

Pure: the routing table and the in-flight counts come in, a node id goes out; the only
randomness is the ``random.Random`` passed in (power of two choices), so a seed fixes
every choice. The gateway calls ``Dispatcher.choose`` per request and on every re-send.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from splitserve.cluster.pools import Market
from splitserve.errors import InvalidInput, ModelNotReady, QueueFull
from splitserve.protocol.header import RequestClass
from splitserve.types import Choice


class NodeState(Choice, what="node state"):
    """A node's place in the routing table (the controller's state machine per node)."""

    STARTING = "starting"  # requested, booting or loading its models: no work yet
    ACTIVE = "active"  # takes new work
    DRAINING = "draining"  # an eviction notice or a scale-in: finishes what it has, takes nothing new
    DEAD = "dead"  # gone; what it held was sent elsewhere


@dataclass(frozen=True)
class NodeView:
    """One node as dispatch sees it. ``capacity`` weighs its load (1.0: a standard node; the
    controller corrects it from the node's measured queue wait); ``models`` are warm there."""

    node: str
    market: Market
    state: NodeState = NodeState.ACTIVE
    models: frozenset[str] = field(default_factory=frozenset)
    capacity: float = 1.0

    def __post_init__(self) -> None:
        if not self.capacity > 0:
            raise InvalidInput(f"node {self.node!r}: capacity must be positive, got {self.capacity}")


# The market each class tries first: strict work on nodes that cannot be revoked under it,
# best-effort work on the cheap ones, so on-demand room stays free for strict work. Only
# while a node there is not busy (``prefer_below``): a preference held up to the window
# queues all strict work on the few on-demand nodes a fallback bought while spot nodes idle.
# Not much lower either: strict work spilled in ones and twos makes small strict batches on
# spot nodes that run ahead of their best-effort queues (bench cluster-spot: 8 lost capacity
# and refused work while a node was short; 16, two full batches, did not).
PREFERRED = {RequestClass.RT: Market.ON_DEMAND, RequestClass.BE: Market.SPOT}


class Dispatcher:
    """Per request: among ACTIVE nodes with the model warm and room in their window, the
    class's preferred market first while one of its nodes has fewer than ``prefer_below``
    requests in flight per unit of capacity, then the lowest ``in_flight / capacity``; with more than
    ``two_choices_above`` such nodes in that market, the less loaded of two drawn at random
    (fewer herds onto the node that looked idlest when counts are stale)."""

    def __init__(self, window: int, two_choices_above: int, rng: random.Random, prefer_below: int) -> None:
        if window < 1 or two_choices_above < 1 or prefer_below < 1:
            raise InvalidInput("window, two_choices_above and prefer_below must be at least 1, got "
                               f"{window}, {two_choices_above}, {prefer_below}")
        self.window = window
        self.two_choices_above = two_choices_above
        self.prefer_below = prefer_below
        self._rng = rng

    def choose(self, model: str, cls: RequestClass, nodes: Sequence[NodeView], in_flight: Mapping[str, int],
               exclude: Collection[str] = ()) -> str:
        """The node for one request of ``model`` in class ``cls`` (DEFAULT counts as BE).

        Raises ``ModelNotReady`` when no ACTIVE node has the model warm (the caller waits for
        placement or refuses), ``QueueFull`` when every such node's window is full.
        ``exclude`` names nodes this request must not go to again (one that refused it)."""
        warm = [n for n in nodes if n.state is NodeState.ACTIVE and model in n.models and n.node not in exclude]
        if not warm:
            raise ModelNotReady(f"no active node has model {model!r} warm")
        open_ = [n for n in warm if in_flight.get(n.node, 0) < self.window]
        if not open_:
            raise QueueFull(f"model {model!r}: all {len(warm)} nodes that hold it have {self.window} requests "
                            "in flight")
        preferred = PREFERRED.get(cls, Market.SPOT)
        group = [n for n in open_ if n.market is preferred
                 and in_flight.get(n.node, 0) / n.capacity < self.prefer_below] or open_
        if len(group) > self.two_choices_above:
            group = self._rng.sample(group, 2)
        return min(group, key=lambda n: (in_flight.get(n.node, 0) / n.capacity, n.node)).node

