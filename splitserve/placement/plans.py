"""A change of placement across several models, as the ordered steps one applier carries out.

Any decider (Packrat's repack, a resize, later PROTEAN) says what it wants: per model, the
list of ``InstancePlacement`` it should run. ``plan_change`` compares that with what runs
now and returns waves of steps. Pure: no clock, no processes; ``ResourceManager.placement()``
and ``idle_cpus()`` give its inputs on a live node.

The node's applier (``server.applier.PlacementApplier``) runs each ``Wave`` in order, all of a wave's steps of one
kind together:

1. ``Start``: start these instances as standby (not yet dispatched to) and wait until every
   one is ready; ``ResourceManager.place`` each before its worker starts.
2. ``Switch``: per model, make the started standby instances serve and stop dispatching to the
   retired ones (``ModelScheduler.activate``); on a model's ``final`` switch its decider's
   settings follow (Packrat's aggregation target).
3. ``Drain``: let the retired instances finish their batches, stop them and ``unplace`` them
   (a partition made for one instance goes back to the node with it).

If a start fails, the applier drains the standby instances of that wave and stops: what was
serving still serves, and the steps already done left the node consistent.

The ordering rule. An instance starts only on CPUs that no running instance holds (two
instances may hold a CPU only if both are ``shared``), so no CPU is ever double-booked; and a
model that serves keeps at least one serving instance at every step, so no request is left
unanswered. Instances that do not change are kept as they are. A model's new instances start
as soon as their CPUs are free; the model switches once all of them are up, which frees its
old instances' CPUs for the next wave (another model's, say). When nothing can start, a model
whose old instances stand in the way retires them early, as many as it can while something
else of it still serves (a rolling change). When even that cannot help (say a model's only
instance holds every CPU its new set needs) the change is refused with
``ResourcesUnavailable``: it needs spare CPUs for a standby set, or a pause in service that
this applier never takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.errors import InvalidInput, ResourcesUnavailable
from splitserve.placement.partition import InstancePlacement, cpu_list

# What runs now: per model, instance id -> its placement.
Current = Mapping[str, Mapping[int, InstancePlacement]]
# What a decider wants: per model, the placements of all its instances (unchanged ones too).
Wanted = Mapping[str, Sequence[InstancePlacement]]


@dataclass(frozen=True)
class Start:
    """Start one instance of ``model`` as standby. ``index`` is its position in
    ``wanted[model]``; later steps name it by that index, the applier keeps the instance id."""

    model: str
    index: int
    placement: InstancePlacement


@dataclass(frozen=True)
class Switch:
    """Dispatch to the standby instances ``activate`` (indexes into ``wanted[model]``) and no
    longer to the running instances ``retire`` (instance ids). ``final`` is the model's last
    switch: its decider's settings follow then."""

    model: str
    activate: tuple[int, ...]
    retire: tuple[int, ...]
    final: bool


@dataclass(frozen=True)
class Drain:
    """Drain, stop and release the retired instances ``instances`` (ids) of ``model``."""

    model: str
    instances: tuple[int, ...]


@dataclass(frozen=True)
class Wave:
    """Steps the applier runs together: all starts, then all switches, then all drains."""

    start: tuple[Start, ...] = ()
    switch: tuple[Switch, ...] = ()
    drain: tuple[Drain, ...] = ()


# A running instance: (model, "cur", instance id) or (model, "new", index into wanted).
_Key = tuple[str, str, int]


