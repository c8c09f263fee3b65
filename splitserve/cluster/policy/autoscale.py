"""How many serving nodes the cluster should have (PROTEAN §4.2 at cluster level).

Two signals: the requests the gateway holds unanswered (queued on nodes or running), which
should come to at most ``requests_per_node`` per node, and strict SLO compliance since the
last decision, which below ``slo_target`` asks for one node more than are serving while work
is outstanding (once at a time: not while a node is still starting, so one slow start does
not buy a node per tick; and not for misses of work already answered, which a new node
cannot help). The controller (from the gateway's counts) and the simulator (from its own)
both turn cumulative strict outcomes into the window's with ``SloWindow``.
More nodes are asked for at once; fewer only after ``keep_alive_s`` of continuous surplus,
by the same keep-alive rule as the node's own instance autoscaler (``protean.instance_autoscale``).

Pure: the caller passes the clock and the counts; which market a node is bought in is
``procurement``'s business, which node goes on scale-in the controller's (the dearest
first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.protean.instance_autoscale import KeepAlive

_KEY = "nodes"


@dataclass(frozen=True)
class ClusterLoad:
    """What the autoscaler sees at one decision."""

    outstanding: int  # requests accepted and not yet answered
    serving: int  # nodes ACTIVE (draining ones are leaving and do not count)
    starting: int  # nodes requested and not yet serving
    strict_met: int = 0  # strict requests answered within their SLO since the last decision
    strict_total: int = 0  # strict requests answered (or refused) since the last decision


class ClusterAutoscaler:
    """The node count to aim for, one ``tick`` per ``autoscale_interval_s``."""

    def __init__(self, min_nodes: int, max_nodes: int, requests_per_node: int, slo_target: float,
                 keep_alive_s: float) -> None:
        if not 1 <= min_nodes <= max_nodes or requests_per_node < 1 or not 0 < slo_target <= 1:
            raise InvalidInput(f"need 1 <= min_nodes <= max_nodes, requests_per_node >= 1 and slo_target in "
                               f"(0, 1]; got {min_nodes}, {max_nodes}, {requests_per_node}, {slo_target}")
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.requests_per_node = requests_per_node
        self.slo_target = slo_target
        self.keep_alive = KeepAlive(keep_alive_s)
        self.slo_scale_ups = 0  # decisions that added a node for compliance, not for queue depth

    def tick(self, now: float, load: ClusterLoad) -> int:
        """The target number of nodes (serving and starting together)."""
        have = load.serving + load.starting
        wanted = math.ceil(max(0, load.outstanding) / self.requests_per_node)
        short = load.strict_total > 0 and load.strict_met < self.slo_target * load.strict_total and load.outstanding > 0
        if short and load.starting == 0 and wanted <= load.serving:
            wanted = load.serving + 1
            self.slo_scale_ups += 1
        wanted = min(self.max_nodes, max(self.min_nodes, wanted))
        return min(self.max_nodes, max(self.min_nodes, self.keep_alive.decide(now, _KEY, have, wanted)))


class SloWindow:
    """Strict SLO outcomes since the last decision, from cumulative counts (the gateway's
    since its process started, the simulator's since the run began)."""

    def __init__(self) -> None:
        self._met = 0
        self._total = 0

    def take(self, met: int, total: int) -> tuple[int, int]:
        """(met, total) since the previous call, given the counts so far. Counts lower than
        the previous ones (a gateway process that restarted counts from zero) start afresh."""
        if met < self._met or total < self._total:
            self._met = self._total = 0
        window = (met - self._met, total - self._total)
        self._met, self._total = met, total
        return window
