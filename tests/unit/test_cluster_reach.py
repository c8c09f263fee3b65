"""Node addresses across hosts: which address a node binds and advertises, and why the head
cannot reach one (the pure part; the probe itself against real loopback sockets)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from splitserve.cluster.actors.node_server import NodeEndpoint
from splitserve.cluster.actors.probe import Reachability, tcp_probe
from splitserve.cluster.policy.reach import (ADVERTISE_LABEL, BIND_LABEL, address_problem, local_address,
                                             node_addresses, probe_reason)


def test_a_node_binds_and_advertises_the_address_ray_knows_it_by_unless_told_otherwise() -> None:
    assert node_addresses("10.0.0.7", {}) == ("10.0.0.7", "10.0.0.7")
    # the cluster-wide settings, each on its own
    assert node_addresses("10.0.0.7", {}, bind="0.0.0.0") == ("0.0.0.0", "10.0.0.7")
    assert node_addresses("10.0.0.7", {}, advertise="203.0.113.7") == ("10.0.0.7", "203.0.113.7")
    # the node's own labels win over the cluster-wide settings
    labels = {BIND_LABEL: "0.0.0.0", ADVERTISE_LABEL: "node7.example"}
    assert node_addresses("10.0.0.7", labels, bind="10.0.0.7", advertise="x") == ("0.0.0.0", "node7.example")


def test_the_node_server_reaches_a_child_bound_to_every_interface_on_loopback() -> None:
    assert local_address("0.0.0.0") == "127.0.0.1"
    assert local_address("::") == "::1"
    assert local_address("10.0.0.7") == "10.0.0.7"


@pytest.mark.parametrize("advertised, node_ip, prober_ip, problem", [
    ("10.0.0.7", "10.0.0.7", "10.0.0.1", None),
    ("node7.example", "10.0.0.7", "10.0.0.1", None),  # a name: only the probe can tell
    ("127.0.0.1", "127.0.0.1", "127.0.0.1", None),  # a cluster on one machine
    ("127.0.0.1", "10.0.0.1", "10.0.0.1", None),  # on the head itself
    ("127.0.0.1", "10.0.0.7", "10.0.0.1", "advertises loopback 127.0.0.1, but it runs on another host"),
    ("::1", "10.0.0.7", "10.0.0.1", "advertises loopback ::1"),
    ("0.0.0.0", "10.0.0.7", "10.0.0.1", "advertises 0.0.0.0, which names no host"),
    ("::", "127.0.0.1", "127.0.0.1", "advertises ::, which names no host"),
])
def test_an_advertised_address_that_cannot_name_the_node_is_refused_with_the_reason(
        advertised: str, node_ip: str, prober_ip: str, problem: str | None) -> None:
    found = address_problem(advertised, node_ip, prober_ip)
    assert found == problem if problem is None else found is not None and found.startswith(problem)


def test_a_failed_probe_is_the_reason_with_the_address() -> None:
    assert probe_reason("10.0.0.7", 5000, None) is None
    assert probe_reason("10.0.0.7", 5000, "TCP connect failed: Connection refused") == \
        "its fast path 10.0.0.7:5000 is unreachable from the controller: TCP connect failed: Connection refused"
    assert "[fd00::7]:5000" in probe_reason("fd00::7", 5000, "x")


def test_the_probe_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: a connect is refused
        open_port, closed_port = listening.getsockname()[1], closed.getsockname()[1]
        assert asyncio.run(tcp_probe("127.0.0.1", open_port)) is None
        assert "refused" in asyncio.run(tcp_probe("127.0.0.1", closed_port))
        check = Reachability("10.0.0.1")
        # a loopback address from another host is refused without a probe, even where one would connect
        far = NodeEndpoint("n", "127.0.0.1", open_port, 0, 1, node_ip="10.0.0.7")
        assert "another host" in asyncio.run(check(far))
        assert asyncio.run(check(NodeEndpoint("n", "127.0.0.1", open_port, 0, 1, node_ip="10.0.0.1"))) is None


def test_only_the_names_of_a_run_whose_process_is_gone_are_stale() -> None:
    from splitserve.bench.netns import PREFIX, _stale

    assert not _stale(f"{PREFIX}{os.getpid():x}-head")  # this run's
    assert not _stale(f"{PREFIX}{os.getpid():x}-v3")
    assert _stale(f"{PREFIX}{2**22 + 1:x}-br")  # above Linux's pid_max ceiling: no such process
    assert not _stale("ssmhzz-head")  # not one of ours
