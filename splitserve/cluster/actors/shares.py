"""The models each node holds, for the controller: ``ModelPlacement``'s plan over its nodes
(demand from the gateway's stats, room from the node settings), and moving a node to its
share of it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import ray

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.node_settings import resident_room
from splitserve.cluster.policy.placement import ModelPlacement, NodeRoom
from splitserve.errors import SplitServeError

log = logging.getLogger(__name__)


class ModelShares:
    """The plan: which models each node with a server should hold now. ``view`` gives
    placement's inputs when asked: the clock's time, the controller's nodes (each with
    ``node_id``, ``endpoint``, ``unreachable``, ``deadline``, ``retiring``, the ``models`` it
    holds and those ``coming``, being loaded there), the
    registry's model names and the gateway's stats (its ``held_by_model``)."""

    def __init__(self, cfg: ClusterConfig, node_env: Mapping[str, str],
                 view: Callable[[], tuple[float, Iterable[Any], Iterable[str], Mapping[str, Any]]]) -> None:
        self.placement = ModelPlacement(cfg.requests_per_node, cfg.model_min_nodes, cfg.keep_alive_s)
        self.room = resident_room(node_env)
        self.view = view

    def configure(self, cfg: ClusterConfig) -> None:
        """Take ``cfg``'s placement settings at run time; the counts placement keeps (and their
        keep-alive) carry on, so a change does not unload what demand asked for a moment ago."""
        self.placement.requests_per_node = cfg.requests_per_node
        self.placement.min_nodes = cfg.model_min_nodes
        self.placement.keep_alive_s = cfg.keep_alive_s

    def plan(self) -> dict[str, frozenset[str]]:
        """Node -> its share, for the nodes with a server the head reaches and no end coming (a
        doomed or retiring node holds what it has until it goes: its models get copies
        elsewhere; an unreachable one is given none until it answers)."""
        now, nodes, models, gateway_stats = self.view()
        takers = [NodeRoom(n.node_id, n.models | n.coming, self.room) for n in nodes
                  if n.endpoint is not None and n.unreachable is None and n.deadline is None and not n.retiring]
        held = {str(m): int(c) for m, c in gateway_stats.get("held_by_model", {}).items()}
        return self.placement.plan(now, held, sorted(models), takers)

    def of(self, n: Any) -> frozenset[str]:
        """Node ``n``'s share (none for a node outside the plan)."""
        return self.plan().get(n.node_id, frozenset())


async def drop_extra(n: Any, share: frozenset[str], publish: Callable[[], None]) -> None:
    """Unload from node ``n`` the models it holds beyond ``share``: out of the routes first,
    so the gateway sends them there no more (what it had sent is answered, or re-sent as
    not run), then unloaded there, under the node's ``giving`` lock."""
    async with n.giving:
        extra = n.models - share
        if not extra:
            return
        n.models = n.models - extra
        publish()
        await n.server.unload_models.remote(sorted(extra))


async def reshare(n: Any, give: Callable[[Any], Awaitable[None]], share: Callable[[Any], frozenset[str]],
                  publish: Callable[[], None]) -> None:
    """Move node ``n`` to its share: load what it lacks (``give``) and route it, then unload
    what it holds beyond. A node that fails is logged; the next round tries again."""
    try:
        await give(n)
        publish()
        await drop_extra(n, share(n), publish)
    except (ray.exceptions.RayError, SplitServeError) as e:
        log.warning("node %s: its models were not moved to its share: %s", n.node_id[:12], e)
