"""What the direct path gives a client on the server's defaults, checked on one real server
(its models in worker processes) shared by the module: the Triton statistics count direct
calls, each model's batching policy holds on the direct path, and a worker's endpoint takes
only what the front end would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from splitserve import Client
from splitserve.server.app import Server
from tests.inproc import quiet_config, server_in_thread, write_model
from tests.integration.test_triton_compat import samples

MODEL = "vecadd1k"


class Node:
    def __init__(self, server: Server, data: Path) -> None:
        self.server = server
        self.data = data
        self.url = f"tcp://127.0.0.1:{server.ports['fast_port']}"
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{server.ports['http_port']}")

    def stats(self, model: str) -> dict[str, Any]:
        r = self.http.get(f"/v2/models/{model}/stats")
        r.raise_for_status()
        return r.json()["model_stats"][0]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("direct-server")
    config = quiet_config(base / "data", cache_dir=base / "cache", load=(MODEL,), repository=base / "repo",
                          ).replaced(http_port=0, fast_port=0)
    with server_in_thread(config, "direct-server") as server:
        n = Node(server, base / "data")
        yield n
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
