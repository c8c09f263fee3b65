"""Packrat as splitserve's CPU placement: config, and the controller that turns queue
depth into a batch size and a batch size into an ⟨instances, threads, batch⟩ plan.

Pure: the runtime feeds it observations and a clock and applies what it returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.placement.estimator import BatchSizeEstimator
from splitserve.placement.optimizer import LatencyProfile, Plan, optimize
from splitserve.placement.topology import Core, allocate, read_topology
from splitserve.types import Choice


class PlacementKind(Choice, what="placement"):
    """How a model's instances get their CPUs: ``[placement] kind`` of a model config, and
    ``ServerConfig.placement`` for models whose config names none."""

    FIXED = "fixed"  # the config's instances and threads, pinned by the node
    PACKRAT = "packrat"  # Packrat's ⟨instances, threads, batch⟩ plan, adapted at run time


@dataclass(frozen=True)
class PackratConfig:
    """``[placement]`` of a model config when ``kind = "packrat"``."""

    threads: int  # T: cores Packrat may use for this model
    batch: int  # B at start; the estimator moves it afterwards
    timeout_ms: float = 5.0  # batch aggregation timeout
    alpha: float = 0.1  # EWMA weight of the newest queue depth
    window: int = 32  # estimates the mode is taken over
    reconfig_timeout_s: float = 10.0  # least time between reconfigurations
    adaptive: bool = True  # let the estimator change B at run time

    @classmethod
    def parse(cls, placement: dict[str, Any], max_batch: int,
              default_kind: PlacementKind = PlacementKind.FIXED) -> "PackratConfig | None":
        """None for fixed placement; a checked config for Packrat."""
        d = dict(placement)
        kind = PlacementKind.parse(d.pop("kind", default_kind), "placement.kind")
        if kind is PlacementKind.FIXED:
            return None
        d.setdefault("threads", len(os.sched_getaffinity(0)))
        d.setdefault("batch", max_batch)
        try:
            cfg = cls(**d)
        except TypeError as e:
            raise InvalidInput(f"placement: {e}") from None
        if not 1 <= cfg.batch <= max_batch:
            raise InvalidInput(f"placement.batch {cfg.batch} must be within 1..max_batch_size ({max_batch})")
        if cfg.threads < 1 or cfg.timeout_ms < 0:
            raise InvalidInput("placement.threads must be >= 1 and placement.timeout_ms >= 0")
        return cfg


class PackratController:
    """Chooses B from the observed queue depth and the plan for a B from the profile."""

    def __init__(self, cfg: PackratConfig, profile: LatencyProfile, max_batch: int, cores: list[Core] | None = None) -> None:
        self.cfg = cfg
        self.profile = profile
        self.cores = cores if cores is not None else read_topology()
        self.threads = min(cfg.threads, len(self.cores), profile.max_threads * len(self.cores))
        self.batch = cfg.batch
        self.estimator = BatchSizeEstimator(alpha=cfg.alpha, window=cfg.window,
                                            reconfig_timeout_s=cfg.reconfig_timeout_s, max_batch=max_batch)

    def plan(self, batch: int | None = None) -> Plan:
        return optimize(self.profile, self.threads, batch or self.batch)

    def shapes(self, plan: Plan) -> list[tuple[int, int, list[int]]]:
        """(threads, batch, pinned CPUs) per instance: disjoint cores, one socket each."""
        flat = [(s.threads, s.batch) for s in plan.shapes for _ in range(s.count)]
        cpus = allocate([t for t, _ in flat], self.cores)
        return [(t, b, c) for (t, b), c in zip(flat, cpus)]

    def observe(self, queue_depth: int, now: float) -> None:
        if self.cfg.adaptive:
            self.estimator.observe(queue_depth, now)

    def next_batch(self, now: float) -> int | None:
        """A new B when the smoothed estimate differs after the reconfiguration timeout."""
        if not self.cfg.adaptive:
            return None
        return self.estimator.should_reconfigure(self.batch, now)

    def switched(self, batch: int, now: float) -> None:
        self.batch = batch
        self.estimator.mark_reconfigured(now)
