"""Hosts as Linux network namespaces on a bridge made for the run (the multi-host test tier
and ``bench cluster-tax -p netns=true``).

Each "host" is a network namespace with one veth leg on a private bridge and one address in
a private /24 of 10.231.0.0/16; nothing else is routed, so every packet the tier sends stays
on that bridge. Names carry a tag with the creating process's pid (``ssmh<pid hex>-...``,
within Linux's 15 bytes for links), so a run cleans up what an earlier run that died left
behind (its pid is gone) and never touches a run still going. ``close`` kills every process
in the namespaces (Ray's daemons, node servers, workers), then removes the links,
namespaces and temp dir; it runs from the caller's finally (the tests' fixture) and, should the
process end before that, at exit.

Ray: ``ray start`` inside each namespace, the head with no CPUs and a ``splitserve_head``
resource, each worker with one ``splitserve_node`` resource and a market label, as a user
joins machines (docs/cluster.md). Ray's token authentication is turned off for the tier's
processes (``RAY_AUTH_MODE=disabled``): a head off loopback would otherwise ask for a
token, which docs/cluster.md covers for users.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from splitserve.cluster.actors import raycompat

PREFIX = "ssmh"  # every name: ssmh<pid hex>-<what>
RAY_PORT = 6379
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")
_STEP_TIMEOUT_S = 60.0


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}{os.getpid():x}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_STEP_TIMEOUT_S)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_all(ns: str, timeout_s: float = 20.0) -> None:
    """SIGKILL every process in ``ns`` until none is left (Ray daemons respawn nothing once
    their raylet is gone, but a fork in flight can add one)."""
    deadline = time.monotonic() + timeout_s
    while pids := _pids(ns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes left in namespace {ns}: {pids}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(name: str) -> bool:
    """Whether ``name`` (``ssmh<pid hex>-...``) belongs to a run whose process is gone."""
    try:
        return not _alive(int(name[len(PREFIX):].split("-")[0], 16))
    except ValueError:
        return False


def clean_stale() -> None:
    """Remove the namespaces and links earlier runs left (their creating pid is gone)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = (line.split() or [""])[0]
        if ns.startswith(PREFIX) and _stale(ns):
            _kill_all(ns)
            _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX) and _stale(name):
            _ip("link", "del", name, check=False)


def enter(ns: str) -> None:
    """Move the calling thread (only it: Linux keeps a network namespace per thread) into
    ``ns``; sockets it makes then live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(_NETNS_DIR / ns, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in(ns: str, fn: Callable[[], Any], timeout_s: float = _STEP_TIMEOUT_S) -> Any:
    """``fn()`` on a thread inside ``ns``: its result, or its exception raised here."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            enter(ns)
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"a call in namespace {ns} took over {timeout_s} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


@dataclass(frozen=True)
class Host:
    """One namespace: its name, address and the host side of its veth."""

    name: str
    ns: str
    ip: str
    veth: str


