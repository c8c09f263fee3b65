"""Every Ray call that is private or version-sensitive, in one place (docs/cluster.md §2.2).

Ray is pinned to 2.60.* in the ``cluster`` extra because of what is here: the GCS client's
drain calls (``ray._raylet.GcsClient``: no public drain API exists; Serve's own controller
and the hidden ``ray drain-node`` CLI use the same calls), starting raylets in-process for
the local provider (``ray._private.node.Node``, as ``ray.cluster_utils.Cluster`` does), and
the environment a loopback-only cluster needs. Only the cluster modules that run inside Ray
import this module; the gateway's data plane never does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster

from splitserve.errors import InternalError

log = logging.getLogger(__name__)

# The loopback traps of Ray 2.60 (docs/cluster.md §3.1): without the first, a driver given
# 127.0.0.1 connects to eth0's address instead; the second turns off the token auth that a
# stray $HOME/.ray/auth_token would turn on. Only for clusters bound to loopback.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}

# Faster node-death detection for local clusters (measured 1.2 s instead of ~13 s).
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}

NODE_RESOURCE = "splitserve_node"  # one per serving node: at most one node server lands on each
MARKET_LABEL = "splitserve.io/market"
NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class RayNode:
    """A node as Ray's GCS lists it."""

    node_id: str  # hex
    alive: bool
    labels: Mapping[str, str]
    resources: Mapping[str, float]


def nodes() -> list[RayNode]:
    """Every node the GCS knows, alive or dead (``ray.nodes()``: no dashboard needed)."""
    return [RayNode(n["NodeID"], bool(n["Alive"]), dict(n.get("Labels") or {}), dict(n.get("Resources") or {}))
            for n in ray.nodes()]


def _gcs(address: str) -> Any:
    from ray._raylet import GcsClient

    return GcsClient(address=address)


def _drain(address: str, node_id: str, reason: str, message: str, deadline_ms: int) -> tuple[bool, str]:
    from ray.core.generated.autoscaler_pb2 import DrainNodeReason

    return _gcs(address).drain_node(node_id, DrainNodeReason.Value(reason), message, deadline_ms, timeout=10)


def drain_node(address: str, node_id: str, deadline_s: float, message: str) -> None:
    """A spot eviction notice: drain ``node_id`` with reason PREEMPTION (not rejectable) and a
    deadline in ``deadline_s`` seconds from now, and check that the GCS took it (a wrong id
    form is accepted silently and drains nothing)."""
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, why = _drain(address, node_id, "DRAIN_NODE_REASON_PREEMPTION", message, deadline_ms)
    if not accepted or node_id not in draining_nodes(address):
        raise InternalError(f"Ray did not drain node {node_id}: {why or 'not listed as draining'}")


def drain_idle(address: str, node_id: str, message: str) -> tuple[bool, str]:
    """Ask the GCS to retire ``node_id`` as idle (IDLE_TERMINATION, what autoscaler v2 sends
    itself): the raylet refuses while anything runs there, else exits at once and the
    autoscaler then terminates its instance. Returns (accepted, why not)."""
    return _drain(address, node_id, "DRAIN_NODE_REASON_IDLE_TERMINATION", message, 0)


def draining_nodes(address: str) -> dict[str, float]:
    """Draining nodes: hex id -> deadline in seconds since the epoch (0: none given)."""
    raw = _gcs(address).get_draining_nodes(timeout=10)
    return {(k.hex() if isinstance(k, bytes) else str(k)): v / 1000.0 for k, v in raw.items()}


