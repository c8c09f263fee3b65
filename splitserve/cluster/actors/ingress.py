"""The Gateway actor: supervises the gateway's data-plane process and feeds it routes.

The data plane (``cluster/gateway/dataplane.py``: the fast path, HTTP and gRPC) never imports
Ray; this actor starts it with the cluster's settings in its environment, long-polls the
controller's ``routes`` with the gateway's own stats (the autoscaler's input), and writes
each newer table to the process's stdin. A data plane that died is started again at once (a
thread waits on it) on the same ports with the latest table: clients reconnect, and a call in flight on a dead connection is
answered by the connection's reset (the client knows it has no answer and may send it
again). The new process links to the nodes afresh from that table.

While the controller is away (its process died and Ray restarts it) the data plane serves
on its last table: each routes call waits at most ``routes_poll_timeout_s`` and is asked
again, and a controller that was replaced by a new actor of the same name is looked up again.

Registrations a client makes at the gateway's HTTP come back up as upcalls
(``cluster/gateway/upcall.py``) on a socketpair made for each data-plane process: a thread of this
actor answers them one at a time by calling the controller (``ControllerRegistry``). The
cluster's management token reaches the process in its environment, not on its command line.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import fields
from typing import Any

import ray

from splitserve.cluster.actors import raycompat
from splitserve.cluster.actors.controller import CONTROLLER_NAME, NAMESPACE
from splitserve.cluster.actors.node_server import die_with_parent
from splitserve.cluster.gateway import upcall
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.cluster.config import ClusterConfig
from splitserve.config import ServerConfig
from splitserve.errors import InternalError, SplitServeError

log = logging.getLogger(__name__)

GATEWAY_NAME = "splitserve-gateway"


def gateway_name(index: int) -> str:
    """The Ray name of the cluster's ``index``-th gateway (the first keeps the plain name)."""
    return GATEWAY_NAME if index == 0 else f"{GATEWAY_NAME}-{index}"


def cluster_env(cfg: ClusterConfig) -> dict[str, str]:
    """``cfg`` as the SPLITSERVE_CLUSTER_* variables ``ClusterConfig.from_env`` reads back."""
    return {f"SPLITSERVE_CLUSTER_{f.name.upper()}": str(getattr(cfg, f.name))
            for f in fields(cfg) if getattr(cfg, f.name) is not None}


class ControllerRegistry:
    """``upcall.ClusterRegistry`` over the controller actor: each call waits at most
    ``timeout_s``, and the controller's SplitServeError comes back as itself."""

    def __init__(self, controller: Any, timeout_s: float, get: Any = ray.get) -> None:
        self.controller = controller
        self.timeout_s = timeout_s
        self._get = get  # ray.get (tests: a fake)

    def register(self, spec: ModelSpec) -> int:
        return int(self._wait(self.controller.register.remote(spec)))

    def unregister(self, name: str) -> None:
        self._wait(self.controller.unregister.remote(name))

    def _wait(self, ref: Any) -> Any:
        try:
            return self._get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise InternalError(f"the cluster's controller did not answer within {self.timeout_s:g} s") from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, SplitServeError):
                raise e.cause from None
            raise InternalError(f"the cluster's controller failed: {e.cause!r}") from None
        except ray.exceptions.RayError as e:
            raise InternalError(f"the cluster's controller is unreachable: {e}") from None


