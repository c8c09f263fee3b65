"""PROTEAN in the node, through real servers (in this process) and real worker processes:
instances pinned to their partitions, rt batches kept off partitions best-effort work has
taken (Algorithm 1's tags), also under a 50/50 stream read back from the event log, a
geometry change under a steady stream of requests, and a worker killed mid-batch restarting
on its partition."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from splitserve.client.aio import AsyncClient
from splitserve.errors import WorkerFailed
from splitserve.models.gate import Gates
from tests.inproc import quiet_config, run_server, until, write_model

BOUND_S = 60.0  # no scenario needs this long; reaching it means something hangs


def key(k: int) -> list[np.ndarray]:
    return [np.array([[k]], np.int64)]


def cpus_allowed(pid: int) -> set[int]:
    """The CPUs the kernel lets ``pid`` run on (``Cpus_allowed_list`` of /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
            return out
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def gate_repo(tmp_path: Path, *models: tuple[str, str]) -> tuple[Path, Path, Gates]:
    repo = tmp_path / "repo"
    for name, toml in models:
        write_model(repo, name, "gate", toml)
    cache = tmp_path / "cache"
    return repo, cache, Gates(cache)


def be_rt_repo(tmp_path: Path) -> tuple[Path, Path, Gates]:
    """Two gate models, ``be`` and ``rt``, of those default classes, one request a batch."""
    return gate_repo(tmp_path, ("be", 'default_class = "be"\nmax_batch_size = 1'),
                     ("rt", 'default_class = "rt"\nmax_batch_size = 1'))


def save_profiles(data: Path, profiles: dict[str, dict[str, object]]) -> None:
    """Store ``{model: {kind: data}}`` in the registry under ``data`` for this machine, as
    ``splitserve profile`` would (the node reads them when it starts)."""
    from splitserve.placement.profiler import machine_id
    from splitserve.registry import Registry

    reg = Registry(data)
    try:
        for model, kinds in profiles.items():
            for kind, value in kinds.items():
                reg.save_profile(model, machine_id(), kind, value)
    finally:
        reg.close()


def partitions_of(server) -> dict[int, set[int]]:
    return {p["id"]: set(p["cpus"]) for p in server.management.partition_status()["partitions"]}


class Ledger:
    """Every call a test sends, by key, with the answers it got (``call``), and how many
    calls of each model were answered (``answered``); ``check`` says each got exactly one
    answer, its own key, and the node counted each once, served."""

    def __init__(self, server) -> None:
        self.server = server
        self.answers: dict[int, list[int]] = {}
        self.answered: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.answers)

    async def call(self, model: str, k: int) -> None:
        assert k not in self.answers, f"key {k} sent twice"
        self.answers[k] = []
        out = await self.server.infer(model, key(k))
        self.answers[k].append(int(out.outputs[0][0, 0]))
        self.answered[model] += 1

    def check(self) -> None:
        assert all(v == [k] for k, v in self.answers.items())
        out = self.server.monitor.outcomes
        assert out["accepted"] == out["ok"] == len(self.answers)
        assert not [k for k in out if k.startswith(("dropped", "error", "expired"))]
        assert self.server.monitor.in_flight == 0


