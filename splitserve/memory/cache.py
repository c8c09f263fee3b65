"""Which models hold memory, and which load or go next: Rafiqi's LRU memory manager (§3.4)
as a pure decider.

``ResidencyCache`` keeps, per model, its residency, the bytes it holds or will hold, when
its latest batch began (Rafiqi's "begins classification": the LRU clock) and whether it is
``keep_resident``; and the load queue (requests for models that are not resident, with
whether real-time work waits and since when). ``plan(now, busy)`` returns what to do now:
evictions to start and loads to start. It never does I/O and takes the clock and the
caller's facts (which models are busy) as arguments; ``memory.manager.MemoryManager``
carries its decisions out and reports back (``loaded``, ``evicted``, ``failed``).

The rules (Rafiqi §3.4, with the decisions of ``notes/rafiqi.md`` Q5-Q7):

* bytes reserved (resident, loading and evicting models) never exceed the budget, and
  those models never exceed ``max_resident``; a load reserves its bytes only once its
  victims have released theirs, so an evicting model still counts;
* at most ``max_loads`` models load at once; the load queue serves models with real-time
  work waiting first, then the oldest request;
* victims are taken in LRU order among evictable models only: resident, not
  ``keep_resident``, not busy (a running or suspended batch, a reconfiguration);
* a model that cannot fit even with every other evictable model gone is refused, with a
  message naming its bytes and what the budget leaves it; when room can come only from
  models that are busy now, nothing happens until the caller plans again (a batch ended).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Entry", "Plan", "Residency", "ResidencyCache"]


class Residency(StrEnum):
    """Where a model's weights are, as users see it (``/v2/memory``, ``splitserve models``)."""

    RESIDENT = "RESIDENT"
    LOADING = "LOADING"
    EVICTING = "EVICTING"  # releasing its weights; its bytes still count
    EVICTED = "EVICTED"  # not resident; loads on its next request
    FAILED = "FAILED"  # its load failed or was refused (``reason`` says why)
    UNLOADED = "UNLOADED"  # explicitly disabled by an operator


HOLDING = (Residency.RESIDENT, Residency.LOADING, Residency.EVICTING)


@dataclass
class Entry:
    """One model as the cache sees it."""

    name: str
    charge: int = 0  # bytes it holds (or would hold once loaded)
    residency: Residency = Residency.EVICTED
    keep_resident: bool = False
    last_used: float | None = None  # start of its latest batch (or of its load)
    reason: str | None = None  # FAILED: why
    wanted_since: float | None = None  # a request waits for it to load
    rt_waiting: bool = False
    loads: int = 0
    evictions: int = 0


@dataclass
class Plan:
    """What to do now: start evicting ``evict``, start loading ``load``, and answer the
    requests of ``refuse`` (model -> why) with an error: they can never fit."""

    evict: list[str] = field(default_factory=list)
    load: list[str] = field(default_factory=list)
    refuse: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.evict or self.load or self.refuse)


