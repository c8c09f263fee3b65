"""Packrat as splitserve's CPU placement: config, and the controller that turns queue
depth into a batch size and a batch size into an ⟨instances, threads, batch⟩ plan.

Pure: the runtime feeds it observations and a clock and applies what it returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.placement.estimator import BatchSizeEstimator
from splitserve.placement.optimizer import InstanceShape, LatencyProfile, Plan, optimize
from splitserve.placement.partition import InstancePlacement
from splitserve.placement.topology import Core, allocate
from splitserve.types import Choice


class PlacementKind(Choice, what="placement"):
    """How a model's instances get their CPUs: ``[placement] kind`` of a model config, and
    ``ServerConfig.packrat.placement`` for models whose config names none."""

    FIXED = "fixed"  # the config's instances and threads, pinned by the node
    PACKRAT = "packrat"  # Packrat's ⟨instances, threads, batch⟩ plan, adapted at run time


@dataclass(frozen=True)
class PackratConfig:
    """``[placement]`` of a model config when ``kind = "packrat"``."""

    threads: int | None  # T: cores Packrat may use (None: a share of the free ones, see placer.PackratPlacer)
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
        d.setdefault("threads", None)
        d.setdefault("batch", max_batch)
        try:
            cfg = cls(**d)
        except TypeError as e:
            raise InvalidInput(f"placement: {e}") from None
        if not 1 <= cfg.batch <= max_batch:
            raise InvalidInput(f"placement.batch {cfg.batch} must be within 1..max_batch_size ({max_batch})")
        if (cfg.threads is not None and cfg.threads < 1) or cfg.timeout_ms < 0:
            raise InvalidInput("placement.threads must be >= 1 and placement.timeout_ms >= 0")
        return cfg


class PackratController:
    """Chooses B from the observed queue depth and the plan for a B from the profile, and
    places the plan's instances inside the cores it was given.

    ``cores`` is the model's budget: the partition the node's ``ResourceManager`` granted it
    (``CoreBudget``, or the config's ``cpus``), read with ``ResourceManager.cores_of``. The plan
    uses the budget's threads, and never a CPU outside it.
    """

    def __init__(self, cfg: PackratConfig, profile: LatencyProfile, max_batch: int, cores: Sequence[Core]) -> None:
        self.cfg = cfg
        self.profile = profile
        self.cores = list(cores)
        if not self.cores:
            raise InvalidInput(f"packrat for {profile.model!r} was given no cores to place instances on")
        self.threads = len(self.cores)
        self.batch = cfg.batch
        self.estimator = BatchSizeEstimator(alpha=cfg.alpha, window=cfg.window,
                                            reconfig_timeout_s=cfg.reconfig_timeout_s, max_batch=max_batch)

    def plan(self, batch: int | None = None) -> Plan:
        """The optimizer's ⟨i, t, b⟩ for a batch of ``batch`` (default: the current B) on the budget."""
        return optimize(self.profile, self.threads, batch or self.batch)

    def resize_plan(self, instances: int) -> Plan:
        """A plan with exactly ``instances`` instances for the current B (what a user's
        resize of a Packrat model asks for): the budget's threads and B split as evenly as
        they go, the larger batches on the instances with more threads.

        Raises InvalidInput when the budget has fewer threads, or B fewer inputs, than
        ``instances``.
        """
        T, B = self.threads, self.batch
        if not 1 <= instances <= min(T, B):
            raise InvalidInput(
                f"{self.profile.model!r} uses packrat with {T} threads and a batch of {B}: it can run "
                f"1..{min(T, B)} instances, not {instances}"
            )
        top = self.profile.max_threads
        flat = [(min(T // instances + (i < T % instances), top), B // instances + (i < B % instances))
                for i in range(instances)]
        counts = Counter(flat)
        shapes = tuple(InstanceShape(threads=t, batch=b, count=n)
                       for (t, b), n in sorted(counts.items(), key=lambda kv: (-kv[0][0], -kv[0][1])))
        return Plan(shapes=shapes, latency=max(self.profile.latency(t, b) for t, b in counts),
                    fat_latency=self.profile.latency(min(T, top), B))

    def placements(self, plan: Plan, shared: bool = False) -> list[InstancePlacement]:
        """One placement per instance of ``plan``: disjoint CPUs of the budget, one socket
        each; ``shared`` when the budget is a partition shared with other models."""
        flat = [(s.threads, s.batch) for s in plan.shapes for _ in range(s.count)]
        cpus = allocate([t for t, _ in flat], self.cores)
        return [InstancePlacement(threads=t, batch=b, cpus=frozenset(c), shared=shared)
                for (t, b), c in zip(flat, cpus)]

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
