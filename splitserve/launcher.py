"""Start a splitserve server in a child process on free loopback ports, and stop it.

``start_server`` runs ``python -m splitserve serve`` with every port set to 0 (any free port),
waits until the server wrote ``server.json`` (it does so once the models named with ``--load``
are ready) and returns a ``ServerProcess`` that knows the URL of every transport it opened;
``ServerProcess.stop`` (or leaving its ``with`` block) stops it. The test suite's fixtures and
the benchmark scenarios share this one helper; it needs nothing beyond the standard library,
so neither the server nor the tests depend on the ``bench`` extra for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# server.json key -> (transport scheme, URL template)
_URL_KEYS: dict[str, tuple[str, str]] = {
    "fast_port": ("tcp", "tcp://{host}:{value}"),
    "unix_path": ("unix", "unix://{value}"),
    "udp_port": ("udp", "udp://{host}:{value}"),
    "http_port": ("http", "http://{host}:{value}"),
    "grpc_port": ("grpc", "grpc://{host}:{value}"),
}


def stop_process(proc: subprocess.Popen, grace_s: float, *, terminate: bool = True) -> int:
    """Stop a child process and reap it; its exit code.

    SIGTERM (unless ``terminate`` is false: the caller has already asked the child to exit, e.g.
    by closing its stdin), then up to ``grace_s`` seconds for it to exit on its own, then
    SIGKILL. A child that has already exited is only reaped. Always waits for the child, so no
    zombie is left behind.
    """
    if proc.poll() is None:
        if terminate:
            proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def urls_from_info(info: dict[str, Any]) -> dict[str, str]:
    """The URL of every transport a ``server.json`` advertises, by scheme (tcp, unix, ...)."""
    host = info.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    out: dict[str, str] = {}
    for key, (scheme, template) in _URL_KEYS.items():
        value = info.get(key)
        if value not in (None, ""):
            out[scheme] = template.format(host=host, value=value)
    return out


@dataclass
class ServerProcess:
    """A running server child: its process, data directory, ``server.json`` and log file."""

    proc: subprocess.Popen
    data_dir: Path
    info: dict
    log: Path

    # One URL per front end; the server was started on loopback, so they name 127.0.0.1.
    @property
    def tcp(self) -> str:
        return f"tcp://127.0.0.1:{self.info['fast_port']}"

    @property
    def udp(self) -> str:
        return f"udp://127.0.0.1:{self.info['udp_port']}"

    @property
    def unix(self) -> str:
        return f"unix://{self.info['unix_path']}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    @property
    def grpc(self) -> str:
        return f"grpc://127.0.0.1:{self.info['grpc_port']}"

    @property
    def urls(self) -> dict[str, str]:
        """Every transport this server opened, by scheme; front ends that are off are absent."""
        return urls_from_info(self.info)

    @property
    def info_file(self) -> Path:
        return self.data_dir / "server.json"

    def settle(self, timeout: float) -> None:
        """Wait until the server is done starting: no model loading and no spare worker still
        importing torch (it takes a core for a second or two, and calls timed meanwhile
        measure that). Needs its HTTP front end."""
        end = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(f"{self.http}/v2/memory", timeout=timeout) as r:  # loopback, our own server
                memory = json.loads(r.read())
            if not memory["loading"] and not memory["spares_starting"]:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"the server was still starting after {timeout:.0f} s: loading "
                                   f"{memory['loading']}, {memory['spares_starting']} spare worker(s) starting")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout`` s for a clean stop, then kill; the exit code."""
        return stop_process(self.proc, timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    data_dir: Path,
    *args: str,
    http: bool = False,
    grpc: bool = False,
    timeout: float = 180.0,
    cache_dir: Path | None = None,
    cwd: Path | None = None,
    log_level: str = "INFO",
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start ``splitserve serve`` on free ports and wait until it wrote ``server.json``.

    ``args`` are passed on (``--load MODEL``, ``--repository DIR``...). HTTP and gRPC are off
    unless asked for. ``cache_dir`` (trained weights) becomes ``SPLITSERVE_CACHE_DIR``. Output
    goes to ``data_dir/server.log``; a server that exits or does not come up in ``timeout`` s
    raises RuntimeError with the end of that log.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    info_file = data_dir / "server.json"
    info_file.unlink(missing_ok=True)
    log = data_dir / "server.log"
    cmd = [sys.executable, "-m", "splitserve", "serve", "--fast-port", "0", "--udp-port", "0",
           "--http-port", "0" if http else "-1", "--grpc-port", "0" if grpc else "-1",
           "--data-dir", str(data_dir), "--log-level", log_level, *args]
    child_env = dict(os.environ if env is None else env)
    if cache_dir is not None:
        child_env["SPLITSERVE_CACHE_DIR"] = str(cache_dir)
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=child_env)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        if info_file.exists():
            return ServerProcess(proc, data_dir, json.loads(info_file.read_text()), log)
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"server did not start in {timeout}s:\n{log.read_text(errors='replace')[-4000:]}")
