"""The direct path as a server and a client get it on their defaults: calls go straight to
the workers, a client that cannot reach a worker's port has the front end hand its
connection over (or, where that is refused, calls through the front end), and direct calls
are the model's use for the memory manager's LRU and Packrat's estimator."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch

from splitserve import Client
from splitserve.client.aio import AsyncClient
from splitserve.models.loader import load_artifact
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import ModelProfile, machine_id, save_profile
from splitserve.registry import Registry
from tests.inproc import quiet_config, run_server, until

BOUND_S = 120.0  # no scenario needs this long; reaching it means something hangs


def reference(xs: np.ndarray, seed: int = 0) -> np.ndarray:
    model = load_artifact("zoo", None, "lenet", seed=seed)
    with torch.inference_mode():
        (y,) = model(torch.from_numpy(xs))
    return y.numpy()


def lenet_copies(repo: Path, n: int) -> list[str]:
    """``n`` LeNets with distinct seeds."""
    names = []
    for seed in range(n):
        name = f"lenet{seed}"
        (repo / name).mkdir(parents=True, exist_ok=True)
        (repo / name / "config.toml").write_text(f'name = "{name}"\nmax_batch_size = 4\n'
                                                 f'[artifact]\nkind = "zoo"\narch = "lenet"\nseed = {seed + 1}\n')
        names.append(name)
    return names


async def relay(listen_host: str, to: tuple[str, int]) -> asyncio.base_events.Server:
    """A TCP relay from ``listen_host`` (an OS-picked port) to ``to``: the front end's port
    let through, the workers' ports not (as a port forward or a firewall does)."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1 << 16):
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        r2, w2 = await asyncio.open_connection(*to)
        await asyncio.gather(pipe(r, w2), pipe(r2, w))

    return await asyncio.start_server(serve, listen_host, 0)


def test_a_client_that_cannot_reach_the_workers_ports_goes_direct_through_the_front_ends_port(tmp_path):
    """The server offers direct TCP endpoints (its default); a client that reached the front
    end through a relay cannot reach them at that address: it has the front end hand a
    connection over to the worker (``protocol/handoff.py``), with no option set, sync and
    async, and the worker answers every call on it. The front end's own fast-path
    connections do not keep the handed-over ones."""
    cfg = quiet_config(tmp_path / "data", load=("lenet",)).replaced(fast_port=0)
    xs = np.random.default_rng(0).integers(0, 256, (6, 1, 28, 28), dtype=np.uint8)
    want = reference(xs)

    async def scenario(server):
        rt = server.runtime("lenet")
        await until(lambda: bool(rt.describe()["direct_tcp"]))  # offered, by default
        front = ("127.0.0.1", server.ports["fast_port"])
        fwd = await relay("127.0.0.2", front)
        url = f"tcp://127.0.0.2:{fwd.sockets[0].getsockname()[1]}"
        try:
            async with AsyncClient(url) as ac:
                got = [await ac.infer("lenet", xs[j]) for j in range(3)]
                held_async = ac.direct_endpoints("lenet")

            def sync_calls() -> tuple[list[np.ndarray], int]:
                with Client(url) as c:
                    return [c.infer("lenet", xs[j]) for j in range(3, 6)], c.direct_endpoints("lenet")

            more, held_sync = await asyncio.to_thread(sync_calls)
            return got + more, held_async, held_sync, rt.direct_tally().counts, server.metrics_text().decode()
        finally:
            fwd.close()

    got, held_async, held_sync, counts, metrics = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    for j, y in enumerate(got):
        np.testing.assert_allclose(y, want[j], rtol=1e-4, atol=1e-5)
    assert held_async == held_sync == 1
    assert counts.received == counts.answered == 6  # every call went to the worker
    assert 'splitserve_handoffs_total{model="lenet"} 2.0' in metrics