def autoscaler_v2() -> bool:
    """Whether the cluster this process is connected to runs Ray's autoscaler v2 (asked of
    the GCS): v1 drops ``request_resources``' label selectors, so it cannot be asked for a
    market (``ray.autoscaler._private.commands.request_resources``)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    return is_autoscaler_v2(fetch_from_server=True)


def autoscaler_adds_nodes() -> bool:
    """Whether Ray's autoscaler may add a node with a ``splitserve_node`` to the cluster this
    process is connected to: autoscaler v2 (v1, the default of a head started by hand, drops
    the market labels of requests), unless the node types it published to the GCS (not every
    deployment publishes them: Ray's own monitor in 2.60 does not) have none with one and room
    to grow. Without it, the cluster's nodes are the machines that join it."""
    from ray._private.state import state

    if not autoscaler_v2():
        return False
    config = state.get_cluster_config()
    return config is None or any(
        g.resources.get(NODE_RESOURCE, 0) >= 1 and (g.max_count == -1 or g.max_count > 0)
        for g in config.node_group_configs)


def request_nodes(wanted: Mapping[str, int]) -> None:
    """Ask Ray's autoscaler for ``wanted[market]`` nodes with one ``splitserve_node`` each
    and the market label. The request replaces the previous one (``request_resources``): the
    caller passes its whole total every time."""
    from ray.autoscaler.sdk import request_resources

    markets = [m for m, n in sorted(wanted.items()) for _ in range(n)]
    request_resources(bundles=[{NODE_RESOURCE: 1} for _ in markets],
                      bundle_label_selectors=[{MARKET_LABEL: m} for m in markets])


def on_node(node_id: str) -> dict[str, Any]:
    """Actor options that pin an actor to one node (the labels doc's replacement for hard affinity)."""
    return {"label_selector": {NODE_ID_LABEL: node_id}}


def current_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def current_node_ip() -> str:
    """The address Ray knows this process's node by (the raylet's ``--node-ip-address``)."""
    return ray.util.get_node_ip_address()


def current_node_labels() -> dict[str, str]:
    """This process's node's labels (``ray start --labels``, and Ray's own ``ray.io/*``)."""
    return dict(ray.get_runtime_context().get_node_labels())


def take_node_niceness() -> None:
    """Run this actor, and every process it starts, at its Ray node's niceness (its raylet's,
    which started this worker; usually 0), not at the ``worker_niceness`` (15) Ray gives
    its workers. Each splitserve actor calls it first thing: at 15 a node's server, its model
    workers and the gateway's data plane yielded the CPU to every other process on the host
    (on 2 busy cores a node's model worker took a minute to start, 2 s outside Ray), and with
    only those raised, the control actors left at 15 waited behind the data plane they
    steer. Raising a priority needs root, CAP_SYS_NICE or a nice limit (``ulimit -e``);
    without, the actor says so and runs as Ray started it."""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if os.getpriority(os.PRIO_PROCESS, 0) > nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        log.warning("this actor (pid %d) keeps Ray's worker niceness, so every other process on the host takes the "
                    "CPU before it and the processes it starts (%s): allow raising it (CAP_SYS_NICE, or `ulimit -e`), "
                    "or start Ray with RAY_worker_niceness=0", os.getpid(), e)


def at_node_niceness(cls: type) -> type:
    """``cls`` as a Ray actor runs it: ``take_node_niceness`` before its own ``__init__``
    (the class itself stays as it is for the tests that build it in process)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        take_node_niceness()
        init(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def session_dir() -> str:
    """This process's Ray session directory (on the head for the controller): it lives as
    long as the Ray cluster, unlike the actor's working directory."""
    return ray._private.worker.global_worker.node.get_session_dir_path()


def named_actor(name: str, namespace: str) -> Any | None:
    """The live actor called ``name`` in ``namespace``, or None when there is none."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def gcs_address() -> str:
    """The GCS address of the cluster this process is connected to."""
    return ray.get_runtime_context().gcs_address


# -- local raylets (development and tests) ---------------------------------------------------


# Ray puts Unix sockets at <temp_dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store.<n>:
# this many bytes after the temp dir, against AF_UNIX's 107. Past it the head starts but every
# raylet fails to, which showed only as "no node serving" after the whole start timeout.
_RAY_SOCKET_SUFFIX = 68
_AF_UNIX_MAX = 107


def start_head(temp_dir: str, system_config: Mapping[str, Any]) -> Cluster:
    """A head node on 127.0.0.1 with no CPUs (only control actors land there) and no dashboard.

    Refuses a ``temp_dir`` too long for the Unix sockets Ray makes under it."""
    room = _AF_UNIX_MAX - _RAY_SOCKET_SUFFIX
    if len(os.fsencode(temp_dir)) > room:
        raise ValueError(f"Ray's temp dir {temp_dir!r} is {len(os.fsencode(temp_dir))} bytes; Ray's Unix socket paths "
                         f"under it need it at most {room} (AF_UNIX allows {_AF_UNIX_MAX}): use a shorter one")
    # Whatever temp_dir says, Cluster writes the head's address to the *default* temp dir's
    # ray_current_cluster (/tmp/ray/…) and does not create that folder: on a machine where no Ray
    # ran before, the head failed to start with FileNotFoundError.
    from ray._private.utils import get_ray_address_file
    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    return Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=80 << 20,
        temp_dir=temp_dir, resources={"splitserve_head": 1}, _system_config=dict(system_config)))


def start_worker_node(address: str, num_cpus: int, labels: Mapping[str, str]) -> Any:
    """Start a raylet on 127.0.0.1 that joins the cluster at ``address``, with one
    ``splitserve_node`` resource; its processes are children of the calling process
    (``Cluster.add_node`` without a ``Cluster``, so any process of the cluster can do it)."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(gcs_address=address, num_cpus=num_cpus, num_gpus=0, object_store_memory=80 << 20,
                       node_ip_address="127.0.0.1", resources={NODE_RESOURCE: 1}, labels=dict(labels),
                       include_log_monitor=False, node_manager_port=0, min_worker_port=0, max_worker_port=0)
    params.dashboard_agent_listen_port = None
    return Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)


