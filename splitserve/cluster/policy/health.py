"""Node health as the gateway sees it: pings answered or missed, with the clock passed in.

A node is ``ALIVE`` while it was heard from (a PONG, an answer, a new connection) within
one ``ping_interval_s``; ``SUSPECT`` once it has missed a ping (it gets no new work, its
in-flight work stays); ``DEAD`` once it has missed ``misses`` pings: its in-flight work is
sent elsewhere (the ledger) and it is forgotten (a node that comes back joins again with
``add``). So a silent node is out of dispatch ``ping_interval_s`` after its last
sign of life and declared dead ``misses × ping_interval_s`` after it, plus however late the
caller's next ``check`` comes (the gateway pings and checks every ``ping_period_s``, half an
interval, so that a healthy node is heard from within each interval). Faster than Ray's own
node-death detection (docs/cluster.md), which only decides replacement.
"""

from __future__ import annotations

from splitserve.errors import InvalidInput
from splitserve.types import Choice


class Health(Choice, what="health"):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


class HealthTracker:
    """Last sign of life per node; ``check`` says who is suspect and who just died."""

    def __init__(self, ping_interval_s: float, misses: int) -> None:
        if not ping_interval_s > 0 or misses < 1:
            raise InvalidInput(f"ping_interval_s must be positive and misses at least 1, got {ping_interval_s}, "
                               f"{misses}")
        self.ping_interval_s = ping_interval_s
        self.misses = misses
        self._heard: dict[str, float] = {}

    @property
    def ping_period_s(self) -> float:
        """How often the caller pings each node: twice an interval, so that a healthy node's
        answer is back before its silence reaches one interval. Pinged once an interval, a
        healthy node was SUSPECT (and got no new work) from each ping's send until its PONG:
        the round trip plus the timer's lateness, every interval."""
        return self.ping_interval_s / 2

    @property
    def dead_after_s(self) -> float:
        """Silence after which a node is DEAD (the bound, less the caller's check period)."""
        return self.misses * self.ping_interval_s

    def add(self, node: str, now: float) -> None:
        """A node joins (its connection is up)."""
        self._heard[node] = now

    def heard(self, node: str, now: float) -> None:
        """Any sign of life from ``node``: a PONG or an answer. Ignored for dead or unknown nodes."""
        if node in self._heard:
            self._heard[node] = max(self._heard[node], now)

    def remove(self, node: str) -> None:
        """The node left on purpose (drained, scaled in): no longer watched."""
        self._heard.pop(node, None)

    def state(self, node: str, now: float) -> Health:
        if node not in self._heard:
            return Health.DEAD
        silent = now - self._heard[node]
        if silent >= self.dead_after_s:
            return Health.DEAD
        return Health.SUSPECT if silent >= self.ping_interval_s else Health.ALIVE

    def check(self, now: float) -> list[str]:
        """The nodes that died since the last check (sorted), now forgotten."""
        died = sorted(n for n in self._heard if self.state(n, now) is Health.DEAD)
        for node in died:
            del self._heard[node]
        return died

    def serving(self, now: float) -> set[str]:
        """The nodes that may get new work: heard from within one ping interval."""
        return {n for n in self._heard if self.state(n, now) is Health.ALIVE}
