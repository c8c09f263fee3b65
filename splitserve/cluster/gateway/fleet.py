"""The cluster's gateways as the controller sees them: each reports its stats with its
routes poll, and the autoscaler, scale-in and ``cluster status`` read their sum.

Pure: reports in, one merged view out, the clock passed in. A gateway that stopped
reporting (killed for good) drops out after ``stale_s``, so the requests it held then no
longer keep a node from leaving."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# keys that are one gateway's own state, not counts to add up: the newest is kept
_LATEST = ("routes",)


def merge_stats(reports: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The gateways' stats added up: numbers summed, dicts merged key by key the same way,
    lists joined (sorted, each item once); ``routes`` (the table's version) the highest."""
    out: dict[str, Any] = {}
    for stats in reports:
        for key, value in stats.items():
            if key in _LATEST:
                out[key] = max(out.get(key, value), value)
            else:
                out[key] = _add(out.get(key), value)
    return out


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(b, dict):
        return {k: _add(a.get(k), b.get(k)) if k in a and k in b else (a[k] if k in a else b[k])
                for k in a.keys() | b.keys()}
    if isinstance(b, list):
        return sorted(set(a) | set(b))
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return a + b
    return b


class GatewayReports:
    """The latest stats of each gateway, by name, and when each came."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._latest: dict[str, tuple[float, dict[str, Any]]] = {}

    def record(self, name: str, stats: dict[str, Any], now: float) -> bool:
        """Keep ``name``'s ``stats``; True if it is the first report of that gateway (a new
        gateway, or a restarted controller's first word from it)."""
        first = name not in self._latest
        self._latest[name] = (now, stats)
        return first

    def merged(self, now: float) -> dict[str, Any]:
        """The sum of the gateways that reported within ``stale_s``."""
        self._latest = {n: r for n, r in self._latest.items() if now - r[0] <= self.stale_s}
        return merge_stats(stats for _, stats in self._latest.values())

    def names(self) -> list[str]:
        """The gateways heard from within ``stale_s`` (as of the last ``merged``)."""
        return sorted(self._latest)
