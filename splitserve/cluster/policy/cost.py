"""What the cluster's nodes cost: one record per node, billed from its request to its end.

PROTEAN projects "the total cost ... based on running time (including keep-alive and
execution times)" (§5): a node is paid for while it boots, serves, idles through a
keep-alive and drains, so cost = Σ price_per_hour × (ended_at − requested_at) / 3600. An
evicted spot node is billed to its eviction; a request withdrawn before its node served is
billed to the withdrawal (the instance was booting); a request the provider refused costs
nothing and gets no record. Pure: times come from the caller's clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace
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


@dataclass
class Totals:
    """What a set of node records adds to a bill: the summary's sums, per market."""

    nodes: int = 0
    dollars: float = 0.0
    billed_s: float = 0.0
    boots: int = 0  # served (booted, models warm)
    withdrawn: int = 0  # ended before serving
    evictions: int = 0
    booting_s: float = 0.0  # billed, not yet serving
    draining_s: float = 0.0  # billed, no longer taking work

    def add(self, r: NodeRecord, now: float) -> None:
        """Count ``r`` as billed up to ``now`` (its end, once it ended)."""
        end = r.ended_at if r.ended_at is not None else now
        self.nodes += 1
        self.dollars += r.cost(now)
        self.billed_s += r.billed_s(now)
        self.boots += r.ready_at is not None
        self.withdrawn += r.ready_at is None and r.ended_at is not None
        self.evictions += r.evicted
        self.booting_s += (r.ready_at if r.ready_at is not None else end) - r.requested_at
        self.draining_s += end - r.drained_at if r.drained_at is not None else 0.0


class CostLedger:
    """Every node's record, and the totals a report needs. With ``keep_closed``, a
    long-running cluster's bill stays bounded: past that many ended records, the oldest is
    folded into per-market ``Totals`` (its node can no longer be looked up; the summary is
    unchanged)."""

    def __init__(self, keep_closed: int | None = None) -> None:
        self.keep_closed = keep_closed
        self._records: dict[str, NodeRecord] = {}
        self._closed: deque[str] = deque()  # nodes of ended records still kept, oldest first
        self._folded: dict[Market, Totals] = {m: Totals() for m in Market}

    def requested(self, node: str, node_type: str, market: Market, price_per_hour: float, now: float) -> None:
        if node in self._records:
            raise InternalError(f"node {node!r} already has a cost record")
        self._records[node] = NodeRecord(node, node_type, Market.parse(market), price_per_hour, now)

    def ready(self, node: str, now: float) -> None:
        self._get(node).ready_at = now

    def record(self, node: str) -> NodeRecord | None:
        """``node``'s record while the ledger keeps it (None: never billed, or folded)."""
        return self._records.get(node)

    def drained(self, node: str, now: float) -> None:
        record = self._get(node)
        if record.drained_at is None:
            record.drained_at = now

    def ended(self, node: str, now: float, evicted: bool = False) -> None:
        record = self._get(node)
        if record.ended_at is None:
            record.ended_at = now
            record.evicted = evicted
            self._closed.append(node)
            while self.keep_closed is not None and len(self._closed) > self.keep_closed:
                old = self._records.pop(self._closed.popleft())
                self._folded[old.market].add(old, now)

    def records(self) -> list[NodeRecord]:
        """The records kept: every open one, and the newest ``keep_closed`` ended ones."""
        return list(self._records.values())

    def totals(self, now: float) -> dict[Market, Totals]:
        """Per market: the folded records' totals plus every kept record's, billed to ``now``."""
        out = {m: replace(t) for m, t in self._folded.items()}
        for r in self._records.values():
            out[r.market].add(r, now)
        return out

    def total(self, now: float) -> float:
        """Dollars so far."""
        return sum(t.dollars for t in self.totals(now).values())

    def node_hours(self, now: float, market: Market | None = None) -> float:
        """Billed node-hours, of one market or of all."""
        return sum(t.billed_s for m, t in self.totals(now).items() if market in (None, m)) / 3600.0

    def summary(self, now: float) -> dict[str, Any]:
        """Totals for a report: dollars, node-hours per market, boots, evictions, and the
        hours spent booting and draining (billed, not serving)."""
        per = self.totals(now)
        every = per.values()
        return {
            "dollars": sum(t.dollars for t in every),
            "node_hours": {str(m): t.billed_s / 3600.0 for m, t in per.items()},
            "boots": sum(t.boots for t in every),
            "withdrawn": sum(t.withdrawn for t in every),
            "evictions": sum(t.evictions for t in every),
            "booting_hours": sum(t.booting_s for t in every) / 3600.0,
            "draining_hours": sum(t.draining_s for t in every) / 3600.0,
        }

    def to_list(self) -> list[dict[str, Any]]:
        """The kept records (``records``) as JSON-ready dicts."""
        return [asdict(r) | {"market": str(r.market)} for r in self._records.values()]

    def folded(self) -> dict[str, dict[str, Any]]:
        """Per market, the totals of the ended records no longer kept."""
        return {str(m): asdict(t) for m, t in self._folded.items()}

    def to_state(self) -> dict[str, Any]:
        """Everything the ledger holds, JSON-ready (the controller's store keeps it across a
        restart); ``from_state`` reads it back."""
        return {"keep_closed": self.keep_closed, "records": self.to_list(), "closed": list(self._closed),
                "folded": self.folded()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> CostLedger:
        ledger = cls(state["keep_closed"])
        for r in state["records"]:
            ledger._records[r["node"]] = NodeRecord(**(r | {"market": Market.parse(r["market"])}))
        ledger._closed.extend(state["closed"])
        for market, totals in state["folded"].items():
            ledger._folded[Market.parse(market)] = Totals(**totals)
        return ledger

    def _get(self, node: str) -> NodeRecord:
        try:
            return self._records[node]
        except KeyError:
            raise InternalError(f"node {node!r} has no cost record") from None
