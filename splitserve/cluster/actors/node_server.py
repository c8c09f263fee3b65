"""The node server: one Ray actor per serving node, supervising an unchanged ``splitserve serve``.

The actor keeps Ray's threads and GIL out of the data path: it starts ``python -m splitserve
serve`` bound to the node's address with an ephemeral fast-path port, reads the child's
``server.json`` for the ports, and answers small control calls from the controller
(``endpoint``, ``ensure_models``, ``unload_models``, ``remove_models``, ``stats``, ``stop``).
Requests never pass through it. The child gets SIGKILL when the actor's process dies,
however it dies (``PR_SET_PDEATHSIG``: Ray kills an actor's children on a clean exit only),
and its workers follow their server.
The cluster's management token is written into the child's data directory before it
starts, so one token works on every node. The child binds, and the node advertises, the
address Ray knows the node by unless its Ray node's labels or the cluster's ``NodeSpec``
say otherwise (``policy/reach.node_addresses``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ray

from splitserve.cluster.actors import raycompat
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.cluster.policy.reach import local_address, node_addresses
from splitserve.errors import InternalError, SplitServeError, Status, error_for_status
from splitserve.launcher import stop_process

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


@dataclass(frozen=True)
class NodeEndpoint:
    """Where a node server's fast path listens."""

    node_id: str
    host: str  # the advertised address: what the gateway connects to
    fast_port: int
    http_port: int
    pid: int
    node_ip: str = ""  # the address Ray knows the node by (where the server runs)


@dataclass(frozen=True)
class NodeSpec:
    """How to start one node's server."""

    host: str | None = None  # the address every node binds (None: each node's Ray address)
    advertise: str | None = None  # the address every node advertises (None: each node's Ray address)
    token: str = ""  # the cluster's management token
    cache_dir: str | None = None  # weights cache shared by the nodes of one machine
    tmp_root: str | None = None  # where the node's data dir goes (short: Unix socket paths)
    start_timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)  # SPLITSERVE_* settings for the child


def die_with_parent() -> None:
    """In a child before exec: SIGKILL when the parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class NodeServer:
    """Supervisor of one ``splitserve serve`` child on this node."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.node_id = raycompat.current_node_id()
        self.node_ip = raycompat.current_node_ip()
        self.addresses = node_addresses(self.node_ip, raycompat.current_node_labels(), spec.host, spec.advertise)
        self.data_dir = Path(tempfile.mkdtemp(prefix="ssn-", dir=spec.tmp_root))
        token_file = self.data_dir / "token"
        token_file.write_text(spec.token + "\n")
        token_file.chmod(0o600)
        env = {**os.environ, **spec.env}
        if spec.cache_dir:
            env["SPLITSERVE_CACHE_DIR"] = spec.cache_dir
        cmd = [sys.executable, "-m", "splitserve", "serve", "--host", self.addresses.bind, "--fast-port", "0",
               "--udp-port", "-1", "--http-port", "0", "--grpc-port", "-1", "--data-dir", str(self.data_dir)]
        self.child = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=open(self.data_dir / "server.log", "ab"))
        self._endpoint = self._wait_started()
        self._registered: set[str] = set()
        log.info("node %s: splitserve serve pid %d on %s:%d, advertised as %s", self.node_id[:12], self.child.pid,
                 self.addresses.bind, self._endpoint.fast_port, self.addresses.advertise)

    def _wait_started(self) -> NodeEndpoint:
        info_file = self.data_dir / "server.json"
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                raise InternalError(f"splitserve serve exited with {self.child.returncode} on node {self.node_id}: "
                                    f"{self._log_tail()}")
            if info_file.exists():
                info = json.loads(info_file.read_text())
                if info.get("pid") == self.child.pid:
                    return NodeEndpoint(self.node_id, self.addresses.advertise, int(info["fast_port"]),
                                        int(info["http_port"]), self.child.pid, self.node_ip)
            time.sleep(_POLL_S)
        self.stop()
        raise InternalError(f"splitserve serve did not start within {self.spec.start_timeout_s} s on node "
                            f"{self.node_id}")

    def _log_tail(self) -> str:
        text = (self.data_dir / "server.log").read_text(errors="replace")
        return text[-2000:]

    def endpoint(self) -> NodeEndpoint:
        return self._endpoint

    def ensure_models(self, specs: list[ModelSpec], warm: tuple[str, ...] = ()) -> list[str]:
        """Register the models this node lacks (idempotent), then load ``warm`` (each waits until
        ready): a node joins the routes with its models warm, or the traffic a replacement takes
        over from a doomed node pays every model's cold start. Returns the names it serves."""
        with self._management() as http:
            for spec in specs:
                if spec.name in self._registered:
                    continue
                files = {"config": ("config.toml", spec.config_toml.encode())}
                if spec.artifact is not None:
                    files["artifact"] = ("artifact", spec.artifact)
                if spec.labels is not None:
                    files["labels"] = ("labels.txt", spec.labels.encode())
                r = http.post(f"/v2/repository/models/{spec.name}/register", files=files)
                if r.status_code != 200 and "already exists" not in r.text:
                    raise _http_error(r)
                self._registered.add(spec.name)
            for name in warm:
                r = http.post(f"/v2/repository/models/{name}/load")
                if r.status_code != 200:
                    raise _http_error(r)
        return sorted(self._registered)

    def remove_models(self, names: list[str]) -> None:
        """Unregister ``names`` on this node (idempotent: a model it does not have is skipped)."""
        with self._management() as http:
            for name in names:
                r = http.delete(f"/v2/repository/models/{name}")
                if r.status_code not in (200, 404):
                    raise _http_error(r)
                self._registered.discard(name)

    def unload_models(self, names: list[str]) -> None:
        """Unload ``names`` on this node, keeping them registered (placement moved them away;
        ``ensure_models`` loads them again). A model it does not have is skipped."""
        with self._management() as http:
            for name in names:
                r = http.post(f"/v2/repository/models/{name}/unload")
                if r.status_code not in (200, 404):
                    raise _http_error(r)

    def _management(self) -> httpx.Client:
        """An HTTP client for the child's management calls, with the cluster's token."""
        host = local_address(self.addresses.bind)
        host = f"[{host}]" if ":" in host else host
        return httpx.Client(base_url=f"http://{host}:{self._endpoint.http_port}",
                            headers={"Authorization": f"Bearer {self.spec.token}"}, timeout=self.spec.start_timeout_s)

    def stats(self) -> dict:
        """Whether the child serves, and its pid (the controller's liveness check)."""
        return {"node_id": self.node_id, "pid": self.child.pid, "alive": self.child.poll() is None}

    def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after its grace) and remove its data dir."""
        stop_process(self.child, 10)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _http_error(r: httpx.Response) -> SplitServeError:
    try:
        doc = r.json()
        return error_for_status(int(Status[doc["status"]]), str(doc["error"]))
    except (ValueError, TypeError, KeyError):
        return InternalError(f"node answered {r.status_code}: {r.text[:500]}")


def node_server_name(node_id: str) -> str:
    return f"splitserve-node-{node_id[:12]}"


# No CPU of its own (the child uses the node's); the node's one splitserve_node resource makes
# it the only node server there. Control calls are idempotent, so a restart may retry them.
NodeServerActor = ray.remote(num_cpus=0, resources={raycompat.NODE_RESOURCE: 1}, max_restarts=-1,
                             max_task_retries=-1)(raycompat.at_node_niceness(NodeServer))
