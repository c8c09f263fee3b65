"""What the direct path gives a client on the server's defaults, checked on one real server
(its models in worker processes) shared by the module: the Triton statistics and /metrics
count direct calls (answered and failed), each model's batching policy holds on the direct
path, and a worker's endpoint takes only what the front end would."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve import Client
from splitserve.client.aio import AsyncClient
from splitserve.errors import Status, WorkerFailed
from splitserve.models.gate import Gates
from splitserve.protocol.header import Header, Kind
from splitserve.server.app import Server
from tests.framing import TIMEOUT_S, describe, read_frame
from tests.inproc import quiet_config, server_in_thread, until, write_model
from tests.integration.test_triton_compat import samples

MODEL = "vecadd1k"
BOUND_S = 60.0  # no scenario needs this long; reaching it means something hangs
GATES = {"gnone": 'policy = "none"', "gwc": 'policy = "work_conserving"'}  # gate models by batching policy
# Adaptive with a fixed threshold of 2 samples tested every minute: within a test only a
# full batch (4 samples) is released
ADAPTIVE = ("vadapt", 'max_batch_size = 4\n[batching]\npolicy = "adaptive"\nquantum_ms = 60000.0\n'
                      'rule = "fixed"\nthreshold_cap = 2')
# vecadd1k declared with 512 output elements: its 1024 cannot fit, so each call fails in the worker
HALF = ("vhalf", '[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1024]\n[[inputs]]\nname = "b"\n'
                 'datatype = "FP32"\nshape = [1024]\n[[outputs]]\nname = "sum"\ndatatype = "FP32"\nshape = [512]\n')


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

    def metrics(self, model: str, path: str) -> dict[tuple[str, tuple], float]:
        """``model``'s series of ``path`` on /metrics: (name, its other labels) -> value."""
        r = self.http.get("/metrics")
        r.raise_for_status()
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "path")))): s.value
                for f in text_string_to_metric_families(r.text) for s in f.samples
                if s.labels.get("model") == model and s.labels.get("path") == path}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("direct-server")
    for name, policy in GATES.items():
        write_model(base / "repo", name, "gate", f"[batching]\n{policy}")
    write_model(base / "repo", ADAPTIVE[0], "vecadd1k", ADAPTIVE[1])
    write_model(base / "repo", HALF[0], "vecadd1k", HALF[1])
    config = quiet_config(base / "data", cache_dir=base / "cache", load=(MODEL, *GATES, ADAPTIVE[0], HALF[0]),
                          repository=base / "repo",
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


def _grown(after: dict[str, Any], before: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``inference_stats`` of ``after`` less ``before``: name -> (count, ns)."""
    a, b = after["inference_stats"], before["inference_stats"]
    return {k: (int(a[k]["count"]) - int(b[k]["count"]), int(a[k]["ns"]) - int(b[k]["ns"])) for k in a}


def _total(series: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels`` (over classes, statuses)."""
    return sum(v for (n, ls), v in series.items() if n == name and set(labels.items()) <= set(ls))


def _counters(node: Node, model: str, path: str) -> tuple[float, float, float]:
    """``model``'s requests answered, samples and batches on /metrics for ``path``."""
    m = node.metrics(model, path)
    return (_total(m, "splitserve_requests_total"), _total(m, "splitserve_inference_count_total"),
            _total(m, "splitserve_execution_count_total"))


def _durations(node: Node, model: str, path: str) -> tuple[float, ...]:
    """``model``'s duration histograms on /metrics for ``path``: the calls in the request,
    queue and compute histograms, and the request durations' sum (s)."""
    m = node.metrics(model, path)
    counts = tuple(_total(m, f"splitserve_{d}_duration_seconds_count") for d in ("request", "queue", "compute"))
    # each histogram's last (+Inf) bucket holds every call it counted
    assert counts == tuple(_total(m, f"splitserve_{d}_duration_seconds_bucket", le="+Inf")
                           for d in ("request", "queue", "compute"))
    return (*counts, _total(m, "splitserve_request_duration_seconds_sum"))


def test_triton_statistics_count_direct_calls_by_batch_size(node: Node) -> None:
    """Calls on the direct path (a default client, one at a time: one batch each) count in
    ``inference_count``, ``execution_count`` and ``batch_stats`` as front-end calls do, and
    the batches by size still add up to the execution count."""
    before = node.stats(MODEL)
    direct0, front0 = _counters(node, MODEL, "direct"), _counters(node, MODEL, "front")
    durations0, front_durations0 = _durations(node, MODEL, "direct"), _durations(node, MODEL, "front")
    started_ms = time.time_ns() // 1_000_000
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
    # each call once in inference_stats, with the worker's times: its duration is its queue
    # wait, its batch's model run and its output copy (one call a batch: the batch's run)
    calls = _grown(s, before)
    assert {k: n for k, (n, _) in calls.items()} == {"success": 9, "fail": 0, "queue": 9, "compute_input": 9,
                                                     "compute_infer": 9, "compute_output": 9}
    assert calls["success"][1] == calls["queue"][1] + calls["compute_infer"][1] + calls["compute_output"][1]
    assert calls["compute_infer"][1] == sum(int(b["compute_infer"]["ns"]) for b in s["batch_stats"]) - \
        sum(int(b["compute_infer"]["ns"]) for b in before["batch_stats"])
    assert int(s["last_inference"]) >= started_ms  # the last of them, as its worker stamped it
    # and /metrics: the per-model counters under path="direct", the front end's unchanged
    direct = _counters(node, MODEL, "direct")
    assert [a - b for a, b in zip(direct, direct0)] == [9, 18, 9]
    assert _counters(node, MODEL, "front") == front0
    # and the duration histograms: each call once, under path="direct", its duration the worker's
    durations = _durations(node, MODEL, "direct")
    assert [a - b for a, b in zip(durations[:3], durations0)] == [9, 9, 9]
    assert durations[3] - durations0[3] == pytest.approx(calls["success"][1] / 1e9)
    assert _durations(node, MODEL, "front") == front_durations0
    # front-end calls count in the same figures
    with Client(node.url, direct=False) as c:
        _call(c, MODEL, 2)
    after = node.stats(MODEL)
    assert after["direct"]["answered"] == s["direct"]["answered"]
    assert int(after["execution_count"]) - int(s["execution_count"]) == 1
    assert _batches(after)[2] - _batches(s)[2] == 1
    assert sum(_batches(after).values()) == int(after["execution_count"])
    assert _grown(after, s)["success"][0] == 1
    assert [a - b for a, b in zip(_counters(node, MODEL, "front"), front0)] == [1, 2, 1]
    assert _counters(node, MODEL, "direct") == direct
    assert [a - b for a, b in zip(_durations(node, MODEL, "front")[:3], front_durations0)] == [1, 1, 1]
    assert _durations(node, MODEL, "direct") == durations


def test_a_direct_call_the_model_fails_counts_as_a_failure(node: Node) -> None:
    """A model error answered to a direct client by its worker is one failure in the
    statistics (with its duration) and one WORKER_FAILED on /metrics under path="direct"."""
    before = node.stats(HALF[0])
    failures = _total(node.metrics(HALF[0], "direct"), "splitserve_request_failures_total", status="WORKER_FAILED")
    durations = _durations(node, HALF[0], "direct")
    with Client(node.url) as c, pytest.raises(WorkerFailed, match="'vhalf' raised"):
        c.infer(HALF[0], samples(MODEL, 1))
    s = node.stats(HALF[0])
    assert s["direct"]["failed"] - before["direct"]["failed"] == 1  # its worker answered it
    calls = _grown(s, before)
    assert calls["fail"][0] == 1 and calls["fail"][1] > 0 and calls["success"] == (0, 0)
    assert int(s["inference_count"]) == int(before["inference_count"])
    assert s["last_inference"] == before["last_inference"]  # a call answered with its result sets it
    after = _total(node.metrics(HALF[0], "direct"), "splitserve_request_failures_total", status="WORKER_FAILED")
    assert after - failures == 1
    # its duration in the request histogram (a failed call has no queue wait or compute there)
    grown = [a - b for a, b in zip(_durations(node, HALF[0], "direct"), durations)]
    assert grown[:3] == [1, 0, 0] and grown[3] == pytest.approx(calls["fail"][1] / 1e9)


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


def test_the_adaptive_policy_holds_direct_calls_until_its_test_releases_them(node: Node) -> None:
    """Adaptive, its threshold 2 samples and its quantum longer than the test: three direct
    calls (1, 1 and 2 samples) wait until together they fill the batch (4), then run as
    one batch; each gets its own rows' answer."""
    name = ADAPTIVE[0]
    start = node.stats(name)
    xs = [samples(MODEL, n) for n in (1, 1, 2)]

    async def scenario() -> list[np.ndarray]:
        async with AsyncClient(node.url) as ac:
            first = asyncio.ensure_future(ac.infer(name, xs[0]))
            # the worker holds the first (work-conserving would run it alone now), then the rest come
            await until(lambda: node.stats(name)["direct"]["received"] > start["direct"]["received"])
            return await asyncio.gather(first, *(ac.infer(name, x) for x in xs[1:]))

    got = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    for x, y in zip(xs, got):
        np.testing.assert_allclose(y, x["a"] + x["b"], rtol=1e-6)
    s = node.stats(name)
    assert s["direct"]["answered"] - start["direct"]["answered"] == 3
    assert {k: v - _batches(start).get(k, 0) for k, v in _batches(s).items()} == {4: 1}


def test_a_worker_endpoint_takes_only_calls_for_its_model_and_pings(node: Node) -> None:
    """A worker's direct endpoint serves its bound model (registered and loaded: a worker
    is bound to nothing else) and nothing of the front end's: its Unix socket is its user's
    alone (0600), a frame of any other kind (LOOKUP, a kind the protocol lacks) is refused
    BAD_FRAME, a call for another model UNKNOWN_MODEL, each answered once, and the
    connection serves on. Management (loads, unloads, settings) is not on this protocol at
    all: it is HTTP or gRPC at the front end, behind its token."""
    (url,) = node.server.runtime(MODEL).describe()["direct"]
    path = urlsplit(url).path
    assert os.stat(path).st_mode & 0o777 == 0o600
    with socket.create_connection(("127.0.0.1", node.server.ports["fast_port"]), timeout=TIMEOUT_S) as front:
        other = describe(front, "gwc")["func_id"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT_S)
        s.connect(path)
        s.sendall(Header(Kind.LOOKUP, req_id=1, payload_len=len(MODEL)).pack() + MODEL.encode())
        h, body = read_frame(s)
        assert h is not None and (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.BAD_FRAME, 1), body
        s.sendall(Header(Kind.LOOKUP_REPLY, req_id=2).pack())
        h, body = read_frame(s)
        assert h is not None and (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.BAD_FRAME, 2), body
        payload = bytes(8)
        s.sendall(Header(Kind.REQUEST, req_id=3, func_id=other, payload_len=len(payload)).pack() + payload)
        h, body = read_frame(s)
        assert h is not None and (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.UNKNOWN_MODEL, 3), body
        s.sendall(Header(Kind.PING, req_id=4).pack())
        h, _ = read_frame(s)
        assert h is not None and (h.kind, h.req_id) == (Kind.PONG, 4)
