"""Liveness and lifecycle: every accepted call gets one answer, every wait has an end.

Batches are held mid-run with the ``gate`` test model (and its load gate holds a worker
before READY), never with sleeps. Every scenario is bounded with ``asyncio.wait_for`` or a
process wait, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from splitserve.client import Client
from splitserve.errors import InternalError, ModelNotReady, ShuttingDown, WorkerFailed
from splitserve.models.gate import LOAD_KEY, Gates
from splitserve.protocol.header import RequestClass
from splitserve.worker.forkserver import node_workers
from splitserve.worker.messages import DoneMsg, Msg
from tests.helpers import ROOT
from tests.inproc import quiet_config, run_server, until, write_model

BOUND_S = 60.0  # no scenario needs this long; reaching it means something hangs


def key(k: int) -> list[np.ndarray]:
    return [np.array([[k]], np.int64)]


def gate_server(tmp_path: Path, toml: str = "", **kw) -> tuple:
    repo = tmp_path / "repo"
    write_model(repo, "gate", "gate", toml)
    cache = tmp_path / "cache"
    return quiet_config(tmp_path / "data", repository=repo, cache_dir=cache, **kw), Gates(cache)


# -- in-process servers ----------------------------------------------------------------------


def test_a_preempted_batch_on_an_instance_being_retired_is_resumed_and_the_switch_ends(tmp_path):
    cfg, gates = gate_server(tmp_path, load=("gate",))

    async def scenario(server):
        rt = server.runtime("gate")
        gates.close(1)
        gates.close(2)
        be = asyncio.ensure_future(server.infer("gate", key(1), cls="be"))
        await until(lambda: gates.held(1))
        rt_call = asyncio.ensure_future(server.infer("gate", key(2), cls="rt"))
        # Open the BE gate only once the node has asked its worker to stop at the next
        # boundary; opened earlier, the batch may run past it before the RT call arrives.
        await until(lambda: any(h.flag.target() for h in rt.workers.values()))
        gates.open(1)  # the BE batch reaches a segment boundary and is preempted there
        await until(lambda: any(s.suspended for s in rt.sched.instances.values()) and gates.held(2))
        (old,) = rt.sched.serving()
        # The node's applier replaces the instance by a new one (fresh CPUs from the placer).
        switch = asyncio.ensure_future(
            server.applier.apply(lambda: {"gate": rt.core.placer.resize(server.resources, [], 1)}))
        await until(lambda: rt.sched.instances[old].draining)
        gates.open(2)  # the RT batch ends; the retired instance still holds the BE batch
        await switch
        return (await rt_call).outputs[0], (await be).outputs[0], old in rt.sched.instances

    rt_out, be_out, still_there = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert rt_out.tolist() == [[2]] and be_out.tolist() == [[1]]
    assert not still_there


def test_a_report_for_another_batch_drops_nothing_and_a_missing_worker_fails_its_batch(tmp_path):
    cfg, gates = gate_server(tmp_path, load=("gate",))

    async def scenario(server):
        rt = server.runtime("gate")
        gates.close(1)
        held = asyncio.ensure_future(server.infer("gate", key(1)))
        await until(lambda: gates.held(1))
        (i,) = rt.sched.serving()
        running = rt.sched.instances[i].running
        rt.instances.on_done(i, DoneMsg(Msg.DONE, running.batch_id + 1000, 0, 2, 0))  # a report for no such batch
        assert rt.sched.instances[i].running is running and not held.done()
        # The next batch is dispatched to an instance whose worker handle is missing.
        handle = rt.workers.pop(i)
        queued = asyncio.ensure_future(server.infer("gate", key(3)))
        await until(lambda: rt.sched.waiting() == 1)
        gates.open(1)
        first = (await held).outputs[0]
        with pytest.raises(WorkerFailed, match="not running"):
            await queued
        rt.workers[i] = handle
        return first

    first = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert first.tolist() == [[1]]


def corrupt_model(repo: Path) -> None:
    d = repo / "broken"
    d.mkdir(parents=True)
    (d / "config.toml").write_text('name = "broken"\n[artifact]\nkind = "safetensors"\narch = "lenet"\n'
                                   'file = "weights.safetensors"\n')
    (d / "weights.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + bytes(64))


def test_a_model_whose_load_failed_is_failed_and_refuses_calls_at_once(tmp_path):
    repo = tmp_path / "repo"
    corrupt_model(repo)
    cfg = quiet_config(tmp_path / "data", repository=repo).replaced(fast_port=0)
    x = np.zeros((1, 1, 28, 28), np.uint8)

    def over_the_fast_path(url: str) -> list[str]:
        with Client(url, timeout=BOUND_S) as c:
            out = []
            for _ in range(3):
                try:
                    c.infer("broken", x)
                    out.append("answered")
                except ModelNotReady as e:
                    out.append(str(e))
            return out

    async def scenario(server):
        rt = server.runtime("broken")
        loads = []
        real_spawn = rt.instances.spawn
        rt.instances.spawn = lambda i: (loads.append(i), real_spawn(i))
        errors = []
        for _ in range(3):  # the first starts the load; the others find the model FAILED
            with pytest.raises(ModelNotReady) as e:
                await server.infer("broken", [x])
            errors.append(str(e.value))
        errors += await asyncio.to_thread(over_the_fast_path, f"tcp://127.0.0.1:{server.ports['fast_port']}")
        state, index = server.model_state("broken"), server.management.repository_index()
        refused_loads = len(loads)
        rt.core.retry_at = time.perf_counter()  # as if load_retry_s had passed: the next request retries
        with pytest.raises(ModelNotReady, match="failed to load"):
            await server.infer("broken", [x])
        with pytest.raises(ModelNotReady, match="failed to load"):
            await rt.wait_ready()  # an explicit load retries at once (and fails the same way)
        return errors, state, index, rt.instance_count, (refused_loads, len(loads))

    errors, state, index, instances, loads = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert len(errors) == 6
    assert all("failed to load" in e and "weights.safetensors" in e for e in errors), errors
    assert all("retries the load" in e for e in errors[1:])  # refused at once, saying when it retries
    assert loads == (1, 3)  # one load for six calls; then one per retry
    assert state == "failed" and instances == 1  # the instance is kept for the retry
    (entry,) = [m for m in index if m["name"] == "broken"]
    assert entry["state"] == "UNAVAILABLE" and "weights.safetensors" in entry["reason"]


def test_a_worker_not_ready_in_time_is_restarted_then_the_model_fails(tmp_path):
    cfg, gates = gate_server(tmp_path, worker_start_timeout_s=0.5, worker_start_attempts=2,
                             worker_restart_backoff_s=0.01)
    gates.close(LOAD_KEY)  # the worker never gets past loading

    async def scenario(server):
        pids = []
        rt = server.runtime("gate")
        real_spawn = rt.instances.spawn

        def spawn(i: int) -> None:
            real_spawn(i)
            pids.append(rt.workers[i].pid)

        rt.instances.spawn = spawn
        with pytest.raises(ModelNotReady) as e:
            await server.infer("gate", key(1))
        with pytest.raises(ModelNotReady, match="worker_start_timeout_s"):
            await server.infer("gate", key(1))  # refused at once now
        return str(e.value), pids, server.model_state("gate")

    error, pids, state = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert "worker_start_timeout_s=0.5s" in error and state == "failed"
    assert len(pids) == 2  # started, timed out, restarted once, timed out: FAILED


def test_a_worker_that_crashes_before_ready_is_restarted_until_the_model_fails(tmp_path):
    cfg, gates = gate_server(tmp_path, worker_start_attempts=2, worker_restart_backoff_s=0.01)
    gates.close(LOAD_KEY)

    async def scenario(server):
        rt = server.runtime("gate")
        call = asyncio.ensure_future(server.infer("gate", key(1)))
        killed: set[int | None] = {None}
        for _ in range(2):  # a crash that sends no FAILED (a segfault, the OOM killer)
            # a new worker, alive and forked (its pid comes with the fork server's answer); waiting for
            # the old one's slot to empty would race the restart, which may refill it between two looks
            await until(lambda: 0 in rt.workers and rt.workers[0].alive and rt.workers[0].pid not in killed)
            killed.add(rt.workers[0].pid)
            os.kill(rt.workers[0].pid, signal.SIGKILL)
        with pytest.raises(ModelNotReady, match="exited before it was ready"):
            await call
        gates.open(LOAD_KEY)
        await rt.wait_ready()  # an explicit load retries, and this time the worker comes up
        return (await server.infer("gate", key(4))).outputs[0]

    out = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert out.tolist() == [[4]]


def test_stop_ends_by_its_deadline_with_a_stopped_worker_and_answers_every_call(tmp_path):
    cfg, gates = gate_server(tmp_path, load=("gate",), stop_timeout_s=1.0)

    async def scenario(server):
        rt = server.runtime("gate")
        gates.close(1)
        held = asyncio.ensure_future(server.infer("gate", key(1)))
        await until(lambda: gates.held(1))
        queued = asyncio.ensure_future(server.infer("gate", key(2)))
        await until(lambda: rt.sched.waiting() == 1)
        os.kill(rt.workers[0].pid, signal.SIGSTOP)  # a worker that will never finish its batch
        await server.stop()
        results = await asyncio.gather(held, queued, return_exceptions=True)
        return [type(r) for r in results]

    kinds = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert kinds == [WorkerFailed, ShuttingDown]


def test_the_watchdog_answers_a_call_past_the_maximum_age_and_drops_its_late_answer(tmp_path):
    cfg, gates = gate_server(tmp_path, load=("gate",), max_call_age_s=0.2, watchdog_period_s=0.05)

    async def scenario(server):
        gates.close(1)
        with pytest.raises(InternalError, match="max_call_age_s"):
            await server.infer("gate", key(1))
        gates.open(1)  # the real answer comes now, after the watchdog's
        await until(lambda: server.monitor.in_flight == 0)
        return server.metrics.render().decode(), dict(server.monitor.outcomes)

    metrics, outcomes = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert 'splitserve_watchdog_expired_total{model="gate",state="RX_COMPLETE"} 1.0' in metrics
    assert 'splitserve_dropped_answers_total{model="gate",reason="late"} 1.0' in metrics
    assert outcomes["expired"] == 1 and "ok" not in outcomes


# -- servers in their own process (signals) ----------------------------------------------------


def spawn_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """``splitserve serve`` in its own session (so a process-group signal reaches only it)."""
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    log = data / "server.log"
    cmd = [sys.executable, "-m", "splitserve", "serve", "--fast-port", "0", "--udp-port", "-1", "--http-port", "-1",
           "--grpc-port", "-1", "--data-dir", str(data), "--repository", str(tmp_path / "repo"), *args]
    # No spare processes: each server's children are the workers of its instances, which
    # these tests follow one by one.
    child_env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(tmp_path / "cache"), "SPLITSERVE_SPARE_WORKERS": "0",
                 **(env or {})}
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env,
                                start_new_session=True)
    return proc, data


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen, what: str) -> None:
    end = time.monotonic() + BOUND_S
    while not cond():
        assert proc.poll() is None, f"server exited ({proc.returncode}) before {what}"
        assert time.monotonic() < end, f"no {what} in {BOUND_S}s"
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (waiting a little for a killed process to die)."""
    end = time.monotonic() + BOUND_S
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.01)
    return not alive(pid)