def node_id_of(node: Any) -> str:
    return node.node_id


def stop_worker_node(node: Any, graceful: bool) -> None:
    """Stop a raylet this process started, with its processes (SIGTERM first when graceful)."""
    node.kill_all_processes(check_alive=False, allow_graceful=graceful, wait=True)


def kill_node_tree(node: Any) -> None:
    """The VM vanishes: SIGKILL the raylet and every descendant at once (§3.3), then the
    node's other processes; no goodbye reaches the GCS or any peer."""
    procs = []
    for info in node.all_processes.get("raylet", []):
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(info.process.pid)
            procs += [root, *root.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


# Where Ray 2.60 looks for the token of a head with token authentication (its C++
# AuthenticationTokenLoader): the variable, else the file the second names, else the third.
TOKEN_ENV, TOKEN_PATH_ENV, TOKEN_FILE = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_hint(sending: bool) -> str:
    """What to check when a Ray cluster did not let this process in: the token it lacks, or
    the one it sent (``sending``)."""
    if sending:
        return (f"this machine sent the token Ray found ({TOKEN_ENV}, {TOKEN_PATH_ENV} or {TOKEN_FILE}): if the head "
                "checks tokens, check it is the head's (`ray get-auth-token` on the head prints it)")
    return (f"if the head checks tokens (Ray's token authentication), give this machine the head's token: "
            f"{TOKEN_ENV}=<token>, or the token in {TOKEN_FILE} (or the file {TOKEN_PATH_ENV} names); "
            "`ray get-auth-token` on the head prints it")


def join(address: str, **init_options: Any) -> None:
    """Connect this driver to the Ray cluster at ``address`` that someone else runs. On a
    loopback address the address stays as given (not rewritten to eth0's). Token
    authentication is turned on where Ray finds a token (``TOKEN_ENV``, ``TOKEN_PATH_ENV``,
    ``TOKEN_FILE``) and ``RAY_AUTH_MODE`` does not say otherwise: Ray does that by itself for
    a cluster it finds on this machine, never for an address it is given, and a head that
    checks no token ignores one. A refused connection names what to check."""
    from ray._private import ray_constants
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    if address.startswith("127."):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    sending = maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    try:
        ray.init(address=address, **init_options)
    except ConnectionError as e:
        raise ConnectionError(f"{e}; {token_hint(sending)}") from None


def use_loopback() -> None:
    """Make this process and every process it starts use the loopback settings. Ray reads
    the first at import, so the constant it set then is corrected too."""
    from ray._private import ray_constants

    os.environ.update(LOOPBACK_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
