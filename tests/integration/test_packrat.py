"""Packrat placement in a running server: pinned thin instances, reconfiguration under load."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from splitserve.errors import ModelNotReady
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import ModelProfile, machine_id, save_profile
from splitserve.registry import Registry
from splitserve.client.aio import AsyncClient
from tests.inproc import quiet_config, run_server, until

NCPU = len(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(NCPU < 2, reason="Packrat's thin instances need at least 2 CPUs")

CONFIG = """
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
adaptive = false
"""


def synthetic_profile(model: str) -> ModelProfile:
    """Sub-linear thread scaling plus a per-batch cost: thin instances win at large B."""
    table = {(t, b): 1e-3 + b * 1e-4 * (0.5 + 0.5 / t) for t in (1, 2) for b in (1, 2, 4, 8, 16)}
    segs = {k: [v / 4] * 4 for k, v in table.items()}
    return ModelProfile(LatencyProfile(model, table), segs, machine_id())


def run(tmp_path: Path, scenario, **config):
    repo = tmp_path / "repo" / "lenet_pk"
    repo.mkdir(parents=True)
    (repo / "config.toml").write_text(CONFIG)
    data = tmp_path / "data"
    data.mkdir()
    reg = Registry(data)
    save_profile(reg, synthetic_profile("lenet_pk"))
    reg.close()

    return run_server(quiet_config(data, repository=tmp_path / "repo", load=("lenet_pk",)).replaced(**config), scenario)


def allowed_cpus(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out = set()
            for part in line.split(":")[1].strip().split(","):
                lo, _, hi = part.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
            return out
    raise AssertionError("no Cpus_allowed_list")


def test_thin_instances_are_pinned_to_disjoint_cores(tmp_path):
    async def scenario(server):
        rt = server.runtime("lenet_pk")
        shapes = [(rt.resources.placed(rt.name, i).threads, rt.sched.instances[i].max_batch)
                  for i in rt.sched.serving()]
        pins = [allowed_cpus(rt.workers[i].pid) for i in rt.sched.serving()]
        x = np.zeros((16, 1, 28, 28), np.uint8)
        out = await server.infer("lenet_pk", [x])
        return shapes, pins, out

    shapes, pins, out = run(tmp_path, scenario)
    assert shapes == [(1, 8), (1, 8)]  # the optimizer's choice for T=2, B=16 on this profile
    assert all(len(p) == 1 for p in pins) and not pins[0] & pins[1], pins
    assert out.outputs[0].shape == (16, 10)


def test_reconfiguration_under_a_steady_stream_loses_no_request_in_process_or_direct(tmp_path):
    """In-process calls and clients on the defaults (they call the workers directly) beside
    them; two repacks replace every instance (new workers, new direct endpoints): each call
    gets its own input's answer, none is lost, and the direct clients are on the new
    instances' endpoints afterwards."""
    async def scenario(server):
        rt = server.runtime("lenet_pk")
        url = f"tcp://127.0.0.1:{server.ports['fast_port']}"
        images = [np.full((1, 1, 28, 28), 40 * i, np.uint8) for i in range(4)]
        want = [(await server.infer("lenet_pk", [x])).outputs[0] for x in images]
        stop = asyncio.Event()
        results: list[str] = []
        direct = [await AsyncClient(url).connect() for _ in images]

        async def call(i: int, infer) -> None:
            while not stop.is_set():
                try:
                    got = await infer(images[i])
                    results.append("ok" if np.allclose(got, want[i], atol=1e-5) else "wrong")
                except Exception as e:  # any failure is what this test is about
                    results.append(f"{type(e).__name__}: {e}")
                    await asyncio.sleep(0.01)  # a failure raised before any await must not starve the loop

        async def in_process(x):
            return (await server.infer("lenet_pk", [x])).outputs[0]

        def of(c: AsyncClient):
            return lambda x: c.infer("lenet_pk", x)

        async def answered(n: int) -> None:  # the clients run: n calls have come back
            await asyncio.wait_for(until(lambda: len(results) >= n), 60)

        try:
            clients = [asyncio.ensure_future(call(i, in_process)) for i in range(len(images))]
            clients += [asyncio.ensure_future(call(i, of(c))) for i, c in enumerate(direct)]
            await answered(20)
            direct_before = [c.direct_endpoints("lenet_pk") for c in direct]
            # Both switch inside the model's 2-core budget, one instance at a time (a rolling change).
            steps = [await rt.repack(4), await rt.repack(16)]
            await answered(len(results) + 40)  # and they still run on the final shape
            # calling on, the direct clients look up again while they hold fewer connections than offered
            await asyncio.wait_for(until(lambda: all(c.direct_endpoints("lenet_pk") for c in direct)), 30)
            stop.set()
            await asyncio.gather(*clients)
        finally:
            for c in direct:
                await c.close()
        final = [(rt.resources.placed(rt.name, i).threads, rt.sched.instances[i].max_batch)
                 for i in rt.sched.serving()]
        return results, direct_before, steps, final, server.monitor.in_flight

    results, direct_before, steps, final, in_flight = run(tmp_path, scenario, fast_port=0)
    assert results and set(results) == {"ok"}, [r for r in results if r != "ok"][:3]
    assert all(direct_before), direct_before  # they were calling the workers directly before the change
    assert in_flight == 0
    assert steps[0]["shapes"] == [(1, 2), (1, 2)] and steps[0]["batch"] == 4 and steps[0]["start_s"] > 0
    assert steps[1]["shapes"] == [(1, 8), (1, 8)] and steps[1]["batch"] == 16
    assert final == [(1, 8), (1, 8)]


def test_two_packrat_models_and_a_fixed_model_never_pin_onto_one_cpu(tmp_path):
    """Every worker's ``Cpus_allowed_list``: the Packrat models' 1-core budgets and the fixed
    model are disjoint. On a 2-CPU runner no CPU is left for the fixed model: its load is
    refused, naming who holds what."""
    repo = tmp_path / "repo"
    for name in ("pk_a", "pk_b"):
        (repo / name).mkdir(parents=True)
        (repo / name / "config.toml").write_text(CONFIG.replace('"lenet_pk"', f'"{name}"').replace("threads = 2",
                                                                                                  "threads = 1"))
    (repo / "fixed").mkdir()
    (repo / "fixed" / "config.toml").write_text('name = "fixed"\n[artifact]\nkind = "zoo"\narch = "lenet"\n')
    data = tmp_path / "data"
    data.mkdir()
    reg = Registry(data)
    for name in ("pk_a", "pk_b"):
        save_profile(reg, synthetic_profile(name))
    reg.close()

    async def scenario(server):
        refused = None
        try:
            await server.runtime("fixed").wait_ready()
        except ModelNotReady as e:
            refused = str(e)
        pins = {name: [allowed_cpus(w.pid) for w in rt.workers.values()] for name, rt in server.runtimes.items()}
        return pins, refused, server.management.node_placement()

    pins, refused, node = run_server(quiet_config(data, repository=repo, load=("pk_a", "pk_b")), scenario)
    every = [c for sets in pins.values() for p in sets for c in p]
    assert len(every) == len(set(every)), pins
    assert [len(pins["pk_a"]), len(pins["pk_b"])] == [1, 1]
    if NCPU >= 3:
        assert refused is None and len(pins["fixed"]) == 1
    else:
        assert refused is not None and "'pk_a' holds" in refused and "'pk_b' holds" in refused, refused
    assert {p["owner"] for p in node["partitions"]} == ({"pk_a", "pk_b", "fixed"} if NCPU >= 3 else {"pk_a", "pk_b"})
