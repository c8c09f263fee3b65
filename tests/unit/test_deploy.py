"""The deployment examples in ``deploy/`` against the code they deploy: the KubeRay
``RayCluster``'s resources and labels are what the cluster's actors ask Ray for and what the
provider reads, its Ray the version the ``cluster`` extra pins, its head's ports the
gateway's defaults; the node config is one ``cluster up`` accepts."""

from __future__ import annotations

import inspect
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from splitserve.cluster.actors import raycompat  # noqa: E402
from splitserve.cluster.actors.controller import ControllerActor  # noqa: E402
from splitserve.cluster.actors.ingress import GatewayActor  # noqa: E402
from splitserve.cluster.actors.node_server import NodeServerActor  # noqa: E402
from splitserve.cluster.actors.provider import AutoscalerProviderActor, market_of  # noqa: E402
from splitserve.cluster.cli import up  # noqa: E402
from splitserve.cluster.node_settings import node_env, read_node_config  # noqa: E402
from splitserve.cluster.pools import Market  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay" / "raycluster.yaml"


@pytest.fixture(scope="module")
def cluster() -> dict:
    doc = yaml.safe_load(MANIFEST.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    return doc["spec"]


def _resources(group: dict) -> dict[str, float]:
    """A group's custom resources, as ``ray start --resources`` reads them: KubeRay puts the
    value on a shell command line as it is written, quotes and escaped quotes included."""
    raw = group["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"'), "KubeRay's form: the JSON quoted for the shell"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def _fits(wanted: dict[str, float], offered: dict[str, float]) -> bool:
    return all(offered.get(name, 0) >= amount for name, amount in wanted.items())


def test_the_head_group_holds_the_control_actors_and_no_serving_node(cluster: dict) -> None:
    head = cluster["headGroupSpec"]
    offered = _resources(head)
    for actor in (ControllerActor, GatewayActor, AutoscalerProviderActor):
        assert _fits(actor._default_options["resources"], offered), actor
    assert not _fits(NodeServerActor._default_options["resources"], offered)  # no node server on the head
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_each_worker_group_is_one_serving_node_of_one_market_and_both_markets_are_there(cluster: dict) -> None:
    markets = []
    for group in cluster["workerGroupSpecs"]:
        resources = _resources(group)
        assert _fits(NodeServerActor._default_options["resources"], resources)
        assert resources[raycompat.NODE_RESOURCE] == 1  # one node server per pod
        market = market_of(group["labels"])
        assert market is not None and group["labels"][raycompat.MARKET_LABEL] == str(market)
        markets.append(market)
    assert sorted(markets) == sorted(Market)


def test_ray_is_the_version_the_cluster_extra_pins_with_autoscaler_v2_and_token_auth(cluster: dict) -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cluster"]
    (pin,) = [re.fullmatch(r"ray==(\d+\.\d+)\.\*", d).group(1) for d in extra if d.startswith("ray")]
    assert cluster["rayVersion"].startswith(pin + ".")
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["version"] == "v2"
    assert cluster["authOptions"]["mode"] == "token"


def test_the_head_opens_the_gateways_default_ports(cluster: dict) -> None:
    ports = {p["containerPort"] for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]
             for p in c["ports"]}
    options = inspect.signature(up).parameters
    for name in ("gateway_port", "gateway_http_port", "gateway_grpc_port"):
        assert options[name].default.default in ports, name


def test_the_example_node_config_is_one_cluster_up_accepts() -> None:
    env = node_env(read_node_config(ROOT / "deploy" / "node.toml"))
    assert env["SPLITSERVE_PARTITIONING"] == "protean"