def test_instances_sit_pinned_on_their_partitions_and_a_killed_worker_restarts_on_its_own(tmp_path):
    repo, cache, gates = gate_repo(tmp_path, ("gate", ""))
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=cache, partitioning="static", load=("gate",))

    async def scenario(server):
        rt = server.runtime("gate")
        parts = partitions_of(server)
        d = rt.describe()
        # one warm instance per partition, each pinned to exactly its partition's CPUs
        assert sorted(d["partitions"]) == sorted(parts)
        for pid, part, threads in zip(d["pids"], d["partitions"], d["threads"]):
            assert cpus_allowed(pid) == parts[part]
            assert threads == len(parts[part])
            # workers that share a partition's cores wait passively (no spinning OpenMP threads)
            assert b"OMP_WAIT_POLICY=PASSIVE" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        gates.close(7)
        call = asyncio.ensure_future(server.infer("gate", key(7)))
        await until(lambda: gates.held(7))
        (i,) = [i for i, st in rt.sched.instances.items() if st.running is not None]
        part = server.resources.placed("gate", i).partition
        old = rt.workers[i].pid
        os.kill(old, signal.SIGKILL)
        with pytest.raises(WorkerFailed):
            await call  # its batch is answered once, with an error
        gates.open(7)
        await until(lambda: i in rt.workers and rt.workers[i].pid != old and rt.sched.instances[i].ready)
        assert server.resources.placed("gate", i).partition == part
        assert cpus_allowed(rt.workers[i].pid) == parts[part]
        out = await server.infer("gate", key(8))
        assert out.outputs[0].tolist() == [[8]]
        events = [e for e in server.coordinator.events if e.kind in ("start", "done", "failed")]
        assert events and all(e.partition in parts for e in events)

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))


def test_protean_keeps_rt_batches_off_partitions_that_best_effort_work_has_taken(tmp_path):
    repo, cache, gates = be_rt_repo(tmp_path)
    data = tmp_path / "data"

    async def measure(server):
        return server.runtime("be").footprint

    # A first run measures what one best-effort batch adds (the node's footprint fallback);
    # the second gives each of two partitions 1.5 of it: one BE batch on each makes a BE
    # demand of 2, which tags the first partition 1 and the second 1/3.
    footprint = run_server(quiet_config(data, repository=repo, cache_dir=cache, load=("be",)),
                           lambda s: asyncio.wait_for(measure(s), BOUND_S))
    assert footprint.measured and footprint.private_bytes > 0
    cfg = quiet_config(data, repository=repo, cache_dir=cache, partitioning="protean", geometry="1,1",
                       preemption="concurrent", partition_memory_bytes=3 * footprint.private_bytes,
                       load=("be", "rt"))

    async def scenario(server):
        be = server.runtime("be")
        gates.close(1)
        gates.close(2)
        first = asyncio.ensure_future(server.infer("be", key(1)))
        await until(lambda: gates.held(1))
        second = asyncio.ensure_future(server.infer("be", key(2)))
        await until(lambda: gates.held(2))
        on = {server.resources.placed("be", i).partition for i, st in be.sched.instances.items() if st.running}
        snap = server.management.partition_status()
        tags = {p["id"]: p["tag"] for p in snap["partitions"]}
        assert len(on) == 2  # the first fills the small partition's memory: the second spills
        assert sorted(tags.values()) == [pytest.approx(1 / 3), 1.0]
        open_part = next(p for p, t in tags.items() if t < 1)
        for k in range(10, 16):
            out = await server.infer("rt", key(k))
            assert out.outputs[0].tolist() == [[k]]
        gates.open(1)
        gates.open(2)
        await asyncio.gather(first, second)
        rt_starts = [e for e in server.coordinator.events if e.model == "rt" and e.kind == "start"]
        assert len(rt_starts) == 6 and {e.partition for e in rt_starts} == {open_part}

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))