class Gateway:
    """One data-plane process on this (ingress) node."""

    def __init__(self, cfg: ClusterConfig, host: str, port: int, controller: Any, http_port: int | None = None,
                 grpc_port: int | None = None, token: str = "", name: str = GATEWAY_NAME) -> None:
        self.cfg = cfg
        self.name = name  # its stats' name at the controller, which adds up every gateway's
        self.host = host
        self.port = port
        self.http_port = http_port  # None: no HTTP front end
        self.grpc_port = grpc_port  # None: no gRPC front end
        self.controller = controller
        self._token = token  # the cluster's management token, checked by the data plane's management routes
        self._registry = ControllerRegistry(controller, cfg.registration_timeout_s)
        self._lock = threading.Lock()  # one conversation with the process at a time
        self._routes: str | None = None
        self._version = 0
        self._stopped = threading.Event()
        self._start_process()
        threading.Thread(target=self._poll, name="gateway-routes", daemon=True).start()
        threading.Thread(target=self._watch, name="gateway-watch", daemon=True).start()

    def _start_process(self) -> None:
        env = {**os.environ, **cluster_env(self.cfg), upcall.TOKEN_ENV: self._token}
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "splitserve.cluster.gateway.dataplane",
               "--host", self.host, "--port", str(self.port),
               "--http-port", str(-1 if self.http_port is None else self.http_port),
               "--grpc-port", str(-1 if self.grpc_port is None else self.grpc_port),
               "--upcall-fd", str(theirs.fileno())]
        with theirs:
            try:
                self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             preexec_fn=die_with_parent, text=True, bufsize=1,
                                             pass_fds=(theirs.fileno(),))
            except BaseException:
                ours.close()
                raise
        # one thread per process: it ends when that process's end of the pair closes
        threading.Thread(target=upcall.serve, args=(ours, self._registry, ServerConfig.from_env().frontends.max_upload_bytes),
                         name="gateway-upcalls", daemon=True).start()
        line = self.proc.stdout.readline()
        if not line:
            raise InternalError(f"the gateway process exited with {self.proc.wait()} before it listened")
        bound = json.loads(line)
        # a restarted process binds the same ports again
        self.port, self.http_port, self.grpc_port = int(bound["port"]), bound["http_port"], bound["grpc_port"]
        if self._routes is not None:
            self.proc.stdin.write(self._routes + "\n")
        log.info("gateway data plane pid %d on %s: fast path %d, HTTP %s, gRPC %s", self.proc.pid, self.host,
                 self.port, self.http_port, self.grpc_port)

    def address(self) -> tuple[str, int, int | None, int | None]:
        """Host, fast-path TCP port, HTTP port and gRPC port (None: not served)."""
        return self.host, self.port, self.http_port, self.grpc_port

    def stats(self) -> dict:
        """The data plane's ledger and link counters."""
        with self._lock:
            if self.proc.poll() is not None:
                self._start_process()
            self.proc.stdin.write("stats\n")
            return json.loads(self.proc.stdout.readline())

    def _watch(self) -> None:
        """Start the data plane again as soon as it exits (not only at the next stats call)."""
        while not self._stopped.is_set():
            proc = self.proc
            proc.wait()
            with self._lock:
                if self._stopped.is_set() or self.proc is not proc:
                    continue
                log.warning("gateway data plane pid %d exited with %s; starting it again", proc.pid, proc.returncode)
                try:
                    self._start_process()
                except (InternalError, OSError, ValueError) as e:
                    log.error("gateway data plane did not start again (%s); trying again", e)
            if self.proc is proc:
                self._stopped.wait(self.cfg.reconcile_interval_s)

    def _poll(self) -> None:
        while not self._stopped.is_set():
            try:
                stats = self.stats()
                doc = ray.get(self.controller.routes.remote(self._version, stats, self.name),
                              timeout=self.cfg.routes_poll_timeout_s)
            except (ray.exceptions.RayError, OSError, ValueError) as e:
                log.warning("gateway: routes poll failed (%s); serving on routes v%d, asking again", e, self._version)
                if isinstance(e, ray.exceptions.ActorDiedError):
                    # killed for good: a new controller of the same name (cluster up again) is another actor
                    self.controller = raycompat.named_actor(CONTROLLER_NAME, NAMESPACE) or self.controller
                    self._registry.controller = self.controller
                self._stopped.wait(self.cfg.reconcile_interval_s)
                continue
            if doc is not None:
                with self._lock:
                    self._routes = doc
                    self._version = json.loads(doc)["version"]
                    self.proc.stdin.write(doc + "\n")

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


# Threaded (the routes poll runs beside stats calls; upcalls have a thread of their own);
# restarted by Ray if its process dies.
GatewayActor = ray.remote(num_cpus=0, resources={"splitserve_head": 0.01}, max_restarts=-1,
                          max_concurrency=4)(raycompat.at_node_niceness(Gateway))
