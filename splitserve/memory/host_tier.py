"""The pinned host tier as a pure decider: which evicted models keep their weights in
page-locked host memory, within a budget of its own, least recently used dropped first.

A model evicted from device memory is *offered* to the tier with its bytes. It is kept if
it can fit: models the tier holds are dropped, least recently used first, until it does,
but never one that is being reloaded from the tier now (its copies are in flight). A model
larger than the whole budget is never kept, and nothing is dropped for it. A reload from
the tier *touches* the model (the tier's LRU clock is the latest reload or offer); a model
unloaded by an operator is *forgotten*. The caller pins and unpins the bytes: this class
only decides, with the clock passed in.

A reload from the tier is asynchronous copies from page-locked memory, layer by layer,
with compute starting on the layers already there (``worker.layer_reload``); one from
disk reads and maps the weights file first. That difference is the tier's reason to be
(PipeSwitch; Rafiqi's host tier).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = ["Offer", "PinnedTier"]


@dataclass(frozen=True)
class Offer:
    """What to do with a model offered to the tier: keep it (pin its bytes) after dropping
    (unpinning) ``drop``, in that order; or not keep it, for ``reason``."""

    keep: bool
    drop: tuple[str, ...] = ()
    reason: str = ""


@dataclass
class PinnedTier:
    """The tier's book: ``budget`` bytes of page-locked host memory; per model its bytes
    and when it last came in or was reloaded."""

    budget: int
    _held: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (bytes, last used)

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"the pinned tier's budget must be a non-negative number of bytes, got {self.budget!r}")

    @property
    def used(self) -> int:
        """Bytes the tier holds."""
        return sum(n for n, _ in self._held.values())

    def holds(self, name: str) -> bool:
        """Whether ``name``'s weights wait in the tier (a reload copies from there)."""
        return name in self._held

    def held(self) -> dict[str, int]:
        """Bytes per model held, least recently used first."""
        return {k: v[0] for k, v in sorted(self._held.items(), key=lambda kv: (kv[1][1], kv[0]))}

    def offer(self, name: str, nbytes: int, now: float, reloading: Collection[str] = ()) -> Offer:
        """``name`` (``nbytes``) leaves device memory: keep it here? Applied to the book
        when kept; ``reloading`` are the models whose reload from the tier is in flight."""
        if nbytes > self.budget:
            return Offer(False, reason=f"{nbytes} bytes are more than the pinned tier's budget of {self.budget}")
        if name in self._held:
            self._held[name] = (nbytes, now)
            return Offer(True)
        room = self.budget - self.used
        drop: list[str] = []
        for victim in self.held():
            if room >= nbytes:
                break
            if victim in reloading:
                continue
            drop.append(victim)
            room += self._held[victim][0]
        if room < nbytes:
            return Offer(False, reason=f"the pinned tier's {self.budget} bytes are held by models reloading now")
        for victim in drop:
            del self._held[victim]
        self._held[name] = (nbytes, now)
        return Offer(True, tuple(drop))

    def touch(self, name: str, now: float) -> None:
        """``name`` was reloaded from the tier now (its pinned copy stays for the next time)."""
        if name in self._held:
            self._held[name] = (self._held[name][0], now)

    def forget(self, name: str) -> bool:
        """Drop ``name`` (unloaded by an operator, or its weights changed); whether it was held."""
        return self._held.pop(name, None) is not None
