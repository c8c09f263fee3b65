"""The cluster across hosts: each host a Linux network namespace on a bridge the test makes.

One cluster for the module: a Ray head (and the splitserve controller and gateway) on host
``head``, serving Ray workers joined as a user joins machines (``ray start --address`` with
one ``splitserve_node`` resource and a market label) on hosts ``a`` and ``b``, and clients on
host ``clients``; every address is on the bridge. Host ``far`` joins too, advertising an
address on the bridge that no host has: it is reported unreachable and never used. Later,
host ``a`` is killed and host ``b``'s link cut under load, and hosts ``c`` and ``d`` join to
replace them. Skipped where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from splitserve.client import connect  # noqa: E402
from splitserve.client.http import HttpClient  # noqa: E402
from splitserve.cluster.actors import raycompat  # noqa: E402
from splitserve.cluster.policy.reach import ADVERTISE_LABEL  # noqa: E402
from splitserve.bench import netns  # noqa: E402
from tests.cluster.clients import Load, lookup, until  # noqa: E402
from tests.helpers import CACHE  # noqa: E402

pytestmark = pytest.mark.skipif((why := netns.unavailable()) is not None, reason=f"no network namespaces: {why}")

TOKEN = "multihost-token"
ON_DEMAND = {raycompat.MARKET_LABEL: "on-demand"}


@dataclass
class MultiHost:
    hosts: netns.Hosts
    driver: netns.Driver
    far: str  # the node id of the host whose advertised address nobody has

    def host(self, name: str) -> netns.Host:
        return self.hosts.hosts[name]

    def on_clients(self, fn: Any) -> Any:
        return netns.run_in(self.host("clients").ns, fn)

    def load(self, func_id: int) -> Load:
        return Load(self.driver.gateway_port, func_id, host=self.host("head").ip,
                    enter=lambda: netns.enter(self.host("clients").ns))


@pytest.fixture(scope="module")
def mh() -> Iterator[MultiHost]:
    hosts = netns.Hosts()
    driver = None
    try:
        head, a, far = hosts.add("head"), hosts.add("a"), hosts.add("far")
        hosts.add("clients")
        address = hosts.ray_head(head)
        # a and far join side by side, while the driver starts on the head's host: each `ray start`
        # and the driver's start-up are seconds of waiting of their own, and which of the two
        # machines joins first, or whether before or after the controller asks for them, does not
        # change what it does with them (it takes both: one serves, one is reported)
        with ThreadPoolExecutor(2) as joining:
            joins = [joining.submit(hosts.ray_worker, a, address, ON_DEMAND),
                     joining.submit(hosts.ray_worker, far, address, {**ON_DEMAND, ADVERTISE_LABEL: hosts.unused_ip()})]
            try:
                driver = netns.Driver(hosts, head, address, 2, TOKEN, str(CACHE))
            finally:
                for j in joins:
                    j.result()
        # both claimed: a serves, far is reported; b joins as the machine that replaces far
        until("a serving and far reported unreachable", lambda: sorted(
            n["state"] for n in driver.nodes().values()) == ["active", "unreachable"], 180)
        (far_id,) = driver.nodes("unreachable")
        hosts.ray_worker(hosts.add("b"), address, ON_DEMAND)
        driver.wait_active(2, 180)
        yield MultiHost(hosts, driver, far_id)
    finally:
        if driver is not None:
            driver.close()
        hosts.close()
    assert hosts.leftovers() == []


def test_a_node_advertising_an_address_nobody_has_is_reported_with_the_reason_and_not_used(mh: MultiHost) -> None:
    far = mh.driver.nodes()[mh.far]
    assert far["state"] == "unreachable"
    assert mh.hosts.unused_ip() in far["reason"] and "unreachable from the controller" in far["reason"]
    gateway = mh.driver.ask("gateway")
    assert mh.far not in gateway["links"]
    active = mh.driver.nodes("active")
    assert len(active) == 2 and mh.far not in active
    assert {n["endpoint"].split(":")[0] for n in active.values()} == {mh.host("a").ip, mh.host("b").ip}


def test_a_model_registered_at_run_time_answers_from_every_host(mh: MultiHost, tmp_path: Path) -> None:
    model = tmp_path / "lenet_hosts"
    model.mkdir()
    (model / "config.toml").write_text('name = "lenet_hosts"\n[artifact]\nkind = "zoo"\narch = "lenet"\n')
    url = f"http://{mh.host('head').ip}:{mh.driver.http_port}"

    def register() -> dict:
        with HttpClient(url, token=TOKEN) as c:
            return c.register(model)

    assert mh.on_clients(register)["name"] == "lenet_hosts"
    active = mh.driver.nodes("active")
    assert all("lenet_hosts" in n["models"] for n in active.values())
    fid = mh.on_clients(lambda: lookup(mh.driver.gateway_port, "lenet_hosts", host=mh.host("head").ip))
    load = mh.load(fid).start()
    until("every serving host answered", lambda: set(mh.driver.ask("gateway")["answers_by_node"]) >= set(active),
          120)
    load.finish()
    assert mh.far not in mh.driver.ask("gateway")["answers_by_node"]
    # the splitserve client over the fast path, from the clients' host, as a user calls the cluster
    x = np.zeros((1, 1, 28, 28), np.uint8)  # the load's image

    def infer() -> np.ndarray:
        with connect(f"tcp://{mh.host('head').ip}:{mh.driver.gateway_port}") as c:
            return c.infer("lenet_hosts", x)

    np.testing.assert_allclose(mh.on_clients(infer).ravel(), np.frombuffer(next(iter(load.outputs)), np.float32),
                               atol=1e-5)


def _lose_a_host_under_load(mh: MultiHost, name: str, lose: Callable[[Any], None], joins: str) -> tuple[str, int]:
    """8 clients' load on both hosts; host ``name`` lost by ``lose`` while host ``joins`` joins
    the cluster; the load's ledger checked (every call answered once and right) once the
    victim left the gateway's links and a new host serves. The victim's node id, and the
    gateway's re-sends before the loss."""
    before = mh.driver.nodes("active")
    fid = mh.on_clients(lambda: lookup(mh.driver.gateway_port, "lenet", host=mh.host("head").ip))
    load = mh.load(fid).start()
    until("load on both hosts", lambda: set(mh.driver.ask("gateway")["answers_by_node"]) >= set(before), 60)
    resent = mh.driver.ask("gateway")["resent"]
    victim = next(n for n, v in before.items() if v["endpoint"].startswith(mh.host(name).ip + ":"))
    lose(mh.host(name))
    mh.hosts.ray_worker(mh.hosts.add(joins), f"{mh.host('head').ip}:{netns.RAY_PORT}", ON_DEMAND)
    until("the victim out of the gateway's links", lambda: victim not in mh.driver.ask("gateway")["links"], 30)
    until("a new host serving", lambda: sum(n not in before for n in mh.driver.nodes("active")) == 1, 180)
    load.finish()
    return victim, resent


def test_a_host_killed_under_load_loses_no_call_and_a_new_host_replaces_it(mh: MultiHost) -> None:
    victim, resent = _lose_a_host_under_load(mh, "a", mh.hosts.kill, "c")
    assert victim not in mh.driver.nodes()
    # 8 clients keep 32 calls in flight over both hosts: the kill caught some on the victim
    assert mh.driver.ask("gateway")["resent"] > resent


def test_a_host_whose_link_is_cut_under_load_loses_no_call_and_a_new_host_replaces_it(mh: MultiHost) -> None:
    """No connection ends here: the gateway learns of the loss from its missed pings and Ray
    from its health checks."""
    victim, resent = _lose_a_host_under_load(mh, "b", mh.hosts.cut, "d")
    assert victim not in mh.driver.nodes("active")
    assert mh.driver.ask("gateway")["resent"] > resent
