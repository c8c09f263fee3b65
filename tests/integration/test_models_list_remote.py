"""``splitserve models list --url URL`` lists the models the server at URL has (its repository
index, each model's metadata, residency where it serves ``/v2/memory``), not the CLI's own
data directory's registry: a node with a model registered at run time from a directory the
CLI never saw, and a cluster gateway (no Ray: ``tests/gateway_front.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unittest import mock

from rich.console import Console
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.cli import models as models_cli
from splitserve.cli.models import short_shapes
from splitserve.client.http import HttpClient
from tests.gateway_front import CLUSTER_FID, with_registry
from tests.inproc import write_model


def _list(url: str, data_dir: Path, *flags: str) -> Any:
    # --wide's rows unfolded: the CLI's console took its width when it was made (a COLUMNS set
    # in the environment then, e.g. by the test runner, fixes it), so give it a wide one
    with mock.patch.object(models_cli, "console", Console(width=200)):
        result = CliRunner().invoke(app, ["models", "list", "--url", url, "--data-dir", str(data_dir), *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in flags else result.output


def test_models_list_with_url_lists_a_model_registered_at_run_time_with_its_state_and_shapes(
        server_factory: Any, tmp_path: Path) -> None:
    s = server_factory(http=True)
    model = write_model(tmp_path / "elsewhere", "vec_rt", "vecadd1k")  # not in either data directory
    with HttpClient(s.http, token=(s.data_dir / "token").read_text().strip()) as h:
        h.register(model)
        info = h.lookup("vec_rt")
    cli_dir = tmp_path / "cli"  # the CLI's own data directory: another registry, without vec_rt

    listed = {m["name"]: m for m in _list(s.http, cli_dir, "--json")}
    row = next(line for line in _list(s.http, cli_dir).splitlines() if " vec_rt " in line)

    mine = listed["vec_rt"]
    assert (mine["state"], mine["residency"], mine["version"]) == ("ready", "RESIDENT", "1")
    assert mine["bytes"] >= 0 and mine["metadata"]["parameters"]["func_id"] == info.func_id
    assert [(t["name"], t["datatype"], t["shape"]) for t in mine["metadata"]["inputs"]] == [
        (t.name, t.datatype, [-1, *t.shape]) for t in info.inputs]
    assert "RESIDENT" in row and f"{short_shapes(info.inputs)} → {short_shapes(info.outputs)}" in row
    assert listed["lenet"]["state"] == "unloaded"  # the node's built-ins, as the node has them


def test_models_list_with_a_gateways_url_lists_the_clusters_models(tmp_path: Path) -> None:
    def calls(ports: dict[str, int]) -> dict[str, Any]:
        url = f"http://127.0.0.1:{ports['http']}"
        return {"json": _list(url, tmp_path / "cli", "--json"), "table": _list(url, tmp_path / "cli"),
                "wide": _list(url, tmp_path / "cli", "--wide")}

    out = with_registry(tmp_path, calls)
    (lenet,) = out["json"]  # the cluster's one model, not the CLI's registry (every built-in)
    assert (lenet["name"], lenet["state"], lenet["residency"]) == ("lenet", "ready", None)
    assert lenet["reason"] == "serving on 1 node(s)"  # a gateway has no /v2/memory: its index says this
    assert lenet["metadata"]["parameters"]["func_id"] == CLUSTER_FID  # the cluster's id, not the node's
    assert "ready" in out["table"] and "UINT8[1,28,28] → FP32[10]" in out["table"]
    assert "serving on 1 node(s)" in out["wide"] and str(CLUSTER_FID) in out["wide"]
