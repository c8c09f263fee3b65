"""Triton's statistics, trace and logging extensions and its model-loading and sequence
parameters, driven with the real ``tritonclient`` (HTTP and gRPC) against one real server
in this process (its models in worker processes).

The statistics measure (the worker's input copy, model and output copy, the monitor's
queue time) and add up to no more than each call's duration, which is no more than what the
client measured; spans of traced calls are caught with the OpenTelemetry SDK's in-memory
exporter; what splitserve does not do (sequences, ensembles, decoupled models) is refused
naming the field.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.utils import InferenceServerException

from splitserve import Client
from splitserve.server.app import Server
from splitserve.server.tracing import TRACE_DIR
from tests.inproc import quiet_config, server_in_thread, write_model
from tests.integration.test_triton_compat import inputs_for, samples

MODEL = "vecadd1k"
STAGED = 64  # fast-path calls whose stamps the server keeps (GET /v2/debug/stages)
EVENTS = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
          "COMPUTE_END", "REQUEST_END"]


class Node:
    def __init__(self, server: Server, data: Path) -> None:
        self.server = server
        self.data = data
        self.auth = {"authorization": f"Bearer {(data / 'token').read_text().strip()}"}
        self.http = thttp.InferenceServerClient(f"127.0.0.1:{server.ports['http_port']}")
        self.grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{server.ports['grpc_port']}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("triton-ext")
    write_model(base / "repo", "idle", "vecadd1k")  # registered, never loaded
    config = quiet_config(base / "data", cache_dir=base / "cache", load=(MODEL,), repository=base / "repo",
                          allow_code_artifacts=True,
                          fast_stage_trace=STAGED).replaced(http_port=0, grpc_port=0, fast_port=0)
    with server_in_thread(config, "triton-ext-server") as server:
        n = Node(server, base / "data")
        yield n
        n.http.close()
        n.grpc.close()


@pytest.fixture
def spans(node: Node) -> Iterator[InMemorySpanExporter]:
    """The spans the server ends from now on; the trace settings are back to their defaults after."""
    exporter = InMemorySpanExporter()
    node.server.tracer.provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # keeps no more spans (the provider cannot drop a processor)
    node.http.update_trace_settings(MODEL, {k: None for k in ("trace_level", "trace_rate", "trace_count",
                                                               "trace_file", "log_frequency")}, headers=node.auth)
    node.http.update_trace_settings(settings={"trace_level": None, "trace_rate": None, "trace_count": None},
                                    headers=node.auth)


def _error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def _calls(node: Node, client: Any, module: Any, n: int) -> float:
    """``n`` calls of 1 to 3 samples; the seconds the client waited for them in all."""
    waited = 0.0
    for i in range(n):
        arrays = samples(MODEL, 1 + i % 3)
        t0 = time.perf_counter()
        out = client.infer(MODEL, inputs_for(module, arrays)).as_numpy("sum")
        waited += time.perf_counter() - t0
        np.testing.assert_allclose(out, arrays["a"] + arrays["b"], rtol=1e-6)
    return waited


# -- readiness, as docs/coming-from-triton.md states it ------------------------------------------

def test_a_model_not_loaded_yet_is_ready_and_one_unloaded_is_not(node: Node) -> None:
    assert node.http.is_server_ready() and node.grpc.is_server_ready()
    assert node.http.is_model_ready("idle") and node.grpc.is_model_ready("idle")  # loads on its first call
    node.grpc.unload_model("idle", headers=node.auth)
    assert not node.http.is_model_ready("idle") and not node.grpc.is_model_ready("idle")
    node.http.load_model("idle", headers=node.auth)
    assert node.http.is_model_ready("idle") and node.server.model_state("idle").value == "ready"


# -- statistics --------------------------------------------------------------------------------

def _ns(d: dict) -> int:
    return int(d.get("ns", 0))


def _count(d: dict) -> int:
    return int(d.get("count", 0))


@pytest.mark.parametrize("module", [thttp, tgrpc], ids=["http", "grpc"])
def test_statistics_measure_and_add_up(node: Node, module: Any) -> None:
    client = node.http if module is thttp else node.grpc
    before = client.get_inference_statistics(MODEL, as_json=True) if module is tgrpc else \
        client.get_inference_statistics(MODEL)
    waited = _calls(node, client, module, 9)
    stats = client.get_inference_statistics(MODEL, as_json=True) if module is tgrpc else \
        client.get_inference_statistics(MODEL)

    def delta(s: dict, key: str) -> tuple[int, int]:
        b = before["model_stats"][0]["inference_stats"].get(key, {})
        return _count(s["inference_stats"][key]) - _count(b), _ns(s["inference_stats"][key]) - _ns(b)

    s = stats["model_stats"][0]
    calls, total = delta(s, "success")
    assert calls == 9
    parts = 0
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        n, ns = delta(s, key)
        assert n == calls and ns > 0, (key, n, ns)
        parts += ns
    # each call's queue wait and its batch's worker times are within its duration (the rest
    # is the front end's receive, hand-off and answer), which the client waited for in full
    assert 0 < parts <= total <= waited * 1e9
    for b in s["batch_stats"]:
        assert int(b["batch_size"]) >= 1
        for key in ("compute_input", "compute_infer", "compute_output"):
            assert _count(b[key]) >= 1 and _ns(b[key]) > 0, (b, key)
    assert sum(_count(b["compute_infer"]) for b in s["batch_stats"]) == int(s["execution_count"])


def test_statistics_add_up_to_each_calls_duration_less_the_measured_gaps(node: Node) -> None:
    """Over the fast path the server keeps each call's stamps, so the gaps the statistics leave
    out (receive, hand-off to the worker, the worker's DONE back, the answer) are measured: a
    call's duration is exactly its queue wait, its batch's worker times and those gaps."""
    before = node.http.get_inference_statistics(MODEL)["model_stats"][0]["inference_stats"]
    # through the front end, which keeps the stamps (a direct call's are the worker's own)
    with Client(f"tcp://127.0.0.1:{node.server.ports['fast_port']}", direct=False) as c:
        ids = []
        for i in range(8):
            call = c.submit(MODEL, samples(MODEL, 1 + i % 3))
            call.result(60)
            ids.append(call.req_id)
    after = node.http.get_inference_statistics(MODEL)["model_stats"][0]["inference_stats"]
    staged = {r["req_id"]: r for r in node.server.stage_trace()["calls"] if r["model"] == MODEL}
    calls = [staged[i] for i in ids]
    gaps_ns = sum(((r["t_rx"] - r["t_ready"]) + (r["t_start_w"] - r["t_dispatch"])
                   + (r["t_work"] - r["t_start_w"] - r["compute_ns"] / 1e9)) * 1e9 for r in calls)
    delta = {k: _ns(after[k]) - _ns(before[k]) for k in after}
    assert _count(after["success"]) - _count(before["success"]) == len(calls)
    parts = sum(delta[k] for k in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert min(delta[k] for k in ("queue", "compute_input", "compute_infer", "compute_output")) > 0
    assert gaps_ns > 0
    # each duration and queue wait is rounded to whole ns once: a few ns a call at most
    assert abs(delta["success"] - parts - gaps_ns) <= 4 * len(calls), (delta, gaps_ns)


def test_tritonclient_reads_direct_calls_in_the_statistics_over_http_and_grpc(node: Node) -> None:
    """Calls a worker answered straight to its client (the default client's path) are in the
    statistics both Triton clients read, each once, with the worker's times: a direct call's
    duration is exactly its queue wait, its batch's model run and its output copy."""
    def read() -> list[dict]:
        return [node.http.get_inference_statistics(MODEL)["model_stats"][0],
                node.grpc.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]]

    rt = node.server.runtime(MODEL)
    before, answered = read(), rt.direct_tally().counts.answered
    with Client(f"tcp://127.0.0.1:{node.server.ports['fast_port']}") as c:
        for i in range(4):  # one at a time: a batch each
            c.infer(MODEL, samples(MODEL, 1 + i % 2))
    assert rt.direct_tally().counts.answered - answered == 4  # they went direct
    for b, a in zip(before, read()):
        delta = {k: (_count(a["inference_stats"][k]) - _count(b["inference_stats"].get(k, {})),
                     _ns(a["inference_stats"][k]) - _ns(b["inference_stats"].get(k, {}))) for k in a["inference_stats"]}
        assert {k: n for k, (n, _) in delta.items()} == {"success": 4, "fail": 0, "queue": 4, "compute_input": 4,
                                                         "compute_infer": 4, "compute_output": 4}
        assert delta["success"][1] == sum(delta[k][1] for k in ("queue", "compute_input", "compute_infer",
                                                                   "compute_output")) > 0
        # (gRPC's JSON leaves out a count that is 0)
        assert int(a["inference_count"]) - int(b.get("inference_count", 0)) == 6
        assert int(a["execution_count"]) - int(b.get("execution_count", 0)) == 4


# -- trace extension -----------------------------------------------------------------------------

def test_trace_settings_read_and_written_over_http_and_grpc(node: Node, spans: InMemorySpanExporter) -> None:
    h, g = node.http, node.grpc
    assert h.get_trace_settings() == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                      "log_frequency": "0", "trace_file": "", "trace_mode": "opentelemetry"}
    assert _error(lambda: h.update_trace_settings(settings={"trace_rate": "1"})).status() == "401"
    assert _error(lambda: g.update_trace_settings(settings={"trace_rate": "1"})).status() == \
        "StatusCode.UNAUTHENTICATED"
    out = h.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "5"}, headers=node.auth)
    assert out["trace_level"] == ["TIMESTAMPS"] and out["trace_rate"] == "5"
    # a model's own settings go over the node's; the others are the node's
    got = g.update_trace_settings(MODEL, {"trace_rate": "1", "trace_count": "2"}, headers=node.auth, as_json=True)
    assert got["settings"]["trace_rate"]["value"] == ["1"] and got["settings"]["trace_count"]["value"] == ["2"]
    assert got["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
    assert h.get_trace_settings(MODEL)["trace_rate"] == "1"
    assert g.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["5"]
    # cleared: the model's setting is the node's again
    g.update_trace_settings(MODEL, {"trace_rate": None}, headers=node.auth)
    assert h.get_trace_settings(MODEL)["trace_rate"] == "5"
    for bad, word in (({"trace_level": ["TENSORS"]}, "TENSORS"), ({"trace_rate": "0"}, "trace_rate"),
                      ({"trace_file": "../etc/x"}, "trace_file"), ({"trace_mode": "triton"}, "trace_mode"),
                      ({"trace_colour": "1"}, "trace_colour")):
        e = _error(lambda: h.update_trace_settings(settings=bad, headers=node.auth))
        assert e.status() == "400" and word in e.message(), (bad, e.message())
        e = _error(lambda: g.update_trace_settings(MODEL, bad, headers=node.auth))
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and word in e.message(), (bad, e.message())
    assert _error(lambda: h.get_trace_settings("nope")).status() == "404"
    meta = h.get_server_metadata()
    assert {"trace", "logging", "statistics"} <= set(meta["extensions"])
    assert {"trace", "logging"} <= set(g.get_server_metadata().extensions)


def test_a_span_per_traced_call_with_the_monitors_timestamps(node: Node, spans: InMemorySpanExporter) -> None:
    _calls(node, node.http, thttp, 2)
    assert spans.get_finished_spans() == ()  # off by default
    node.http.update_trace_settings(MODEL, {"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "2",
                                            "trace_file": "calls.jsonl", "log_frequency": "2"}, headers=node.auth)
    _calls(node, node.http, thttp, 3)
    _calls(node, node.grpc, tgrpc, 3)
    got = spans.get_finished_spans()
    # every 2nd call traced, until the 2 traces of its count are spent
    assert len(got) == 2
    assert node.http.get_trace_settings(MODEL)["trace_count"] == "0"
    for span in got:
        assert span.name == "InferRequest" and span.attributes["model_name"] == MODEL
        names = [e.name for e in span.events]
        assert names == EVENTS
        stamps = [e.timestamp for e in span.events]
        assert stamps == sorted(stamps) and span.start_time == stamps[0] and span.end_time == stamps[-1]
        assert stamps[-1] - stamps[0] < 60e9
    # the trace file has both (written once two were held), JSON lines
    assert node.server.tracer.provider.force_flush()
    lines = (node.data / TRACE_DIR / "calls.jsonl").read_text().splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["InferRequest", "InferRequest"]


# -- logging extension -------------------------------------------------------------------------

def test_log_levels_change_at_run_time(node: Node) -> None:
    logger = logging.getLogger("splitserve")
    h, g = node.http, node.grpc
    start = h.get_log_settings()
    assert start["log_file"] == "" and start["log_format"] == "default" and start["log_error"] is True
    try:
        out = h.update_log_settings({"log_verbose_level": 1}, headers=node.auth)
        assert out["log_verbose_level"] == 1 and logger.getEffectiveLevel() == logging.DEBUG
        g.update_log_settings({"log_verbose_level": 0, "log_info": False, "log_warning": True}, headers=node.auth)
        assert logger.getEffectiveLevel() == logging.WARNING
        got = g.get_log_settings().settings
        assert got["log_info"].bool_param is False and got["log_warning"].bool_param is True
        assert h.get_log_settings()["log_info"] is False
        assert _error(lambda: h.update_log_settings({"log_info": True})).status() == "401"
        for bad, word in (({"log_file": "/tmp/x.log"}, "log_file"), ({"log_info": True, "log_warning": False},
                                                                      "threshold"),
                          ({"log_verbose_level": -1}, "log_verbose_level"), ({"log_colour": True}, "log_colour")):
            e = _error(lambda: h.update_log_settings(bad, headers=node.auth))
            assert e.status() == "400" and word in e.message(), (bad, e.message())
        assert logger.getEffectiveLevel() == logging.WARNING  # a refused change changes nothing
    finally:
        h.update_log_settings({k: start[k] for k in ("log_info", "log_warning", "log_error", "log_verbose_level")},
                              headers=node.auth)


# -- refused: sequences, ensembles, decoupled models ------------------------------------------

def test_sequence_parameters_are_refused_not_ignored(node: Node) -> None:
    arrays = samples(MODEL, 1)
    e = _error(lambda: node.http.infer(MODEL, inputs_for(thttp, arrays), sequence_id=7, sequence_start=True))
    assert e.status() == "400" and "sequence_id" in e.message()
    e = _error(lambda: node.grpc.infer(MODEL, inputs_for(tgrpc, arrays), sequence_id=7, sequence_end=True))
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "sequence_id" in e.message()
    _calls(node, node.http, thttp, 1)  # the server serves on


def _doubler() -> bytes:
    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    buf = io.BytesIO()
    with warnings.catch_warnings():  # torch.jit is deprecated upstream; Triton's PyTorch models are TorchScript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.trace(Double(), torch.zeros(1, 4)), buf)
    return buf.getvalue()


def _triton_config(name: str, **extra: Any) -> str:
    return json.dumps({"name": name, "platform": "pytorch_libtorch", "max_batch_size": 4,
                       "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
                       "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
                       "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
                       "dynamic_batching": {"max_queue_delay_microseconds": 500}, **extra})


@pytest.mark.parametrize("module", [thttp, tgrpc], ids=["http", "grpc"])
def test_load_takes_a_triton_json_config_and_the_model_file(node: Node, module: Any) -> None:
    client = node.http if module is thttp else node.grpc
    name = f"double_{'http' if module is thttp else 'grpc'}"
    files = {"file:1/model.pt": _doubler()}
    client.load_model(name, headers=node.auth, config=_triton_config(name), files=files)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    t = module.InferInput("INPUT__0", [2, 4], "FP32")
    t.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer(name, [t]).as_numpy("OUTPUT__0"), 2 * x)
    cfg = node.http.get_model_config(name)
    assert cfg["max_batch_size"] == 4 and cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert cfg["input"][0]["dims"] == [4]