@pytest.fixture
def gated(tmp_path):
    write_model(tmp_path / "repo", "gate", "gate")
    gates = Gates(tmp_path / "cache")
    procs: list[subprocess.Popen] = []
    yield gates, procs
    gates.open_all()
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigterm_during_a_long_load_stops_cleanly(tmp_path, gated):
    gates, procs = gated
    gates.close(LOAD_KEY)
    proc, data = spawn_server(tmp_path, "--load", "gate")
    procs.append(proc)
    wait_for(lambda: bool(node_workers(proc.pid)), proc, "worker start")  # start-up is under way
    (worker,) = node_workers(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(BOUND_S) == 0
    assert gone(worker) and not (data / "server.json").exists()


def started_with_held_call(tmp_path, gated, k: int, env: dict[str, str] | None = None):
    gates, procs = gated
    proc, data = spawn_server(tmp_path, "--load", "gate", env=env)
    procs.append(proc)
    wait_for(lambda: (data / "server.json").exists(), proc, "server.json")
    info = json.loads((data / "server.json").read_text())
    client = Client(f"tcp://127.0.0.1:{info['fast_port']}", timeout=BOUND_S)
    (worker,) = node_workers(proc.pid)
    gates.close(k)
    pending = client.submit("gate", np.array([[k]], np.int64), cls=RequestClass.BE)
    wait_for(lambda: gates.held(k), proc, "held batch")
    return proc, data, client, pending, worker


def shutting_down(data: Path) -> Callable[[], bool]:
    return lambda: "shutting down" in (data / "server.log").read_text(errors="replace")


def test_workers_ignore_sigint_and_finish_their_batch_while_the_server_drains(tmp_path, gated):
    gates = gated[0]
    proc, data, client, pending, worker = started_with_held_call(tmp_path, gated, 7)
    with client:
        os.kill(worker, signal.SIGINT)  # sent to the worker itself
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the server's process group
        wait_for(shutting_down(data), proc, "shutdown")
        assert alive(worker)
        gates.open(7)
        assert pending.result(BOUND_S).value().tolist() == [[7]]  # drained, not failed
    assert proc.wait(BOUND_S) == 0


def test_a_second_sigterm_exits_at_once(tmp_path, gated):
    proc, data, client, pending, worker = started_with_held_call(
        tmp_path, gated, 8, env={"SPLITSERVE_STOP_TIMEOUT_S": "600"})  # the drain alone would take that long
    with client:
        proc.send_signal(signal.SIGTERM)
        wait_for(shutting_down(data), proc, "shutdown")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 128 + signal.SIGTERM
    assert gone(worker)
