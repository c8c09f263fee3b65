"""Preemption ``idle``: best-effort workers under SCHED_IDLE, read back from the OS, and
real-time work that never waits for a best-effort batch on the same core."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from splitserve.client import AsyncClient
from splitserve.models.gate import Gates
from tests.inproc import quiet_config, run_server, until, write_model
from tests.integration.test_preemption import BE_KEY, RT_KEY, kinds

SPLIT_KEY = 8003  # gate_split's best-effort sample


def policies(pid: int) -> dict[int, int]:
    """The scheduling policy of every thread of process ``pid``, from the OS."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getscheduler(int(tid))
        except ProcessLookupError:
            pass
    return out


async def _demotion(server, gates):
    """Each worker's thread policies before and after a batch of each class."""
    before = {m: [policies(h.pid) for h in server.runtime(m).workers.values()] for m in ("gate_be", "gate_rt")}
    # a batch each: pool threads started while serving inherit their worker's class
    await server.infer("gate_be", [np.array([[1]], np.int64)], cls="be")
    await server.infer("gate_rt", [np.array([[2]], np.int64)], cls="rt")
    after = {m: [policies(h.pid) for h in server.runtime(m).workers.values()] for m in ("gate_be", "gate_rt")}
    split = server.runtime("gate_split")
    kept = {i: (split.dispatch.sched.instances[i].best_effort, set(policies(h.pid).values()))
            for i, h in split.workers.items()}
    return before, after, kept


async def _flood(server, gates):
    """An RT call beside 8 BE calls held mid-run at their gate, then a split model's RT call
    beside its own BE batch held on the instance kept for that class."""
    first = len(server.coordinator.events)
    gates.close(BE_KEY)
    flood = [asyncio.ensure_future(server.infer("gate_be", [np.array([[BE_KEY]], np.int64)], cls="be"))
             for _ in range(8)]
    await asyncio.wait_for(until(lambda: gates.held(BE_KEY)), 60)
    rt = await server.infer("gate_rt", [np.array([[RT_KEY]], np.int64)], cls="rt")
    still_held = gates.held(BE_KEY)  # the best-effort batch is mid-run on the same core
    # a model called in both classes: its real-time call takes its own instance while its
    # best-effort batch is held mid-run on the instance kept for that class
    gates.close(SPLIT_KEY)
    split_be = asyncio.ensure_future(server.infer("gate_split", [np.array([[SPLIT_KEY]], np.int64)], cls="be"))
    await asyncio.wait_for(until(lambda: gates.held(SPLIT_KEY)), 60)
    split_rt = await server.infer("gate_split", [np.array([[RT_KEY]], np.int64)], cls="rt")
    still_held = still_held and gates.held(SPLIT_KEY) and bool(split_rt.outputs)
    # and a direct client's real-time calls: each to the real-time instance's worker, never
    # to the one kept for best-effort work, where the held batch would keep them waiting
    by_instance = {i: h.counters.snapshot().answered for i, h in server.runtime("gate_split").workers.items()}
    async with AsyncClient(f"tcp://127.0.0.1:{server.ports['fast_port']}") as c:
        direct_rt = [await asyncio.wait_for(c.infer_result("gate_split", np.array([[RT_KEY]], np.int64), cls="rt"), 60)
                     for _ in range(4)]
        held_connections = c.direct_endpoints("gate_split")
    grown = {i: h.counters.snapshot().answered - by_instance.get(i, 0)
             for i, h in server.runtime("gate_split").workers.items()}
    direct = (held_connections, grown, gates.held(SPLIT_KEY), all(r.outputs for r in direct_rt))
    flood.append(split_be)
    gates.open(BE_KEY)
    gates.open(SPLIT_KEY)
    be = await asyncio.gather(*flood)
    return list(server.coordinator.events)[first:], rt, be, still_held, direct


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """One server for the module: ``gate_be`` (a best-effort model), ``gate_rt`` (a real-time
    one) and ``gate_split`` (an instance per class) on CPU 0, under idle; both scenarios' results."""
    tmp_path = tmp_path_factory.mktemp("reef_idle")
    repo = tmp_path / "repo"
    write_model(repo, "gate_be", "gate", 'cpus = [0]\nshare_cpus = true\ndefault_class = "be"')
    write_model(repo, "gate_rt", "gate", 'cpus = [0]\nshare_cpus = true\ndefault_class = "rt"')
    write_model(repo, "gate_split", "gate",
                'cpus = [0]\nshare_cpus = true\ndefault_class = "rt"\ninstances = 2\nbe_instances = 1')
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache",
                       load=("gate_be", "gate_rt", "gate_split"), preemption="idle").replaced(fast_port=0)
    gates = Gates(tmp_path / "cache")

    async def both(server):
        return {"demotion": await _demotion(server, gates), "flood": await _flood(server, gates)}

    try:
        return run_server(cfg, both)
    finally:
        gates.open_all()


def test_idle_demotes_every_thread_of_best_effort_workers_and_leaves_real_time_ones(seen):
    before, after, kept = seen["demotion"]
    # the model with an instance per class: its best-effort instance alone is demoted
    assert sorted(kept.values()) == [(False, {os.SCHED_OTHER}), (True, {os.SCHED_IDLE})]
    for seen in (before, after):
        assert seen["gate_be"] and seen["gate_rt"]
        for threads in seen["gate_be"]:
            assert threads and set(threads.values()) == {os.SCHED_IDLE}, threads
        for threads in seen["gate_rt"]:
            assert threads and set(threads.values()) == {os.SCHED_OTHER}, threads


def test_idle_a_real_time_call_under_a_best_effort_flood_completes_while_best_effort_still_runs(seen):
    events, rt, be, still_held, direct = seen["flood"]
    assert still_held
    assert rt.outputs  # answered
    assert len(be) == 9 and all(r.outputs for r in be)
    seq = kinds(events)
    assert seq.index(("done", "rt")) < seq.index(("done", "be"))
    assert not any(k in ("preempt", "preempted") for k, _ in seq)
    # the worker's compute-start stamp: the held best-effort batch began before the real-time
    # one arrived; the real-time batch began computing after it started and before it was done
    rt_start, rt_done = (next(e for e in events if e.model == "gate_rt" and e.kind == k) for k in ("start", "done"))
    be_done = next(e for e in events if e.model == "gate_be" and e.kind == "done")
    assert be_done.compute_start is not None and rt_done.compute_start is not None
    assert be_done.compute_start < rt_start.t <= rt_done.compute_start <= rt_done.t
    assert len(rt_done.waits_us) == 1 and 0 <= rt_done.waits_us[0]
    split = {e.cls: e.instance for e in events if e.model == "gate_split" and e.kind == "done"}
    assert set(split) == {"rt", "be"} and split["rt"] != split["be"]
    # over the direct path: the client held both workers' connections, and each of its
    # real-time calls was answered by the real-time instance's worker while the best-effort
    # batch was still held on the other
    connections, grown, held, answered = direct
    assert connections == 2 and held and answered
    assert grown == {split["rt"]: 4, split["be"]: 0}