def test_a_handed_over_connection_the_worker_refuses_leaves_its_calls_with_the_front_end(tmp_path):
    """A worker at its direct connection limit refuses a connection handed over to it, as one
    to its own port: the client (``direct="via-front"``: the front end's port only) is told
    why, and its calls go through the front end, answered there; once the limit frees, a
    handed-over connection is served again."""
    cfg = quiet_config(tmp_path / "data", load=("lenet",)).replaced(fast_port=0, direct_max_connections=1)
    xs = np.random.default_rng(0).integers(0, 256, (4, 1, 28, 28), dtype=np.uint8)
    want = reference(xs)

    async def scenario(server):
        rt = server.runtime("lenet")
        await until(lambda: bool(rt.describe()["direct_tcp"]))
        url = f"tcp://127.0.0.1:{server.ports['fast_port']}"

        def calls() -> tuple[list[np.ndarray], list[int]]:
            with Client(url, direct="via-front") as first, Client(url, direct="via-front") as second:
                got = [first.infer("lenet", xs[0]), second.infer("lenet", xs[1])]
                held = [first.direct_endpoints("lenet"), second.direct_endpoints("lenet")]
            return got, held

        got, held = await asyncio.to_thread(calls)
        async with AsyncClient(url, direct="via-front") as ac:  # the limit is free again
            got.append(await ac.infer("lenet", xs[2]))
            held.append(ac.direct_endpoints("lenet"))
        await until(lambda: rt.direct_tally().counts.connections == 0)
        return got, held, rt.direct_tally().counts

    got, held, counts = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    for j, y in enumerate(got):
        np.testing.assert_allclose(y, want[j], rtol=1e-4, atol=1e-5)
    assert held == [1, 0, 1]
    assert counts.answered == 2  # the second client's call took the front end


def test_with_the_workers_tcp_ports_closed_a_tcp_client_still_goes_direct_through_the_front_ends_port(tmp_path):
    """``direct_tcp`` off: the workers listen on no TCP port, and LOOKUP names no TCP endpoint.
    A ``tcp://`` client, on its defaults, names a worker's Unix endpoint in a HANDOFF (never
    connecting to the path itself) and its calls go to the worker on the connection the
    front end handed over."""
    cfg = quiet_config(tmp_path / "data", load=("lenet",)).replaced(fast_port=0, direct_tcp=False)
    xs = np.random.default_rng(2).integers(0, 256, (3, 1, 28, 28), dtype=np.uint8)
    want = reference(xs)

    async def scenario(server):
        rt = server.runtime("lenet")
        await until(lambda: bool(rt.describe()["direct"]))
        assert rt.describe()["direct_tcp"] == []
        url = f"tcp://127.0.0.1:{server.ports['fast_port']}"

        def calls() -> tuple[list[np.ndarray], int]:
            with Client(url) as c:
                return [c.infer("lenet", x) for x in xs], c.direct_endpoints("lenet")

        got, held = await asyncio.to_thread(calls)
        return got, held, rt.direct_tally().counts

    got, held, counts = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    for j, y in enumerate(got):
        np.testing.assert_allclose(y, want[j], rtol=1e-4, atol=1e-5)
    assert held == 1 and counts.answered == 3


def test_a_model_used_only_directly_is_the_memory_managers_most_recent_not_its_first_victim(tmp_path):
    """Room for two of three models. lenet0 loads, lenet1 is used through the front end,
    then lenet0 only directly: the node's look at its workers' pages makes it the most
    recently used, so lenet2's load evicts lenet1."""
    names = lenet_copies(tmp_path / "repo", 3)
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", cache_dir=tmp_path / "cache",
                       max_resident_models=2, spare_workers=1, unix_path=tmp_path / "fast.sock")
    xs = np.random.default_rng(1).integers(0, 256, (1, 1, 28, 28), dtype=np.uint8)

    async def scenario(server):
        async with AsyncClient(f"unix://{server.config.unix_socket}") as ac:
            await ac.infer(names[0], xs)  # its load (no endpoint offered before it)
            await server.infer(names[1], [xs])  # the front end: LRU touched at its batch
            lru_before = server.memory.status()["lru"]
            rt = server.runtime(names[0])
            while ac.direct_endpoints(names[0]) == 0:  # looked up again once its endpoint is offered
                await ac.infer(names[0], xs)
                await asyncio.sleep(0.01)
            received = rt.direct_tally().counts.received
            await ac.infer(names[0], xs)
            assert rt.direct_tally().counts.received == received + 1  # straight to the worker
            await until(lambda: server.memory.status()["lru"][-1] == names[0])
            await server.infer(names[2], [xs])
            status = server.memory.status()
        return lru_before, status

    lru_before, status = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert lru_before == [names[0], names[1]]  # least recent first
    assert status["models"][names[1]]["residency"] == "EVICTED"
    assert status["models"][names[0]]["residency"] != "EVICTED" and names[0] in status["lru"]


