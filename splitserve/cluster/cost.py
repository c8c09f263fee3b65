"""What the cluster's nodes cost: one record per node, billed from its request to its end.

PROTEAN projects "the total cost ... based on running time (including keep-alive and
execution times)" (§5): a node is paid for while it boots, serves, idles through a
keep-alive and drains, so cost = Σ price_per_hour × (ended_at − requested_at) / 3600. An
evicted spot node is billed to its eviction; a request withdrawn before its node served is
billed to the withdrawal (the instance was booting); a request the provider refused costs
nothing and gets no record. Pure: times come from the caller's clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from splitserve.cluster.pools import Market
from splitserve.errors import InternalError


@dataclass
class NodeRecord:
    """One node's life, for the bill."""

    node: str
    node_type: str
    market: Market
    price_per_hour: float
    requested_at: float
    ready_at: float | None = None  # serving (booted, models warm)
    drained_at: float | None = None  # stopped taking work (eviction notice or scale-in)
    ended_at: float | None = None  # gone: billing stops
    evicted: bool = False  # ended by the provider, not by the cluster

    def billed_s(self, now: float) -> float:
        """Seconds billed so far (to ``now`` while it runs)."""
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, end - self.requested_at)

    def cost(self, now: float) -> float:
        return self.price_per_hour * self.billed_s(now) / 3600.0


class CostLedger:
    """Every node's record, and the totals a report needs."""

    def __init__(self) -> None:
        self._records: dict[str, NodeRecord] = {}

    def requested(self, node: str, node_type: str, market: Market, price_per_hour: float, now: float) -> None:
        if node in self._records:
            raise InternalError(f"node {node!r} already has a cost record")
        self._records[node] = NodeRecord(node, node_type, Market.parse(market), price_per_hour, now)

    def ready(self, node: str, now: float) -> None:
        self._get(node).ready_at = now

    def drained(self, node: str, now: float) -> None:
        record = self._get(node)
        if record.drained_at is None:
            record.drained_at = now

    def ended(self, node: str, now: float, evicted: bool = False) -> None:
        record = self._get(node)
        if record.ended_at is None:
            record.ended_at = now
            record.evicted = evicted

    def records(self) -> list[NodeRecord]:
        return list(self._records.values())

    def total(self, now: float) -> float:
        """Dollars so far."""
        return sum(r.cost(now) for r in self._records.values())

    def node_hours(self, now: float, market: Market | None = None) -> float:
        """Billed node-hours, of one market or of all."""
        return sum(r.billed_s(now) for r in self._records.values() if market in (None, r.market)) / 3600.0

    def summary(self, now: float) -> dict[str, Any]:
        """Totals for a report: dollars, node-hours per market, boots, evictions, and the
        hours spent booting and draining (billed, not serving)."""
        recs = self._records.values()
        boot = sum((r.ready_at if r.ready_at is not None else r.billed_s(now) + r.requested_at) - r.requested_at
                   for r in recs)
        drain = sum(((r.ended_at if r.ended_at is not None else now) - r.drained_at)
                    for r in recs if r.drained_at is not None)
        return {
            "dollars": self.total(now),
            "node_hours": {str(m): self.node_hours(now, m) for m in Market},
            "boots": sum(1 for r in recs if r.ready_at is not None),
            "withdrawn": sum(1 for r in recs if r.ready_at is None and r.ended_at is not None),
            "evictions": sum(1 for r in recs if r.evicted),
            "booting_hours": boot / 3600.0,
            "draining_hours": drain / 3600.0,
        }

    def to_list(self) -> list[dict[str, Any]]:
        return [asdict(r) | {"market": str(r.market)} for r in self._records.values()]

    def _get(self, node: str) -> NodeRecord:
        try:
            return self._records[node]
        except KeyError:
            raise InternalError(f"node {node!r} has no cost record") from None
