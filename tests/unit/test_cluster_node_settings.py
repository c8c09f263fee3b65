"""The node settings ``cluster up`` gives every node: a node config file and the node flags
become the SPLITSERVE_* variables each node's ``serve`` reads, checked by that same reader
before anything starts (the Ray cluster test checks a node runs with them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("ray")

from splitserve.cluster.cli import cluster_app  # noqa: E402
from splitserve.cluster.node_settings import node_env, read_node_config  # noqa: E402
from splitserve.config import ServerConfig  # noqa: E402
from splitserve.errors import InvalidInput  # noqa: E402
from splitserve.placement.partition import Partitioning  # noqa: E402
from splitserve.scheduler.priority import PriorityMode  # noqa: E402


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_a_node_config_file_reaches_a_node_as_its_serve_would_read_it(tmp_path: Path) -> None:
    path = _file(tmp_path, 'memory_budget_bytes = "2GiB"\nfast_direct = false\n'
                           '[protean]\npartitioning = "protean"\n[memory]\nmax_resident_models = 3\n')
    env = node_env(read_node_config(path))
    assert env["SPLITSERVE_MEMORY_BUDGET_BYTES"] == "2GiB"
    node = ServerConfig.from_env(environ=env)
    assert node.memory.memory_budget_bytes == 2 << 30 and node.memory.max_resident_models == 3
    assert node.protean.partitioning is Partitioning.PROTEAN
    assert node.reef.preemption is PriorityMode.CONCURRENT  # protean's default, as on one server
    assert node.transports.fast_direct is False


@pytest.mark.parametrize(("settings", "refusal"), [
    ({"fast_port": 9000}, "the cluster sets fast_port"),
    ({"load": "lenet"}, "the cluster sets load"),
    ({"memory_budget": "2GiB"}, "no node setting 'memory_budget'"),
    ({"ts_inference_port": 8080}, "no node setting 'ts_inference_port'"),  # a flag only: no variable reads it
    ({"memory_budget_bytes": "lots"}, "SPLITSERVE_MEMORY_BUDGET_BYTES='lots' is not a size"),
    ({"partitioning": "halves"}, "unknown SPLITSERVE_PARTITIONING 'halves'"),
    ({"geometry": "1,1"}, "geometry '1,1' needs partitioning"),  # the server's own cross-check
    ({"preemption": ["reef"]}, "takes one value"),
])
def test_node_settings_a_node_would_refuse_are_refused_with_their_name(settings: dict, refusal: str) -> None:
    with pytest.raises(InvalidInput, match=refusal):
        node_env(settings)


def test_a_node_config_file_names_only_settings_under_their_own_section(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"\[memory\] has no setting 'partitioning'"):
        read_node_config(_file(tmp_path, '[memory]\npartitioning = "static"\n'))
    with pytest.raises(InvalidInput, match="is not TOML"):
        read_node_config(_file(tmp_path, "memory_budget_bytes = \n"))
    with pytest.raises(InvalidInput, match="cannot read the node config"):
        read_node_config(tmp_path / "missing.toml")


def test_cluster_up_refuses_bad_node_settings_before_it_starts_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(cluster_app, ["up", "--data-dir", str(tmp_path), "--memory-budget", "lots"],
                        env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "SPLITSERVE_MEMORY_BUDGET_BYTES='lots' is not a size" in out.output
    path = _file(tmp_path, 'partitioning = "static"\n')
    out = runner.invoke(cluster_app, ["up", "--data-dir", str(tmp_path), "--node-config", str(path),
                                      "--partitioning", "bogus"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "bogus" in out.output  # a flag is checked by its own choices
    assert not (tmp_path / "cluster.json").exists()
