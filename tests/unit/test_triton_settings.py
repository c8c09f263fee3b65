"""The parts of Triton's trace, logging and model-loading extensions below the front ends:
which calls the trace settings pick, a span's export to a real OTLP/HTTP collector on
loopback, how log switches map onto a level, and how Triton's model configuration becomes
splitserve's."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.triton_config import from_triton_config
from splitserve.server.log_settings import LogSettings
from splitserve.server.registration import registration
from splitserve.server.trace_settings import TraceSampler
from splitserve.server.tracing import TRACE_DIR, CallTracer


def _picked(sampler: TraceSampler, model: str, calls: int) -> list[int]:
    return [i for i in range(1, calls + 1) if sampler.sample(model) is not None]


def test_every_rate_th_call_is_traced_until_the_count_is_spent() -> None:
    s = TraceSampler()
    assert _picked(s, "m", 50) == []  # off by default
    s.update({"trace_level": ["TIMESTAMPS"], "trace_rate": "3", "trace_count": "2"})
    assert _picked(s, "m", 20) == [3, 6]
    assert s.settings()["trace_count"] == "0"
    s.update({"trace_count": "-1"})
    assert len(_picked(s, "m", 30)) == 10


def test_a_models_own_settings_and_its_own_count() -> None:
    s = TraceSampler()
    s.update({"trace_level": ["TIMESTAMPS"], "trace_rate": "10"})
    s.update({"trace_rate": "1", "trace_count": "1"}, "a")
    assert _picked(s, "a", 5) == [1] and _picked(s, "b", 10) == [10]
    assert s.settings("a")["trace_rate"] == "1" and s.settings("b")["trace_rate"] == "10"
    s.update({"trace_level": ["OFF"]})  # the node's level reaches the model, which did not set its own
    assert s.settings("a")["trace_level"] == ["OFF"]
    s.update({"trace_rate": None, "trace_count": None}, "a")  # nothing of its own left: the node's again
    assert s.settings("a") == s.settings()


def test_a_bad_change_changes_nothing() -> None:
    s = TraceSampler()
    before = s.settings()
    with pytest.raises(InvalidInput, match="trace_count"):
        s.update({"trace_level": ["TIMESTAMPS"], "trace_count": "-2"})
    assert s.settings() == before
    with pytest.raises(InvalidInput, match="TENSORS"):
        s.update({"trace_level": ["TIMESTAMPS", "TENSORS"]}, "m")
    assert s.settings("m") == before


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    lg = logging.getLogger("splitserve.test_triton_settings")
    lg.setLevel(logging.INFO)
    yield lg
    lg.setLevel(logging.NOTSET)


def test_log_switches_are_a_threshold(logger: logging.Logger) -> None:
    logs = LogSettings(logger)
    assert logs.settings() == {"log_file": "", "log_format": "default", "log_info": True, "log_warning": True,
                               "log_error": True, "log_verbose_level": 0}
    assert logs.update({"log_info": False})["log_warning"] is True and logger.level == logging.WARNING
    logs.update({"log_warning": False, "log_error": False})
    assert not logger.isEnabledFor(logging.CRITICAL)
    assert logs.update({"log_verbose_level": 2})["log_verbose_level"] == 2 and logger.level == logging.DEBUG
    with pytest.raises(InvalidInput, match="threshold"):
        logs.update({"log_verbose_level": 0, "log_info": True, "log_warning": False})
    assert logger.level == logging.DEBUG


TRITON = {"name": "m", "platform": "pytorch_libtorch", "max_batch_size": 16,
          "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [3, 8]}],
          "output": [{"name": "OUTPUT__0", "data_type": "TYPE_INT64", "dims": [2]}]}


@pytest.mark.parametrize("extra, expect", [
    ({}, {"batching": {"policy": "none"}, "instances": 1, "device": "cpu"}),
    ({"dynamic_batching": {}}, {"batching": {"policy": "work_conserving"}}),
    ({"dynamic_batching": {"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": 2500}},
     {"batching": {"policy": "timeout", "max_delay_ms": 2.5, "preferred_batch": 8}}),
    ({"instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [1]}]}, {"instances": 2, "device": "cuda:1"}),
    ({"parameters": {"threads": {"string_value": "4"}, "func_id": {"string_value": "3"}}}, {"threads": 4}),
])
def test_a_triton_config_becomes_splitserves(extra: dict, expect: dict) -> None:
    cfg, data = from_triton_config({**TRITON, **extra}, "m", {"1/model.pt": b"ts"})
    assert data == b"ts" and cfg["artifact"] == {"kind": "torchscript", "file": "model.pt"}
    assert cfg["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [3, 8]}]
    assert cfg["outputs"][0]["datatype"] == "INT64" and cfg["max_batch_size"] == 16
    assert {k: cfg[k] for k in expect} == expect


def test_a_registration_from_triton_json_is_a_valid_config_toml() -> None:
    got = registration("m", {"config": json.dumps(TRITON)}, {"1/model.pt": b"ts"})
    assert got is not None and got.artifact == b"ts"
    cfg = ModelConfig.from_toml(got.config_toml)
    assert cfg.name == "m" and cfg.inputs[0].shape == (3, 8) and cfg.artifact.file == "model.pt"


@pytest.mark.parametrize("doc, field", [
    ({**TRITON, "sequence_batching": {}}, "sequence_batching"),
    ({**TRITON, "model_transaction_policy": {"decoupled": True}}, "model_transaction_policy.decoupled"),
    ({**TRITON, "platform": "onnxruntime_onnx"}, "platform"),
    ({**TRITON, "name": "other"}, "name"),
    ({**TRITON, "optimization": {}}, "optimization"),
    ({**TRITON, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3], "reshape": {"shape": []}}]},
     "input.reshape"),
    ({**TRITON, "dynamic_batching": {"priority_levels": 2}}, "dynamic_batching.priority_levels"),
    ({**TRITON, "instance_group": [{"kind": "KIND_CPU"}, {"kind": "KIND_GPU"}]}, "instance_group.kind"),
])
def test_what_a_triton_config_asks_that_splitserve_does_not_do_is_refused(doc: dict, field: str) -> None:
    with pytest.raises(InvalidInput, match=repr(field).replace(".", r"\.")):
        from_triton_config(doc, "m", {"1/model.pt": b"ts"})


@dataclass
class _Stamps:
    """A call's stamps as the monitor keeps them (``tracing.TracedCall``), in perf_counter seconds."""

    req_id: int = 7
    count: int = 2
    t_first: float = 10.0
    t_rx: float = 10.001
    t_dispatch: float = 10.002
    t_start_w: float = 10.003
    t_work: float = 10.010
    t_tx: float = 0.0
    compute_ns: int = 5_000_000
    input_ns: int = 100_000
    output_ns: int = 200_000


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector on loopback that keeps what it is sent."""

    got: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_traced_calls_are_exported_over_otlp_when_an_endpoint_is_set(tmp_path: Path) -> None:
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    try:
        tracer = CallTracer(tmp_path, f"http://127.0.0.1:{collector.server_address[1]}/v1/traces")
        tracer.sampler.update({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        tracer.closed("m", _Stamps(), None)
        tracer.close()  # exports what is held
    finally:
        collector.shutdown()
        collector.server_close()
        thread.join()
    [(path, ctype, body)] = _Collector.got
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    for word in (b"InferRequest", b"REQUEST_START", b"QUEUE_START", b"COMPUTE_END", b"splitserve"):
        assert word in body
    assert not (tmp_path / TRACE_DIR).exists()  # no trace file was asked for
