"""The peers ``bench peers`` compares splitserve with: Triton (via PyTriton) and Ray Serve.

Each peer runs from an environment of its own, built once in a cache folder (a venv without
system site packages: the peers' pins, protobuf's and ray's, never meet splitserve's), as a
child process running a small server script (``triton_server.py``, ``ray_server.py``) that
imports torch and the peer, never splitserve. The models reach it as ``torch.export``
programs of splitserve's zoo models, so every server computes the same function with the
same weights; the scenario checks that their answers agree before timing.

``env_commands`` and ``PEERS`` are pure; ``build_env`` and ``PeerServer`` do the I/O. A peer
that cannot be built or started raises ``PeerUnavailable`` with the reason, and the scenario
reports it and goes on with the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
STAMP = ".splitserve-peer.json"  # in a built venv: the commands that built it


class PeerUnavailable(Exception):
    """A peer cannot be measured here; the message says why."""


@dataclass(frozen=True)
class Peer:
    """A peer server: its packages, its script and the front ends it opens (client kind per port)."""

    name: str
    label: str
    packages: tuple[str, ...]
    script: str
    ports: tuple[str, ...]  # the script's port arguments, in order
    front_ends: tuple[tuple[str, str, str], ...]  # (front end, client kind, port name)


PEERS: dict[str, Peer] = {
    "triton": Peer("triton", "Triton (PyTriton)", ("nvidia-pytriton",), "triton_server.py",
                   ("http", "grpc", "metrics"),
                   (("http", "tritonclient-http", "http"), ("grpc", "tritonclient-grpc", "grpc"))),
    "ray": Peer("ray", "Ray Serve", ("ray[serve]",), "ray_server.py", ("http",),
                (("http", "httpx-raw", "http"),)),
}


def env_commands(peer: Peer, python: str, venv: Path, torch_spec: str) -> list[list[str]]:
    """The command lines that build ``peer``'s environment in ``venv`` from ``python``."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    return [[python, "-m", "venv", "--clear", str(venv)],
            pip + ["--upgrade", "pip"],
            pip + [*peer.packages, torch_spec, "numpy"]]


def build_env(peer: Peer, python: str, cache: Path, torch_spec: str, timeout_s: float, log: Path) -> Path:
    """The Python of ``peer``'s environment under ``cache``, built now unless built before by
    the same commands. Their output goes to ``log``; a failure raises ``PeerUnavailable``."""
    venv = cache / peer.name
    commands = env_commands(peer, python, venv, torch_spec)
    stamp = venv / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == commands:
        return venv / "bin" / "python"
    if not Path(python).is_file():
        raise PeerUnavailable(f"no Python at {python} to build its environment from")
    deadline = time.monotonic() + timeout_s
    with log.open("ab") as out:
        for cmd in commands:
            out.write(("$ " + " ".join(cmd) + "\n").encode())
            out.flush()
            try:
                code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, deadline - time.monotonic())).returncode
            except subprocess.TimeoutExpired:
                raise PeerUnavailable(f"building its environment took over {timeout_s:.0f} s "
                                      f"(see {log.name})") from None
            if code != 0:
                raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` failed with exit code {code} "
                                      f"(no network, or no wheel for this system? see {log.name})")
    stamp.write_text(json.dumps(commands))
    return venv / "bin" / "python"


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now (the peer binds them a moment later)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of a log, for a reason in the report."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class PeerServer:
    """A peer's server script, running from its environment in a session of its own."""

    def __init__(self, peer: Peer, python: Path, manifest: Path, workdir: Path, log: Path) -> None:
        self.peer = peer
        self.log = log
        self.ready = workdir / f"{peer.name}.ready"
        self.ready.unlink(missing_ok=True)
        self.ports = dict(zip(peer.ports, free_ports(len(peer.ports))))
        cmd = [str(python), str(HERE / peer.script), str(manifest), str(self.ready),
               *(str(self.ports[p]) for p in peer.ports)]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        with log.open("ab") as out:
            # a session of its own: stop() signals the peer's whole process group (ray's workers too)
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=workdir, env=env, start_new_session=True)

    def urls(self) -> dict[str, tuple[str, str]]:
        """Front end -> (client kind, URL)."""
        return {fe: (kind, f"http://127.0.0.1:{self.ports[port]}") for fe, kind, port in self.peer.front_ends}

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the script says its models are served; ``PeerUnavailable`` if it exits or
        takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.is_file():
            code = self.proc.poll()
            if code is not None:
                raise PeerUnavailable(f"its server exited with code {code} while starting: {tail(self.log)}")
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"its server was not ready after {timeout_s:.0f} s: {tail(self.log)}")
            time.sleep(0.2)  # polling a child's file, not synchronising a test

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the script (it shuts its peer down), then SIGKILL to whatever of its
        process group is left (ray's workers, Triton's stubs); the script's exit code."""
        self.proc.terminate()
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group we created for it, by its id
        return code if code is not None else self.proc.wait(10.0)


def export_models(models: Sequence[str], folder: Path, threads: int, seed: int = 0) -> Path:
    """Export each zoo model (seeded weights; any batch size up to its max) with ``torch.export``
    to ``folder/<model>.pt2``; write and return the manifest the peers' scripts read."""
    import numpy as np
    import torch

    from splitserve.bench.validate import reference_model
    from splitserve.models.catalog import zoo_entry

    folder.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    for name in models:
        entry = zoo_entry(name)
        example = tuple(torch.from_numpy(np.zeros((2, *s.shape), s.dtype)) for s in entry.inputs)
        batch = torch.export.Dim("batch", min=1, max=entry.max_batch)
        with torch.no_grad():
            # the zoo's forward takes *inputs: one spec per input, inside that tuple
            program = torch.export.export(reference_model(name, seed).eval(), example,
                                          dynamic_shapes=(tuple({0: batch} for _ in example),))
        path = folder / f"{name}.pt2"
        torch.export.save(program, path)
        entries.append({"name": name, "path": str(path), "max_batch": entry.max_batch,
                        "inputs": [s.to_dict() for s in entry.inputs],
                        "outputs": [s.to_dict() for s in entry.outputs]})
    manifest = folder / "models.json"
    manifest.write_text(json.dumps({"models": entries, "threads": threads}, indent=1))
    return manifest


def default_cache() -> Path:
    """Where the peers' environments live between runs (the scenario's ``cache_dir`` moves it)."""
    return Path.home() / ".cache" / "splitserve" / "bench-peers"


def default_python() -> str:
    """The interpreter the peers' environments are built from: Debian's system Python 3.11,
    whose libpython PyTriton's ``tritonserver`` binary links against, where it exists."""
    system = Path("/usr/bin/python3.11")
    return str(system) if system.is_file() else sys.executable


__all__ = ["PEERS", "Peer", "PeerServer", "PeerUnavailable", "build_env", "default_cache", "default_python",
           "env_commands", "export_models", "free_ports"]
