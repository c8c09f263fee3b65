"""The node's pool of spare worker processes, with fake workers (no processes): what a take
gets, when a process given back is kept, and that the pool stays bounded and refills
itself; and how a runtime takes, measures and gives back its processes through it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from splitserve.config import ServerConfig
from splitserve.memory.footprints import MemoryFootprint
from splitserve.worker.messages import LoadedMsg
from splitserve.worker.pool import Residency
from splitserve.worker.spares import SparePool
from tests.unit.test_runtime_seams import FakeWorker, Harness

MIB = 1 << 20


class Owner:
    """A runtime as the pool sees it: only whom a worker reports to matters here."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None  # on_ready, on_exit, ...: heard and ignored


class Pool:
    """A pool over fake workers on a real loop (its stops are tasks), recording each start."""

    def __init__(self, tmp_path: Path, node_stopping: bool = False, **settings: Any) -> None:
        self.started: list[FakeWorker] = []
        cfg = ServerConfig.of(data_dir=tmp_path, **settings)
        self.pool = SparePool(cfg, asyncio.get_running_loop(), self.spawn,  # type: ignore[arg-type]
                              lambda: node_stopping)

    def spawn(self, owner: Any, instance: int, make_spec: Any, loop: Any) -> FakeWorker:
        w = FakeWorker(owner, instance, make_spec, loop)
        self.started.append(w)
        return w

    def spares(self) -> list[FakeWorker]:
        return [w for w in self.started if w.owner is self.pool and w.alive]


def bound_then_unloaded(w: FakeWorker) -> FakeWorker:
    """A worker that served a model and released it (UNBOUND again)."""
    if not w.started:
        w.start()
    return w


def run(story: Any) -> None:
    asyncio.run(asyncio.wait_for(story(), 10))


def test_a_take_gets_an_idle_spare_first_then_one_starting_then_a_new_process(tmp_path: Path) -> None:
    async def story() -> None:
        p = Pool(tmp_path, spare_workers=2)
        p.pool.start()
        first, second = p.started
        assert first.instance < 0 and first.owner is p.pool and p.pool.spares == 0
        second.start()  # up: idle
        assert p.pool.spares == 1
        a, b = Owner(), Owner()
        got = p.pool.take(a, 3)  # type: ignore[arg-type]
        assert got is second and got.owner is a and got.instance == 3 and got.residency is Residency.UNBOUND
        third = p.started[-1]  # the pool refilled: two spares starting now
        assert len(p.started) == 3 and third.owner is p.pool
        got = p.pool.take(b, 0)  # type: ignore[arg-type]
        assert got in (first, third) and got.owner is b and got.residency is Residency.STARTING
        got.start()  # it reports READY to its new owner (a FakeWorker calls owner.on_ready)
        off = Pool(tmp_path, spare_workers=0)
        off.pool.start()
        assert off.started == []  # no spares: every take starts a process for its owner
        fresh = off.pool.take(a, 1)  # type: ignore[arg-type]
        assert off.started == [fresh] and fresh.owner is a and fresh.instance == 1

    run(story)


