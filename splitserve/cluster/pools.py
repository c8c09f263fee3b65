"""Markets, node prices and the procurement policies' names (PROTEAN §2.3 Table 3, §4.5).

Kept apart from the deciders so that ``splitserve.config`` can name these lists without
importing any of them."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.errors import InvalidInput
from splitserve.types import Choice


class Market(Choice, what="market"):
    """How a node is bought: revocable and cheap, or kept and dear."""

    SPOT = "spot"
    ON_DEMAND = "on-demand"


class NodeProviderKind(Choice, what="provider"):
    """Where the cluster's serving nodes come from (``cluster/actors/provider.py``)."""

    AUTO = "auto"  # local on a cluster `cluster up` starts itself; autoscaler on one it joins (--address)
    LOCAL = "local"  # raylets started on the head's machine (development, tests)
    AUTOSCALER = "autoscaler"  # the Ray cluster's own nodes: machines joined by hand, and Ray's autoscaler's (v2)

    def resolve(self, joined: bool) -> "NodeProviderKind":
        """The provider to build: ``auto`` becomes ``autoscaler`` on a cluster someone else
        runs (``joined``), ``local`` on one the CLI starts."""
        if self is NodeProviderKind.AUTO:
            return NodeProviderKind.AUTOSCALER if joined else NodeProviderKind.LOCAL
        return self


class PricePreset(Choice, what="pricing", hint="PROTEAN Table 3: $/h of an 8xA100 instance"):
    """Whose prices the cost ledger uses by default."""

    AWS = "aws"
    AZURE = "azure"
    GCP = "gcp"


class ProcurementPolicy(Choice, what="procurement"):
    """Which market a new node is bought in (PROTEAN §4.5)."""

    PROTEAN = "protean"  # spot first; on-demand after a failed spot request or a timeout
    SPOT_ONLY = "spot-only"  # spot, and only spot: a failed request waits and asks again
    ON_DEMAND_ONLY = "on-demand-only"  # never revoked, never cheap


@dataclass(frozen=True)
class Prices:
    """Dollars per hour of one node in each market."""

    on_demand: float
    spot: float

    def __post_init__(self) -> None:
        if not (self.on_demand > 0 and self.spot > 0):
            raise InvalidInput(f"node prices must be positive, got on-demand {self.on_demand}, spot {self.spot}")

    def of(self, market: Market) -> float:
        return self.spot if market is Market.SPOT else self.on_demand


# PROTEAN Table 3: averages over US east and west, per 8xA100 instance.
TABLE3: dict[PricePreset, Prices] = {
    PricePreset.AWS: Prices(on_demand=32.7726, spot=9.8318),
    PricePreset.AZURE: Prices(on_demand=32.7700, spot=18.0235),
    PricePreset.GCP: Prices(on_demand=30.0846, spot=8.8147),
}
