"""The schemes PROTEAN is compared with, each nothing but ``ServerConfig`` overrides.

The table is the issue-12 contract: a scheme never gets a code path of its own in the server,
so a difference between two schemes' numbers is a difference between their settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

# scheme -> ServerConfig field -> value (PROTEAN §5 baselines; see docs/protean-bench.md)
SCHEMES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "protean": MappingProxyType({"partitioning": "protean"}),
    # Naive Slicing: static partitions, load-balanced, strictness-agnostic
    "naive": MappingProxyType({"partitioning": "static", "class_order": "arrival", "preemption": "concurrent"}),
    # INFless/Llama: everything co-located on all the node's cores, strictness-agnostic
    "colocate": MappingProxyType({"partitioning": "colocate", "class_order": "arrival",
                                  "preemption": "concurrent"}),
    # Molecule (beta): one batch at a time on the whole node, in arrival order
    "timeshare": MappingProxyType({"partitioning": "colocate", "class_order": "arrival", "preemption": "seq"}),
    # the §2.2 straw man: strict always on the largest partition (the ablation of eta)
    "smart-static": MappingProxyType({"partitioning": "static", "strict_placement": "largest",
                                      "preemption": "concurrent"}),
    # PROTEAN with immediate scale-down: the cold-start comparison of §4.2
    "protean-no-keepalive": MappingProxyType({"partitioning": "protean", "protean_keep_alive_s": 0}),
})

# The scheme every other one is set against in the ratios (violations, p99, queue share).
REFERENCE = "protean"


def check_schemes(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` in the table's order, refusing unknown ones with the valid ones listed."""
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        raise ValueError(f"unknown schemes {', '.join(unknown)}; choose from {', '.join(SCHEMES)}")
    if not names:
        raise ValueError(f"give at least one scheme; choose from {', '.join(SCHEMES)}")
    return tuple(n for n in SCHEMES if n in names)


def server_env(overrides: Mapping[str, Any]) -> dict[str, str]:
    """The ``SPLITSERVE_*`` variables that set ``overrides`` on a server (every ServerConfig
    field reads its own), so a scheme needs no flag of its own."""
    return {f"SPLITSERVE_{name.upper()}": str(value) for name, value in overrides.items()}
