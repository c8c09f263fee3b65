"""The seeded revocation emulator (PROTEAN §5: "revocation notifications at each worker node
at fixed time intervals based on revocation probability (P_rev)").

Every ``interval_s`` of the cluster's clock, each live spot node that has no notice yet gets
one with probability ``p_rev``; its eviction comes a lead time drawn uniformly from
[``notice_min_s``, ``notice_max_s``] later (providers warn 30 s to 120 s ahead, §2.3). A
request for a new spot node fails with probability ``p_rev`` too: the paper does not say
how a replacement spot request fails, and splitserve assumes that spot capacity is as
scarce for a new request as for a running node. A failed request is known at once (a cloud
refuses a spot request it cannot fill when it is made); a granted one serves
``spot_launch_s`` later, which is the caller's business (``ClusterConfig.launch_s``).

The one ``random.Random`` passed in drives every draw, in a fixed order (interval by
interval, nodes by id), so the same seed, nodes and requests give the same schedule in
the simulator and in a real-Ray run. Pure: no timers; the caller ticks it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.errors import InvalidInput

if TYPE_CHECKING:
    from splitserve.cluster.config import ClusterConfig


@dataclass(frozen=True)
class Notice:
    """``node`` will be evicted at ``deadline``; the notice came at ``at`` (an interval's end)."""

    node: str
    at: float
    deadline: float


@dataclass(frozen=True)
class DoomedStep:
    """What a node under an eviction notice does now (``doomed_step``)."""

    stop_taking_work: bool  # leave dispatch: its replacement serves, or the lead is reached
    end: bool  # the cluster ends it now, billed to now
    evicted: bool  # ended at the margin (what it still held is taken back): counted an eviction


def doomed_step(cfg: "ClusterConfig", now: float, deadline: float, serving: bool, draining: bool,
                replacement_serves: bool, holds_work: bool) -> DoomedStep:
    """The one rule for a doomed node, in the controller and the simulator alike. It takes
    work (``serving``) until a replacement serves ("once the new VM is acquired, we redirect
    the incoming traffic to it", PROTEAN §4.5) or ``drain_lead_s`` before ``deadline``; once
    it has stopped (``draining``) and holds no work it is ended at once, an idle spot node
    being worth nothing until its eviction; ``drain_margin_s`` before the deadline it is
    ended whatever it holds (the ledger re-sends that)."""
    stop = serving and (replacement_serves or now >= deadline - cfg.drain_lead_s)
    at_margin = now >= deadline - cfg.drain_margin_s
    return DoomedStep(stop, at_margin or ((draining or stop) and not holds_work), at_margin)


def replacement_due(cfg: ClusterConfig, deadlines: Iterable[float]) -> float | None:
    """When a node ordered now should serve (``Procurement.open``'s ``serve_by``): before the
    first doomed node still taking work stops, ``drain_lead_s`` before its eviction (None:
    no doomed node is taking work). The controller and the simulator both ask here."""
    first = min(deadlines, default=None)
    return None if first is None else first - cfg.drain_lead_s


class RevocationEmulator:
    """Eviction notices for live spot nodes, and the fate of new spot requests."""

    def __init__(self, p_rev: float, interval_s: float, notice_min_s: float, notice_max_s: float,
                 rng: random.Random, start: float = 0.0) -> None:
        if not 0 <= p_rev <= 1:
            raise InvalidInput(f"p_rev must be a probability in [0, 1], got {p_rev}")
        if not interval_s > 0 or not 0 < notice_min_s <= notice_max_s:
            raise InvalidInput(f"need interval_s > 0 and 0 < notice_min_s <= notice_max_s; got {interval_s}, "
                               f"{notice_min_s}, {notice_max_s}")
        self.p_rev = p_rev
        self.interval_s = interval_s
        self.notice_min_s = notice_min_s
        self.notice_max_s = notice_max_s
        self._rng = rng
        self._next = start + interval_s  # the next interval boundary
        self._noticed: set[str] = set()
        self.notices = 0
        self.spot_requests = 0
        self.spot_failures = 0

    @classmethod
    def of(cls, cfg: ClusterConfig, start: float = 0.0) -> RevocationEmulator:
        """The emulator ``cfg`` describes, drawing from ``random.Random(cfg.revocation_seed)``.
        The simulator and the controller both build theirs here: one seed must give both the
        same schedule, or a simulated run cannot be checked against a real one."""
        return cls(cfg.p_rev, cfg.revocation_interval_s, cfg.notice_min_s, cfg.notice_max_s,
                   random.Random(cfg.revocation_seed), start)

    @property
    def next_at(self) -> float:
        """When the next interval ends (the caller's next tick need not come earlier)."""
        return self._next

    def tick(self, now: float, live_spot: Iterable[str]) -> list[Notice]:
        """Notices for the intervals that ended by ``now``, for the spot nodes live now."""
        nodes = sorted(set(live_spot) - self._noticed)
        out: list[Notice] = []
        while self._next <= now:
            at = self._next
            self._next += self.interval_s
            if self.p_rev == 0:
                continue  # no draw at all: P_rev 0 means no notice, ever
            for node in nodes:
                if node in self._noticed:
                    continue
                if self._rng.random() < self.p_rev:
                    lead = self._rng.uniform(self.notice_min_s, self.notice_max_s)
                    out.append(Notice(node, at, at + lead))
                    self._noticed.add(node)
        self.notices += len(out)
        return out

    def gone(self, node: str) -> None:
        """``node`` left the cluster: forget its notice (keeps the set bounded)."""
        self._noticed.discard(node)

    def spot_request_fails(self) -> bool:
        """Whether a new spot request made now fails (probability ``p_rev``; splitserve's
        assumption, stated in every report)."""
        self.spot_requests += 1
        failed = self.p_rev > 0 and self._rng.random() < self.p_rev
        self.spot_failures += failed
        return failed
