"""One class model for REEF and PROTEAN on a real server: a late real-time call
is served and counted ``missed``; a hard deadline still answers DEADLINE_MISSED and counts
``dropped``; under ``--class-order arrival`` an earlier best-effort call runs before a later
real-time one. The gate model holds the only instance so that every call waits.

Then, straight to one node over HTTP and gRPC: a per-call ``slo_ms`` counted ``met`` or
``missed`` in ``/metrics``, a bad one refused (400 / INVALID_ARGUMENT) with the node serving
on, and the class spelled ``strict`` counted as ``rt``."""

from __future__ import annotations

import re
import time

import grpc
import httpx
import numpy as np
import pytest

from splitserve.client.common import encode_inputs
from splitserve.client import Client
from splitserve.client.grpc import GrpcClient, infer_request
from splitserve.client.http import HttpClient
from splitserve.errors import DeadlineMissed
from splitserve.models.gate import Gates
from splitserve.protocol import v2
from splitserve.protocol.grpc_codec import set_param
from tests.helpers import start_server
from tests.inproc import write_model

OUTCOMES = ("met", "missed", "dropped")
VEC = (np.ones(1024, np.float32), np.ones(1024, np.float32))  # vecadd1k answers their sum: 2.0 throughout
# slo_ms not a positive number of milliseconds (refused, never read as "no SLO"); a class
# sent as a bool or a fraction (gRPC served true as best-effort, 0.5 as real-time)
BAD_PARAMETERS = [("slo_ms", -5.0), ("slo_ms", 0), ("slo_ms", "soon"), ("slo_ms", True),
                  ("class", True), ("class", 0.5)]


def key(k: int) -> np.ndarray:
    return np.array([[k]], np.int64)


def slo_counts(metrics: str, model: str) -> dict[str, float]:
    found = re.findall(rf'splitserve_slo_requests_total\{{class="rt",model="{model}",outcome="(\w+)"\}} (\S+)', metrics)
    return {outcome: float(n) for outcome, n in found}


def test_late_rt_is_served_and_missed_a_deadline_is_dropped_and_arrival_order_serves_be_first(
        server_factory, tmp_path):
    write_model(tmp_path / "repo", "gate", "gate", 'max_batch_size = 1\n[batching]\npolicy = "none"\n'
                                                   "[slo]\ntarget_ms = 60000.0")
    gates = Gates(tmp_path / "cache")
    s = server_factory("--repository", str(tmp_path / "repo"), "--load", "gate", "--preemption", "concurrent",
                       "--class-order", "arrival", http=True, cache_dir=tmp_path / "cache")
    try:
        with Client(s.tcp, direct=False) as c, HttpClient(s.http) as h:  # the scheduler's classes
            gates.close(1)
            holder = c.submit("gate", key(1), cls="be")  # holds the only instance mid-run
            with httpx.Client(base_url=s.http, timeout=30) as web:
                give_up = time.monotonic() + 60
                while not gates.held(1):  # a file the worker writes once key 1 waits at its gate
                    assert time.monotonic() < give_up, "the gate never held key 1"
                    web.get("/v2/health/live")
                early_be = c.submit("gate", key(2), cls="be")
                late_rt = c.submit("gate", key(3), cls="rt", slo_ms=1)  # cannot be met: the instance is held
                with pytest.raises(DeadlineMissed):  # answered while the gate still holds key 1
                    c.infer_result("gate", key(4), cls="rt", deadline_ms=50)
                assert gates.held(1)
                gates.open(1)
                assert int(holder.result().value()[0, 0]) == 1
                assert int(early_be.result().value()[0, 0]) == 2
                assert int(late_rt.result().value()[0, 0]) == 3  # late, and served all the same
                assert int(h.infer("gate", key(5), cls="rt")[0, 0]) == 5  # the model's SLO: 60 s, met
                starts = [e["cls"] for e in web.get("/v2/scheduler/events").json()["events"] if e["kind"] == "start"]
                metrics = web.get("/metrics").text
            (stats,) = h.stats("gate")["model_stats"]
    finally:
        gates.open_all()
    # the earlier best-effort call ran before the later real-time one (arrival order)
    assert starts == ["be", "be", "rt", "rt"]
    assert slo_counts(metrics, "gate") == {"met": 1.0, "missed": 1.0, "dropped": 1.0}
    assert stats["slo"] == {"met": 1, "missed": 1, "dropped": 1}


