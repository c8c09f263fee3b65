"""Each node-level part gets only the piece of a model it drives: the coordinator the
``dispatch``, the memory manager the ``residency``, the placement applier and the partition
manager the ``placements``; the worker handles report to the ``instances``. Driven with the
fakes of ``test_runtime_seams`` (a fake loop, fake workers, a recording node)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.config import ServerConfig
from splitserve.placement.partition import Partitioning
from splitserve.server.app import Server
from splitserve.server.model.dispatch import Dispatch
from splitserve.server.model.instances import Instances
from splitserve.server.model.placement import ModelPlacement
from splitserve.server.model.residency import ModelResidency
from splitserve.server.ports import ModelState
from tests.unit.test_runtime_seams import BE, Harness

# What each part drives (its seam's members) and members of the other pieces it must not reach.
DISPATCH = {"instance_views", "rt_waiting", "start_batches", "preempt", "clear_preempt", "pad", "kick",
            "direct_activity", "set_direct_bell", "direct_use"}
RESIDENCY = {"charge", "pinned", "holds_memory", "begin_load", "release_residency", "refuse_load"}
PLACEMENT = {"add_standby", "until_ready", "switch", "retire", "changed", "placed_now", "waiting_requests",
             "resize", "placements_on"}
WORKER_OWNER = {"on_ready", "on_done", "on_failed", "on_loaded", "on_load_failed", "on_unloaded", "on_direct",
                "on_exit"}


def _members(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_each_piece_has_its_seam_and_none_of_the_others(h):
    rt = h.rt
    pieces = {"dispatch": (rt.dispatch, DISPATCH), "residency": (rt.residency, RESIDENCY),
              "placements": (rt.placements, PLACEMENT), "instances": (rt.instances, WORKER_OWNER)}
    for name, (piece, seam) in pieces.items():
        members = _members(piece)
        assert seam <= members, f"{name} lacks {seam - members}"
        for other, (_, other_seam) in pieces.items():
            if other != name:
                assert not (other_seam - {"kick", "resize"}) & members, f"{name} reaches {other}'s seam"


def test_the_coordinator_is_handed_the_dispatch_and_the_memory_manager_the_residency(h):
    seen: list[object] = []
    schedule = h.node.schedule

    def recording(model, now):
        seen.append(model)
        return schedule(model, now)

    h.node.schedule = recording  # type: ignore[method-assign]
    h.call(1, bytes([1, 2, 3, 4]))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    h.run_batch(worker)
    assert seen and all(type(m) is Dispatch for m in seen)
    memory = h.rt.core.env.memory
    assert all(type(m) is ModelResidency for m in memory.models.values())
    assert worker.owner is h.rt.instances and type(worker.owner) is Instances
    assert h.sink.answers == [(1, bytes([2, 4, 6, 8]))] and h.rt.state is ModelState.READY


def test_the_node_hands_each_part_only_its_piece(h, tmp_path):
    server = Server(ServerConfig.of(data_dir=tmp_path))
    server.runtimes[h.rt.name] = h.rt
    assert list(server.coordinator.models()) == [h.rt.dispatch]
    piece = server.applier.models(h.rt.name)
    assert piece is h.rt.placements and type(piece) is ModelPlacement
    assert not hasattr(piece, "begin_load") and not hasattr(piece, "start_batches") and not hasattr(piece, "submit")


def test_the_partition_manager_is_handed_the_placement_piece(h, tmp_path):
    server = Server(ServerConfig.of(data_dir=tmp_path, partitioning=Partitioning.COLOCATE))
    server.runtimes[h.rt.name] = h.rt
    assert server.partitions is not None and list(server.partitions.models()) == [h.rt.placements]


def test_a_batch_that_ends_tells_the_coordinator_once_and_the_memory_manager_at_the_next_pass(h):
    told: list[str] = []
    memory = h.rt.core.env.memory
    memory.batch_done = told.append  # type: ignore[method-assign]
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    msg = h.run_batch(worker)
    assert [c for c in h.node.calls if c[0] == "finished"] == [("finished", "double", msg.batch_id, True)]
    assert told == []  # not from inside the worker's report
    h.loop.run()
    assert told == ["double"] and h.rt.queues.rings[BE].in_use == 0


@pytest.mark.parametrize("plain", [True, False], ids=["plain-node", "node-with-priorities"])
def test_a_batch_that_ends_is_followed_by_a_scheduling_pass_only_where_one_could_start_something(h, plain):
    """A batch that ends with a call waiting starts it at the pass that follows; one that
    ends with nothing waiting costs no pass on a node whose pass only starts the model's own
    batches (the front end's path: every call ends a batch on an idle model), and one on a
    node with priorities in play (a pass may preempt or pad others); the memory manager
    hears of both ends, and what waits for the instance to go idle is woken either way."""
    h.node.only_own = plain
    told: list[str] = []
    h.rt.core.env.memory.batch_done = told.append  # type: ignore[method-assign]
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    first = h.run_batch(worker)
    h.call(2, bytes([1, 1, 1, 1]))  # arrives while the first batch's end is being handled
    h.call(3, bytes([2, 2, 2, 2]))
    h.loop.run()
    h.rt.core.changed.clear()
    second = h.run_batch(worker)
    assert second.batch_id != first.batch_id and second.count == 2
    assert h.rt.core.changed.is_set()  # what waits for the instance to go idle (a drain) looks again
    passes = h.node.passes
    h.loop.run()
    assert told == ["double", "double"]
    assert h.node.passes == passes + (0 if plain else 1)  # the second end found nothing waiting
    assert [a[0] for a in h.sink.answers] == [1, 2, 3] and h.rt.queues.rings[BE].in_use == 0


def test_the_memory_manager_is_never_called_back_while_it_plans(h):
    """A load that fails to place, an eviction with nothing left to release: what the model
    reports while it carries out the manager's command comes back with the command."""
    memory = h.rt.core.env.memory
    planning = []
    plan_once = memory._plan_once

    def watched() -> bool:
        planning.append(True)
        try:
            return plan_once()
        finally:
            planning.pop()

    memory._plan_once = watched  # type: ignore[method-assign]
    for name in ("request", "loaded", "evicting", "released", "load_failed", "batch_done", "touch"):
        report = getattr(memory, name)

        def guarded(*args, _report=report, _name=name):
            assert not planning, f"{_name} called back into the manager from inside its plan"
            return _report(*args)

        setattr(memory, name, guarded)
    residency = h.rt.residency
    grant = residency._begin_load

    def granted_too_late() -> None:  # an operator's unload came first: the model holds nothing and says so
        h.rt.core.enabled = False
        grant()

    residency._begin_load = granted_too_late  # type: ignore[method-assign]
    h.call(1, bytes(4))
    (answer,) = h.sink.answers
    assert answer[1].status.name == "MODEL_NOT_READY" and h.workers == []
    assert memory.status()["reserved_bytes"] == 0 and memory.status()["models"]["double"]["residency"] != "LOADING"
