"""What the cluster controller keeps on disk so that a restarted controller finds it again.

The controller is a detached, named actor that Ray restarts when its process dies
(``max_restarts=-1``); a restart runs its constructor again with nothing in memory. What
Ray itself cannot give back lives here, in one SQLite file in the head's Ray session
directory (the session is the cluster's life: a new ``cluster up`` is a new session):

- the cluster's models (name, cluster func id, the spec a node registers), written before a
  registration reaches any node and removed if it is rolled back;
- the bill (``CostLedger.to_state``) and procurement's counters, written when they changed,
  once per reconcile round;
- the settings ``configure`` changed at run time (the actor's constructor gets the ones the
  cluster started with);
- a generation, one more for every controller that opens the store: routing-table versions
  start at ``generation << 32``, so the gateway takes a restarted controller's first table
  as newer than anything the one before it published.

The node table, the markets and the launches in flight are not stored: the provider and
Ray's named actors know them (``Controller._recover``). The node registry
(``splitserve.registry.Registry``) does not fit here: it syncs the built-in zoo, keeps
artifacts as files in a repository directory and assigns a node's own func ids, while the
cluster needs each spec exactly as registered, to send it to nodes that join later.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from splitserve.cluster.gateway.modelspec import ModelSpec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name     TEXT PRIMARY KEY,
    func_id  INTEGER UNIQUE NOT NULL,
    config   TEXT,                   -- NULL: built in on every node
    artifact BLOB,
    labels   TEXT
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

STORE_FILE = "splitserve-controller.sqlite3"


class ControllerStore:
    """The controller's models, bill, counters, settings and generation in one SQLite file (``:memory:`` for tests
    that do not restart). Calls are short and synchronous; the lock makes them safe from
    the threads ``asyncio.to_thread`` uses."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.executescript(_SCHEMA)

    def next_generation(self) -> int:
        """Count one more controller on this store and return its number (1 for the first)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
            generation = (int(row[0]) if row else 0) + 1
            self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('generation', ?)", (str(generation),))
        return generation

    def models(self) -> list[tuple[str, int, ModelSpec | None]]:
        """Every stored model, by func id: (name, func id, spec; None for a built-in one)."""
        with self._lock:
            rows = self._db.execute("SELECT name, func_id, config, artifact, labels FROM models ORDER BY func_id")
            return [(name, int(fid), None if config is None else ModelSpec(name, config, artifact, labels))
                    for name, fid, config, artifact, labels in rows.fetchall()]

    def add_model(self, name: str, func_id: int, spec: ModelSpec | None) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO models(name, func_id, config, artifact, labels)"
                             " VALUES (?, ?, ?, ?, ?)", (name, func_id, None if spec is None else spec.config_toml,
                              None if spec is None else spec.artifact, None if spec is None else spec.labels))
            if func_id > self._last_func_id():
                self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('last_func_id', ?)", (str(func_id),))

    def last_func_id(self) -> int:
        """The highest func id ever stored, unregistered models' included: a restarted
        controller never gives one twice (a client holding it must not reach another model)."""
        with self._lock:
            return self._last_func_id()

    def _last_func_id(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key='last_func_id'").fetchone()
        return int(row[0]) if row else 0

    def remove_model(self, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM models WHERE name=?", (name,))

    def save_bill(self, state: dict) -> None:
        self._save_json("bill", state)

    def bill(self) -> dict | None:
        """The bill as last saved (None: none yet)."""
        return self._json("bill")

    def save_counters(self, counters: dict[str, int]) -> None:
        self._save_json("counters", counters)

    def counters(self) -> dict[str, int]:
        """Procurement's counters as last saved (empty: none yet)."""
        return self._json("counters") or {}

    def save_placement(self, counts: dict) -> None:
        self._save_json("placement", counts)

    def placement(self) -> dict:
        """Placement's counts by model as last saved (empty: none yet)."""
        return self._json("placement") or {}

    def save_settings(self, settings: dict) -> None:
        self._save_json("settings", settings)

    def settings(self) -> dict:
        """The settings ``configure`` last took, as plain values (empty: none)."""
        return self._json("settings") or {}

    def _save_json(self, key: str, value: dict) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def _json(self, key: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def clear(self) -> None:
        """Forget the models, the bill, the counters, placement's counts and the settings
        (``cluster down``: the cluster is gone); the generation stays, so versions keep rising
        on this Ray session."""
        with self._lock:
            self._db.execute("DELETE FROM models")
            self._db.execute("DELETE FROM meta WHERE key IN ('bill', 'counters', 'placement', 'settings')")

    def close(self) -> None:
        with self._lock:
            self._db.close()
