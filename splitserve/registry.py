"""The model registry: models, versions, function ids and configs in one SQLite file, and
the model repository (a directory per model) on disk. Both survive restarts.

Function ids are assigned once per model name and never reused for another name, so a
client that cached a func_id keeps talking to the same model across server restarts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.errors import InvalidInput, UnknownModel
from splitserve.modelconfig import ModelConfig, check_model_name

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name     TEXT PRIMARY KEY,
    func_id  INTEGER UNIQUE NOT NULL,
    version  INTEGER NOT NULL,
    source   TEXT NOT NULL,          -- builtin | repository | registered
    path     TEXT,                   -- the model's directory (NULL for builtin zoo models)
    config   TEXT NOT NULL,          -- ModelConfig as JSON
    created  REAL NOT NULL,
    updated  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS func_ids (name TEXT PRIMARY KEY, func_id INTEGER UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS profiles (
    model    TEXT NOT NULL,
    machine  TEXT NOT NULL,
    kind     TEXT NOT NULL,          -- latency | segments | memory | footprint | colocation | fbr
    data     TEXT NOT NULL,
    created  REAL NOT NULL,
    PRIMARY KEY (model, machine, kind)
);
"""


@dataclass(frozen=True)
class ModelRecord:
    """A registered model as the registry stores it."""

    name: str
    func_id: int
    version: int
    source: str
    path: Path | None
    config: ModelConfig


def builtin_configs(device: str = "cpu") -> list[ModelConfig]:
    """A config for every built-in zoo architecture, on ``device``: the built-in model repository."""
    from splitserve.models.catalog import ZOO

    return [
        ModelConfig.from_dict({"name": name, "device": device, "artifact": {"kind": "zoo", "arch": name}})
        for name in sorted(ZOO) if ZOO[name].builtin
    ]


def read_model_dir(path: Path) -> ModelConfig:
    """Read ``path/config.toml``; the directory name must equal the model name."""
    cfg_file = path / "config.toml"
    if not cfg_file.is_file():
        raise InvalidInput(f"{path} has no config.toml")
    cfg = ModelConfig.from_toml(cfg_file.read_text())
    if cfg.name != path.name:
        raise InvalidInput(f"{cfg_file}: name {cfg.name!r} differs from its directory {path.name!r}")
    if cfg.artifact.file and not (path / cfg.artifact.file).is_file():
        raise InvalidInput(f"{path}: artifact file {cfg.artifact.file!r} is missing")
    return cfg


def private_dir(path: Path) -> Path:
    """Create the data directory 0700, or tighten an existing one: it holds the token, the
    uploaded weights and the fast path's Unix socket, none of which other users should reach."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("data directory %s had mode %o; setting 0700", path, mode)
        os.chmod(path, 0o700)
    return path


class Registry:
    """SQLite-backed registry plus the data directory's model repository.

    Methods are synchronous and thread-safe; the server calls them off its event loop.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.repository = data_dir / "repository"
        self.repository.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "registry.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- models -----------------------------------------------------------------------

    def _func_id(self, name: str) -> int:
        row = self._db.execute("SELECT func_id FROM func_ids WHERE name=?", (name,)).fetchone()
        if row:
            return int(row[0])
        fid = int(self._db.execute("SELECT COALESCE(MAX(func_id), 0) + 1 FROM func_ids").fetchone()[0])
        if fid > 0xFFFF:
            raise InvalidInput("no function ids left (65535 models registered)")
        self._db.execute("INSERT INTO func_ids(name, func_id) VALUES (?, ?)", (name, fid))
        return fid

    def upsert(self, config: ModelConfig, source: str, path: Path | None) -> ModelRecord:
        """Add or replace a model; keeps its func_id, bumps nothing else implicitly."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                fid = self._func_id(config.name)
                self._db.execute(
                    "INSERT INTO models(name, func_id, version, source, path, config, created, updated)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(name) DO UPDATE SET version=excluded.version, source=excluded.source,"
                    " path=excluded.path, config=excluded.config, updated=excluded.updated",
                    (config.name, fid, config.version, source, str(path) if path else None,
                     json.dumps(config.to_dict()), now, now),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return ModelRecord(config.name, fid, config.version, source, path, config)

    def sync(self, extra_repository: Path | None = None, zoo_device: str = "cpu") -> list[ModelRecord]:
        """Bring the registry in line with the built-in zoo (on ``zoo_device``) and the
        repositories on disk."""
        for cfg in builtin_configs(zoo_device):
            existing = self.find(cfg.name)
            if existing is None or existing.source == "builtin":
                self.upsert(cfg, "builtin", None)
        for repo, source in ((extra_repository, "repository"), (self.repository, "registered")):
            if repo is None or not repo.is_dir():
                continue
            for d in sorted(p for p in repo.iterdir() if p.is_dir()):
                try:
                    self.upsert(read_model_dir(d), source, d)
                except InvalidInput as e:
                    log.warning("skipping model directory %s: %s", d, e)
        return self.list()

    def _row(self, row: tuple[Any, ...]) -> ModelRecord:
        name, fid, version, source, path, config = row
        return ModelRecord(name, fid, version, source, Path(path) if path else None,
                           ModelConfig.from_dict(json.loads(config)))

    def find(self, name: str) -> ModelRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT name, func_id, version, source, path, config FROM models WHERE name=?", (name,)
            ).fetchone()
        return self._row(row) if row else None

    def get(self, name: str) -> ModelRecord:
        rec = self.find(name)
        if rec is None:
            raise UnknownModel(f"unknown model {name!r}")
        return rec

    def list(self) -> list[ModelRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT name, func_id, version, source, path, config FROM models ORDER BY func_id"
            ).fetchall()
        return [self._row(r) for r in rows]

    def remove(self, name: str) -> None:
        """Forget a registered model and delete its repository directory (func_id is kept)."""
        rec = self.get(name)
        with self._lock:
            self._db.execute("DELETE FROM models WHERE name=?", (name,))
        if rec.source == "registered" and rec.path and rec.path.parent == self.repository:
            shutil.rmtree(rec.path, ignore_errors=True)

    def model_dir(self, name: str) -> Path:
        """Where a registered model's files live (validated name, so no traversal)."""
        return self.repository / check_model_name(name)

    # -- profiles (Packrat, REEF padding and PROTEAN read the same stored profile) ----------

    def save_profile(self, model: str, machine: str, kind: str, data: Any) -> None:
        """Store ``data`` (a JSON value: an object, or a list for ``colocation``) as the
        ``kind`` profile of ``model`` on ``machine``, replacing the one stored before."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO profiles(model, machine, kind, data, created) VALUES (?, ?, ?, ?, ?)",
                (model, machine, kind, json.dumps(data), time.time()),
            )

    def load_profile(self, model: str, machine: str, kind: str) -> Any:
        with self._lock:
            row = self._db.execute(
                "SELECT data FROM profiles WHERE model=? AND machine=? AND kind=?", (model, machine, kind)
            ).fetchone()
        return json.loads(row[0]) if row else None
