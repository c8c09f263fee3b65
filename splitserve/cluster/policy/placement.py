"""Which nodes hold which model, by demand (docs/cluster.md, "Models placed by demand").

A model is loaded on as many nodes as its demand asks: its requests the gateway holds (queued
or running on a node, or waiting for one) over ``requests_per_node``, the load one node
should carry (the cluster autoscaler's own measure), never below ``min_nodes`` (a node lost
leaves it served while another loads it) nor above the nodes there are. A node holds at most
its ``room`` models at once (its ``max_resident_models``): where room is short, every model
gets one node before any gets a second, the busiest first. A count that falls stays up
``keep_alive_s`` (the cluster's keep-alive), so a lull does not unload what the next burst
loads again.

Pure: demand, the models and the nodes (with what each holds now) come in, with the clock; a
plan (node -> the models it should hold) goes out. Stable: a model stays on the nodes that
hold it, new copies go to the nodes holding the fewest, ties in the order the nodes come, so
an unchanged input moves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.errors import InvalidInput


@dataclass(frozen=True)
class NodeRoom:
    """One node as placement sees it."""

    node: str
    holds: frozenset[str] = frozenset()  # the models loaded there now
    room: int | None = None  # models it may hold at once (None: no limit)


class ModelPlacement:
    """The plan, and each model's count over time (the keep-alive)."""

    def __init__(self, requests_per_node: int, min_nodes: int, keep_alive_s: float) -> None:
        if requests_per_node < 1 or min_nodes < 1 or keep_alive_s < 0:
            raise InvalidInput("requests_per_node and min_nodes must be at least 1 and keep_alive_s at least 0, got "
                               f"{requests_per_node}, {min_nodes}, {keep_alive_s}")
        self.requests_per_node = requests_per_node
        self.min_nodes = min_nodes
        self.keep_alive_s = keep_alive_s
        self._counts: dict[str, tuple[int, float]] = {}  # model -> (count, when demand last asked for it)

    def counts(self) -> dict[str, tuple[int, float]]:
        """Each model's count and when demand last asked for it: what a controller saves, so
        that the keep-alive outlives a restart (``restore``)."""
        return dict(self._counts)

    def restore(self, counts: Mapping[str, Sequence[float]]) -> None:
        """Take back ``counts`` as ``counts()`` gave them (from a store: lists, not tuples)."""
        self._counts = {m: (int(count), float(since)) for m, (count, since) in counts.items()}

    def count(self, now: float, model: str, held: int) -> int:
        """Nodes ``model`` should be on with ``held`` of its requests outstanding (before the
        nodes there are cap it)."""
        asked = max(self.min_nodes, math.ceil(held / self.requests_per_node))
        count, since = self._counts.get(model, (0, now))
        if asked >= count or now - since >= self.keep_alive_s:
            self._counts[model] = (asked, now)
            return asked
        return count

    def plan(self, now: float, held: Mapping[str, int], models: Sequence[str],
             nodes: Sequence[NodeRoom]) -> dict[str, frozenset[str]]:
        """The models each of ``nodes`` should hold, for every model in ``models`` (the
        registry) with ``held`` of its requests outstanding (absent: none)."""
        for gone in self._counts.keys() - set(models):
            del self._counts[gone]
        wanted = {m: min(len(nodes), self.count(now, m, held.get(m, 0))) for m in models}
        busiest = sorted(models, key=lambda m: (-held.get(m, 0), m))
        out: dict[str, set[str]] = {n.node: set() for n in nodes}
        order = {n.node: i for i, n in enumerate(nodes)}
        for first_pass in (True, False):  # one node for every model before a second for any
            for model in busiest:
                goal = 1 if first_pass else wanted[model]
                have = sum(model in s for s in out.values())
                free = [n for n in nodes if model not in out[n.node]
                        and (n.room is None or len(out[n.node]) < n.room)]
                free.sort(key=lambda n: (model not in n.holds, len(out[n.node]), order[n.node]))
                for n in free[:max(0, goal - have)]:
                    out[n.node].add(model)
        return {node: frozenset(s) for node, s in out.items()}
