"""PROTEAN's in-node autoscaler (PROTEAN §4.2): one instance per pending batch, scaled up at
once, scaled down only after a keep-alive of continuous surplus.

    n_c = Σ_m ⌈n_r(m) / batch(m)⌉      (one container per batch, §4.2)

Surplus instances are "terminated only after ~10 min during which the reactive policy has
consistently judged some containers surplus" (§4.2). How "consistently" is measured is not
given: splitserve's choice is that every tick of the window must show a surplus (one tick
without restarts the window), and what is retired at its end is the smallest surplus seen
over it, so no instance that some tick of the window needed goes. Keep-alive 0 is immediate
scale-down, the paper's comparison for cold starts ("up to 98%" fewer with keep-alive).

Pure: the caller passes the clock and the counts; nothing here starts or stops anything.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from splitserve.errors import InvalidInput


class InstanceAutoscaler:
    """Target instance counts per model, one ``tick`` per interval (the interval is not
    given: the node's timer sets it).

    ``cold_starts[m]`` counts the instances scale-up added to ``m`` (each is a cold start:
    a worker bound and loaded, §2.1); ``retired[m]`` the instances scale-down removed.
    """

    def __init__(self, keep_alive_s: float) -> None:
        self.keep_alive = KeepAlive(keep_alive_s)
        self.cold_starts: dict[str, int] = {}
        self.retired: dict[str, int] = {}

    def tick(
        self,
        now: float,
        pending: Mapping[str, int],
        batch: Mapping[str, int],
        current: Mapping[str, int],
    ) -> dict[str, int]:
        """Target instances for every model in ``current`` (loaded, with that many instances)
        or with requests ``pending`` (the requests queued or running for it, the paper's
        n_r); ``batch[m]`` is its batch size.

        Wanted = ⌈pending / batch⌉, at least 1 while the model is loaded (§4.2 reactive
        policy). A model below it is raised to it at once; one above it keeps its instances
        until every tick for ``keep_alive_s`` has shown a surplus, then drops the smallest
        surplus of that window, and a new window starts.
        """
        targets: dict[str, int] = {}
        for m in sorted(set(current) | {m for m, n in pending.items() if n > 0}):
            have = current.get(m, 0)
            b = batch.get(m, 1)
            if b < 1:
                raise InvalidInput(f"model {m!r} has batch size {b}; a batch holds at least one request")
            wanted = math.ceil(max(0, pending.get(m, 0)) / b)
            if have > 0:
                wanted = max(1, wanted)
            target = self.keep_alive.decide(now, m, have, wanted)
            if target > have:
                self.cold_starts[m] = self.cold_starts.get(m, 0) + target - have
            elif target < have:
                self.retired[m] = self.retired.get(m, 0) + have - target
            targets[m] = target
        self.keep_alive.keep_only(targets)  # unloaded models: forget their windows
        return targets

    @property
    def keep_alive_s(self) -> float:
        return self.keep_alive.keep_alive_s

    def to_dict(self) -> dict[str, object]:
        """Counters for reports: cold starts and retirements per model, and the keep-alive."""
        return {"keep_alive_s": self.keep_alive_s, "cold_starts": dict(self.cold_starts),
                "retired": dict(self.retired)}


class KeepAlive:
    """Scale up at once, scale down only after ``keep_alive_s`` of continuous surplus (§4.2),
    per key: a model's instances here, a pool's nodes in ``cluster.autoscale``.

    Every decision of the window must show a surplus (one without restarts it), and what is
    retired at its end is the smallest surplus seen over it, so nothing that some decision of
    the window needed goes."""

    def __init__(self, keep_alive_s: float) -> None:
        if keep_alive_s < 0:
            raise InvalidInput(f"keep_alive_s={keep_alive_s}: use 0 (immediate scale-down) or more")
        self.keep_alive_s = keep_alive_s
        self._since: dict[str, float] = {}  # key -> start of its current run of surplus decisions
        self._least_surplus: dict[str, int] = {}  # key -> smallest surplus seen in that run

    def decide(self, now: float, key: str, have: int, wanted: int) -> int:
        """The count ``key`` should have: ``wanted`` when that is more (or no surplus),
        ``have`` while the window runs, ``have`` less the window's least surplus at its end."""
        surplus = have - wanted
        if surplus <= 0:
            self.forget(key)
            return wanted
        start = self._since.setdefault(key, now)
        least = min(self._least_surplus.get(key, surplus), surplus)
        self._least_surplus[key] = least
        if now - start < self.keep_alive_s:
            return have
        self.forget(key)
        return have - least

    def forget(self, key: str) -> None:
        self._since.pop(key, None)
        self._least_surplus.pop(key, None)

    def keep_only(self, keys: Collection[str]) -> None:
        """Forget every key not in ``keys``."""
        for key in set(self._since) - set(keys):
            self.forget(key)
