"""Benchmark scenario helpers without processes or sockets: validation, knees, rate ladders,
parameters, repositories, targets and the RPC-tax arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.bench.codecs import CodecTiming
from splitserve.bench.inputs import make_inputs
from splitserve.bench.runner import build_params
from splitserve.bench.scenarios import SCENARIOS, get
from splitserve.bench.results import ResultsDir
from splitserve.bench.scenarios.base import (
    Context,
    Params,
    apply_overrides,
    note_generator_bottleneck,
    report_intro,
    write_repository,
)
from splitserve.bench.scenarios.batching import fig5, fig5_lines, variant_name, variants
from splitserve.bench.scenarios.load import Params as LoadParams
from splitserve.bench.scenarios.load import find_knee, rate_ladder
from splitserve.bench.scenarios.rpc_tax import breakdown, ratios
from splitserve.bench.timing import CallTimes
from splitserve.bench.transports import Target, Unavailable
from splitserve.bench.validate import Check, ValidationFailed, check, check_all, compare
from splitserve.registry import read_model_dir
from splitserve.types import TensorSpec

SPECS = (TensorSpec("a", "FP32", (4,)), TensorSpec("b", "FP32", (4,)))


def _samples(n: int = 3) -> list[list[np.ndarray]]:
    return make_inputs(SPECS, n, seed=0)


def _vecadd(samples: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    return [[s[0] + s[1]] for s in samples]


def test_validator_accepts_right_answers_and_refuses_wrong_ones():
    samples = _samples()
    want = _vecadd(samples)

    def right(model, x):
        a, b = x
        return {"sum": a + b}

    def wrong(model, x):  # another model's answer: a - b
        a, b = x
        return {"sum": a - b}

    ok = check(right, "vecadd", "fake", samples, want)
    assert ok.ok and ok.max_rel_error == 0.0
    bad = check(wrong, "vecadd", "fake", samples, want)
    assert not bad.ok and "differ" in bad.detail
    with pytest.raises(ValidationFailed, match="vecadd over fake"):
        check_all([ok, bad])
    assert check_all([ok]) == [ok]


def test_validator_counts_a_failing_request_and_a_wrong_shape_as_wrong():
    samples = _samples(1)
    want = _vecadd(samples)

    def boom(model, x):
        raise ConnectionError("refused")

    assert "request failed" in check(boom, "m", "fake", samples, want).detail
    assert not check(lambda m, x: np.zeros(3, np.float32), "m", "fake", samples, want).ok
    ok, err, _ = compare([want[0][0] * (1 + 1e-5)], want[0])
    assert ok and err < 1e-4


def test_find_knee():
    pts = [{"rate": 10, "p99_ms": 1.0, "errors": 0}, {"rate": 20, "p99_ms": 2.5, "errors": 0},
           {"rate": 40, "p99_ms": 3.5, "errors": 0}, {"rate": 80, "p99_ms": 2.0, "errors": 3}]
    assert find_knee(pts, 3.0) == 40
    assert find_knee(pts[:2], 3.0) is None
    assert find_knee([{"rate": 5, "p99_ms": 1.0, "errors": 1}]) == 5


def test_rate_ladder_spans_the_slowest_and_fastest_transport():
    rates = rate_ladder({"tcp": 1000.0, "grpc": 100.0, "http": 0.0}, 5, 0.2, 1.2)
    assert rates[0] == pytest.approx(20.0) and rates[-1] == pytest.approx(1200.0)
    assert rates == sorted(rates) and len(rates) == 5
    assert rate_ladder({}, 5, 0.2, 1.2) == []


def test_overrides_are_typed_and_unknown_names_refused():
    p = apply_overrides(LoadParams(), {"rates": "10, 20.5", "duration-s": "2", "models": "lenet"})
    assert p.rates == (10.0, 20.5) and p.duration_s == 2.0 and p.models == ("lenet",)
    with pytest.raises(ValueError, match="unknown parameter"):
        apply_overrides(LoadParams(), {"nope": "1"})
    with pytest.raises(ValueError, match="expected int"):
        apply_overrides(LoadParams(), {"steps": "many"})


def test_every_scenario_has_params_and_a_quick_size():
    for name in SCENARIOS:
        mod = get(name).load()
        full, quick = build_params(name), build_params(name, quick=True)
        assert set(full.models) <= set(mod.MODELS) and set(full.transports) <= set(mod.TRANSPORTS)
        assert full.to_dict().keys() == quick.to_dict().keys()
    with pytest.raises(ValueError, match="unknown transports"):
        build_params("rpc-tax", transports=("carrier-pigeon",))


def test_every_report_opens_with_its_scenarios_docstring_less_the_title():
    assert report_intro("load: the title.\n\nWhat it does,\nin two lines.\n\nMore.\n") == \
        "What it does,\nin two lines.\n\nMore."
    assert report_intro("A title alone.") == report_intro(None) == ""  # python -OO drops docstrings


def test_the_generator_section_appears_only_where_the_generator_fell_behind():
    report, lines = ["intro", ""], ["a line"]
    note_generator_bottleneck(report, lines, [])
    assert (report, lines) == (["intro", ""], ["a line"])
    note_generator_bottleneck(report, lines, ["lenet at 100", "lenet at 200"], counted="in {n} run(s)",
                              explain="Why it matters:")
    assert report[2:] == ["## The generator was the bottleneck", "", "Why it matters:", "", "- lenet at 100",
                          "- lenet at 200", ""]
    assert lines[1:] == ["the load generator was the bottleneck in 2 run(s); see report.md"]


def test_batching_repository_is_readable_by_the_registry(tmp_path):
    repo = write_repository(tmp_path, variants(("resnet18",), 8, ("work_conserving", "none")))
    on = read_model_dir(repo / variant_name("resnet18", 8, "work_conserving"))
    off = read_model_dir(repo / "resnet18_b8_nobatch")
    assert on.name == "resnet18_b8" and on.max_batch_size == 8 and on.batching.policy == "work_conserving"
    assert off.batching.policy == "none" and off.artifact.arch == "resnet18"


def test_batching_fig5_ratios_come_from_one_run():
    p = build_params("batching", overrides={"clients": "1,256", "quantum_ms": "10"})
    assert p.policies == ("none", "timeout", "work_conserving", "adaptive", "adaptive_aimd")
    assert (p.max_batch, p.generators_for(1), p.generators_for(256)) == (128, 1, 2)

    def curve(*points):
        return {"points": [{"clients": c, "throughput_rps": rps, "p50_ms": p50} for c, rps, p50 in points]}

    results = {"lenet": {"tcp": {"none": curve((1, 1000, 1.0), (256, 1100, 200.0)),
                                 "adaptive": curve((1, 800, 6.0), (256, 4400, 40.0)),
                                 "adaptive_aimd": curve((1, 700, 8.0), (256, 4000, 50.0)),
                                 "work_conserving": curve((1, 1000, 1.0), (256, 5500, 30.0))}}}
    r = fig5(p, results)["lenet"]["tcp"]
    assert r["adaptive_over_none_throughput"] == pytest.approx(4.0)
    assert r["adaptive_minus_none_p50_quanta"] == pytest.approx(0.5)
    assert r["ewma_over_aimd_p50"] == pytest.approx({1: 0.75, 256: 0.8})
    assert r["adaptive_over_work_conserving_throughput"] == pytest.approx(0.8)
    assert r["none_throughput_max_over_min"] == pytest.approx(1.1)
    assert "4.00x (goal >= 1.5)" in fig5_lines(p, "lenet", "tcp", r)[0]
    adaptive_only = fig5(p, {"lenet": {"tcp": {"adaptive": results["lenet"]["tcp"]["adaptive"]}}})["lenet"]["tcp"]
    assert adaptive_only["adaptive_over_none_throughput"] is None and adaptive_only["ewma_over_aimd_p50"] == {}
    assert variants(("lenet",), 128, ("adaptive_aimd",), 10.0, 64)["lenet_b128_aimd"]["batching"] == \
        {"policy": "adaptive", "rule": "aimd", "quantum_ms": 10.0, "threshold_cap": 64}


def test_target_from_urls_and_server_json(tmp_path):
    t = Target.parse(["tcp://127.0.0.1:1", "grpc://127.0.0.1:2"])
    assert t.url("tcp") == "tcp://127.0.0.1:1" and t.url("grpc") == "grpc://127.0.0.1:2"
    with pytest.raises(Unavailable):
        t.url("http-binary")
    (tmp_path / "server.json").write_text(json.dumps({"host": "127.0.0.1", "fast_port": 5, "udp_port": 6,
                                                       "unix_path": "/tmp/x.sock"}))
    t2 = Target.parse([str(tmp_path)])
    assert t2.url("udp") == "udp://127.0.0.1:6" and t2.url("unix") == "unix:///tmp/x.sock"
    with pytest.raises(ValueError):
        Target.parse(["ftp://nowhere"])


def test_rpc_tax_components_add_up_to_the_median():
    e2e = np.array([100.0, 110.0, 120.0])
    times = CallTimes(e2e, np.array([5.0, 5, 5]), np.array([40.0, 40, 40]), np.array([70.0, 70, 70]), [])
    cell = breakdown(times, CodecTiming(4e-6, 6e-6, "test"))
    parts = cell["components"]
    assert parts == pytest.approx({"compute_us": 40, "server_queue_us": 5, "server_other_us": 25,
                                   "client_us": 10, "transport_us": 30})
    assert sum(parts.values()) == pytest.approx(110.0)
    assert cell["tax_us"] == pytest.approx(70.0)
    unreported = breakdown(CallTimes(e2e, np.zeros(3), np.zeros(3), np.zeros(3), []), None)
    assert unreported["tax_us"] is None and unreported["components"]["transport_us"] == pytest.approx(110.0)
    r = ratios({"tcp": {"tax_us": 70.0}, "echo": {"tax_us": 35.0}, "grpc": {"tax_us": 700.0},
                "direct": {"tax_us": 84.0}, "direct+poll": {"tax_us": 35.0}})
    assert r["vs_echo"] == pytest.approx(2.0) and r["vs_grpc"] == pytest.approx(0.1) and r["vs_http_json"] is None
    assert r["direct_vs_grpc"] == pytest.approx(0.12) and r["direct_polled_vs_grpc"] == pytest.approx(0.05)


def test_inputs_are_deterministic_and_valid_for_text_models():
    specs = (TensorSpec("input_ids", "INT32", (8,)), TensorSpec("attention_mask", "INT32", (8,)),
             TensorSpec("image", "UINT8", (2, 2)))
    a, b = make_inputs(specs, 2, seed=3), make_inputs(specs, 2, seed=3)
    assert all(np.array_equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    ids, mask, img = a[0]
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 1000
    assert (mask == 1).all() and img.dtype == np.uint8


def test_check_records_are_json_ready():
    c = Check("m", "tcp", True, 3, 0.0)
    assert json.loads(json.dumps(c.to_dict()))["transport"] == "tcp"


def test_bad_scenario_parameters_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="unknown trace"):
        build_params("trace", overrides={"traces": "weekly"})
    with pytest.raises(ValueError, match="unknown batching policy"):
        build_params("batching", overrides={"policies": "fifo"})


def test_a_runs_servers_share_one_weights_cache_beside_its_results(tmp_path, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CACHE_DIR", raising=False)
    ctx = Context(ResultsDir(tmp_path, "load"), Params())
    assert ctx.weights_cache() == tmp_path / ".weights-cache"  # every server of the run, and the next run
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert ctx.weights_cache() == tmp_path / "mine"


@pytest.mark.parametrize("poll_us", [0.0, 200.0], ids=["blocking", "polling"])
def test_the_echo_server_answers_the_sizes_asked_whether_it_blocks_or_polls(poll_us):
    """A real echo process on loopback: each call's answer is the size its header asked
    for, a request split in two sends still comes whole, and the server serves on."""
    from splitserve.bench.echo import EchoClient, EchoProcess

    with EchoProcess.start(poll_us=poll_us) as server:
        with EchoClient(server.host, server.port, 64 + 4096, 64 + 40, timeout=10, poll_us=100) as client:
            for _ in range(20):
                client.call()  # reads exactly the answer's size, within the timeout
            client.sock.sendall(client._header[:10])  # a header in two parts
            client.sock.sendall(client._header[10:] + client._payload)
            got = 0
            while got < 64 + 40:
                got += len(client.sock.recv(1 << 16))
            assert got == 64 + 40
            client.call()
