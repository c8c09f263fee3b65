"""``AutoscalerProvider`` on Ray's real autoscaler (v2) through its fake multi-node provider.

One head on 127.0.0.1 started with ``ray start --head --autoscaling-config`` and a config
written here (``ray.cluster_utils.AutoscalingCluster`` cannot be used: the 2.60 wheel lacks
its example.yaml and it runs ``ray stop --force``, docs/cluster.md), node types per market
as a user writes them, torn down by the PIDs of the processes under its own temp dir. The
head checks tokens (Ray's token authentication), so every test here runs as a user's
cluster does; a machine joined by hand serves beside the autoscaler's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
from ray._raylet import Config  # noqa: E402

from splitserve.client import connect  # noqa: E402
from splitserve.cluster.actors import raycompat  # noqa: E402
from splitserve.cluster.actors.local import attach, stop_actors, wait_serving  # noqa: E402
from splitserve.cluster.actors.node_server import NodeSpec  # noqa: E402
from splitserve.cluster.actors.provider import AutoscalerProviderActor  # noqa: E402
from splitserve.cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import CACHE  # noqa: E402

# the fake provider names its nodes by number; v2 needs the head's named so too
FAKE_HEAD_ID = "f" * 51 + "00000"
MARKETS = ("spot", "on-demand")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(gcs_port: int) -> dict:
    """What a user's cluster YAML holds (docs/cluster.md), on the fake provider: one node
    type per market, each with the market label and one ``splitserve_node``."""
    worker = {"node_config": {}, "min_workers": 0, "max_workers": 1}
    return {
        "cluster_name": "splitserve-test", "max_workers": 2,
        # "external" + the fake provider's class: the "fake_multinode" type needs the example.yaml
        # the wheel lacks for its defaults
        "provider": {"type": "external",
                     "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
                     "gcs_address": f"127.0.0.1:{gcs_port}", "head_node_id": FAKE_HEAD_ID, "launch_multiple": True,
                     "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0, "splitserve_head": 1}, "node_config": {}, "max_workers": 0},
            **{m: {**worker, "resources": {"CPU": 1, raycompat.NODE_RESOURCE: 1, "object_store_memory": 80 << 20},
                   "labels": {raycompat.MARKET_LABEL: m}} for m in MARKETS},
        },
        "head_node_type": "ray.head.default", "idle_timeout_minutes": 1, "upscaling_speed": 1.0,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _kill_under(root: Path) -> None:
    """SIGKILL every process whose command line names ``root`` (the head's, and the nodes
    Ray's monitor started, all under its temp dir), with their descendants."""
    me = os.getpid()
    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != me and any(str(root) in a for a in p.info["cmdline"] or ()):
                procs.update({q.pid: q for q in (p, *p.children(recursive=True))})
        except psutil.Error:
            continue
    for p in procs.values():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=10)


@pytest.fixture(scope="module")
def head() -> Iterator[dict]:
    """The head as users run it: Ray's token authentication on (its nodes get the token from
    its environment); this driver is given only the token, as a user gives it, and joins
    through ``raycompat.join``, which turns token authentication on."""
    root = Path(tempfile.mkdtemp(prefix="ssas-"))
    port = _free_port()
    token = secrets.token_hex(16)
    (root / "autoscaler.json").write_text(json.dumps(_config(port)))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", raycompat.AUTH_MODE_ENV: "token",
           raycompat.TOKEN_ENV: token, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_ID, "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    given = pytest.MonkeyPatch()
    try:
        # every port the head would take by default is a free one: other clusters may run beside it
        subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
                        f"--port={port}", f"--temp-dir={root / 't'}", f"--autoscaling-config={root / 'autoscaler.json'}",
                        "--num-cpus=0", '--resources={"splitserve_head": 1}', "--include-dashboard=false",
                        f"--dashboard-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
                        f"--dashboard-agent-listen-port={_free_port()}"],
                       env=env, check=True, capture_output=True, timeout=120)
        started = time.monotonic() - t0
        # unset (a loopback cluster before may have turned it off), so that join turns it on; the
        # setenv first records what was there, so that undo also removes the "token" join sets
        given.setenv(raycompat.AUTH_MODE_ENV, "")
        given.delenv(raycompat.AUTH_MODE_ENV)
        given.setenv(raycompat.TOKEN_ENV, token)
        raycompat.join(f"127.0.0.1:{port}", logging_level="WARNING", log_to_driver=False)
        yield {"address": f"127.0.0.1:{port}", "head_start_s": started}
    finally:
        ray.shutdown()
        given.undo()
        Config.initialize("")  # this process's Ray reads its authentication mode from the environment again
        _kill_under(root)
        shutil.rmtree(root, ignore_errors=True)