def test_a_process_given_back_is_kept_only_if_its_memory_came_back_and_the_pool_has_room(tmp_path: Path) -> None:
    async def story() -> None:
        p = Pool(tmp_path, spare_workers=1, recycle_slack_bytes=32 * MIB)
        owner = Owner()
        ws = [p.pool.take(owner, i) for i in range(5)]  # type: ignore[arg-type]
        for w in ws:
            bound_then_unloaded(w)  # type: ignore[arg-type]
        start = ws[0].rss_anon_at_start
        assert start is not None
        assert not p.pool.give_back(ws[0], start + 33 * MIB)  # it kept 33 MiB: it exits
        assert p.pool.give_back(ws[1], start + 31 * MIB)  # within the slack: a spare again
        assert ws[1].owner is p.pool and ws[1] in p.pool.idle
        # one more than spare_workers is kept across an eviction, for the load it makes room for
        assert p.pool.give_back(ws[2], start)
        assert not p.pool.give_back(ws[3], start)  # full
        await asyncio.sleep(0)  # the stops are tasks
        assert not ws[0].alive and not ws[3].alive and ws[0].stopping and ws[3].stopping
        assert p.pool.take(owner, 9) is ws[2]  # type: ignore[arg-type]  # the last one given back is taken first
        ws[4].stopping = True  # its model is unloading for good: whoever stops it sees to it
        assert not p.pool.give_back(ws[4], start) and ws[4].alive and ws[4].owner is owner
        zero = Pool(tmp_path, spare_workers=0)
        w = bound_then_unloaded(zero.pool.take(owner, 0))  # type: ignore[arg-type]
        assert not zero.pool.give_back(w, w.rss_anon_at_start)  # type: ignore[arg-type]  # no pool: every unload exits

    run(story)


def test_a_spare_that_dies_is_replaced_and_refilling_pauses_after_failed_starts(tmp_path: Path) -> None:
    async def story() -> None:
        p = Pool(tmp_path, spare_workers=1, worker_start_attempts=2)
        p.pool.start()
        (spare,) = p.started
        spare.start()
        spare.die()  # an idle spare died: replaced
        assert p.pool.spares == 0 and len(p.started) == 2
        p.started[1].die()  # died before it was up: a failed start, replaced once more
        assert len(p.started) == 3
        p.started[2].die()  # the second failed start in a row: the pool stops refilling
        assert len(p.started) == 3 and p.pool.starting == {}
        p.pool.take(Owner(), 0)  # type: ignore[arg-type]  # demand starts a process and tries a refill again
        assert len(p.started) == 5 and len(p.spares()) == 1

    run(story)


def test_stopping_the_pool_stops_every_spare_and_one_that_comes_up_later(tmp_path: Path) -> None:
    async def story() -> None:
        p = Pool(tmp_path, spare_workers=2)
        p.pool.start()
        up, late = p.started
        up.start()
        stopping = asyncio.ensure_future(p.pool.stop())
        await stopping
        assert not up.alive and not late.alive and p.pool.spares == 0
        p.pool.give_back(bound_then_unloaded(p.pool.take(Owner(), 0)), 0)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert p.spares() == []  # nothing is kept or refilled after the stop
        halting = Pool(tmp_path, node_stopping=True, spare_workers=1)
        halting.pool.start()
        assert halting.started == []  # a node that is shutting down starts no spare

    run(story)


# -- a runtime and the pool -------------------------------------------------------------------


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_a_runtime_measures_its_model_once_keeps_the_measure_and_takes_back_the_process_it_gave(h: Harness) -> None:
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.start()
    (bind,) = worker.loads
    assert bind.measure  # nothing known yet: the first load measures
    worker.residency = Residency.BOUND
    h.rt.instances.on_loaded(0, LoadedMsg(worker.binding or 0, "double", 4096, 2_000_000, 3, "cpu",
                                         private_bytes=7 * MIB))
    assert h.rt.footprint == MemoryFootprint(4096, 7 * MIB, measured=True)
    assert h.footprints.saved == [("double", MemoryFootprint(4096, 7 * MIB, measured=True), 2.0)]
    h.loop.run()
    h.run_batch(worker)
    assert h.rt.residency.begin_eviction()
    worker.unloaded()  # gives its process back to the pool, which keeps it (its memory came back)
    assert worker.owner is h.pool and h.pool.spares == 1 and h.rt.describe()["pids"] == [None]
    h.call(2, bytes(4))  # loads again: into the same process, without measuring again
    assert h.workers == [worker] and worker.owner is h.rt.instances
    assert len(worker.loads) == 2 and not worker.loads[1].measure
    worker.loaded(nbytes=4096)
    assert h.rt.footprint == MemoryFootprint(4096, 7 * MIB, measured=True) and len(h.footprints.saved) == 1
