"""``plan_change``: a placement change across several models as ordered waves.

``simulate`` plays the waves the way the applier will and checks, after every step, that no
CPU is held by two instances (unless both share) and that every model that was serving
still has a serving instance, so no request is left without an instance to answer it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.errors import InvalidInput, ResourcesUnavailable
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.packrat import PackratConfig, PackratController
from splitserve.placement.partition import CoreBudget, Cpus, InstancePlacement
from splitserve.placement.plans import Current, Drain, Start, Switch, Wanted, Wave, plan_change
from splitserve.placement.resources import ResourceManager
from splitserve.placement.topology import Core


def inst(*cpus: int, batch: int = 4, shared: bool = False) -> InstancePlacement:
    return InstancePlacement(threads=len(cpus), batch=batch, cpus=frozenset(cpus), shared=shared)


def simulate(current: Current, wanted: Wanted, waves: tuple[Wave, ...]) -> None:
    live = {(m, "cur", i): p for m, insts in current.items() for i, p in insts.items()}
    serving = {m: {(m, "cur", i) for i in insts} for m, insts in current.items() if insts}
    standby: set[tuple[str, str, int]] = set()

    def no_double_booking() -> None:
        items = list(live.items())
        for a, (ka, pa) in enumerate(items):
            for kb, pb in items[a + 1:]:
                assert not pa.clashes(pb), f"{ka} and {kb} both hold {sorted(pa.clashes(pb))}"

    def everyone_served() -> None:
        for m, keys in serving.items():
            assert keys, f"{m} has no serving instance"
            assert keys <= live.keys()

    for wave in waves:
        for s in wave.start:
            key = (s.model, "new", s.index)
            assert key not in live and s.placement == wanted[s.model][s.index]
            live[key] = s.placement
            standby.add(key)
        no_double_booking()
        for sw in wave.switch:
            for idx in sw.activate:
                key = (sw.model, "new", idx)
                standby.remove(key)
                serving.setdefault(sw.model, set()).add(key)
            for i in sw.retire:
                serving[sw.model].remove((sw.model, "cur", i))
        everyone_served()
        for d in wave.drain:
            for i in d.instances:
                key = (d.model, "cur", i)
                assert all(key not in keys for keys in serving.values())
                del live[key]
        everyone_served()
    assert not standby
    for m in set(current) | set(wanted):
        got = Counter(p for (mm, _, _), p in live.items() if mm == m)
        assert got == Counter(wanted[m] if m in wanted else current[m].values())
        assert {k for k in live if k[0] == m} == serving.get(m, set())


def test_a_change_across_two_models_keeps_both_served_and_never_double_books():
    # a moves to free CPUs; b takes the CPUs a leaves: b must wait for a's drain.
    current = {"a": {0: inst(0, 1, 2, 3)}, "b": {0: inst(4, 5), 1: inst(6, 7)}, "c": {0: inst(12)}}
    wanted = {"a": [inst(8, 9), inst(10, 11)], "b": [inst(0, 1, 2, 3, batch=8)]}
    waves = plan_change(current, wanted, free=frozenset(range(8, 12)))
    simulate(current, wanted, waves)
    assert waves == (
        Wave(start=(Start("a", 0, inst(8, 9)), Start("a", 1, inst(10, 11))),
             switch=(Switch("a", (0, 1), (0,), final=True),),
             drain=(Drain("a", (0,)),)),
        Wave(start=(Start("b", 0, inst(0, 1, 2, 3, batch=8)),),
             switch=(Switch("b", (0,), (0, 1), final=True),),
             drain=(Drain("b", (0, 1)),)),
    )


def test_a_model_with_two_instances_rolls_onto_its_own_cpus():
    current = {"m": {0: inst(0, 1), 1: inst(2, 3)}}
    wanted = {"m": [inst(0, batch=2), inst(1, batch=2), inst(2, batch=2), inst(3, batch=2)]}
    waves = plan_change(current, wanted, free=frozenset())
    simulate(current, wanted, waves)
    # The first step retires one old instance early; the other serves meanwhile.
    assert waves[0] == Wave(switch=(Switch("m", (), (0,), final=False),), drain=(Drain("m", (0,)),))


def test_unchanged_instances_are_kept_and_a_resize_only_adds_or_drains():
    current = {"m": {3: inst(0), 5: inst(1)}}
    grow = {"m": [inst(0), inst(1), inst(2)]}
    assert plan_change(current, grow, free=frozenset({2, 3})) == (
        Wave(start=(Start("m", 2, inst(2)),), switch=(Switch("m", (2,), (), final=True),)),)
    shrink = {"m": [inst(1)]}
    assert plan_change(current, shrink, free=frozenset()) == (
        Wave(switch=(Switch("m", (), (3,), final=True),), drain=(Drain("m", (3,)),)),)
    assert plan_change(current, {"m": [inst(1), inst(0)]}, free=frozenset()) == ()


def test_a_change_that_needs_a_pause_in_service_is_refused_naming_the_cpus():
    current = {"m": {0: inst(0, 1, 2, 3)}}
    with pytest.raises(ResourcesUnavailable, match=r"'m' new instance 0 \(CPUs 0-1\) needs 0-1 held by 'm' instance 0"):
        plan_change(current, {"m": [inst(0, 1), inst(2, 3)]}, free=frozenset())


def test_a_wanted_placement_that_double_books_or_takes_others_cpus_is_refused():
    current = {"a": {0: inst(0, 1)}, "b": {0: inst(2, 3)}}
    with pytest.raises(ResourcesUnavailable, match=r"puts 'a' wanted instance 0 and 'b' instance 0 both on CPUs 3"):
        plan_change(current, {"a": [inst(3)]}, free=frozenset({4}))  # b is not being changed
    with pytest.raises(ResourcesUnavailable, match="CPUs 5, which are neither free nor held"):
        plan_change(current, {"a": [inst(4, 5)]}, free=frozenset({4}))
    with pytest.raises(InvalidInput, match="without instances; unload it instead"):
        plan_change(current, {"a": []}, free=frozenset())
    # Shared instances may sit together.
    current = {"a": {0: inst(0, shared=True)}}
    waves = plan_change(current, {"b": [inst(0, shared=True)]}, free=frozenset())
    simulate(current, {"b": [inst(0, shared=True)]}, waves)


def test_a_packrat_repack_and_a_fixed_resize_at_once_through_the_resource_manager():
    """The applier's loop: place each start, unplace each drain; the manager agrees at every step."""
    rm = ResourceManager([Core(cpu=c, core=c, socket=0) for c in range(12)])
    table = {(t, b): 1e-3 + b * 1e-4 * (0.5 + 0.5 / t) for t in range(1, 9) for b in (1, 2, 4, 8, 16)}
    budget = rm.allocate("p", CoreBudget(8))
    pk = PackratController(PackratConfig(threads=8, batch=16), LatencyProfile("p", table), 16, rm.cores_of(budget.id))
    for i, pl in enumerate(pk.placements(pk.resize_plan(2))):
        rm.place("p", i, pl)
    rm.place("f", 0, InstancePlacement(2, 4, rm.allocate("f", Cpus(2)).cpus))
    # Packrat wants four thinner instances in its (full) budget; f grows to two instances.
    grown = rm.allocate("f", Cpus(2))
    wanted = {"p": pk.placements(pk.resize_plan(4)),
              "f": [rm.placement()["f"][0], InstancePlacement(2, 4, grown.cpus)]}
    current = rm.placement()
    waves = plan_change(current, wanted, rm.idle_cpus(wanted))
    simulate(current, wanted, waves)
    assert any(not sw.final for w in waves for sw in w.switch)  # p rolls: its budget has no spare CPU
    ids = {m: max(insts) + 1 for m, insts in current.items()}
    for wave in waves:
        for s in wave.start:
            rm.place(s.model, ids[s.model] + s.index, s.placement)  # refused if it double-booked
        for d in wave.drain:
            for i in d.instances:
                rm.unplace(d.model, i)
    final = rm.placement()
    assert Counter(final["p"].values()) == Counter(wanted["p"]) and Counter(final["f"].values()) == Counter(wanted["f"])
    assert sum(pl.batch for pl in final["p"].values()) == 16 and rm.free_cpus() == set()