def _node(node_id: str) -> raycompat.RayNode:
    return next(n for n in raycompat.nodes() if n.node_id == node_id)


def _launches_done(address: str, timeout_s: float = 60.0) -> None:
    """Wait until Ray's autoscaler reports no launch and no node still pending. Its fake
    provider creates a node in the monitor's process, holding the provider's lock until that
    node's raylet is listed (and the monitor loop with it); a node taken away before then (a
    launch that returns as soon as its node joined, then a terminate) left it waiting 30 s
    for a node that was gone, and every launch asked of it meanwhile (the next test's) waited
    too. A cloud's provider does not wait on the node, so this is the fake one's, not the
    provider's under test."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    deadline = time.monotonic() + timeout_s
    while True:
        status = get_cluster_status(address)
        if not status.pending_launches and not status.pending_nodes:
            return
        assert time.monotonic() < deadline, f"launches still pending after {timeout_s:g} s: {status}"
        time.sleep(0.2)


def test_a_machine_joined_by_hand_serves_at_once_as_on_demand_and_stays_when_released(head):
    """A machine that joined with a ``splitserve_node`` and no market label (here a raylet
    this driver starts, with the token it was given) is taken at once, as on-demand, without
    asking Ray's autoscaler; retired, it stays in the Ray cluster. First in the module: no
    node of the autoscaler's is there yet to be taken instead."""
    machine = raycompat.start_worker_node(head["address"], 1, {})
    provider = AutoscalerProviderActor.remote(head["address"], 120.0, 60.0)
    try:
        node_id = raycompat.node_id_of(machine)
        t0 = time.monotonic()
        assert ray.get(provider.launch.remote("on-demand")) == node_id
        took_s = time.monotonic() - t0
        assert ray.get(provider.markets.remote()) == {node_id: "on-demand"}
        ray.get(provider.terminate.remote(node_id))
        assert _node(node_id).alive
        print(f"\nthe joined machine was taken in {took_s:.2f} s")
    finally:
        ray.kill(provider)
        raycompat.stop_worker_node(machine, graceful=True)


def test_nodes_of_each_market_come_from_rays_autoscaler_and_leave_on_terminate(head):
    provider = AutoscalerProviderActor.remote(head["address"], 120.0, 60.0)
    t0 = time.monotonic()
    pending = {provider.launch.remote(m): m for m in MARKETS}
    got: dict[str, str] = {}
    arrived: dict[str, float] = {}
    while pending:
        [ref], _ = ray.wait(list(pending), num_returns=1)
        m = pending.pop(ref)
        got[m] = ray.get(ref)
        arrived[m] = time.monotonic() - t0
    assert got["spot"] != got["on-demand"]
    for m, node_id in got.items():
        n = _node(node_id)
        assert n.alive and n.labels[raycompat.MARKET_LABEL] == m and n.resources[raycompat.NODE_RESOURCE] == 1
    assert ray.get(provider.markets.remote()) == {v: k for k, v in got.items()}
    _launches_done(head["address"])

    left: dict[str, float] = {}
    for m, node_id in got.items():
        t1 = time.monotonic()
        ray.get(provider.terminate.remote(node_id))  # returns once Ray lists the node dead (bounded)
        left[m] = time.monotonic() - t1
        assert not _node(node_id).alive
    assert ray.get(provider.markets.remote()) == {}
    print(f"\nhead start {head['head_start_s']:.1f} s; node arrived: "
          + ", ".join(f"{m} {s:.1f} s" for m, s in arrived.items())
          + "; gone after terminate: " + ", ".join(f"{m} {s:.1f} s" for m, s in left.items()))
    ray.kill(provider)


def test_the_controller_serves_through_the_gateway_from_a_node_rays_autoscaler_gave(head):
    cfg = ClusterConfig.from_env(min_nodes=1, max_nodes=1, procurement="on-demand-only", keep_alive_s=3600)
    spec = NodeSpec(token="autoscaler-test-token", cache_dir=str(CACHE), tmp_root=tempfile.gettempdir())
    h = attach(cfg, spec, "127.0.0.1", 0, ["lenet"], None, None, joined=True)
    try:
        status = wait_serving(h.controller, 1, 180, h.gateways())  # the gateway routes it: a call is served
        [node] = status["nodes"]
        assert node["market"] == "on-demand" and _node(node["node"]).labels[raycompat.MARKET_LABEL] == "on-demand"
        with connect(f"tcp://127.0.0.1:{h.gateway_port}") as c:
            assert c.infer("lenet", np.zeros((1, 28, 28), np.uint8)).shape == (10,)
    finally:
        stop_actors(h)