class _Change:
    """The planner's state while it walks from ``current`` to ``wanted``."""

    def __init__(self, current: Current, wanted: Wanted) -> None:
        self.wanted = wanted
        self.live: dict[_Key, InstancePlacement] = {
            (m, "cur", i): p for m, insts in current.items() for i, p in insts.items()
        }
        self.serving: dict[str, set[_Key]] = {m: {(m, "cur", i) for i in insts} for m, insts in current.items()}
        self.pending: dict[str, list[int]] = {}
        self.retire: dict[str, set[int]] = {}
        self.standby: dict[str, list[int]] = {m: [] for m in wanted}
        for m, want in wanted.items():
            unmatched = dict(current.get(m, {}))
            self.pending[m] = []
            for idx, p in enumerate(want):
                same = next((i for i, q in sorted(unmatched.items()) if q == p), None)
                if same is None:
                    self.pending[m].append(idx)
                else:
                    del unmatched[same]
            self.retire[m] = set(unmatched)

    def holders(self, p: InstancePlacement) -> list[tuple[_Key, frozenset[int]]]:
        """Running instances that hold a CPU ``p`` needs, with those CPUs."""
        out = []
        for key, q in self.live.items():
            clash = p.clashes(q)
            if clash:
                out.append((key, clash))
        return out

    def start_wave(self) -> list[Start]:
        starts = []
        for m in sorted(self.wanted):
            for idx in list(self.pending[m]):
                p = self.wanted[m][idx]
                if not self.holders(p):
                    self.live[(m, "new", idx)] = p
                    self.pending[m].remove(idx)
                    self.standby[m].append(idx)
                    starts.append(Start(m, idx, p))
        return starts

    def switch(self, m: str, retire: list[int], final: bool) -> Switch:
        activate = tuple(self.standby[m])
        self.serving.setdefault(m, set()).update((m, "new", i) for i in activate)
        self.standby[m] = []
        for i in retire:
            self.serving[m].discard((m, "cur", i))
            self.retire[m].discard(i)
            del self.live[(m, "cur", i)]
        return Switch(m, activate, tuple(retire), final)

    def blocking(self) -> set[_Key]:
        """Running instances due to retire that stand in the way of a pending start (only
        running ones can: ``_check`` refused wanted instances that clash with each other)."""
        keys = set()
        for m, idxs in self.pending.items():
            for idx in idxs:
                keys |= {k for k, _ in self.holders(self.wanted[m][idx]) if k[2] in self.retire.get(k[0], ())}
        return keys

    def early_retire(self) -> tuple[list[Switch], list[Drain]]:
        """Retire blocking instances while each model keeps one serving (rolling change)."""
        blocking = self.blocking()
        switches, drains = [], []
        for m in sorted(self.wanted):
            chosen: list[int] = []
            left = set(self.serving.get(m, set())) | {(m, "new", i) for i in self.standby[m]}
            for i in sorted(self.retire[m]):
                key = (m, "cur", i)
                if key in blocking and left - {key}:
                    chosen.append(i)
                    left.discard(key)
            if chosen:
                switches.append(self.switch(m, chosen, final=False))
                drains.append(Drain(m, tuple(chosen)))
        return switches, drains

    def stuck_message(self) -> str:
        parts = []
        for m in sorted(self.pending):
            for idx in self.pending[m]:
                p = self.wanted[m][idx]
                # Only running instances can hold them: ``_check`` refused wanted ones that clash.
                held = "; ".join(f"{cpu_list(c)} held by {k[0]!r} instance {k[2]}" for k, c in self.holders(p))
                parts.append(f"{m!r} new instance {idx} (CPUs {cpu_list(p.cpus)}) needs {held}")
        return (
            "the placement change cannot be made without a pause in service: " + "; ".join(parts) +
            ". Each of those instances is its model's last serving one: free CPUs for a standby set "
            "(the change then starts it beside the running one), or give the model a second instance first"
        )


def _check(current: Current, wanted: Wanted, free: frozenset[int]) -> None:
    """Refuse a wanted placement that could not hold even once every step is done."""
    for m, want in wanted.items():
        if not want:
            raise InvalidInput(f"the placement change leaves {m!r} without instances; unload it instead")
    changing = {c for m in wanted for p in current.get(m, {}).values() for c in p.cpus}
    others = [(m, f"instance {i}", p) for m, insts in current.items() if m not in wanted for i, p in insts.items()]
    final = [(m, f"wanted instance {idx}", p) for m, want in wanted.items() for idx, p in enumerate(want)] + others
    held_by_others = {c for _, _, q in others for c in q.cpus}
    for m, want in wanted.items():
        for idx, p in enumerate(want):
            elsewhere = p.cpus - free - changing - held_by_others
            if elsewhere:
                raise ResourcesUnavailable(
                    f"{m!r} wanted instance {idx} asks for CPUs {cpu_list(elsewhere)}, which are neither free nor held "
                    f"by the models being changed (free: {cpu_list(free)}); allocate them to {m!r} first"
                )
    for a, (ma, na, pa) in enumerate(final):
        for mb, nb, pb in final[a + 1:]:
            clash = pa.clashes(pb)
            if clash:
                raise ResourcesUnavailable(
                    f"the wanted placement puts {ma!r} {na} and {mb!r} {nb} both on CPUs {cpu_list(clash)}; "
                    "two instances share a CPU only when both are shared"
                )


def plan_change(current: Current, wanted: Wanted, free: frozenset[int]) -> tuple[Wave, ...]:
    """The waves that take the node from ``current`` to ``wanted`` (see the module doc).

    ``current`` lists every running instance of the node (untouched models included, so no
    new instance lands on their CPUs); ``wanted`` lists only the models to change, each with
    all of its instances; ``free`` is the CPUs no instance holds that the change may use
    (``ResourceManager.idle_cpus`` of the changing models). Models absent from ``wanted`` are
    not touched. Raises ResourcesUnavailable when the wanted placement double-books a CPU or
    uses CPUs it was not given, or when no order keeps every serving model served.
    """
    _check(current, wanted, free)
    change = _Change(current, wanted)
    waves: list[Wave] = []
    while any(change.pending.values()) or any(change.retire.values()) or any(change.standby.values()):
        starts = change.start_wave()
        switches: list[Switch] = []
        drains: list[Drain] = []
        for m in sorted(wanted):
            if not change.pending[m] and (change.standby[m] or change.retire[m]):
                retire = sorted(change.retire[m])
                switches.append(change.switch(m, retire, final=True))
                if retire:
                    drains.append(Drain(m, tuple(retire)))
        if not starts and not switches:
            switches, drains = change.early_retire()
            if not switches:
                raise ResourcesUnavailable(change.stuck_message())
        waves.append(Wave(tuple(starts), tuple(switches), tuple(drains)))
    return tuple(waves)
