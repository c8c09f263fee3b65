"""Shared fixtures: real server processes on free loopback ports, stopped after use."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from splitserve.launcher import ServerProcess
from tests.helpers import CACHE, ROOT, start_server

# Hypothesis caches what it learns from the source even with database=None; keep that out of
# the work tree (the property tests set derandomize=True and database=None themselves).
set_hypothesis_home_dir(ROOT / ".pytest_cache" / "hypothesis")
# No spare worker processes in the servers the tests start, the benchmarks' own included: a
# spare costs a process importing torch per server (seconds of CPU each on 2 cores), and the
# tests that are about spares ask for them (``spare_workers=1``, or an ``env`` of their own).
os.environ.setdefault("SPLITSERVE_SPARE_WORKERS", "0")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def shared_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers a benchmark starts for itself keep their weights in ``CACHE`` (through
    ``SPLITSERVE_CACHE_DIR``): drawn once for the suite, not once per server."""
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(CACHE))


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    started: list[ServerProcess] = []

    def make(*args: str, data_dir: Path | None = None, **kw: Any) -> ServerProcess:
        s = start_server(data_dir or tmp_path / "data", *args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
