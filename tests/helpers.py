"""Paths and a server launcher the tests share (conftest.py keeps only fixtures and hooks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitserve import launcher
from splitserve.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
# Trained weights (digits) are shared by every server the tests start.
CACHE = ROOT / ".pytest_cache" / "splitserve-cache"

__all__ = ["CACHE", "ROOT", "ServerProcess", "start_server"]


def start_server(data_dir: Path, *args: str, **kw: Any) -> ServerProcess:
    """``launcher.start_server`` with the tests' shared weight cache and working directory."""
    kw.setdefault("cache_dir", CACHE)
    kw.setdefault("cwd", ROOT)
    return launcher.start_server(data_dir, *args, **kw)
