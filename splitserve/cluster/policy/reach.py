"""Node addresses across hosts: which address a node server binds and advertises, and
whether the address it advertises is one the controller and gateway can reach.

Pure functions (no sockets, no Ray): the node server passes in its Ray node's address and
labels, the controller the outcome of its TCP probe (``actors/probe.py``), made only where
``address_problem`` finds nothing.

A node server binds and advertises, by default, the address Ray knows its node by (the
raylet's ``--node-ip-address``): an address the other Ray nodes already reach. Either can
be set apart, for one node with a label on its Ray node (``ray start --labels
'{"splitserve.io/advertise-address": "203.0.113.7"}'``), or for every node with ``cluster
up --node-host/--node-advertise``; a node's label wins over the cluster-wide setting.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import NamedTuple

BIND_LABEL = "splitserve.io/bind-address"
ADVERTISE_LABEL = "splitserve.io/advertise-address"


class NodeAddresses(NamedTuple):
    """Where a node server listens, and the address it tells the cluster to call it on."""

    bind: str
    advertise: str


def node_addresses(node_ip: str, labels: Mapping[str, str], bind: str | None = None,
                   advertise: str | None = None) -> NodeAddresses:
    """The node's addresses: its label, else the cluster-wide setting (``bind``,
    ``advertise``), else ``node_ip`` (Ray's address for the node)."""
    return NodeAddresses(labels.get(BIND_LABEL) or bind or node_ip,
                         labels.get(ADVERTISE_LABEL) or advertise or node_ip)


def local_address(bind: str) -> str:
    """An address the node server reaches its own child on: ``bind``, or loopback when the
    child binds every interface (0.0.0.0 / ::)."""
    ip = _ip(bind)
    if ip is not None and ip.is_unspecified:
        return "::1" if ip.version == 6 else "127.0.0.1"
    return bind


def address_problem(advertised: str, node_ip: str, prober_ip: str) -> str | None:
    """Why ``advertised`` cannot name a node whose Ray address is ``node_ip`` to a prober on
    the Ray node ``prober_ip`` (None: no reason found without a probe). A probe would not
    tell these apart: a loopback address connects to whatever listens on the prober's own
    host."""
    ip = _ip(advertised)
    if ip is None:
        return None  # a host name: only the probe can tell
    if ip.is_unspecified:
        return (f"advertises {advertised}, which names no host: set its advertise address (the "
                f"{ADVERTISE_LABEL} label of its Ray node, or `cluster up --node-advertise`)")
    node = _ip(node_ip)
    if ip.is_loopback and node_ip != prober_ip and not (node is not None and node.is_loopback):
        return (f"advertises loopback {advertised}, but it runs on another host ({node_ip}) than the controller "
                f"({prober_ip}): bind and advertise an address the head reaches")
    return None


def probe_reason(advertised: str, port: int, probe_error: str | None) -> str | None:
    """Why the node at ``advertised:port`` is unreachable, from the controller's TCP probe
    (None: it answered)."""
    if probe_error is None:
        return None
    return f"its fast path {_hostport(advertised, port)} is unreachable from the controller: {probe_error}"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