class ResidencyCache:
    """The memory manager's state and decisions; see the module docstring."""

    def __init__(self, budget: int | None, max_resident: int | None, max_loads: int = 1) -> None:
        self.budget = budget
        self.max_resident = max_resident
        self.max_loads = max_loads
        self.entries: dict[str, Entry] = {}

    # -- facts the caller reports ----------------------------------------------------------

    def entry(self, name: str) -> Entry:
        """The model's entry (a new, EVICTED one for a model not seen before)."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(name)
        return e

    def forget(self, name: str) -> None:
        """The model is gone (unregistered): it holds nothing and waits for nothing."""
        self.entries.pop(name, None)

    def request(self, name: str, now: float, rt_waiting: bool = False) -> None:
        """A call waits for ``name``: queue a load unless it holds (or is getting) its weights.
        An evicting model stays queued and loads again once its eviction ends."""
        e = self.entry(name)
        if e.residency in (Residency.RESIDENT, Residency.LOADING):
            return
        if e.residency in (Residency.FAILED, Residency.UNLOADED):
            e.residency, e.reason = Residency.EVICTED, None
        if e.wanted_since is None:
            e.wanted_since = now
        e.rt_waiting = e.rt_waiting or rt_waiting

    def touch(self, name: str, now: float) -> None:
        """A batch of ``name`` began: it becomes the most recently used."""
        self.entry(name).last_used = now

    def loaded(self, name: str, charge: int) -> None:
        """The load ended well; ``charge`` is what it measured (it replaces the reservation,
        which may leave the cache over budget until ``plan`` evicts the difference)."""
        e = self.entry(name)
        if e.residency is Residency.LOADING:
            e.loads += 1
        e.residency, e.charge, e.reason = Residency.RESIDENT, charge, None

    def evicting(self, name: str) -> None:
        """An eviction began elsewhere (an operator's evict): its bytes count until ``released``."""
        e = self.entry(name)
        if e.residency in HOLDING:
            e.residency = Residency.EVICTING

    def released(self, name: str, disabled: bool = False) -> None:
        """The model holds nothing now (its eviction ended, it was unloaded: ``disabled``, or a
        load it was granted was not wanted any more). Requests for it are forgotten: the
        caller asks again for calls still waiting."""
        e = self.entry(name)
        if e.residency is Residency.EVICTING:
            e.evictions += 1
        if e.residency is not Residency.FAILED or disabled:
            e.residency = Residency.UNLOADED if disabled else Residency.EVICTED
        e.wanted_since, e.rt_waiting = None, False

    def failed(self, name: str, reason: str) -> None:
        """Its load failed: it holds nothing, its waiting requests were answered."""
        e = self.entry(name)
        e.residency, e.reason = Residency.FAILED, reason
        e.wanted_since, e.rt_waiting = None, False

    # -- views -----------------------------------------------------------------------------

    def holding(self) -> Iterator[Entry]:
        return (e for e in self.entries.values() if e.residency in HOLDING)

    @property
    def reserved(self) -> int:
        """Bytes resident, loading and evicting models hold or will hold."""
        return sum(e.charge for e in self.holding())

    def lru(self) -> list[str]:
        """Resident models, least recently used first."""
        resident = [e for e in self.entries.values() if e.residency is Residency.RESIDENT]
        return [e.name for e in sorted(resident, key=_age)]

    def load_queue(self) -> list[str]:
        """Models waiting to load, in the order they will: real-time waiting first, then oldest."""
        wanted = [e for e in self.entries.values() if e.wanted_since is not None]
        return [e.name for e in sorted(wanted, key=lambda e: (not e.rt_waiting, e.wanted_since, e.name))]

    # -- the decision ----------------------------------------------------------------------

    def plan(self, now: float, busy: Collection[str] = ()) -> Plan:
        """Evictions and loads to start now (applied to the cache already: victims are
        EVICTING, loads LOADING with their bytes reserved). ``busy``: models that must not
        be evicted now (a running or suspended batch, a reconfiguration)."""
        out = Plan()
        budget = self.budget if self.budget is not None else float("inf")
        max_resident = self.max_resident if self.max_resident is not None else float("inf")
        # A load may measure more than it reserved: give back the difference first.
        self._make_room(0, 0, budget, max_resident, busy, out)
        loading = sum(1 for e in self.entries.values() if e.residency is Residency.LOADING)
        for name in self.load_queue():
            if loading >= self.max_loads:
                break
            e = self.entries[name]
            if e.residency is Residency.EVICTING:
                continue  # loads again once its eviction ends
            kept = sum(k.charge for k in self.holding() if k.keep_resident and k.name != name)
            if e.charge > budget - kept:
                why = (f"model {name!r} needs {e.charge} bytes but the memory budget of {self.budget} bytes leaves it "
                       f"{max(0, self.budget - kept) if self.budget is not None else 0} (keep_resident models hold "
                       f"{kept})")
                self.failed(name, why)
                out.refuse[name] = why
                continue
            if not self._make_room(e.charge, 1, budget, max_resident, busy, out):
                break  # wait for victims to release, or for a busy model to end its batch
            e.residency, e.reason, e.last_used = Residency.LOADING, None, now
            e.wanted_since, e.rt_waiting = None, False
            out.load.append(name)
            loading += 1
        return out

    def _make_room(self, need: int, models: int, budget: float, max_resident: float, busy: Collection[str],
                   out: Plan) -> bool:
        """Whether ``need`` more bytes and ``models`` more models fit now; if not, start
        evicting LRU victims that make them fit (False until they have released)."""
        holding = list(self.holding())
        free = budget - sum(e.charge for e in holding)
        slots = max_resident - len(holding)
        if free >= need and slots >= models:
            return True
        evicting = [e for e in holding if e.residency is Residency.EVICTING]
        free += sum(e.charge for e in evicting)
        slots += len(evicting)
        victims = []
        for e in sorted((e for e in holding if e.residency is Residency.RESIDENT and not e.keep_resident
                         and e.name not in busy), key=_age):
            if free >= need and slots >= models:
                break
            victims.append(e)
            free += e.charge
            slots += 1
        if free >= need and slots >= models:
            for v in victims:
                v.residency = Residency.EVICTING
                out.evict.append(v.name)
        return False


def _age(e: Entry) -> tuple[float, str]:
    return (e.last_used if e.last_used is not None else float("-inf"), e.name)
