"""Which front end a client talks to when it was given several (a cluster's gateways): the
order it tries them in when it connects, and again after the one it used is lost.

A pure decider: addresses in, an order out, the clock passed in. ``Client`` and
``AsyncClient`` do the connecting."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.client.common import Endpoint
from splitserve.errors import InvalidInput


def front_endpoints(url: str | Sequence[str]) -> list[Endpoint]:
    """The front ends a client was given: one URL, several separated by commas, or a list."""
    urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else [str(u).strip() for u in url]
    urls = [u for u in urls if u]
    if not urls:
        raise InvalidInput("give at least one front-end URL, e.g. tcp://127.0.0.1:8100")
    return [Endpoint.parse(u) for u in urls]


class FrontChoice:
    """The front ends in the order a client tries them: starting after the one it used last
    (so the clients of a lost gateway spread over the others rather than meeting on the
    first), those that failed within ``retry_s`` after the rest, so a gateway that just went
    away is not tried first but is still tried before the client gives up."""

    def __init__(self, count: int, retry_s: float, first: int = 0) -> None:
        if count < 1:
            raise InvalidInput("a client needs at least one front end")
        self.count = count
        self.retry_s = retry_s
        self.current = first % count  # the front end in use (or last used)
        self._failed_at: dict[int, float] = {}

    def order(self, now: float, *, fresh: bool = False) -> list[int]:
        """The indices to try: with ``fresh`` (a first connection) from the current one,
        else from the one after it; recent failures last, in their turn."""
        start = self.current if fresh else self.current + 1
        turn = [(start + k) % self.count for k in range(self.count)]
        recent = {i for i, t in self._failed_at.items() if now - t < self.retry_s}
        return [i for i in turn if i not in recent] + [i for i in turn if i in recent]

    def failed(self, index: int, now: float) -> None:
        """``index`` refused a connection, or its connection was lost, at ``now``."""
        self._failed_at[index] = now

    def connected(self, index: int) -> None:
        """``index`` took the connection: it is the one in use."""
        self.current = index
        self._failed_at.pop(index, None)