PACKRAT = """
name = "lenet_pk"
max_batch_size = 16
[artifact]
kind = "zoo"
arch = "lenet"
[placement]
kind = "packrat"
threads = 2
batch = 16
timeout_ms = 1.0
"""


def test_packrats_estimator_observes_direct_arrivals(tmp_path):
    """A Packrat model called only directly: its batch-size estimator sees those calls."""
    repo = tmp_path / "repo" / "lenet_pk"
    repo.mkdir(parents=True)
    (repo / "config.toml").write_text(PACKRAT)
    data = tmp_path / "data"
    data.mkdir()
    reg = Registry(data)
    table = {(t, b): 1e-3 + b * 1e-4 * (0.5 + 0.5 / t) for t in (1, 2) for b in (1, 2, 4, 8, 16)}
    save_profile(reg, ModelProfile(LatencyProfile("lenet_pk", table), {k: [v / 4] * 4 for k, v in table.items()},
                                   machine_id()))
    reg.close()
    cfg = quiet_config(data, repository=tmp_path / "repo", load=("lenet_pk",), unix_path=tmp_path / "fast.sock")
    xs = np.random.default_rng(2).integers(0, 256, (1, 1, 28, 28), dtype=np.uint8)

    async def scenario(server):
        rt = server.runtime("lenet_pk")
        estimator = rt.core.placer.controller.estimator
        async with AsyncClient(f"unix://{server.config.unix_socket}") as ac:
            await ac.infer("lenet_pk", xs)
            assert ac.direct_endpoints("lenet_pk") > 0  # loaded at start: direct from the first call
            before = rt.direct_tally().counts.received
            calls = [asyncio.ensure_future(ac.infer("lenet_pk", xs)) for _ in range(64)]
            await asyncio.gather(*calls)
            assert rt.direct_tally().counts.received == before + 64
            await until(lambda: estimator.ewma is not None)
        return estimator.ewma, rt.stats.success

    ewma, front_end_calls = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert ewma >= 0 and front_end_calls == 0  # every observation came from a direct arrival


def test_a_direct_batch_starts_as_the_models_timeout_policy_says(tmp_path):
    """``timeout`` batching, preferred 4, a delay no test reaches: three direct calls wait
    in the worker (no batch runs), the fourth starts one batch of all four."""
    repo = tmp_path / "repo"
    (repo / "lenet_t").mkdir(parents=True)
    (repo / "lenet_t" / "config.toml").write_text(
        'name = "lenet_t"\nmax_batch_size = 8\n[batching]\npolicy = "timeout"\nmax_delay_ms = 60000.0\n'
        'preferred_batch = 4\n[artifact]\nkind = "zoo"\narch = "lenet"\n')
    cfg = quiet_config(tmp_path / "data", repository=repo, load=("lenet_t",), unix_path=tmp_path / "fast.sock")
    xs = np.random.default_rng(3).integers(0, 256, (4, 1, 28, 28), dtype=np.uint8)
    want = reference(xs)

    async def scenario(server):
        rt = server.runtime("lenet_t")
        async with AsyncClient(f"unix://{server.config.unix_socket}") as ac:
            await ac.lookup("lenet_t")
            assert ac.direct_endpoints("lenet_t") == 1
            first = [asyncio.ensure_future(ac.infer("lenet_t", xs[j])) for j in range(3)]
            await until(lambda: rt.direct_tally().counts.received == 3)
            held = rt.direct_tally().counts
            pending = not any(f.done() for f in first)
            last = await ac.infer("lenet_t", xs[3])
            got = [await f for f in first] + [last]
        return held, pending, got, rt.direct_tally().counts

    held, pending, got, after = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert held.batches == 0 and held.in_flight_rt + held.in_flight_be == 3 and pending
    assert after.batches == 1 and after.samples == 4 and after.answered == 4
    for j, y in enumerate(got):
        np.testing.assert_allclose(y, want[j], rtol=1e-4, atol=1e-5)


