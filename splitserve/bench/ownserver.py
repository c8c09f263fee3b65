"""Servers a scenario starts itself, with settings of its own (preemption mode, placement,
pinned CPUs), and the HTTP introspection endpoints it reads from them.

``Context.target`` starts one server with default settings; the DISB and Packrat scenarios need
several, one after another, each with its own flags and sometimes a prepared data directory
(stored profiles), so they use ``own_server`` instead. A scenario's ``--url`` cannot stand in
for them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.bench.scenarios.base import Context
    from splitserve.launcher import ServerProcess

EVENT_LIMIT = 100_000  # scheduler events fetched per request (the server keeps 200 000)


@contextmanager
def own_server(ctx: Context, label: str, args: Sequence[str],
               prepare: Callable[[Path], None] | None = None,
               env: Mapping[str, str] | None = None) -> Iterator[ServerProcess]:
    """A server of this scenario's own (HTTP on, for the introspection endpoints), stopped on
    exit with its log kept in the results folder as ``server-<label>.log``.

    ``prepare(data_dir)`` runs before the start, e.g. to store profiles in its registry;
    ``env`` adds ``SPLITSERVE_*`` settings that have no command-line flag.
    """
    from splitserve.launcher import start_server

    if ctx.urls:
        raise ValueError("this scenario starts its own servers with their own settings; it cannot "
                         "measure a running server (--url)")
    data = Path(tempfile.mkdtemp(prefix="splitserve-bench-"))
    try:
        if prepare is not None:
            prepare(data)
        with ctx.task(f"{label}: starting a server", 1):
            server = start_server(data, *args, http=True, timeout=ctx.start_timeout_s, log_level="WARNING",
                                  env={**os.environ, **env} if env else None, cache_dir=ctx.weights_cache())
        ctx.server_info.setdefault("started_by_bench", True)
        ctx.server_info.setdefault("servers", {})[label] = {"args": list(args), "env": dict(env or {}),
                                                            "urls": server.urls}
        try:
            yield server
        finally:
            code = server.stop()
            if code not in (0, None):
                ctx.notes.append(f"the {label} server exited with code {code} when stopped")
            try:
                shutil.copyfile(server.log, ctx.results.path / f"server-{label}.log")
            except OSError:
                pass
    finally:
        shutil.rmtree(data, ignore_errors=True)


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback, our own server
        return json.loads(r.read())


def server_now(http: str) -> float:
    """The server's perf_counter clock now (no events are after 1e18)."""
    return float(get_json(f"{http}/v2/scheduler/events?since=1e18&limit=1")["now"])


def fetch_events(http: str, since: float) -> tuple[list[dict[str, Any]], bool]:
    """The scheduler events after ``since`` and whether the log held more than one page."""
    events = get_json(f"{http}/v2/scheduler/events?since={since!r}&limit={EVENT_LIMIT}")["events"]
    return events, len(events) >= EVENT_LIMIT