def test_protean_under_a_50_50_stream_logs_strict_batches_only_on_partitions_tagged_below_1(tmp_path):
    """Issue 12: under 50/50 load with ``--partitioning protean`` the event log shows strict
    batches only on partitions with tag < 1, every event carrying its partition's tag when
    the batch was placed. Two rt and two be clients send ten calls each at once."""
    repo, cache, gates = be_rt_repo(tmp_path)
    data = tmp_path / "data"
    # One BE batch holds F bytes and each of the two 1-core partitions has 1.5 F: with both BE
    # clients' calls in (running or queued), the demand of 2 F tags the first partition 1 and
    # the second 1/3. A strict batch holds next to nothing (the tags leave out what strict
    # batches hold), so the demand of at most two BE calls never tags both partitions: the
    # fallback when every partition is wholly taken is not what this test is about.
    f = 100 * 2**20
    save_profiles(data, {"be": {"footprint": {"1": f}}, "rt": {"footprint": {"1": 1}}})
    # preemption concurrent is what --partitioning protean defaults to (ServerConfig.from_env);
    # one instance of each model per partition: no cold starts on 2 cores
    cfg = quiet_config(data, repository=repo, cache_dir=cache, partitioning="protean", geometry="1,1",
                       preemption="concurrent", partition_memory_bytes=3 * f, partition_max_instances=1,
                       load=("be", "rt")).replaced(http_port=0)
    calls = 10  # per client

    async def scenario(server):
        ledger = Ledger(server)
        held = 0  # BE calls that have reached their gate (so run, and hold their partition)
        mark = 0  # strict answers when the last BE call reached its gate
        holding = [False, False]  # each BE client's current call sits at its gate
        done = [False, False]  # each BE client has had all its calls answered
        turn = 0  # the BE client that lets its call through next

        async def be_client(me: int) -> None:
            # Each BE call is held at its gate until the strict stream has had three more
            # answers since the last BE call reached its gate (or has ended), and the two BE
            # clients let their calls through in turns, each only while the other's call is
            # held: every BE call after the first two is placed while the other client's
            # runs, at a demand of 2 F, and after each such placement at least one strict
            # batch (of two clients, at most two calls were in flight) starts beside both.
            nonlocal held, mark, turn
            other = 1 - me
            for i in range(calls):
                k = 1 + me * 100 + i
                gates.close(k)
                call = asyncio.ensure_future(ledger.call("be", k))
                await until(lambda: gates.held(k))
                held += 1
                holding[me] = True
                mark = ledger.answered["rt"]
                await until(lambda: (ledger.answered["rt"] >= mark + 3 or ledger.answered["rt"] == 2 * calls)
                            and (turn == me or done[other]) and (holding[other] or done[other]))
                holding[me] = False
                turn = other
                gates.open(k)
                await call
            done[me] = True

        async def rt_client(me: int) -> None:
            # The strict stream keeps pace: call i waits for the BE stream to have held i / 2
            # calls, so it cannot run out before the BE calls that take a partition.
            for i in range(calls):
                await until(lambda: 2 * held >= i)
                await ledger.call("rt", 1000 + me * 100 + i)

        await asyncio.gather(*(be_client(c) for c in (0, 1)), *(rt_client(c) for c in (0, 1)))
        ledger.check()
        assert ledger.answered == {"be": 2 * calls, "rt": 2 * calls}
        url = f"http://127.0.0.1:{server.ports['http_port']}/v2/scheduler/events"
        events = (await asyncio.to_thread(_get, url))["events"]
        parts = set(partitions_of(server))
        starts = [e for e in events if e["kind"] == "start"]
        rt = [e for e in starts if e["cls"] == "rt"]
        be = [e for e in starts if e["cls"] == "be"]
        # both classes ran, one batch a call, each on a partition, each with its tag at placement
        assert len(rt) == len(be) == 2 * calls
        assert all(e["partition"] in parts and e["tag"] is not None for e in starts)
        # the claim: no strict batch was placed on a partition best-effort work had taken
        assert [e for e in rt if e["tag"] >= 1] == []
        # and not vacuously: best-effort work took a partition (BE batches placed there at
        # tag 1), and strict batches were placed while BE batches ran on both partitions (a
        # demand of 2 F, which tags the first partition 1): those went to the other one
        assert [e for e in be if e["tag"] >= 1]
        ends = {(e["model"], e["batch"]): e["t"] for e in events if e["kind"] == "done"}
        beside_both = [r for r in rt if sum(b["t"] <= r["t"] <= ends[(b["model"], b["batch"])] for b in be) == 2]
        assert beside_both

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=BOUND_S) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=BOUND_S) as r:
        return json.loads(r.read())


