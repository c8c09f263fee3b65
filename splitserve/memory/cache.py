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
  models that are busy now, nothing happens until the caller plans again (a batch ended);
* device memory is a budget of its own per GPU partition (a whole GPU or a MIG device,
  by UUID), never mixed with host bytes: a model's ``device_charge`` names what it holds on
  each partition (every instance's copy: a GPU instance holds its own weights), and a
  victim is taken, still in LRU order, only if it frees something that is short (host
  bytes, a model slot, or bytes on a partition the load needs), so a load on one GPU never
  evicts a model that holds nothing there when only that GPU is full.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
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
    charge: int = 0  # host bytes it holds (or would hold once loaded)
    device_charge: dict[str, int] = field(default_factory=dict)  # partition UUID -> device bytes, all instances
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

    def __init__(self, budget: int | None, max_resident: int | None, max_loads: int = 1,
                 device_budget: int | None = None) -> None:
        self.budget = budget
        self.device_budget = device_budget  # bytes per GPU partition (None: device memory unbudgeted)
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

    def loaded(self, name: str, charge: int, device_charge: Mapping[str, int] | None = None) -> None:
        """The load ended well; ``charge`` (host bytes) and ``device_charge`` (per partition;
        None: as reserved) are what it measured: they replace the reservation, which may leave
        the cache over budget until ``plan`` evicts the difference."""
        e = self.entry(name)
        if e.residency is Residency.LOADING:
            e.loads += 1
        e.residency, e.charge, e.reason = Residency.RESIDENT, charge, None
        if device_charge is not None:
            e.device_charge = dict(device_charge)

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
        """Host bytes resident, loading and evicting models hold or will hold."""
        return sum(e.charge for e in self.holding())

    def device_reserved(self) -> dict[str, int]:
        """Device bytes per partition that resident, loading and evicting models hold or will hold."""
        out: dict[str, int] = {}
        for e in self.holding():
            for dev, n in e.device_charge.items():
                out[dev] = out.get(dev, 0) + n
        return out

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
        self._make_room({}, budget, max_resident, busy, out)
        loading = sum(1 for e in self.entries.values() if e.residency is Residency.LOADING)
        for name in self.load_queue():
            if loading >= self.max_loads:
                break
            e = self.entries[name]
            if e.residency is Residency.EVICTING:
                continue  # loads again once its eviction ends
            why = self._never_fits(e, budget)
            if why is not None:
                self.failed(name, why)
                out.refuse[name] = why
                continue
            if not self._make_room(_holds(e), budget, max_resident, busy, out):
                break  # wait for victims to release, or for a busy model to end its batch
            e.residency, e.reason, e.last_used = Residency.LOADING, None, now
            e.wanted_since, e.rt_waiting = None, False
            out.load.append(name)
            loading += 1
        return out

    def _never_fits(self, e: Entry, budget: float) -> str | None:
        """Why ``e`` cannot fit even with every evictable model gone (None: it can)."""
        kept = [k for k in self.holding() if k.keep_resident and k.name != e.name]
        host_kept = sum(k.charge for k in kept)
        if e.charge > budget - host_kept:
            return (f"model {e.name!r} needs {e.charge} bytes but the memory budget of {self.budget} bytes leaves it "
                    f"{max(0, self.budget - host_kept) if self.budget is not None else 0} (keep_resident models hold "
                    f"{host_kept})")
        if self.device_budget is None:
            return None
        for dev, need in sorted(e.device_charge.items()):
            dev_kept = sum(k.device_charge.get(dev, 0) for k in kept)
            if need > self.device_budget - dev_kept:
                return (f"model {e.name!r} needs {need} bytes of device memory on {dev} but the device budget of "
                        f"{self.device_budget} bytes leaves it {max(0, self.device_budget - dev_kept)} "
                        f"(keep_resident models hold {dev_kept} there)")
        return None

    def _room(self, holding: list[Entry], budget: float, max_resident: float) -> dict[str, float]:
        """What is free now: host bytes, model slots, and device bytes per partition."""
        room: dict[str, float] = {_BYTES: budget - sum(e.charge for e in holding), _MODELS: max_resident - len(holding)}
        device_budget = self.device_budget if self.device_budget is not None else float("inf")
        for e in holding:
            for dev in e.device_charge:
                room.setdefault(_device(dev), device_budget)
        for e in holding:
            for dev, n in e.device_charge.items():
                room[_device(dev)] -= n
        return room

    def _make_room(self, want: Mapping[str, int], budget: float, max_resident: float, busy: Collection[str],
                   out: Plan) -> bool:
        """Whether ``want`` (``_holds`` of a load; empty: nothing more) fits now; if not, start
        evicting LRU victims that make it fit (False until they have released). A victim is
        taken only if it frees something that is short."""
        holding = list(self.holding())
        room = self._room(holding, budget, max_resident)
        device_budget = self.device_budget if self.device_budget is not None else float("inf")
        for key in want:
            room.setdefault(key, device_budget)  # a partition nothing holds yet

        def short() -> list[str]:
            return [k for k, free in room.items() if free < want.get(k, 0)]

        if not short():
            return True
        for e in holding:
            if e.residency is Residency.EVICTING:
                _add(room, _holds(e))
        victims = []
        for e in sorted((e for e in holding if e.residency is Residency.RESIDENT and not e.keep_resident
                         and e.name not in busy), key=_age):
            lacking = short()
            if not lacking:
                break
            held = _holds(e)
            if not any(held.get(k, 0) > 0 for k in lacking):
                continue  # it frees nothing that is short (it holds nothing on the full GPU)
            victims.append(e)
            _add(room, held)
        if not short():
            for v in victims:
                v.residency = Residency.EVICTING
                out.evict.append(v.name)
        return False


_BYTES, _MODELS = "bytes", "models"


def _device(uuid: str) -> str:
    return f"device:{uuid}"


def _holds(e: Entry) -> dict[str, int]:
    """What ``e`` holds (or will hold) in each resource ``_room`` counts."""
    held = {_BYTES: e.charge, _MODELS: 1}
    held.update((_device(dev), n) for dev, n in e.device_charge.items())
    return held


def _add(room: dict[str, float], held: Mapping[str, int]) -> None:
    for k, n in held.items():
        room[k] = room.get(k, 0) + n


def _age(e: Entry) -> tuple[float, str]:
    return (e.last_used if e.last_used is not None else float("-inf"), e.name)
