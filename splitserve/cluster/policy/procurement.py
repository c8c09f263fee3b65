"""Which market each new node is bought in (PROTEAN §4.5).

"On receipt of the eviction notification, we retry for another spot VM and only issue an
on-demand VM request if the spot request fails." Each node the cluster wants is an
*order*; the policy turns orders into requests to a market:

- ``protean``: a spot request first; on-demand when it fails, or when it is still not
  serving ``spot_retry_timeout_s`` after it was made (the pending spot request is then
  withdrawn), or at once when the order must serve by a time (``serve_by``: a doomed node's
  replacement, before the node stops taking work) that a spot node would miss and an
  on-demand node would come sooner. Each switch is a *fallback*. With ``spot_return_s``,
  protean moves back: an on-demand node that has served that long gets a *swap*, a spot
  request to replace it (the caller retires it once the spot node serves); a refused swap
  is dropped, not fallen back, and asked again ``spot_return_s`` later.
- ``spot-only``: spot requests only; after a failure it waits ``spot_retry_timeout_s`` and
  asks again, however long that takes (its SLO compliance pays for it).
- ``on-demand-only``: on-demand requests only.

Pure: the caller performs the ``Launch`` and ``Cancel`` actions and reports back what the
provider (or the revocation emulator) did with ``failed`` and ``ready``; ``tick`` handles
the timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

from splitserve.cluster.pools import Market, ProcurementPolicy
from splitserve.errors import InternalError, InvalidInput

if TYPE_CHECKING:
    from splitserve.cluster.config import ClusterConfig


@dataclass(frozen=True)
class Launch:
    """Ask the provider for a node in ``market`` for ``order``."""

    order: int
    market: Market


@dataclass(frozen=True)
class Cancel:
    """Withdraw ``order``'s pending request in ``market`` (a node it already started is
    stopped and billed to now)."""

    order: int
    market: Market


Action = Launch | Cancel


@dataclass
class Order:
    """One node wanted and not yet serving."""

    order: int
    opened_at: float
    market: Market | None = None  # the market of the pending request (None: none pending)
    requested_at: float = 0.0  # when that request was made
    retry_at: float | None = None  # spot-only: when to ask again after a failure
    replaces: str | None = None  # a swap: the on-demand node it retires once it serves


class Procurement:
    """Open orders and the policy that fills them."""

    def __init__(self, policy: ProcurementPolicy, spot_retry_timeout_s: float, spot_launch_s: float,
                 on_demand_launch_s: float, spot_return_s: float = 0.0) -> None:
        if not min(spot_retry_timeout_s, spot_launch_s, on_demand_launch_s) > 0 or spot_return_s < 0:
            raise InvalidInput("spot_retry_timeout_s, spot_launch_s and on_demand_launch_s must be positive and "
                               f"spot_return_s at least 0, got {spot_retry_timeout_s}, {spot_launch_s}, "
                               f"{on_demand_launch_s}, {spot_return_s}")
        self.policy = ProcurementPolicy.parse(policy)
        self.spot_retry_timeout_s = spot_retry_timeout_s
        self.spot_launch_s = spot_launch_s
        self.on_demand_launch_s = on_demand_launch_s
        self.spot_return_s = spot_return_s
        self._orders: dict[int, Order] = {}
        self._swap_tried: dict[str, float] = {}  # on-demand node -> when a swap was last asked for it
        self._ids = count(1)
        self.fallbacks = 0  # orders protean switched from spot to on-demand
        self.notice_fallbacks = 0  # of those, orders bought on-demand at once: a spot node would serve too late
        self.spot_retries = 0  # spot-only's requests after a failure
        self.swaps = 0  # spot requests protean made to replace an on-demand node

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Procurement:
        """The procurement ``cfg`` describes (the simulator's and the controller's)."""
        return cls(cfg.procurement, cfg.spot_retry_timeout_s, cfg.spot_launch_s, cfg.on_demand_launch_s,
                   cfg.spot_return_s)

    @property
    def open_orders(self) -> int:
        """Nodes wanted and not yet serving (a swap adds none: it replaces a serving node)."""
        return sum(o.replaces is None for o in self._orders.values())

    def order(self, order: int) -> Order:
        try:
            return self._orders[order]
        except KeyError:
            raise InternalError(f"no open order {order}") from None

    def open(self, now: float, serve_by: float | None = None) -> list[Action]:
        """One more node is wanted, serving by ``serve_by`` if it can (None: no hurry).
        PROTEAN §4.5 asks for the replacement "on receipt of the eviction notification" so
        that it serves before the eviction; protean buys on-demand at once when only that
        market can come sooner than a spot node that would miss ``serve_by``."""
        o = Order(next(self._ids), now)
        self._orders[o.order] = o
        first = Market.ON_DEMAND if self.policy is ProcurementPolicy.ON_DEMAND_ONLY else Market.SPOT
        if (self.policy is ProcurementPolicy.PROTEAN and serve_by is not None
                and now + self.spot_launch_s > serve_by and self.on_demand_launch_s < self.spot_launch_s):
            self.fallbacks += 1
            self.notice_fallbacks += 1
            first = Market.ON_DEMAND
        return [self._launch(o, first, now)]

    def adopt(self, market: Market, now: float) -> int:
        """An order for a node already requested in ``market`` (a launch a restarted controller
        found in flight): counted as wanted, filled by ``ready``, with no new request."""
        o = Order(next(self._ids), now, market, now)
        self._orders[o.order] = o
        return o.order

    def failed(self, order: int, now: float) -> list[Action]:
        """``order``'s pending request was refused (no capacity in that market)."""
        o = self.order(order)
        market, o.market = o.market, None
        if o.replaces is not None:
            del self._orders[order]  # the on-demand node serves on; asked again after spot_return_s
            return []
        if market is Market.SPOT and self.policy is ProcurementPolicy.PROTEAN:
            self.fallbacks += 1
            return [self._launch(o, Market.ON_DEMAND, now)]
        if self.policy is ProcurementPolicy.SPOT_ONLY:
            o.retry_at = now + self.spot_retry_timeout_s
            return []
        return [self._launch(o, Market.ON_DEMAND, now)]  # on-demand refused: ask again

    def ready(self, order: int) -> Market:
        """``order``'s node serves: the order is filled. Returns the node's market."""
        o = self.order(order)
        if o.market is None:
            raise InternalError(f"order {order} has no pending request to be ready")
        del self._orders[order]
        return o.market

    def replaces(self, order: int) -> str | None:
        """The on-demand node ``order`` replaces once it serves (None: not a swap)."""
        return self.order(order).replaces

    def close(self, order: int) -> list[Action]:
        """``order`` is no longer wanted (scale-in before its node came): withdraw its request."""
        o = self._orders.pop(order, None)
        return [Cancel(o.order, o.market)] if o is not None and o.market is not None else []

    def newest(self) -> int | None:
        """The most recently opened order (the first to close on scale-in), or None; swaps
        are not counted as wanted nodes, so scale-in leaves them."""
        return max((o.order for o in self._orders.values() if o.replaces is None), default=None)

    def swap(self, now: float, on_demand: dict[str, float]) -> list[Action]:
        """Protean's move back to spot: a spot request for each on-demand node in
        ``on_demand`` (node -> when it began serving) that has served ``spot_return_s`` and
        was not asked for within ``spot_return_s``; none with ``spot_return_s`` 0."""
        for node in self._swap_tried.keys() - on_demand.keys():
            del self._swap_tried[node]
        if self.policy is not ProcurementPolicy.PROTEAN or not self.spot_return_s:
            return []
        pending = {o.replaces for o in self._orders.values()}
        out: list[Action] = []
        for node, since in sorted(on_demand.items()):
            if node in pending or now - max(since, self._swap_tried.get(node, since)) < self.spot_return_s:
                continue
            self._swap_tried[node] = now
            self.swaps += 1
            o = Order(next(self._ids), now, replaces=node)
            self._orders[o.order] = o
            out.append(self._launch(o, Market.SPOT, now))
        return out

    def tick(self, now: float) -> list[Action]:
        """Timeouts: protean falls back from a spot request pending too long (not a swap's:
        its on-demand node serves meanwhile); spot-only asks again once its wait after a
        failure is over."""
        out: list[Action] = []
        for o in list(self._orders.values()):
            if (self.policy is ProcurementPolicy.PROTEAN and o.market is Market.SPOT and o.replaces is None
                    and now - o.requested_at >= self.spot_retry_timeout_s):
                self.fallbacks += 1
                out += [Cancel(o.order, Market.SPOT), self._launch(o, Market.ON_DEMAND, now)]
            elif o.market is None and o.retry_at is not None and now >= o.retry_at:
                self.spot_retries += 1
                out.append(self._launch(o, Market.SPOT, now))
        return out

    def _launch(self, o: Order, market: Market, now: float) -> Launch:
        o.market, o.requested_at, o.retry_at = market, now, None
        return Launch(o.order, market)
