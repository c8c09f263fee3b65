"""Residency on a real server: a model's weights are released (evict) while its identity
(func_id, queues, statistics) stays; calls for it queue, load it again and are answered
right."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from splitserve import Client
from splitserve.cli import app
from splitserve.client.http import HttpClient
from splitserve.models.zoo import build_zoo_model
from splitserve.models.gate import Gates
from splitserve.scheduler.model_scheduler import Residency
from splitserve.server.ports import ModelState
from splitserve.worker.pool import Residency as WorkerResidency
from tests.inproc import quiet_config, run_server, until, write_model

BOUND_S = 60.0  # no scenario needs this long; reaching it means something hangs


def lenet(xs: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        (y,) = build_zoo_model("lenet")(torch.from_numpy(xs))
    return y.numpy()


def describe(url: str) -> dict[str, Any]:
    """A fresh lookup (a client caches the ones it made)."""
    with Client(url) as c:
        return c.lookup("twin").extra


def test_an_evicted_model_keeps_its_func_id_and_the_calls_that_wait_load_it_again(server_factory, tmp_path):
    write_model(tmp_path / "repo", "twin", "lenet", "instances = 2")
    s = server_factory("--repository", str(tmp_path / "repo"), "--load", "twin", http=True,
                       env={**os.environ, "SPLITSERVE_SPARE_WORKERS": "1"})
    token = (s.data_dir / "token").read_text().strip()
    xs = np.random.default_rng(0).integers(0, 256, (8, 1, 28, 28), dtype=np.uint8)
    want = lenet(xs)
    s.settle(120)  # what the benchmarks wait for before they time calls: the spare is up, none starting
    with HttpClient(s.http, token=token) as h, Client(s.tcp) as c:
        memory = h.memory()
        assert memory["loading"] == [] and memory["spares_starting"] == 0 and memory["spares"] == 1
        np.testing.assert_allclose(c.infer("twin", xs), want, rtol=1e-4, atol=1e-5)
        before = describe(s.tcp)
        assert before["residency"] == ["resident"] * 2 and before["weights_bytes"] > 0

        assert h.evict("twin") == {"name": "twin", "evicted": True, "state": "evicted"}
        after = describe(s.tcp)
        assert after["func_id"] == before["func_id"] and after["state"] == "evicted" and after["enabled"]
        assert after["residency"] == ["absent"] * 2 and after["weights_bytes"] == 0
        # both processes went back to the node's pool of spares: the model holds none
        assert after["pids"] == [None, None]
        (entry,) = [m for m in h.index() if m["name"] == "twin"]
        assert entry["state"] == "UNAVAILABLE" and entry["reason"].startswith("EVICTED")
        assert h.ready()  # an evicted --load model still takes calls
        assert h.metadata("twin")["parameters"]["state"] == "evicted"
        listed = CliRunner().invoke(app, ["models", "list", "--json", "--data-dir", str(s.data_dir), "--url", s.http])
        assert listed.exit_code == 0, listed.output
        assert [(m["state"], m["residency"]) for m in json.loads(listed.output) if m["name"] == "twin"] == [
            ("evicted", "EVICTED")]

        # Calls for a model that is not resident queue, load it and are answered right.
        calls = [c.submit("twin", x) for x in xs]
        got = np.stack([p.result().value() for p in calls])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        h.load("twin")  # returns once every instance is up again
        again = describe(s.tcp)
        assert again["func_id"] == before["func_id"] and again["state"] == "ready"
        assert again["residency"] == ["resident"] * 2 and again["weights_bytes"] == before["weights_bytes"]
        # at least one of its processes came back from the pool (the pool keeps one more than
        # its spare_workers=1 across an eviction); the other took the pool's own spare, or the
        # second evicted process when the pool had not refilled its spare yet
        assert None not in again["pids"] and len(set(again["pids"]) & set(before["pids"])) >= 1
        (stats,) = h.stats("twin")["model_stats"]
        assert stats["residency"]["loads"] == 4 and stats["residency"]["evictions"] == 1
        # every sample counted once, whether the front end or a worker's direct path (the
        # default) served it
        assert stats["inference_count"] == 16
        assert stats["inference_stats"]["fail"]["count"] == 0 and stats["direct"]["failed"] == 0


def test_an_eviction_waits_for_the_running_batch_and_calls_sent_meanwhile_queue_and_load_it_again(tmp_path):
    write_model(tmp_path / "repo", "gate", "gate")
    gates = Gates(tmp_path / "cache")
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", cache_dir=tmp_path / "cache", load=("gate",))

    def key(k: int) -> list[np.ndarray]:
        return [np.array([[k]], np.int64)]

    async def scenario(server):
        rt = server.runtime("gate")
        func_id = rt.func_id
        gates.close(1)
        held = asyncio.ensure_future(server.infer("gate", key(1)))
        await until(lambda: gates.held(1))
        (i,) = rt.sched.serving()
        evict = asyncio.ensure_future(rt.evict())
        await until(lambda: rt.state is ModelState.EVICTED)
        assert rt.sched.instances[i].residency is Residency.UNLOADING  # no new batch goes there
        queued = asyncio.ensure_future(server.infer("gate", key(2)))
        await until(lambda: rt.sched.waiting() == 1)  # taken and queued, not refused
        assert rt.workers[i].residency is WorkerResidency.BOUND  # the UNLOAD waits for the running batch
        gates.open(1)
        first = (await held).outputs[0]
        assert await evict
        second = (await queued).outputs[0]  # it loaded the model again
        return first, second, rt.func_id == func_id, rt.stats.evictions, rt.state

    try:
        first, second, same_id, evictions, state = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    finally:
        gates.open_all()
    assert first.tolist() == [[1]] and second.tolist() == [[2]]
    assert same_id and evictions == 1 and state is ModelState.READY


@pytest.mark.parametrize("direct", [True, "via-front"], ids=["workers-ports", "handed-over"])
def test_direct_calls_across_an_eviction_are_each_answered_once_and_the_client_follows_the_reload(
        server_factory, tmp_path, direct):
    """Two instances, two direct connections (to the workers' ports, or handed over to them
    by the front end); an eviction closes both endpoints with calls unanswered: the client
    sends those through the front end (which loads the model again for them), every call
    gets its own answer once, and the next lookup finds the new endpoints."""
    import time

    from tests.framing import direct_env

    write_model(tmp_path / "repo", "twin", "lenet", "instances = 2")
    s = server_factory("--repository", str(tmp_path / "repo"), "--load", "twin", http=True, env=direct_env())
    token = (s.data_dir / "token").read_text().strip()
    xs = np.random.default_rng(1).integers(0, 256, (48, 1, 28, 28), dtype=np.uint8)
    want = lenet(xs)
    with HttpClient(s.http, token=token) as h, Client(s.tcp, direct=direct) as c:
        calls = [c.submit("twin", xs[j]) for j in range(16)]
        assert c.direct_endpoints("twin") == 2
        for j, p in enumerate(calls):
            np.testing.assert_allclose(p.result().value(), want[j], rtol=1e-4, atol=1e-5)
        assert describe(s.tcp)["direct_counts"]["answered"] == 16  # both workers' pages, summed
        calls = [(j, c.submit("twin", xs[j])) for j in range(16, 48)]
        assert h.evict("twin")["evicted"]
        seen = set()
        for j, p in calls:
            np.testing.assert_allclose(p.result(timeout=120).value(), want[j], rtol=1e-4, atol=1e-5)
            assert p.req_id not in seen
            seen.add(p.req_id)
        assert len(seen) == 32
        deadline = time.monotonic() + 120
        while c.direct_endpoints("twin") < 2:  # the reload's endpoints, once its instances serve
            assert time.monotonic() < deadline, describe(s.tcp)
            np.testing.assert_allclose(c.infer("twin", xs[0]), want[0], rtol=1e-4, atol=1e-5)
            time.sleep(0.05)