# -- per-call SLOs straight to a node, over HTTP and gRPC ----------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("classes"), "--load", "vecadd1k", http=True, grpc=True)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def http(node):
    with HttpClient(node.http) as h:
        yield h


@pytest.fixture(scope="module")
def rpc(node):
    with GrpcClient(node.grpc) as g:
        yield g


def slo_change(h: HttpClient, before: dict[str, float]) -> dict[str, float]:
    """How far vecadd1k's real-time SLO counts in the node's ``/metrics`` moved since ``before``."""
    after = slo_counts(h.metrics(), "vecadd1k")
    return {o: after.get(o, 0.0) - before.get(o, 0.0) for o in OUTCOMES}


def http_call(h: HttpClient, parameters: dict) -> httpx.Response:
    """A v2 JSON infer call to vecadd1k with these ``parameters``, as sent on the wire."""
    info = h.lookup("vecadd1k")
    arrays, _, _ = encode_inputs(info, VEC)
    parts, _ = v2.build_infer_request([(t.name, a) for t, a in zip(info.inputs, arrays)], binary=False,
                                      parameters=parameters)
    return h.http.post("/v2/models/vecadd1k/infer", content=b"".join(parts),
                       headers={"Content-Type": v2.JSON_CONTENT_TYPE})


def grpc_call(g: GrpcClient, parameters: dict):
    """A ModelInfer call to vecadd1k with these ``parameters``, as sent on the wire."""
    info = g.lookup("vecadd1k")
    arrays, _, _ = encode_inputs(info, VEC)
    req = infer_request(info, arrays, None, None)
    for k, v in parameters.items():
        set_param(req.parameters, k, v)
    return g.stub.ModelInfer(req, timeout=30)


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_slo_ms_is_met_or_missed_and_late_calls_are_answered(front, http, rpc):
    """A minute is met; 1 µs cannot be, and the call is answered with its result all the same."""
    client = http if front == "http" else rpc
    before = slo_counts(http.metrics(), "vecadd1k")
    for slo_ms in (60_000, 0.001):
        np.testing.assert_array_equal(client.infer("vecadd1k", VEC, cls="rt", slo_ms=slo_ms).ravel(),
                                      np.full(1024, 2.0))
    assert slo_change(http, before) == {"met": 1.0, "missed": 1.0, "dropped": 0.0}


@pytest.mark.parametrize("name, value", BAD_PARAMETERS)
def test_a_bad_slo_ms_or_class_is_refused_over_http_and_grpc_and_the_node_serves_on(name, value, http, rpc):
    before = slo_counts(http.metrics(), "vecadd1k")
    parameters = {"class": "rt", "slo_ms": 60_000.0, name: value}
    r = http_call(http, parameters)
    assert r.status_code == 400 and name in r.json()["error"], r.text
    with pytest.raises(grpc.RpcError) as info:
        grpc_call(rpc, parameters)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in info.value.details()
    for client in (http, rpc):  # and the next call is served
        np.testing.assert_array_equal(client.infer("vecadd1k", VEC).ravel(), np.full(1024, 2.0))
    assert slo_change(http, before) == dict.fromkeys(OUTCOMES, 0.0)  # a refused call has no SLO outcome


def test_strict_is_real_time_on_the_wire_and_in_the_client(http, rpc):
    """``class: "strict"`` over HTTP and gRPC, and ``cls="strict"`` in the client, are counted as rt."""
    before = slo_counts(http.metrics(), "vecadd1k")
    r = http_call(http, {"class": "strict", "slo_ms": 60_000})
    assert r.status_code == 200, r.text
    (out,) = v2.parse_infer_response(r.content).outputs.values()
    np.testing.assert_array_equal(out.ravel(), np.full(1024, 2.0))
    grpc_call(rpc, {"class": "strict", "slo_ms": 60_000.0})
    rpc.infer("vecadd1k", VEC, cls="strict", slo_ms=60_000)
    assert slo_change(http, before) == {"met": 3.0, "missed": 0.0, "dropped": 0.0}
    assert 'class="strict"' not in http.metrics()
