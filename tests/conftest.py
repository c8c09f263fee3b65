"""Shared fixtures: real server processes on free loopback ports, stopped after use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Trained weights (digits) are shared by every server the tests start.
CACHE = ROOT / ".pytest_cache" / "splitserve-cache"


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    data_dir: Path
    info: dict
    log: Path

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

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(data_dir: Path, *args: str, http: bool = False, grpc: bool = False,
                 timeout: float = 180.0) -> ServerProcess:
    """Start ``splitserve serve`` on free ports and wait until it wrote server.json."""
    data_dir.mkdir(parents=True, exist_ok=True)
    info_file = data_dir / "server.json"
    info_file.unlink(missing_ok=True)
    log = data_dir / "server.log"
    cmd = [sys.executable, "-m", "splitserve", "serve", "--fast-port", "0", "--udp-port", "0",
           "--http-port", "0" if http else "-1", "--grpc-port", "0" if grpc else "-1",
           "--data-dir", str(data_dir), "--log-level", "INFO", *args]
    env = dict(os.environ, SPLITSERVE_CACHE_DIR=str(CACHE))
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if info_file.exists():
            return ServerProcess(proc, data_dir, json.loads(info_file.read_text()), log)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    started: list[ServerProcess] = []

    def make(*args: str, data_dir: Path | None = None, **kw: bool) -> ServerProcess:
        s = start_server(data_dir or tmp_path / "data", *args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
