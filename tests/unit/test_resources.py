"""The node's resource manager over synthetic topologies: partitions never collide unless
both sides ask to share, refusals name what is in use, and Packrat plans inside its budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.errors import InvalidInput, ResourcesUnavailable
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.packrat import PackratConfig, PackratController
from splitserve.placement.partition import CoreBudget, Cpus, ExactCpus, InstancePlacement, cpu_list
from splitserve.placement.resources import ResourceManager
from splitserve.placement.topology import Core
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import InstanceView, PriorityMode, decide


def node(sockets: int = 2, per_socket: int = 8) -> list[Core]:
    """``sockets`` x ``per_socket`` cores, no SMT: CPUs numbered socket by socket."""
    return [Core(cpu=s * per_socket + k, core=k, socket=s) for s in range(sockets) for k in range(per_socket)]


def profile(name: str, max_threads: int = 8) -> LatencyProfile:
    """Thin instances win: latency grows with the batch and shrinks sub-linearly with threads."""
    return LatencyProfile(name, {(t, b): 1e-3 + b * 1e-4 * (0.5 + 0.5 / t)
                                 for t in range(1, max_threads + 1) for b in (1, 2, 4, 8, 16)})


def packrat(rm: ResourceManager, name: str, budget: int, batch: int = 16) -> list[frozenset[int]]:
    """Load a Packrat model the way the runtime will: a budget, a plan inside it, each instance placed."""
    part = rm.allocate(name, CoreBudget(budget))
    pc = PackratController(PackratConfig(threads=budget, batch=batch), profile(name), 16, rm.cores_of(part.id))
    for i, p in enumerate(pc.placements(pc.plan())):
        rm.place(name, i, p)
    return [rm.instance_cpus(name, i) for i in range(len(pc.placements(pc.plan())))]


def fixed(rm: ResourceManager, name: str, instances: int, threads: int) -> list[frozenset[int]]:
    """Load a fixed model: one partition of ``threads`` CPUs per instance."""
    for i in range(instances):
        part = rm.allocate(name, Cpus(threads))
        rm.place(name, i, InstancePlacement(threads, 4, part.cpus))
    return [rm.instance_cpus(name, i) for i in range(instances)]


def test_two_packrat_models_and_a_fixed_model_get_disjoint_cpus():
    rm = ResourceManager(node())
    a = packrat(rm, "a", budget=6)
    b = packrat(rm, "b", budget=6)
    f = fixed(rm, "f", instances=2, threads=2)
    every = [c for cpus in a + b + f for c in cpus]
    assert len(every) == len(set(every)) == 16  # the whole node, nothing pinned twice
    budgets = {p.owner: p.cpus for p in rm.partitions() if isinstance(p.request, CoreBudget)}
    assert all(c <= budgets["a"] for c in a) and all(c <= budgets["b"] for c in b)
    # A budget that fits a socket stays on it.
    assert budgets["a"] == frozenset(range(6)) and budgets["b"] == frozenset(range(8, 14))


def test_an_oversubscribed_request_is_refused_naming_what_is_in_use():
    rm = ResourceManager(node(sockets=1, per_socket=8))
    packrat(rm, "resnet", budget=6)
    with pytest.raises(ResourcesUnavailable) as e:
        rm.allocate("bert", CoreBudget(4))
    assert "'bert' asks for a budget of 4 cores but only 2 are free (6-7)" in e.value.message
    assert "'resnet' holds 0-5" in e.value.message
    assert rm.free_cpus() == {6, 7}  # a refusal takes nothing


def test_explicit_cpus_of_two_models_overlap_only_when_both_ask_to_share():
    rm = ResourceManager(node())
    rm.allocate("a", ExactCpus(frozenset({0, 1})))
    refusal = r"'b' asks for CPUs 1-2 \(shared\) but finds 1 held by 'a' \(CPUs 0-1, not shared\)"
    with pytest.raises(ResourcesUnavailable, match=refusal):
        rm.allocate("b", ExactCpus(frozenset({1, 2}), share=True))  # a wants its CPUs to itself
    rm.allocate("c", ExactCpus(frozenset({4, 5}), share=True))
    with pytest.raises(ResourcesUnavailable, match="both must ask to share"):
        rm.allocate("d", ExactCpus(frozenset({5})))  # d did not ask
    shared = rm.allocate("d", ExactCpus(frozenset({5, 6}), share=True))
    assert shared.cpus == {5, 6} and shared.shared
    # Shared CPUs are never handed out to a count or a budget.
    assert rm.free_cpus() == set(range(16)) - {0, 1, 4, 5, 6}
    assert not rm.allocate("e", Cpus(9)).cpus & {0, 1, 4, 5, 6}


def test_explicit_cpus_the_node_lacks_are_invalid_input():
    rm = ResourceManager(node(sockets=1, per_socket=4))
    with pytest.raises(InvalidInput, match="CPUs 9, which this node does not have"):
        rm.allocate("a", ExactCpus(frozenset({1, 9})))


def test_a_packrat_budget_bounds_its_plan():
    rm = ResourceManager(node())
    part = rm.allocate("m", CoreBudget(4))
    # The config asks for 12 threads; the budget granted 4, and the plan stays inside them.
    pc = PackratController(PackratConfig(threads=12, batch=16), profile("m"), 16, rm.cores_of(part.id))
    placements = pc.placements(pc.plan())
    assert pc.plan().total_threads <= 4
    assert set().union(*(p.cpus for p in placements)) <= part.cpus
    assert sum(p.batch for p in placements) == 16


def test_resize_of_a_packrat_model_goes_through_its_plan():
    pc = PackratController(PackratConfig(threads=4, batch=10), profile("m"), 16, node(1, 4))
    plan = pc.resize_plan(3)
    placements = pc.placements(plan)
    assert sorted((p.threads, p.batch) for p in placements) == [(1, 3), (1, 3), (2, 4)]
    assert plan.total_batch == 10 and plan.total_threads == 4  # Packrat's B, not max_batch per instance
    with pytest.raises(InvalidInput, match="1..4 instances, not 5"):
        pc.resize_plan(5)


def test_release_returns_the_cpus_and_forgets_the_instances():
    rm = ResourceManager(node(sockets=1, per_socket=8))
    packrat(rm, "a", budget=4)
    fixed(rm, "f", instances=2, threads=2)
    assert rm.free_cpus() == set()
    gone = rm.release("a")
    assert [p.owner for p in gone] == ["a"] and rm.free_cpus() == {0, 1, 2, 3}
    assert rm.instance_cpus("a", 0) == frozenset() and "a" not in rm.placement()
    assert rm.allocate("b", Cpus(4)).cpus == {0, 1, 2, 3}


def test_unplacing_an_instance_returns_its_own_partition_but_keeps_a_budget():
    rm = ResourceManager(node(sockets=1, per_socket=8))
    fixed(rm, "f", instances=2, threads=2)
    packrat(rm, "p", budget=4)
    back = rm.unplace("f", 1)
    assert back is not None and back.cpus == {2, 3} and rm.free_cpus() == {2, 3}
    assert rm.unplace("p", 0) is None and rm.free_cpus() == {2, 3}  # the budget stays with p
    assert rm.unplace("f", 1) is None  # already gone


def test_instances_of_one_budget_cannot_be_placed_on_each_other():
    rm = ResourceManager(node(sockets=1, per_socket=4))
    rm.allocate("m", CoreBudget(4))
    rm.place("m", 0, InstancePlacement(4, 8, frozenset(range(4))))
    with pytest.raises(ResourcesUnavailable, match="its instance 0 still holds; drain that instance first"):
        rm.place("m", 1, InstancePlacement(2, 4, frozenset({0, 1})))
    with pytest.raises(InvalidInput, match=r"CPUs 7 are outside its partitions \(0-3\)"):
        rm.place("m", 1, InstancePlacement(1, 4, frozenset({7})))
    rm.unplace("m", 0)
    rm.place("m", 1, InstancePlacement(2, 4, frozenset({0, 1})))
    assert rm.idle_cpus(["m"]) == {2, 3}


def test_snapshot_and_claims_lookup_show_each_partition_and_its_instances():
    rm = ResourceManager(node(sockets=1, per_socket=4))
    fixed(rm, "f", instances=1, threads=2)
    snap = rm.snapshot()
    assert snap["free"] == [2, 3]
    assert snap["partitions"] == [{
        "id": 1, "owner": "f", "kind": "cpus", "request": "2 CPUs", "cpus": [0, 1], "shared": False,
        "instances": [{"instance": 0, "threads": 2, "batch": 4, "cpus": [0, 1], "shared": False}],
    }]
    assert rm.snapshot("other")["partitions"] == []
    assert rm.instance_cpus("f", 0) == {0, 1}  # what the coordinator's REEF claims read
    assert rm.partition_of("f", 0).id == 1


def test_reef_claims_from_the_manager_preempt_only_instances_on_the_claimed_cpus():
    rm = ResourceManager(node(sockets=1, per_socket=8))
    pk = packrat(rm, "be", budget=6)
    fixed(rm, "rt", instances=1, threads=2)
    # The coordinator's view, with each instance's CPUs looked up in the manager.
    view = [InstanceView("rt", 0, rm.instance_cpus("rt", 0), ready=True, running_cls=RequestClass.RT, running_batch=1)]
    view += [InstanceView("be", i, rm.instance_cpus("be", i), ready=True, running_cls=RequestClass.BE,
                          running_batch=10 + i) for i in range(len(pk))]
    d = decide(PriorityMode.REEF, view)
    assert d.preempt == []  # RT claims CPUs 6-7 only; Packrat's BE batches run on 0-5
    assert all(d.padding_deadline.get(("be", i)) is not None for i in range(len(pk)))


def test_cpu_list_is_the_kernels_form():
    assert cpu_list([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert cpu_list([]) == "none"


# -- properties -------------------------------------------------------------------------------

_requests = st.one_of(
    st.builds(Cpus, st.integers(1, 6)),
    st.builds(CoreBudget, st.integers(1, 6)),
    st.builds(ExactCpus, st.frozensets(st.integers(0, 11), min_size=1, max_size=4), st.booleans()),
)
_ops = st.lists(st.one_of(
    st.tuples(st.just("allocate"), st.sampled_from("abcd"), _requests),
    st.tuples(st.just("release"), st.sampled_from("abcd"), st.none()),
), max_size=30)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_no_cpu_is_ever_double_booked(ops):
    rm = ResourceManager(node(sockets=2, per_socket=6))
    for op, owner, request in ops:
        if op == "release":
            rm.release(owner)
        else:
            free_before = rm.free_cpus()
            try:
                part = rm.allocate(owner, request)
            except ResourcesUnavailable:
                # Refused only when it truly cannot be met.
                if isinstance(request, ExactCpus):
                    assert any(p.cpus & request.cpus and not (p.shared and request.share) for p in rm.partitions())
                else:
                    assert request.count > len(free_before)
            else:
                want = request.count if not isinstance(request, ExactCpus) else len(request.cpus)
                assert len(part.cpus) == want
        parts = rm.partitions()
        for i, p in enumerate(parts):
            for q in parts[i + 1:]:
                assert not p.cpus & q.cpus or (p.shared and q.shared)
        held = {c for p in parts for c in p.cpus}
        assert rm.free_cpus() == rm.cpus - held
