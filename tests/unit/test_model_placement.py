"""``ModelPlacement``: a model on as many nodes as its demand and the nodes' room ask, at
least ``min_nodes``, stable, with a keep-alive; a fake clock, no Ray."""

from __future__ import annotations

import pytest

from splitserve.cluster.policy.placement import ModelPlacement, NodeRoom
from splitserve.errors import InvalidInput

NODES = [NodeRoom(f"n{i}") for i in range(4)]


def _copies(plan: dict[str, frozenset[str]], model: str) -> set[str]:
    return {n for n, held in plan.items() if model in held}


def _holding(plan: dict[str, frozenset[str]], room: int | None = None) -> list[NodeRoom]:
    """The nodes once they hold what ``plan`` gave them."""
    return [NodeRoom(n, held, room) for n, held in plan.items()]


def test_a_model_is_on_min_nodes_when_idle_and_on_more_as_its_requests_rise():
    p = ModelPlacement(requests_per_node=8, min_nodes=2, keep_alive_s=60)
    plan = p.plan(0.0, {}, ["m"], NODES)
    assert len(_copies(plan, "m")) == 2  # not every node: nothing asks for more
    plan = p.plan(1.0, {"m": 17}, ["m"], _holding(plan))
    assert len(_copies(plan, "m")) == 3  # 17 held at 8 per node
    assert len(_copies(p.plan(2.0, {"m": 500}, ["m"], _holding(plan)), "m")) == 4  # all nodes, no more


def test_a_model_registered_now_is_placed_at_once_and_a_single_node_cluster_holds_everything():
    p = ModelPlacement(requests_per_node=8, min_nodes=2, keep_alive_s=60)
    assert p.plan(0.0, {}, ["a", "b"], [NodeRoom("only")]) == {"only": frozenset({"a", "b"})}


def test_a_count_that_falls_stays_up_for_the_keep_alive_then_drops():
    p = ModelPlacement(requests_per_node=8, min_nodes=1, keep_alive_s=60)
    busy = p.plan(0.0, {"m": 32}, ["m"], NODES)
    assert len(_copies(busy, "m")) == 4
    assert p.plan(59.0, {}, ["m"], _holding(busy)) == busy  # a lull: nothing unloads
    quiet = p.plan(60.0, {}, ["m"], _holding(busy))
    assert len(_copies(quiet, "m")) == 1 and _copies(quiet, "m") <= _copies(busy, "m")


def test_placement_is_stable_and_new_copies_go_to_the_nodes_holding_fewest():
    p = ModelPlacement(requests_per_node=8, min_nodes=1, keep_alive_s=0)
    nodes = [NodeRoom("n0", frozenset({"a"})), NodeRoom("n1", frozenset({"b"})), NodeRoom("n2"), NodeRoom("n3")]
    plan = p.plan(0.0, {"a": 8, "b": 8}, ["a", "b"], nodes)
    assert plan == {"n0": {"a"}, "n1": {"b"}, "n2": set(), "n3": set()}  # nothing moves
    plan = p.plan(1.0, {"a": 16, "b": 8}, ["a", "b"], _holding(plan))
    assert _copies(plan, "a") == {"n0", "n2"} and _copies(plan, "b") == {"n1"}
    assert p.plan(2.0, {"a": 16, "b": 8}, ["a", "b"], _holding(plan)) == plan  # the same input, the same plan


def test_where_room_is_short_every_model_gets_a_node_before_any_gets_two_the_busiest_first():
    p = ModelPlacement(requests_per_node=1, min_nodes=1, keep_alive_s=0)
    nodes = [NodeRoom(f"n{i}", room=1) for i in range(3)]
    plan = p.plan(0.0, {"hot": 50, "warm": 5, "cold": 0}, ["cold", "hot", "warm"], nodes)
    assert all(len(held) == 1 for held in plan.values())
    assert {m for held in plan.values() for m in held} == {"hot", "warm", "cold"}
    two_nodes = [NodeRoom(f"n{i}", room=1) for i in range(2)]
    crowded = p.plan(1.0, {"hot": 50, "warm": 5, "cold": 0}, ["cold", "hot", "warm"], two_nodes)
    assert {m for held in crowded.values() for m in held} == {"hot", "warm"}  # the idle one waits for room


def test_an_unregistered_model_leaves_the_plan_and_its_count():
    p = ModelPlacement(requests_per_node=8, min_nodes=1, keep_alive_s=600)
    plan = p.plan(0.0, {"m": 32}, ["m", "x"], NODES)
    assert len(_copies(plan, "m")) == 4
    plan = p.plan(1.0, {}, ["x"], _holding(plan))
    assert _copies(plan, "m") == set()
    assert len(_copies(p.plan(2.0, {}, ["m", "x"], _holding(plan)), "m")) == 1  # registered again: counted anew


def test_bad_settings_are_refused():
    with pytest.raises(InvalidInput, match="min_nodes must be at least 1"):
        ModelPlacement(requests_per_node=8, min_nodes=0, keep_alive_s=0)