def test_a_geometry_change_under_a_steady_stream_answers_every_request_exactly_once(tmp_path):
    repo, cache, _ = gate_repo(tmp_path, ("gate", "max_batch_size = 4"))
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=cache, partitioning="static",
                       geometry="1,1", load=("gate",)).replaced(http_port=0)

    async def scenario(server):
        url = f"http://127.0.0.1:{server.ports['http_port']}/v2/partitions"
        token = server.management.ensure_token()
        before = partitions_of(server)
        ledger = Ledger(server)
        stop = asyncio.Event()
        keys = iter(range(100, 1_000_000))

        async def client() -> None:
            while not stop.is_set():
                await ledger.call("gate", next(keys))

        clients = [asyncio.ensure_future(client()) for _ in range(4)]
        await until(lambda: len(ledger) > 20)
        # two 1-core partitions become one of both cores while four clients keep sending
        one = await asyncio.to_thread(_post, url, {"geometry": "2"}, token)
        assert one["geometry"] == [2] and not set(p["id"] for p in one["partitions"]) & set(before)
        mid = len(ledger)
        await until(lambda: len(ledger) > mid + 20)
        stop.set()
        await asyncio.gather(*clients)
        # every request answered once, with its own answer; nothing dropped, nothing left open
        ledger.check()
        now = partitions_of(server)
        placed = server.resources.placement()["gate"]
        assert {q.partition for q in placed.values()} == set(now)
        assert [c["ok"] for c in server.partitions.changes] == [True]
        # the old partitions went back: only the current ones (and the models' places on them) remain
        assert {p.request.partition for p in server.resources.partitions("gate")} == set(now)

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))


def test_a_geometry_change_moves_direct_clients_to_the_new_instances_and_answers_each_call_once(tmp_path):
    """Clients on the defaults call the workers directly; the partitions are re-carved under
    them (every instance replaced: new workers, new endpoints). Each call gets exactly one
    answer, its own, and the clients call the new instances directly afterwards."""
    repo, cache, _ = gate_repo(tmp_path, ("gate", "max_batch_size = 4"))
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=cache, partitioning="static",
                       geometry="1,1", load=("gate",)).replaced(http_port=0, fast_port=0)

    async def scenario(server):
        url = f"http://127.0.0.1:{server.ports['http_port']}/v2/partitions"
        token = server.management.ensure_token()
        rt = server.runtime("gate")
        answers: dict[int, list[int]] = {}
        stop = asyncio.Event()
        keys = iter(range(100, 1_000_000))
        fast = f"tcp://127.0.0.1:{server.ports['fast_port']}"
        clients = [await AsyncClient(fast).connect() for _ in range(4)]

        async def calls(c: AsyncClient) -> None:
            while not stop.is_set():
                k = next(keys)
                answers[k] = []
                out = await c.infer("gate", key(k)[0])
                answers[k].append(int(np.asarray(out).reshape(-1)[0]))

        try:
            tasks = [asyncio.ensure_future(calls(c)) for c in clients]
            await until(lambda: len(answers) > 20)
            direct_before = [c.direct_endpoints("gate") for c in clients]
            old_pids = set(rt.describe()["pids"])
            await asyncio.to_thread(_post, url, {"geometry": "2"}, token)
            mid = len(answers)
            await until(lambda: len(answers) > mid + 20)
            # calling on, they look the model up again and go to the new workers' endpoints
            await until(lambda: all(c.direct_endpoints("gate") for c in clients))
            served = rt.describe()["direct_counts"]["answered"]
            await until(lambda: rt.describe()["direct_counts"]["answered"] > served + 20)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for c in clients:
                await c.close()
        assert all(direct_before), direct_before  # direct before the change
        assert not set(rt.describe()["pids"]) & old_pids  # every instance was replaced
        assert all(v == [k] for k, v in answers.items()), [(k, v) for k, v in answers.items() if v != [k]][:3]
        assert server.monitor.in_flight == 0

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))