# -- properties -------------------------------------------------------------------------------

CPUS = 8
MODELS = "abc"


@st.composite
def changes(draw):
    """A node of CPUS CPUs with disjoint current instances, and a wanted placement for some
    models on CPUs that are free or held by those models."""
    order = draw(st.permutations(range(CPUS)))
    current: dict[str, dict[int, InstancePlacement]] = {}
    pos = 0
    for m in MODELS:
        for i in range(draw(st.integers(0, 2))):
            n = draw(st.integers(1, 2))
            if pos + n > CPUS:
                break
            current.setdefault(m, {})[i] = inst(*order[pos:pos + n])
            pos += n
    changed = draw(st.sets(st.sampled_from(MODELS), min_size=1))
    held = {c for insts in current.values() for p in insts.values() for c in p.cpus}
    untouched = {c for m, insts in current.items() if m not in changed for p in insts.values() for c in p.cpus}
    usable = draw(st.permutations(sorted(set(range(CPUS)) - untouched)))
    wanted: dict[str, list[InstancePlacement]] = {}
    pos = 0
    for m in sorted(changed):
        wanted[m] = []
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(1, 2))
            if pos + n > len(usable):
                break
            wanted[m].append(inst(*usable[pos:pos + n], batch=draw(st.integers(1, 2))))
            pos += n
        if not wanted[m]:
            del wanted[m]
    return current, wanted, frozenset(range(CPUS)) - held


@settings(max_examples=300, deadline=None)
@given(changes())
def test_every_plan_keeps_models_served_and_cpus_single_booked(change):
    current, wanted, free = change
    try:
        waves = plan_change(current, wanted, free)
    except ResourcesUnavailable:
        # Refused only when the new instances need CPUs some running instance holds.
        held = {c for insts in current.values() for p in insts.values() for c in p.cpus}
        assert any(p.cpus & held for want in wanted.values() for p in want)
        return
    simulate(current, wanted, waves)