def test_a_model_whose_worker_holds_a_direct_call_is_not_evicted_under_it(tmp_path):
    """Room for one model. A direct call holds the resident model's worker (at a gate); a
    call for another model waits for the room instead of evicting it mid-call; once the
    direct call is answered (by its worker, once) the other model loads."""
    from splitserve.models.gate import Gates
    from tests.inproc import write_model

    repo = tmp_path / "repo"
    write_model(repo, "gate", "gate")
    (other,) = lenet_copies(repo, 1)
    gates = Gates(tmp_path / "cache")
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache", max_resident_models=1,
                       load=("gate",), unix_path=tmp_path / "fast.sock")
    xs = np.zeros((1, 1, 28, 28), np.uint8)

    async def scenario(server):
        gates.close(5)
        async with AsyncClient(f"unix://{server.config.unix_socket}") as ac:
            await ac.lookup("gate")
            assert ac.direct_endpoints("gate") == 1
            held = asyncio.ensure_future(ac.infer("gate", np.array([5], np.int64)))
            await until(lambda: gates.held(5))
            waiting = asyncio.ensure_future(server.infer(other, [xs]))
            await until(lambda: server.memory.status()["load_queue"] == [other])
            residency = server.memory.status()["models"]["gate"]["residency"]
            gates.open(5)
            answer = await held
            await waiting  # the load that waited for the room: told once the direct call ended
        return residency, answer, server.runtime("gate").direct_tally().counts, server.memory.status()

    try:
        residency, answer, counts, status = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    finally:
        gates.open_all()
    assert residency != "EVICTED" and answer.ravel().tolist() == [5]
    assert counts.received == counts.answered == 1  # answered by its worker, not re-sent after an eviction
    assert status["models"]["gate"]["residency"] == "EVICTED" and status["lru"] == [other]


def test_an_idle_node_looks_at_its_workers_pages_seldom_and_direct_or_front_end_work_brings_the_look_back(tmp_path):
    """The node's look backs off to ``direct_idle_poll_s`` while it finds nothing; a look
    that finds direct calls comes back to ``direct_poll_s``; under REEF a front-end call
    brings it back at its scheduling pass."""
    cfg = quiet_config(tmp_path / "data", load=("lenet",), unix_path=tmp_path / "fast.sock",
                       direct_poll_s=0.005, direct_idle_poll_s=0.04)
    xs = np.random.default_rng(3).integers(0, 256, (1, 1, 28, 28), dtype=np.uint8)

    async def scenario(server):
        look = server._look
        waits: list[tuple[bool, float]] = []  # each look: whether it found something, the wait it set
        next_wait, hurry = look.next, look.hurry
        hurried: list[float] = []

        def recorded_next(found: bool) -> float:
            waits.append((found, next_wait(found)))
            return waits[-1][1]

        def recorded_hurry() -> None:
            hurried.append(look.wait_s)
            hurry()

        look.next, look.hurry = recorded_next, recorded_hurry
        await until(lambda: look.wait_s == 0.04)  # nothing to find: backed off to the idle wait
        idle = list(waits)
        async with AsyncClient(f"unix://{server.config.unix_socket}") as ac:
            await ac.infer("lenet", xs)
            assert ac.direct_endpoints("lenet") > 0
            waits.clear()
            while not any(found for found, _ in waits):  # direct calls until a look has seen them
                await ac.infer("lenet", xs)
        direct = list(waits)
        await until(lambda: look.wait_s == 0.04)
        hurried.clear()
        await server.infer("lenet", [xs])  # the front end, under REEF: hurried at its scheduling pass
        return idle, direct, hurried, server.runtime("lenet").stats.success

    idle, direct, hurried, front_end_calls = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert idle and not any(found for found, _ in idle) and idle[-1][1] == 0.04
    assert all(wait == 0.005 for found, wait in direct if found)
    assert hurried[:1] == [0.04] and front_end_calls == 1  # hurried from the idle wait