class Hosts:
    """The bridge, the hosts on it, and the processes started in them."""

    def __init__(self) -> None:
        clean_stale()
        self.tag = f"{PREFIX}{os.getpid():x}"
        self.subnet = f"10.231.{1 + os.getpid() % 250}"
        self.bridge = f"{self.tag}-br"
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))  # short: Ray's Unix sockets
        self.hosts: dict[str, Host] = {}
        self._closed = False
        atexit.register(self.close)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        """A new host on the bridge, with the next address."""
        i = len(self.hosts) + 1
        h = Host(name, f"{self.tag}-{name}", f"{self.subnet}.{i}", f"{self.tag}-v{i}")
        self.hosts[name] = h
        _ip("netns", "add", h.ns)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
        _ip("link", "set", h.veth, "master", self.bridge, "up")
        _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _ip("-n", h.ns, "link", "set", "eth0", "up")
        _ip("-n", h.ns, "link", "set", "lo", "up")
        return h

    def unused_ip(self) -> str:
        """An address on the bridge's subnet that no host has."""
        return f"{self.subnet}.200"

    def env(self) -> dict[str, str]:
        """The hosts' processes' environment: this one's without the loopback settings a local
        cluster in this process may have put there (they would refuse every worker's join)."""
        inherited = {k: v for k, v in os.environ.items() if k not in raycompat.LOOPBACK_ENV}
        return {**inherited, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(self.root), "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_enable_autoscaler_v2": "1", "TMPDIR": str(self.root)}

    def run(self, h: Host, args: list[str], timeout_s: float = _STEP_TIMEOUT_S) -> str:
        r = subprocess.run(["ip", "netns", "exec", h.ns, *args], env=self.env(), capture_output=True, text=True,
                           timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:3])} on {h.name} exited {r.returncode}: {r.stderr[-2000:]}")
        return r.stdout

    def spawn(self, h: Host, args: list[str]) -> subprocess.Popen:
        with open(self.root / f"{h.name}.log", "ab") as log:
            return subprocess.Popen(["ip", "netns", "exec", h.ns, *args], env=self.env(),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    def _ray(self, h: Host, *args: str) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        self.run(h, [ray, "start", "--node-ip-address", h.ip, "--object-store-memory", str(80 << 20),
                     "--temp-dir", str(self.root / h.name), "--disable-usage-stats", *args])

    def ray_head(self, h: Host) -> str:
        """Start a Ray head on ``h`` (no CPUs: only control actors land there); its address."""
        self._ray(h, "--head", "--port", str(RAY_PORT), "--num-cpus", "0", "--include-dashboard", "false",
                  "--resources", json.dumps({"splitserve_head": 1}),
                  "--system-config", json.dumps(raycompat.FAST_HEALTH_CHECKS))
        return f"{h.ip}:{RAY_PORT}"

    def ray_worker(self, h: Host, head: str, labels: Mapping[str, str]) -> None:
        """Join ``h`` to the Ray cluster at ``head`` as a serving node, as a user does."""
        self._ray(h, "--address", head, "--num-cpus", "1",
                  "--resources", json.dumps({raycompat.NODE_RESOURCE: 1}), "--labels", json.dumps(dict(labels)))

    def cut(self, h: Host) -> None:
        """The host's link goes down: its processes live on, and nothing reaches them or comes
        back (no FIN, no RST: peers learn it from timeouts)."""
        _ip("link", "set", h.veth, "down")

    def kill(self, h: Host) -> None:
        """The host dies: every process on it gets SIGKILL at once."""
        _kill_all(h.ns)

    def close(self) -> None:
        """Everything this object made, whatever state it is in (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            with contextlib.suppress(Exception):
                _kill_all(h.ns)
        for h in self.hosts.values():
            _ip("link", "del", h.veth, check=False)
            _ip("netns", "del", h.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this run is still there (namespaces, links, processes, the temp dir): none after ``close``."""
        names = [(line.split() or [""])[0] for line in _ip("netns", "list", check=False).stdout.splitlines()]
        names += [line.split(":")[1].strip().split("@")[0] for line in
                  _ip("-o", "link", "show", check=False).stdout.splitlines() if ":" in line]
        left = [n for n in names if n.startswith(f"{self.tag}-")]
        left += [f"pid {p.pid}" for p in psutil.process_iter() if _mentions(p, str(self.root))]
        return left + ([str(self.root)] if self.root.exists() else [])


def _mentions(p: psutil.Process, text: str) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(text in arg for arg in p.cmdline())
    return False


class Driver:
    """The Ray driver on the head's host (``splitserve.bench.netns_driver``): it puts the
    splitserve actors on the cluster at ``address``, then answers status and gateway-stats
    asks; ``close`` stops the actors."""

    def __init__(self, hosts: Hosts, head: Host, address: str, nodes: int, token: str, cache_dir: str,
                 timeout_s: float = 120.0, models: tuple[str, ...] = ("lenet",)) -> None:
        self.proc = hosts.spawn(head, [sys.executable, "-m", "splitserve.bench.netns_driver", address, head.ip,
                                       str(nodes), token, cache_dir, ",".join(models)])
        try:
            ports = self._line(timeout_s)
        except BaseException:
            self.close()
            raise
        self.gateway_port: int = ports["gateway_port"]
        self.http_port: int = ports["http_port"]

    def _line(self, timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the driver said nothing within {timeout_s:g} s (exit {self.proc.poll()})")
        return json.loads(line)

    def ask(self, what: str, timeout_s: float = 90.0) -> dict[str, Any]:
        """``status`` (the controller's) or ``gateway`` (the gateway's stats)."""
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._line(timeout_s)

    def nodes(self, state: str | None = None) -> dict[str, dict]:
        """The controller's nodes by id (only those in ``state``, if given)."""
        return {n["node"]: n for n in self.ask("status")["nodes"] if state is None or n["state"] == state}

    def wait_active(self, count: int, timeout_s: float) -> dict[str, dict]:
        """Block until ``count`` nodes serve; returns them."""
        deadline = time.monotonic() + timeout_s
        while len(active := self.nodes("active")) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} nodes were not serving within {timeout_s:g} s: {self.nodes()}")
            time.sleep(0.5)
        return active

    def close(self) -> None:
        """Stop the splitserve actors (the driver does on its stdin's end), then the driver."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