@pytest.mark.parametrize("module", [thttp, tgrpc], ids=["http", "grpc"])
@pytest.mark.parametrize("extra, field", [
    ({"sequence_batching": {"max_sequence_idle_microseconds": 5000}}, "sequence_batching"),
    ({"platform": "ensemble"}, "platform"),
    ({"ensemble_scheduling": {"step": []}}, "ensemble_scheduling"),
    ({"model_transaction_policy": {"decoupled": True}}, "model_transaction_policy.decoupled"),
    ({"input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [-1]}]}, "input.dims"),
    ({"max_batch_size": 0}, "max_batch_size"),
], ids=["sequence", "ensemble-platform", "ensemble-scheduling", "decoupled", "variable-dims", "no-batching"])
def test_what_splitserve_does_not_do_is_refused_at_load_naming_the_field(node: Node, module: Any,
                                                                        extra: dict, field: str) -> None:
    client = node.http if module is thttp else node.grpc
    e = _error(lambda: client.load_model("refused", headers=node.auth, config=_triton_config("refused", **extra),
                                         files={"file:1/model.pt": b"not read"}))
    assert e.status() in ("400", "StatusCode.INVALID_ARGUMENT") and repr(field) in e.message(), e.message()
    assert "refused" not in {m["name"] for m in node.http.get_model_repository_index()}


def test_a_load_with_a_file_that_is_not_base64_is_refused(node: Node) -> None:
    body = {"parameters": {"config": _triton_config("b64"), "file:1/model.pt": "not base64!"}}
    r = httpx.post(f"http://127.0.0.1:{node.server.ports['http_port']}/v2/repository/models/b64/load", json=body,
                   headers=node.auth)
    assert r.status_code == 400 and "base64" in r.json()["error"]