def test_protean_holds_a_strict_batch_for_its_busy_partition_rather_than_run_it_beside_best_effort(tmp_path):
    from splitserve.protocol.header import RequestClass

    repo, cache, gates = be_rt_repo(tmp_path)
    data = tmp_path / "data"
    # Stored profiles: rt takes 100 s alone on a core (FBR 0.5), be has FBR 5 and no solo time.
    # A second rt batch beside a BE batch is predicted at 550 s; waiting for the rt batch that
    # just started elsewhere, at about 200 s: it waits, for minutes, so only that end ends it.
    fit = {"fbr": {"rt@1": 0.5, "be@1": 5.0}, "unidentified": [], "residuals": {}, "equations": 2}
    save_profiles(data, {"rt": {"latency": {"model": "rt", "table": {"1,1": 100.0, "2,1": 100.0}}, "fbr": fit},
                         "be": {"fbr": fit}})
    cfg = quiet_config(data, repository=repo, cache_dir=cache, partitioning="protean", geometry="1,1",
                       preemption="concurrent", load=("be", "rt"))

    async def scenario(server):
        def on(model: str) -> set[int]:
            rt = server.runtime(model)
            return {server.resources.placed(model, i).partition for i, st in rt.sched.instances.items() if st.running}

        gates.close(1)
        gates.close(2)
        be1 = asyncio.ensure_future(server.infer("be", key(1)))
        await until(lambda: gates.held(1))
        rt1 = asyncio.ensure_future(server.infer("rt", key(2)))
        await until(lambda: gates.held(2))
        (be_part,), (rt_part,) = on("be"), on("rt")
        assert be_part != rt_part
        rt2 = asyncio.ensure_future(server.infer("rt", key(3)))
        await until(lambda: server.management.partition_status()["waiting_for"] == {"rt": rt_part})
        # best effort arriving meanwhile does not take the partition the strict batch waits for
        be2 = asyncio.ensure_future(server.infer("be", key(4)))
        await until(lambda: server.runtime("be").sched.waiting(RequestClass.BE) == 1 or len(on("be")) == 2)
        assert on("be") == {be_part} and not rt2.done()
        gates.open(2)  # the rt batch ends: the waiting one runs on its partition, alone
        assert [o.outputs[0].tolist() for o in await asyncio.gather(rt1, rt2)] == [[[2]], [[3]]]
        gates.open(1)
        await asyncio.gather(be1, be2)
        starts = [e for e in server.coordinator.events if e.kind == "start"]
        assert [e.partition for e in starts if e.model == "rt"] == [rt_part, rt_part]
        second_rt = [e for e in starts if e.model == "rt"][1]
        assert all(e.t >= second_rt.t for e in starts if e.model == "be" and e.partition == rt_part)

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))


def test_partitions_lists_the_nodes_gpus_read_only_on_any_node(tmp_path):
    from tests.unit.test_gpus import _has_driver

    cfg = quiet_config(tmp_path / "data").replaced(http_port=0)

    async def scenario(server):
        await until(lambda: server.gpus.listing is not None)  # read at start, off the loop
        url = f"http://127.0.0.1:{server.ports['http_port']}/v2/partitions"
        body = await asyncio.to_thread(_get, url)
        assert body["partitioning"] == "none" and body["partitions"] == []
        gpus = body["gpus"]
        assert set(gpus) == {"gpus", "reason", "mps", "age_s"} and gpus["mps"] in (True, False)
        if not _has_driver():
            assert gpus["gpus"] == [] and gpus["reason"].startswith("no GPUs (NVML not available: ")
        else:
            assert gpus["reason"] is not None or all(g["uuid"].startswith("GPU-") for g in gpus["gpus"])

    run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
