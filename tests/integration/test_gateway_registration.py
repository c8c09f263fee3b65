"""Registering a model at the cluster gateway, without Ray: the gateway's data plane (its HTTP
and gRPC front ends, ``GatewayRegistrar`` and the upcall channel) in front of a real node,
with a registry standing in for the controller (``tests/gateway_front.py::with_registry``).
``HttpClient.register``, ``splitserve models register`` and ``tritonclient.grpc``'s
``load_model`` with a config go through the gateway, and the model answers there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.client.http import HttpClient
from splitserve.errors import UnknownModel
from tests.gateway_front import CLUSTER_FID, TOKEN, with_registry
from tests.inproc import write_model


def test_a_model_registered_at_the_gateway_answers_there_and_management_needs_the_clusters_token(
        tmp_path: Path) -> None:
    x = (np.arange(784) % 251).astype(np.uint8).reshape(1, 1, 28, 28)
    mine = write_model(tmp_path / "models", "lenet_gw", "lenet")
    by_cli = write_model(tmp_path / "models", "lenet_cli", "lenet")

    def calls(ports: dict[str, int]) -> dict[str, Any]:
        url, node_port = f"http://127.0.0.1:{ports['http']}", ports["node_http"]
        out: dict[str, Any] = {}
        with httpx.Client(base_url=url, timeout=60) as http:
            out["no_token"] = http.delete("/v2/repository/models/lenet_gw")
            out["bad_token"] = http.post("/v2/repository/models/lenet_gw/register",
                                         files={"config": ("config.toml", (mine / "config.toml").read_bytes())},
                                         headers={"Authorization": "Bearer wrong"})
        with HttpClient(url, token=TOKEN) as c, HttpClient(f"http://127.0.0.1:{node_port}") as node:
            out["registered"] = c.register(mine)
            out["answer"] = c.infer("lenet_gw", x)  # the model answers through the gateway at once
            out["want"] = node.infer("lenet_gw", x)
            out["index"] = c.index()
        with httpx.Client(base_url=url, timeout=60) as http:
            out["duplicate"] = http.post("/v2/repository/models/lenet_gw/register",
                                         files={"config": ("config.toml", (mine / "config.toml").read_bytes())},
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        out["cli"] = CliRunner().invoke(app, ["models", "register", str(by_cli), "--url", url, "--token", TOKEN])
        with HttpClient(url, token=TOKEN) as c:
            out["cli_answer"] = c.infer("lenet_cli", x)
            c.unregister("lenet_gw")
            try:
                c.infer("lenet_gw", x)
            except UnknownModel as e:
                out["after_unregister"] = e.message
            out["index_after"] = c.index()
        return out

    out = with_registry(tmp_path, calls)

    assert out["no_token"].status_code == 401
    assert out["bad_token"].status_code == 401 and "wrong management token" in out["bad_token"].json()["error"]
    reg = out["registered"]
    assert reg["name"] == "lenet_gw" and reg["func_id"] > CLUSTER_FID and reg["state"] == "READY"
    np.testing.assert_allclose(out["answer"], out["want"], atol=1e-5)
    assert {"name": "lenet_gw", "version": "1", "state": "READY", "reason": "serving on 1 node(s)"} in out["index"]
    assert out["duplicate"].status_code == 400 and "lenet_gw" in out["duplicate"].json()["error"]
    assert out["cli"].exit_code == 0, out["cli"].output
    assert "registered lenet_cli" in out["cli"].output
    np.testing.assert_allclose(out["cli_answer"], out["want"], atol=1e-5)
    assert "lenet_gw" in out["after_unregister"]
    assert [m["name"] for m in out["index_after"]] == ["lenet", "lenet_cli"]


def _failure(call: Callable[[], Any]) -> tuple[str, str]:
    """The status and message of the error ``call`` raises."""
    try:
        call()
    except InferenceServerException as e:
        return str(e.status()), str(e.message())
    raise AssertionError("the call succeeded")


def test_grpc_at_the_gateway_lists_and_registers_the_clusters_models_with_the_clusters_token(
        tmp_path: Path) -> None:
    x = (np.arange(784) % 251).astype(np.uint8).reshape(1, 1, 28, 28)
    config = (write_model(tmp_path / "models", "lenet_grpc", "lenet") / "config.toml").read_text()
    auth = {"authorization": f"Bearer {TOKEN}"}

    def calls(ports: dict[str, int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        triton = tgrpc.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
        try:
            out["index"] = triton.get_model_repository_index(as_json=True)["models"]
            out["no_token"] = _failure(lambda: triton.load_model("lenet_grpc", config=config))
            out["wrong_token"] = _failure(lambda: triton.load_model("lenet_grpc", config=config,
                                                                    headers={"authorization": "Bearer wrong"}))
            triton.load_model("lenet_grpc", config=config, headers=auth)  # registered with the cluster
            out["index_after"] = triton.get_model_repository_index(as_json=True)["models"]
            t = tgrpc.InferInput("image", list(x.shape), "UINT8")
            t.set_data_from_numpy(x)
            out["answer"] = triton.infer("lenet_grpc", [t]).as_numpy("logits")
            out["duplicate"] = _failure(lambda: triton.load_model("lenet_grpc", config=config, headers=auth))
            triton.load_model("lenet", headers=auth)  # the cluster serves it: nothing to load
            out["unknown"] = _failure(lambda: triton.load_model("nope", headers=auth))
            out["unload"] = _failure(lambda: triton.unload_model("lenet", headers=auth))
        finally:
            triton.close()
        with HttpClient(f"http://127.0.0.1:{ports['node_http']}") as node:
            out["want"] = node.infer("lenet_grpc", x)
        return out

    out = with_registry(tmp_path, calls, grpc=True)
    assert out["index"] == [{"name": "lenet", "version": "1", "state": "READY", "reason": "serving on 1 node(s)"}]
    assert out["no_token"][0] == out["wrong_token"][0] == "StatusCode.UNAUTHENTICATED"
    assert "wrong management token" in out["wrong_token"][1]
    assert [(m["name"], m["state"]) for m in out["index_after"]] == [("lenet", "READY"), ("lenet_grpc", "READY")]
    np.testing.assert_allclose(out["answer"], out["want"], atol=1e-5)
    assert out["duplicate"][0] == "StatusCode.INVALID_ARGUMENT" and "lenet_grpc" in out["duplicate"][1]
    assert out["unknown"][0] == "StatusCode.NOT_FOUND" and "nope" in out["unknown"][1]
    assert out["unload"][0] == "StatusCode.UNIMPLEMENTED"  # the cluster keeps its models: DELETE unregisters
