"""What the direct path gives a client on the server's defaults, checked on one real server
(its models in worker processes) shared by the module: the Triton statistics count direct
calls, each model's batching policy holds on the direct path, and a worker's endpoint takes
only what the front end would."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from splitserve import Client
from splitserve.client.aio import AsyncClient
from splitserve.models.gate import Gates
from splitserve.server.app import Server
from tests.inproc import quiet_config, server_in_thread, until, write_model
from tests.integration.test_triton_compat import samples

MODEL = "vecadd1k"
BOUND_S = 60.0  # no scenario needs this long; reaching it means something hangs
GATES = {"gnone": 'policy = "none"', "gwc": 'policy = "work_conserving"'}  # gate models by batching policy


class Node:
    def __init__(self, server: Server, data: Path, cache: Path) -> None:
        self.server = server
        self.data = data
        self.gates = Gates(cache)
        self.url = f"tcp://127.0.0.1:{server.ports['fast_port']}"
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{server.ports['http_port']}")

    def stats(self, model: str) -> dict[str, Any]:
        r = self.http.get(f"/v2/models/{model}/stats")
        r.raise_for_status()
        return r.json()["model_stats"][0]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("direct-server")
    for name, policy in GATES.items():
        write_model(base / "repo", name, "gate", f"[batching]\n{policy}")
    config = quiet_config(base / "data", cache_dir=base / "cache", load=(MODEL, *GATES), repository=base / "repo",
                          ).replaced(http_port=0, fast_port=0)
    with server_in_thread(config, "direct-server") as server:
        n = Node(server, base / "data", base / "cache")
        try:
            yield n
        finally:
            n.gates.open_all()
            n.http.close()


def _call(c: Client, model: str, n: int) -> None:
    x = samples(MODEL, n)
    np.testing.assert_allclose(c.infer(model, x), x["a"] + x["b"], rtol=1e-6)


def _batches(s: dict[str, Any]) -> dict[int, int]:
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s["batch_stats"]}


def test_triton_statistics_count_direct_calls_by_batch_size(node: Node) -> None:
    """Calls on the direct path (a default client, one at a time: one batch each) count in
    ``inference_count``, ``execution_count`` and ``batch_stats`` as front-end calls do, and
    the batches by size still add up to the execution count."""
    before = node.stats(MODEL)
    with Client(node.url) as c:
        for i in range(9):
            _call(c, MODEL, 1 + i % 3)
    s = node.stats(MODEL)
    assert s["direct"]["answered"] - before["direct"]["answered"] == 9  # they went direct
    assert int(s["execution_count"]) - int(before["execution_count"]) == 9
    assert int(s["inference_count"]) - int(before["inference_count"]) == 3 * (1 + 2 + 3)
    grown = {k: v - _batches(before).get(k, 0) for k, v in _batches(s).items()}
    assert grown == {1: 3, 2: 3, 3: 3}
    assert sum(_batches(s).values()) == int(s["execution_count"])
    assert all(int(b["compute_infer"]["ns"]) > 0 for b in s["batch_stats"])
    # front-end calls count in the same figures
    with Client(node.url, direct=False) as c:
        _call(c, MODEL, 2)
    after = node.stats(MODEL)
    assert after["direct"]["answered"] == s["direct"]["answered"]
    assert int(after["execution_count"]) - int(s["execution_count"]) == 1
    assert _batches(after)[2] - _batches(s)[2] == 1
    assert sum(_batches(after).values()) == int(after["execution_count"])


def _rx_queued(port: int) -> int:
    """Bytes the kernel holds unread for the TCP sockets on local ``port`` (/proc/net/tcp)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":  # ESTABLISHED
            total += int(f[4].split(":")[1], 16)
    return total


def _two_behind_a_held_call(node: Node, model: str) -> dict[int, int]:
    """A direct call held in its batch (at a gate), two more sent behind it and waiting in
    the worker's socket; then the gate opens. Every call answered once, right; the batches
    that ran, by size."""
    start = node.stats(model)
    before = _batches(start)
    (url,) = node.server.runtime(model).describe()["direct_tcp"]
    port = urlsplit(url).port
    gates = node.gates

    async def scenario() -> list[int]:
        gates.open_all()  # no mark of an earlier held call
        gates.close(1)
        async with AsyncClient(node.url) as ac:
            await ac.lookup(model)
            assert ac.direct_endpoints(model) == 1
            first = asyncio.ensure_future(ac.infer(model, np.array([1], np.int64)))
            await until(lambda: gates.held(1))
            rest = [asyncio.ensure_future(ac.infer(model, np.array([k], np.int64))) for k in (2, 3)]
            await until(lambda: _rx_queued(port) >= 2 * 72)  # both frames (a header and one sample each)
            gates.open(1)
            return [int(np.asarray(y).ravel()[0]) for y in await asyncio.gather(first, *rest)]

    assert asyncio.run(asyncio.wait_for(scenario(), BOUND_S)) == [1, 2, 3]
    s = node.stats(model)
    assert s["direct"]["answered"] - start["direct"]["answered"] == 3  # all three went direct
    assert sum(_batches(s).values()) == int(s["execution_count"])
    return {k: v - before.get(k, 0) for k, v in _batches(s).items() if v - before.get(k, 0)}


def test_the_policy_none_runs_each_direct_call_alone(node: Node) -> None:
    """Under ``none`` the two calls that waited run one by one, as the front end runs them;
    under work-conserving (the control: the same calls, the same timing) they share a batch."""
    assert _two_behind_a_held_call(node, "gnone") == {1: 3}
    assert _two_behind_a_held_call(node, "gwc") == {1: 1, 2: 1}
