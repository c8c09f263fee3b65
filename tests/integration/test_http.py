"""HTTP front end end to end: Open Inference Protocol v2, binary tensors, management,
security, statistics and metrics, against real server processes on loopback."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from splitserve import Client
from splitserve.client.http import HttpClient
from splitserve.errors import InvalidInput, ModelNotReady, SplitServeError, Unauthorized, UnknownModel
from splitserve.models.zoo import build_zoo_model
from splitserve.models.loader import save_safetensors
from splitserve.protocol import v2
from tests.helpers import ROOT, start_server
from tests.inproc import quiet_config, run_server

MODELS = ("lenet", "distilbert")  # UINT8 in / FP32 out, and INT32 in; vecadd1k (FP32 in) loads lazily
UPLOAD_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("http"), *sum((["--load", m] for m in MODELS), []), http=True)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, timeout=60) as h:
        yield h


@pytest.fixture(scope="module")
def token(server):
    path = server.data_dir / "token"
    assert path.stat().st_mode & 0o777 == 0o600
    return path.read_text().strip()


def local_outputs(name, xs, seed=0):
    import torch

    m = build_zoo_model(name, seed=seed)
    with torch.inference_mode():
        ys = m(*[torch.from_numpy(x) for x in xs])
    return [y.numpy() for y in ys]


def lenet_input(n=2, seed=0):
    return np.random.default_rng(seed).integers(0, 255, (n, 1, 28, 28), dtype=np.uint8)


def distilbert_input(n=2, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, (n, 128), dtype=np.int32)
    mask = np.ones((n, 128), np.int32)
    mask[:, 100:] = 0
    return ids, mask


# -- health and metadata ---------------------------------------------------------------------


def test_health_metadata_and_docs(http):
    assert http.get("/v2").json()["name"] == "splitserve"
    assert "binary_tensor_data" in http.get("/v2").json()["extensions"]
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").json() == {"ready": True}
    assert http.get("/v2/models/lenet/ready").json() == {"name": "lenet", "ready": True}
    assert http.get("/v2/models/lenet/versions/1/ready").status_code == 200
    # registered, never loaded: ready all the same (a call is served without an explicit load)
    assert http.get("/v2/models/matmul8k/ready").status_code == 200
    meta = http.get("/v2/models/lenet").json()
    assert meta["name"] == "lenet" and meta["versions"] == ["1"] and meta["platform"] == "pytorch"
    assert meta["inputs"] == [{"name": "image", "datatype": "UINT8", "shape": [-1, 1, 28, 28]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert http.get("/v2/models/lenet/versions/1").json() == meta
    r = http.get("/v2/models/lenet/versions/7")
    assert r.status_code == 404 and "no version '7'" in r.json()["error"]
    r = http.get("/v2/models/nope")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    assert http.get("/v2/models/nope/ready").status_code == 404
    assert http.get("/v2/models/distilbert/config/splitserve").json()["max_batch_size"] == 8
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert "/v2/models/{name}/infer" in paths and "/v2/repository/models/{name}/register" in paths


# -- inference -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["lenet", "vecadd1k", "distilbert"])
def test_every_zoo_datatype_same_answer_over_fast_path_json_and_binary(server, model):
    if model == "lenet":
        xs = [lenet_input()]
    elif model == "vecadd1k":
        rng = np.random.default_rng(2)
        xs = [rng.standard_normal((3, 1024)).astype(np.float32) for _ in range(2)]
    else:
        xs = list(distilbert_input())
    (want,) = local_outputs(model, xs)
    arg = xs[0] if len(xs) == 1 else xs
    with HttpClient(server.http) as h, Client(server.tcp) as f:
        fast = f.infer(model, arg)
        binary = h.infer_result(model, arg)
        as_json = h.infer(model, arg, binary=False)
    np.testing.assert_allclose(fast, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(binary.value(), fast)
    np.testing.assert_array_equal(as_json, fast)
    assert binary.total_us > 0 and binary.compute_us > 0


def test_raw_v2_json_and_binary_bodies(http):
    x = lenet_input(1, seed=3)
    (want,) = local_outputs("lenet", [x])
    body = {"id": "req-7", "parameters": {"class": "rt", "deadline_ms": 5000},
            "inputs": [{"name": "image", "datatype": "UINT8", "shape": [1, 1, 28, 28], "data": x.tolist()}]}
    r = http.post("/v2/models/lenet/infer", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["model_name"] == "lenet" and doc["model_version"] == "1" and doc["id"] == "req-7"
    assert set(doc["parameters"]) == {"queue_us", "compute_us", "total_us"}
    (out,) = doc["outputs"]
    assert out["name"] == "logits" and out["datatype"] == "FP32" and out["shape"] == [1, 10]
    np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(1, 10), want, rtol=1e-4, atol=1e-5)
    # binary input, binary output asked for per output, through the versioned path
    head = json.dumps({"inputs": [{"name": "image", "datatype": "UINT8", "shape": [1, 1, 28, 28],
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    r = http.post("/v2/models/lenet/versions/1/infer", content=head + x.tobytes(),
                  headers={"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"})
    assert r.status_code == 200
    hlen = int(r.headers["Inference-Header-Content-Length"])
    doc = json.loads(r.content[:hlen])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 40}
    np.testing.assert_allclose(np.frombuffer(r.content[hlen:], "<f4").reshape(1, 10), want, rtol=1e-4, atol=1e-5)


def _infer(http, model, inputs, **kw):
    return http.post(f"/v2/models/{model}/infer", json={"inputs": inputs}, **kw)


@pytest.mark.parametrize("case, status, words", [
    ("unknown_model", 404, "unknown model 'nope'"),
    ("wrong_shape", 400, "must have shape [n, 1, 28, 28]"),
    ("no_batch_dim", 400, "must have shape [n, 1, 28, 28]"),
    ("wrong_datatype", 400, "is UINT8, got FP32"),
    ("bytes_input", 400, "BYTES inputs are not supported"),
    ("unknown_input", 400, "has no input 'pixels'"),
    ("malformed_json", 400, "not valid JSON"),
    ("truncated_binary", 400, "truncated"),
    ("bad_header_length", 400, "does not fit"),
    ("bad_class", 400, "parameters.class"),
    ("too_many_samples", 400, "max_batch_size"),
])
def test_bad_requests_get_the_right_status_and_a_message(http, case, status, words):
    img = {"name": "image", "datatype": "UINT8", "shape": [1, 1, 28, 28], "data": [0] * 784}
    if case == "unknown_model":
        r = _infer(http, "nope", [img])
    elif case == "wrong_shape":
        r = _infer(http, "lenet", [dict(img, shape=[1, 28, 28])])
    elif case == "no_batch_dim":
        r = _infer(http, "lenet", [dict(img, shape=[1, 28, 28, 1])])
    elif case == "wrong_datatype":
        r = _infer(http, "lenet", [dict(img, datatype="FP32")])
    elif case == "bytes_input":
        r = _infer(http, "lenet", [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["abc"]}])
    elif case == "unknown_input":
        r = _infer(http, "lenet", [dict(img, name="pixels")])
    elif case == "malformed_json":
        r = http.post("/v2/models/lenet/infer", content=b'{"inputs": [', headers={"Content-Type": "application/json"})
    elif case in ("truncated_binary", "bad_header_length"):
        head = json.dumps({"inputs": [dict(img, data=None, parameters={"binary_data_size": 784})]}).encode()
        hlen = len(head) if case == "truncated_binary" else len(head) + 1000
        r = http.post("/v2/models/lenet/infer", content=head + bytes(700),
                      headers={"Inference-Header-Content-Length": str(hlen)})
    elif case == "bad_class":
        r = http.post("/v2/models/lenet/infer", json={"parameters": {"class": "vip"}, "inputs": [img]})
    else:
        r = _infer(http, "lenet", [dict(img, shape=[40, 1, 28, 28], data=[0] * 784 * 40)])
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_client_errors_are_typed(server):
    with HttpClient(server.http) as h:
        with pytest.raises(UnknownModel):
            h.lookup("nope")
        with pytest.raises(InvalidInput, match="must be UINT8"):
            h.infer("lenet", np.zeros((1, 1, 28, 28), np.float32))  # refused before sending


def test_async_client_and_connect(server):
    import asyncio

    from splitserve import connect
    from splitserve.client.http import AsyncHttpClient

    x = lenet_input(3, seed=6)
    with connect(server.http) as c:
        assert isinstance(c, HttpClient)
        want = c.infer("lenet", x)

    async def main():
        async with AsyncHttpClient(server.http) as a:
            outs = await asyncio.gather(*(a.infer("lenet", x[i], cls="rt") for i in range(3)),
                                        a.infer("lenet", x, binary=False, deadline_ms=10_000))
        return outs

    *singles, batch = asyncio.run(main())
    np.testing.assert_allclose(np.stack(singles), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch, want, rtol=1e-5, atol=1e-6)


# -- statistics and metrics ---------------------------------------------------------------------


def test_statistics_and_metrics(http):
    assert _infer(http, "lenet", [{"name": "image", "datatype": "UINT8", "shape": [2, 1, 28, 28],
                                   "data": [1] * 784 * 2}]).status_code == 200
    (st,) = http.get("/v2/models/lenet/stats").json()["model_stats"]
    assert st["name"] == "lenet" and st["version"] == "1"
    assert st["inference_count"] >= 2 and st["execution_count"] >= 1 and st["last_inference"] > 0
    inf = st["inference_stats"]
    assert set(inf) >= {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output"}
    assert inf["success"]["count"] >= 1 and inf["success"]["ns"] > 0 and inf["compute_infer"]["ns"] > 0
    assert sum(b["compute_infer"]["count"] for b in st["batch_stats"]) == st["execution_count"]
    every = http.get("/v2/models/stats").json()["model_stats"]
    assert {"lenet", "distilbert", "bert_tiny"} <= {m["name"] for m in every}
    assert http.get("/v2/models/nope/stats").status_code == 404
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'splitserve_requests_total{class="be",model="lenet",path="front"}' in r.text
    assert 'splitserve_instances{model="lenet"} 1.0' in r.text


# -- repository, security -----------------------------------------------------------------------


def test_repository_index(http):
    index = http.post("/v2/repository/index").json()
    states = {m["name"]: m for m in index}
    assert states["lenet"]["state"] == "READY" and states["lenet"]["version"] == "1"
    assert states["resnet152"]["state"] == "UNAVAILABLE" and "first use" in states["resnet152"]["reason"]
    ready = {m["name"] for m in http.post("/v2/repository/index", json={"ready": True}).json()}
    assert {"lenet", "distilbert"} <= ready and "resnet152" not in ready


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic abc", "Bearer"])
def test_management_needs_the_token(http, auth):
    headers = {"Authorization": auth} if auth else {}
    for path in ("/v2/repository/models/lenet/load", "/v2/repository/models/lenet/unload",
                 "/v2/repository/models/x/register"):
        r = http.post(path, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert "Bearer" in r.json()["error"] or "wrong" in r.json()["error"]
    r = http.post("/v2/repository/models/lenet/config", json={"instances": 2}, headers=headers)
    assert r.status_code == 401
    assert http.get("/v2/models/lenet/ready").status_code == 200  # nothing happened


@pytest.mark.parametrize("name", [".hidden", "a b", "-dash", "x" * 65, "..."])
def test_bad_model_names_are_refused(http, token, name):
    r = http.post(f"/v2/repository/models/{name}/register", headers={"Authorization": f"Bearer {token}"},
                  files={"config": ("config.toml", b'name = "x"\n[artifact]\nkind = "zoo"\narch = "lenet"\n')})
    assert r.status_code == 400 and "bad model name" in r.json()["error"]


def test_management_validation(http, token):
    auth = {"Authorization": f"Bearer {token}"}
    r = http.post("/v2/repository/models/lenet/config", json={"instances": 0}, headers=auth)
    assert r.status_code == 400 and "between 1 and 64" in r.json()["error"]
    r = http.post("/v2/repository/models/lenet/config", json={"threads": 2}, headers=auth)
    assert r.status_code == 400 and "unknown keys" in r.json()["error"]
    r = http.post("/v2/repository/models/nope/load", headers=auth)
    assert r.status_code == 404
    r = http.post("/v2/repository/models/lenet/register", headers=auth,
                  files={"config": ("config.toml", b'name = "lenet"\n[artifact]\nkind = "zoo"\narch = "lenet"\n')})
    assert r.status_code == 400 and "already exists" in r.json()["error"]


def test_batching_changes_in_place(http, token):
    auth = {"Authorization": f"Bearer {token}"}
    r = http.post("/v2/repository/models/distilbert/config", headers=auth,
                  json={"batching": {"policy": "timeout", "max_delay_ms": 1.0, "preferred_batch": 4}, "max_batch_size": 4})
    assert r.status_code == 200, r.text
    assert {k: r.json()["batching"][k] for k in ("policy", "max_delay_ms", "preferred_batch")} == \
        {"policy": "timeout", "max_delay_ms": 1.0, "preferred_batch": 4}
    assert r.json()["dispatch_max_batch"] == 4
    ids, mask = distilbert_input(1)
    with HttpClient(str(http.base_url)) as h:
        assert h.infer("distilbert", [ids, mask]).shape == (1, 2)
    r = http.post("/v2/repository/models/distilbert/config", headers=auth, json={"batching": {"policy": "fifo"}})
    assert r.status_code == 400 and "work_conserving" in r.json()["error"]
    r = http.post("/v2/repository/models/distilbert/config", headers=auth, json={"max_batch_size": 64})
    assert r.status_code == 400 and "1..8" in r.json()["error"]
    r = http.post("/v2/repository/models/distilbert/config", headers=auth,
                  json={"batching": {"policy": "work_conserving"}, "max_batch_size": 8})
    assert r.status_code == 200


def test_scaling_1_2_1_under_load_drops_nothing(server, token):
    x = lenet_input(1, seed=5)
    (want,) = local_outputs("lenet", [x])
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = [0] * 8

    def client(i: int) -> None:
        with HttpClient(server.http) as h:
            while not stop.is_set():
                try:
                    np.testing.assert_allclose(h.infer("lenet", x), want, rtol=1e-4, atol=1e-5)
                    counts[i] += 1
                except BaseException as e:  # noqa: BLE001 - every failure is reported below
                    errors.append(e)
                    return

    def every_client_answered(what: str) -> None:  # one more call each, or a client's error
        base = list(counts)
        deadline = time.monotonic() + 60
        while not errors and any(c <= b for c, b in zip(counts, base)):
            assert time.monotonic() < deadline, f"the clients stalled {what}: {counts}"
            time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        with HttpClient(server.http, token=token) as admin:
            every_client_answered("before scaling")
            assert admin.scale("lenet", 2)["instances"] == 2
            deadline = time.monotonic() + 60
            while "splitserve_instances{model=\"lenet\"} 2.0" not in admin.metrics():
                assert time.monotonic() < deadline, "the second instance did not come up"
                time.sleep(0.1)
            every_client_answered("on two instances")
            assert admin.scale("lenet", 1)["instances"] == 1
            every_client_answered("on one instance")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert all(c > 0 for c in counts), counts


# -- registration, unload/load, restart, upload limits --------------------------------------------


def _model_dir(tmp_path, name, seed=1, labels=True, garbage=False):
    d = tmp_path / name
    d.mkdir()
    (d / "config.toml").write_text(
        f'name = "{name}"\nmax_batch_size = 8\n[artifact]\nkind = "safetensors"\narch = "lenet"\n'
        f'file = "model.safetensors"\n')
    if garbage:
        (d / "model.safetensors").write_bytes(b"\x00" * 64)
    else:
        save_safetensors(build_zoo_model("lenet", seed=seed), d / "model.safetensors")
    if labels:
        (d / "labels.txt").write_text("\n".join(f"digit-{i}" for i in range(10)) + "\n")
    return d


def test_register_unload_load_restart_and_upload_limits(tmp_path):
    data = tmp_path / "data"
    env = dict(os.environ, SPLITSERVE_MAX_UPLOAD_BYTES=str(UPLOAD_LIMIT))
    s = start_server(data, http=True, env=env)
    try:
        token = (data / "token").read_text().strip()
        x = lenet_input(2, seed=4)
        (want,) = local_outputs("lenet", [x], seed=1)

        # register with the CLI (config, safetensors artifact, labels); it is loaded on return
        model_dir = _model_dir(tmp_path, "mylenet")
        out = subprocess.run([sys.executable, "-m", "splitserve", "models", "register", str(model_dir),
                              "--url", s.http, "--data-dir", str(data)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "registered mylenet" in out.stdout
        assert (data / "repository" / "mylenet" / "model.safetensors").is_file()
        with HttpClient(s.http, token=token) as h, Client(s.tcp) as f:
            assert h.ready("mylenet")
            func_id = h.lookup("mylenet").func_id
            np.testing.assert_allclose(h.infer("mylenet", x), want, rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(f.infer("mylenet", x), h.infer("mylenet", x))
            preds = h.classify("mylenet", x[0], top_k=3)
            assert [p["label"] for p in preds[0]] == [f"digit-{i}" for i in np.argsort(-want[0])[:3]]
            assert abs(sum(p["score"] for p in h.classify("mylenet", x[0], top_k=10)[0]) - 1) < 1e-6
            with pytest.raises(InvalidInput, match="no labels"):
                h.classify("lenet", x[0])

            # unload: requests fail cleanly over HTTP and the fast path, nothing loads lazily
            h.unload("mylenet")
            with pytest.raises(ModelNotReady, match="unloaded"):
                h.infer("mylenet", x)
            with pytest.raises(SplitServeError, match="unloaded"):
                f.infer("mylenet", x)
            r = httpx.post(f"{s.http}/v2/models/mylenet/infer", json={"inputs": [
                {"name": "image", "datatype": "UINT8", "shape": [1, 1, 28, 28], "data": [0] * 784}]})
            assert r.status_code == 503 and r.json()["status"] == "MODEL_NOT_READY"
            (entry,) = [m for m in h.index() if m["name"] == "mylenet"]
            assert entry == {"name": "mylenet", "version": "1", "state": "UNAVAILABLE", "reason": "UNLOADED"}
            assert not h.ready("mylenet")
            h.load("mylenet")
            np.testing.assert_allclose(h.infer("mylenet", x), want, rtol=1e-4, atol=1e-5)

            # a model that fails to load is rolled back with the worker's message
            bad = _model_dir(tmp_path, "broken", garbage=True, labels=False)
            with pytest.raises(InvalidInput, match="safetensors"):
                h.register(bad)
            assert "broken" not in {m["name"] for m in h.index()}
            assert not (data / "repository" / "broken").exists()
            with pytest.raises(UnknownModel):
                h.lookup("broken")
            # a non-zoo artifact without its file, and labels that do not fit the output
            r = httpx.post(f"{s.http}/v2/repository/models/nofile/register", headers={"Authorization": f"Bearer {token}"},
                           files={"config": ("config.toml", (model_dir / "config.toml").read_bytes()
                                             .replace(b"mylenet", b"nofile"))})
            assert r.status_code == 400 and "uploaded" in r.json()["error"]
            r = httpx.post(f"{s.http}/v2/repository/models/fewlabels/register",
                           headers={"Authorization": f"Bearer {token}"},
                           files={"config": ("config.toml", b'name = "fewlabels"\n[artifact]\nkind = "zoo"\n'
                                             b'arch = "lenet"\n'), "labels": ("labels.txt", b"a\nb\n")})
            assert r.status_code == 400 and "one label per value" in r.json()["error"]
            # a config whose name differs from the URL
            r = httpx.post(f"{s.http}/v2/repository/models/other/register", headers={"Authorization": f"Bearer {token}"},
                           files={"config": ("config.toml", (model_dir / "config.toml").read_bytes())})
            assert r.status_code == 400 and "URL says 'other'" in r.json()["error"]

            # uploads over the limit: refused from Content-Length, and counted when chunked
            big = {"config": ("config.toml", (model_dir / "config.toml").read_bytes().replace(b"mylenet", b"big")),
                   "artifact": ("model.safetensors", os.urandom(2 * UPLOAD_LIMIT))}
            r = httpx.post(f"{s.http}/v2/repository/models/big/register", files=big,
                           headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 413 and "limit" in r.json()["error"]

            def chunks():  # a well-formed multipart start, then an artifact that never ends
                yield (b'--abc\r\nContent-Disposition: form-data; name="artifact"; filename="a"\r\n'
                       b"Content-Type: application/octet-stream\r\n\r\n")
                for _ in range(40):
                    yield b"x" * 65536

            r = httpx.post(f"{s.http}/v2/repository/models/big/register", content=chunks(),
                           headers={"Authorization": f"Bearer {token}",
                                    "Content-Type": "multipart/form-data; boundary=abc"})
            assert r.status_code == 413
            assert "big" not in {m["name"] for m in h.index()}
            assert h.ready("mylenet")
    finally:
        assert s.stop() == 0

    # a restart keeps the registered model, its func_id, weights and labels
    s = start_server(data, http=True, env=env)
    try:
        with HttpClient(s.http) as h:
            info = h.lookup("mylenet")
            assert info.func_id == func_id
            np.testing.assert_allclose(h.infer("mylenet", x), want, rtol=1e-4, atol=1e-5)
            assert h.classify("mylenet", x[0], top_k=1)[0][0]["label"] == f"digit-{int(np.argmax(want[0]))}"
        with HttpClient(s.http, token="nope") as h, pytest.raises(Unauthorized):
            h.unload("mylenet")
        assert (data / "token").read_text().strip() == token  # the token survives restarts too
        # unregister deletes the files; registering the name again gets its old func_id back
        with HttpClient(s.http, token=token) as h:
            h.unregister("mylenet")
            assert not (data / "repository" / "mylenet").exists()
            with pytest.raises(UnknownModel):
                h.lookup("mylenet")
            with pytest.raises(InvalidInput, match="builtin"):
                h.unregister("lenet")
            assert h.register(model_dir)["func_id"] == func_id
    finally:
        assert s.stop() == 0


# -- in-process servers: the codec pool, limits, storage, bad input, safer defaults ---------------


def _inproc(tmp_path, test, **overrides):
    """Run ``test(server, base_url)`` in a thread beside an in-process server (HTTP and the
    fast path on free ports, no workers unless a model is used)."""
    config = quiet_config(tmp_path / "data", cache_dir=tmp_path / "cache").replaced(http_port=0, fast_port=0,
                                                                                    **overrides)

    async def scenario(server):
        return await asyncio.to_thread(test, server, f"http://127.0.0.1:{server.ports['http_port']}")

    return run_server(config, scenario)


def _matmul_json(extra_input=True):
    """A multi-MB JSON infer body for matmul8k (32 samples of two 64x64 FP32 inputs); with
    ``extra_input`` it names an input the model lacks, so it is refused once decoded and no
    worker is ever started."""
    x = np.random.default_rng(0).standard_normal((32, 64, 64)).astype(np.float32).tolist()
    inputs = [{"name": n, "datatype": "FP32", "shape": [32, 64, 64], "data": x}
              for n in ("a", "b", *(("c",) if extra_input else ()))]
    return json.dumps({"inputs": inputs}).encode()


def test_a_large_json_body_is_decoded_off_the_loop_the_fast_path_serves(tmp_path, monkeypatch):
    """While a multi-MB JSON body is being decoded (held mid-decode), a fast-path ping is
    answered, and another large body beyond ``codec_max_pending`` is refused at once."""
    decoding, release = threading.Event(), threading.Event()
    order: list[str] = []
    parse = v2.parse_infer_request

    def held_parse(body, header_length=None):
        decoding.set()
        release.wait(30)  # bounded, so the old code (decoding on the loop) fails instead of hanging
        order.append("decoded")
        return parse(body, header_length)

    monkeypatch.setattr(v2, "parse_infer_request", held_parse)
    body = _matmul_json()
    assert len(body) > 4 << 20

    def test(server, url):
        first: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: first.append(
            httpx.post(f"{url}/v2/models/matmul8k/infer", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})))
        sender.start()
        try:
            assert decoding.wait(60), "the large body never reached the decoder"
            with Client(f"tcp://127.0.0.1:{server.ports['fast_port']}") as c:
                c.ping()
            order.append("pong")
            second = httpx.post(f"{url}/v2/models/matmul8k/infer", content=body, timeout=120,
                                headers={"Content-Type": "application/json"})
        finally:
            release.set()
            sender.join(120)
        return second, first[0]

    second, first = _inproc(tmp_path, test, codec_max_pending=1)
    assert order == ["pong", "decoded"]
    assert second.status_code == 503 and "SPLITSERVE_CODEC_MAX_PENDING" in second.json()["error"]
    assert first.status_code == 400 and "has no input 'c'" in first.json()["error"]


def test_infer_bodies_are_limited_by_the_models_size_not_the_upload_limit(tmp_path):
    """lenet's limit is 32 samples x 784 values x 32 characters + 64 KiB = 868,352 bytes: a
    2 MiB body is refused before it is read, a chunked one once 868,352 bytes arrived, one
    just inside is decoded (and refused for what it says)."""
    too_big = 2 << 20

    def test(server, url):
        cfg = server.records["lenet"].config
        per_value = server.config.frontends.json_chars_per_value
        assert v2.infer_body_limit(cfg.inputs, cfg.max_batch_size, per_value) == 868_352
        assert too_big < server.config.frontends.max_upload_bytes // 100
        declared = httpx.post(f"{url}/v2/models/lenet/infer", content=b" " * too_big,
                              headers={"Content-Type": "application/json"})

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(too_big // 65536):
                yield b" " * 65536

        chunked = httpx.post(f"{url}/v2/models/lenet/infer", content=chunks(),
                             headers={"Content-Type": "application/json"})
        inside = httpx.post(f"{url}/v2/models/lenet/infer", content=b" " * 868_000 + b"{}",
                            headers={"Content-Type": "application/json"})
        return declared, chunked, inside

    declared, chunked, inside = _inproc(tmp_path, test)
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        assert r.json()["status"] == "PAYLOAD_TOO_LARGE" and "max_batch_size 32" in r.json()["error"]
    assert inside.status_code == 400 and "inputs" in inside.json()["error"]


def _register(url, token, name, toml, files=None):
    return httpx.post(f"{url}/v2/repository/models/{name}/register", headers={"Authorization": f"Bearer {token}"},
                      files={"config": ("config.toml", toml.encode()), **(files or {})}, timeout=60)


def test_a_full_disk_is_507_and_a_bug_is_a_500_without_its_details(tmp_path, monkeypatch, caplog):
    from splitserve.server import management

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def bug(*args, **kw):
        raise RuntimeError("secret detail of a bug")

    monkeypatch.setattr(os, "fsync", full)  # what a full disk answers when the upload is flushed
    monkeypatch.setattr(management.ModelManager, "repository_index", bug)

    def test(server, url):
        token = (server.config.data_dir / "token").read_text().strip()
        full_disk = _register(url, token, "small", 'name = "small"\n[artifact]\nkind = "safetensors"\narch = "lenet"\n'
                                                   'file = "w.safetensors"\n', {"artifact": ("w", b"weights")})
        left = sorted(p.name for p in (server.config.data_dir / "repository").iterdir())
        uploads = list((server.config.data_dir / management.UPLOAD_DIR).iterdir())
        return full_disk, left, uploads, httpx.post(f"{url}/v2/repository/index")

    with caplog.at_level(logging.ERROR):
        full_disk, left, uploads, internal = _inproc(tmp_path, test)
    assert full_disk.status_code == 507, full_disk.text
    assert full_disk.json()["status"] == "INSUFFICIENT_STORAGE" and "no storage left" in full_disk.json()["error"]
    assert left == [] and uploads == []
    assert internal.status_code == 500 and internal.json()["status"] == "INTERNAL"
    message = internal.json()["error"]
    assert "secret" not in message and "RuntimeError" not in message
    ref = message.split("reference ")[1].split()[0]
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)  # the details stay in the log


def test_bad_management_input_is_a_400_with_a_message(tmp_path):
    def test(server, url):
        auth = {"Authorization": f"Bearer {(server.config.data_dir / 'token').read_text().strip()}"}
        out = []
        for body in ({"batching": {"max_delay_ms": "abc"}}, {"batching": {"preferred_batch": 2.5}},
                     {"batching": {"policy": 3}}, {"max_batch_size": "8"}, {"instances": 1.5}):
            out.append(httpx.post(f"{url}/v2/repository/models/lenet/config", json=body, headers=auth))
        out.append(httpx.post(f"{url}/v2/repository/models/lenet/config", headers=auth,
                              content=b'{"batching": {"max_delay_ms": NaN}}'))
        nul = 'name = "nul"\n[artifact]\nkind = "safetensors"\narch = "lenet"\nfile = "a\\u0000b"\n'
        out.append(_register(url, auth["Authorization"].split()[1], "nul", nul, {"artifact": ("a", b"x")}))
        return out

    for r in _inproc(tmp_path, test):
        assert r.status_code == 400, r.text
        assert any(w in r.json()["error"] for w in ("must be", "plain file name")), r.text


@pytest.mark.parametrize("allow", [False, True])
def test_code_artifact_uploads_need_the_flag(tmp_path, allow):
    toml = 'name = "ts"\n[artifact]\nkind = "torchscript"\nfile = "m.pt"\n' \
           '[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [2]\n[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [2]\n'

    def test(server, url):
        token = (server.config.data_dir / "token").read_text().strip()
        return _register(url, token, "ts", toml, {"artifact": ("m.pt", b"not torchscript")})

    r = _inproc(tmp_path, test, allow_code_artifacts=allow)
    assert r.status_code == 400
    if allow:  # past the gate: the worker tried the file, and the registration was rolled back
        assert "allow-code-artifacts" not in r.json()["error"] and "TorchScript" in r.json()["error"]
    else:
        assert "--allow-code-artifacts" in r.json()["error"] and "run code" in r.json()["error"]


def test_the_data_directory_is_private_and_readiness_agrees(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)

    def test(server, url):
        return stat.S_IMODE(data.stat().st_mode), httpx.get(f"{url}/v2/health/ready")

    mode, ready = _inproc(tmp_path, test)
    assert mode == 0o700
    assert ready.status_code == 200 and ready.json() == {"ready": True}


def test_a_non_loopback_bind_warns_what_needs_no_token():
    from splitserve.config import ServerConfig
    from splitserve.server.management import exposure_warning

    assert exposure_warning(ServerConfig.of(host="127.0.0.1")) is None
    assert exposure_warning(ServerConfig.of(host="::1")) is None
    text = exposure_warning(ServerConfig.of(host="0.0.0.0"))
    for words in ("fast path on TCP 8100", "UDP 8101", "/classify", "/metrics", "gRPC 8001", "first request"):
        assert words in text


def test_node_and_model_placement_show_every_partition_and_its_instances(http):
    node = http.get("/v2/placement").json()
    owners = {p["owner"] for p in node["partitions"]}
    assert set(MODELS) <= owners, node
    held = [c for p in node["partitions"] for c in p["cpus"]]
    assert set(held) | set(node["free"]) == set(node["cpus"])
    lenet = http.get("/v2/models/lenet/placement").json()
    assert lenet["placement"] == "fixed" and "reconfigurations" in lenet
    assert lenet["partitions"] and all(p["owner"] == "lenet" for p in lenet["partitions"])
    assert sorted(c for i in lenet["instances"] for c in i["cpus"]) == sorted(
        c for p in lenet["partitions"] for i in p["instances"] for c in i["cpus"])
