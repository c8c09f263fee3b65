"""``splitserve models``: list a node's (or a gateway's) models, register, load, unload,
evict and scale them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from splitserve.cli.common import DATA_DIR_HELP, console, size_text
from splitserve.config import default_data_dir
from splitserve.types import TensorSpec


models_app = typer.Typer(add_completion=False, help="List, register, load, unload and scale models.")

_URL = typer.Option("http://127.0.0.1:8000", help="The server's HTTP URL.")
_TOKEN = typer.Option(None, envvar="SPLITSERVE_TOKEN",
                      help="Management token (default: read DATA_DIR/token).")
_STATE_URL = typer.Option(None, "--url", help="A running server's (or a cluster gateway's) HTTP URL: list the models "
                                              "that server has (its repository index), each with its state (ready, "
                                              "loading, evicted, unloaded, failed; a gateway: ready or unavailable), "
                                              "shapes from its metadata, and residency (RESIDENT, LOADING, EVICTED, "
                                              "FAILED, UNLOADED) and bytes where it serves /v2/memory (a gateway does "
                                              "not). Default: the data directory's registry, with the state of the "
                                              "server running on it, if any.")
_WIDE = typer.Option(False, "--wide", help="Every field (func_id, tensor names, batch, instances, source), "
                                           "not the 80-column summary; with --url, what the server says (instances "
                                           "and source are not among it: '-'), and a gateway's reason (on how "
                                           "many nodes a model is served).")
_JSON = typer.Option(False, "--json", help="Print JSON instead of a table: each model's config.toml with its "
                                           "func_id and state; with --url, each model's index entry, state, "
                                           "residency and bytes, and the server's v2 metadata for it.")


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One model as ``models`` lists it: from the local registry (``ModelRow.of``) or from a
    server's repository index, metadata and memory (``_remote_rows``). None: not known."""

    name: str
    version: str
    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None
    func_id: int | None = None
    max_batch: int | None = None
    instances: str | None = None  # "instances x threads"
    source: str | None = None
    state: str | None = None  # None for every row: no server answered, so no state columns
    residency: str | None = None
    reason: str | None = None
    bytes: int | None = None

    @classmethod
    def of(cls, rec: Any, live: Mapping[str, Any] | None) -> "ModelRow":
        """A registry record, with its state on a running server (``_live``'s entry) if any."""
        c, m = rec.config, live or {}
        return cls(rec.name, str(rec.version), tuple(c.inputs), tuple(c.outputs), rec.func_id, c.max_batch_size,
                   f"{c.instances} x {c.threads}", rec.source, m.get("state"), m.get("residency"),
                   m.get("reason"), m.get("bytes"))


def short_shapes(specs: Sequence[TensorSpec] | None) -> str:
    """Tensors as ``DTYPE[dims]``, runs of equal ones counted: ``3×INT32[512]``; ``?`` unknown."""
    if specs is None:
        return "?"
    runs: list[list[Any]] = []
    for t in specs:
        text = f"{t.datatype}[{','.join(map(str, t.shape))}]"
        if runs and runs[-1][1] == text:
            runs[-1][0] += 1
        else:
            runs.append([1, text])
    return ", ".join(f"{n}×{text}" if n > 1 else text for n, text in runs)


def _named_shapes(specs: Sequence[TensorSpec] | None) -> str:
    return "?" if specs is None else ", ".join(f"{s.name} {s.datatype}{list(s.shape)}" for s in specs)


def _known(value: Any) -> str:
    return "-" if value is None else str(value)


def models_table(rows: Sequence[ModelRow], wide: bool) -> Table:
    """The ``models`` table: compact (name, residency, version, bytes, short shapes; fits 80
    columns for the built-in models) or ``wide`` (every field, full tensor names). The state
    columns are there when a server said how its models are (some row has a state)."""
    live = any(r.state is not None for r in rows)
    if not wide:
        cols = ["state", "bytes"] if live else []
        t = Table("name", *cols[:1], "ver", *cols[1:], "inputs → outputs")
        for r in rows:
            shown = [r.residency or r.state or "?", size_text(r.bytes)] if live else []
            t.add_row(r.name, *shown[:1], r.version, *shown[1:],
                      f"{short_shapes(r.inputs)} → {short_shapes(r.outputs)}")
        return t
    cols = ["state", "residency", "bytes"] if live else []
    t = Table()
    for header in ("func_id", "name", "version", "inputs", "outputs", "max batch", "instances x threads", "source",
                   *cols):  # in a narrow terminal, wrapped rather than cut short
        t.add_column(header, overflow="fold", no_wrap=header == "name")
    for r in rows:
        residency = " ".join(filter(None, [r.residency, f"({r.reason})" if r.reason else None]))
        t.add_row(_known(r.func_id), r.name, r.version, _named_shapes(r.inputs), _named_shapes(r.outputs),
                  _known(r.max_batch), _known(r.instances), _known(r.source),
                  *([r.state or "?", residency, _known(r.bytes)] if live else []))
    return t


def _server_url(data_dir: Path) -> str | None:
    """The HTTP URL of the server running on ``data_dir`` (its server.json), if any."""
    from splitserve.launcher import urls_from_info

    try:
        info = json.loads((data_dir / "server.json").read_text())
    except (OSError, ValueError):
        return None
    return urls_from_info(info).get("http") if isinstance(info, dict) else None


def _residency(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A model's residency, its reason and bytes from its ``/v2/memory`` entry."""
    return {"residency": entry.get("residency"), "reason": entry.get("reason"),
            "bytes": entry.get("reserved_bytes") or entry.get("weights_bytes", 0)}


def _live(url: str, names: Sequence[str]) -> dict[str, dict[str, Any]] | None:
    """Each model's state, residency and bytes on the server at ``url`` (its metadata and
    ``/v2/memory``); None when it does not answer."""
    import httpx

    from splitserve.client.http import HttpClient
    from splitserve.errors import SplitServeError

    try:
        with HttpClient(url, timeout=_STATE_TIMEOUT_S) as c:
            states = {n: c.metadata(n)["parameters"]["state"] for n in names}
            memory = c.memory()["models"]
    except (SplitServeError, httpx.HTTPError, OSError, KeyError):
        return None
    return {n: {"state": states[n], **_residency(memory.get(n, {}))} for n in names}


def _remote_rows(url: str) -> list[tuple[ModelRow, dict[str, Any] | None]]:
    """The models the server at ``url`` has, node or cluster gateway: its repository index,
    each model's v2 metadata (shapes, func_id, batch; None when it does not describe the
    model now, e.g. a gateway none of whose nodes has yet), and residency where it serves
    ``/v2/memory`` (a gateway does not). Raises what the index call raises."""
    import httpx

    from splitserve.client.http import HttpClient
    from splitserve.errors import SplitServeError

    out: list[tuple[ModelRow, dict[str, Any] | None]] = []
    with HttpClient(url, timeout=_LIST_TIMEOUT_S) as c:
        index = c.index()
        try:
            memory: Mapping[str, Any] | None = c.memory()["models"]
        except (SplitServeError, httpx.HTTPError, KeyError, TypeError):
            memory = None
        for entry in index:
            name = str(entry["name"])
            try:
                info = c.lookup(name)
            except (SplitServeError, httpx.HTTPError, KeyError, TypeError, ValueError):
                info = None
            params = (info.extra.get("parameters") or {}) if info is not None else {}
            # a node's metadata names its own state word; a gateway's index says READY or UNAVAILABLE
            state = params.get("state") or str(entry.get("state") or "?").lower()
            where = _residency(memory[name]) if memory is not None and name in memory else {
                "residency": None, "reason": entry.get("reason") or None, "bytes": None}
            out.append((ModelRow(name, str(entry.get("version") or "?"),
                                 info.inputs if info is not None else None,
                                 info.outputs if info is not None else None,
                                 info.func_id if info is not None else None,
                                 info.max_batch_size if info is not None else None,
                                 state=state, **where),
                        info.extra if info is not None else None))
    return out


_STATE_TIMEOUT_S = 2.0  # how long ``models`` waits for a server's answer before listing without states
_LIST_TIMEOUT_S = 10.0  # how long ``models --url`` waits for each of the server's answers


def _list_models(data_dir: Path | None, as_json: bool, url: str | None, wide: bool) -> None:
    """``models``: the server's models with ``url``, else the data directory's registry."""
    if url:
        _list_remote(url, as_json, wide)
        return
    from splitserve.registry import Registry

    data_dir = data_dir or default_data_dir()
    reg = Registry(data_dir)
    try:
        if not reg.list():
            reg.sync()
        recs = reg.list()
    finally:
        reg.close()
    running = _server_url(data_dir)
    live = _live(running, [r.name for r in recs]) if running else None
    if as_json:
        console.print_json(json.dumps([{"name": r.name, "func_id": r.func_id, **r.config.to_dict(),
                                        **(live[r.name] if live else {})} for r in recs]))
        return
    console.print(models_table([ModelRow.of(r, live[r.name] if live else None) for r in recs], wide))
    if live is None and not wide:
        console.print("(no server answered: start one, or pass --url, to see each model's state; "
                      "--wide shows every field)", style="dim", highlight=False)


def _list_remote(url: str, as_json: bool, wide: bool) -> None:
    import httpx

    from splitserve.errors import SplitServeError

    try:
        rows = _remote_rows(url)
    except (SplitServeError, httpx.HTTPError, OSError) as e:
        console.print(f"[red]error:[/] the server at {url} did not list its models: {e}", highlight=False)
        raise typer.Exit(1) from None
    if as_json:
        console.print_json(json.dumps([
            {"name": r.name, "version": r.version, "state": r.state, "residency": r.residency, "reason": r.reason,
             "bytes": r.bytes, "metadata": meta} for r, meta in rows]))
        return
    console.print(models_table([r for r, _ in rows], wide))


@models_app.callback(invoke_without_command=True)
def models(
    ctx: typer.Context,
    data_dir: Path = typer.Option(None, help=DATA_DIR_HELP),
    as_json: bool = _JSON,
    url: Optional[str] = _STATE_URL,
    wide: bool = _WIDE,
) -> None:
    """List registered models (same as ``splitserve models list``)."""
    if ctx.invoked_subcommand is None:
        _list_models(data_dir, as_json, url, wide)


@models_app.command("list")
def models_list(
    data_dir: Path = typer.Option(None, help=DATA_DIR_HELP),
    as_json: bool = _JSON,
    url: Optional[str] = _STATE_URL,
    wide: bool = _WIDE,
) -> None:
    """List models: name, state, version and shapes (``--wide``: every field); the data
    directory's registry, or with ``--url`` the models that server or cluster gateway has."""
    _list_models(data_dir, as_json, url, wide)


def _management(url: str, token: str | None, data_dir: Path | None) -> "Any":
    from splitserve.client.http import HttpClient

    if not token:
        path = (data_dir or default_data_dir()) / "token"
        try:
            token = path.read_text().strip()
        except OSError:
            raise typer.BadParameter(f"no --token given and {path} cannot be read; pass --token or --data-dir")
    return HttpClient(url, token=token)


def _managed(fn: "Any") -> None:
    from splitserve.errors import SplitServeError

    try:
        fn()
    except SplitServeError as e:
        console.print(f"[red]error:[/] {e.message}", highlight=False)
        raise typer.Exit(1) from None


@models_app.command("register")
def models_register(
    model_dir: Path = typer.Argument(..., help="Directory with config.toml, the artifact and optional labels.txt."),
    url: str = _URL, token: Optional[str] = _TOKEN, data_dir: Path = typer.Option(None, help=DATA_DIR_HELP),
    device: Optional[str] = typer.Option(None, help="Serve it on this device whatever its config.toml says: "
                                                    "cpu, cuda (a GPU per instance) or cuda:N."),
) -> None:
    """Upload a model directory to a running server; returns once the model is loaded."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            r = c.register(model_dir, device=device)
        console.print(f"registered {r['name']} (func_id {r['func_id']}, version {r['version']})", highlight=False)
    _managed(run)


@models_app.command("load")
def models_load(name: str, url: str = _URL, token: Optional[str] = _TOKEN,
                data_dir: Path = typer.Option(None, help=DATA_DIR_HELP)) -> None:
    """Start a model's workers and wait until it is ready."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            c.load(name)
        console.print(f"{name}: ready")
    _managed(run)


@models_app.command("unload")
def models_unload(name: str, url: str = _URL, token: Optional[str] = _TOKEN,
                  data_dir: Path = typer.Option(None, help=DATA_DIR_HELP)) -> None:
    """Stop a model's workers; it refuses requests until loaded again."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            c.unload(name)
        console.print(f"{name}: unloaded")
    _managed(run)


@models_app.command("evict")
def models_evict(name: str, url: str = _URL, token: Optional[str] = _TOKEN,
                 data_dir: Path = typer.Option(None, help=DATA_DIR_HELP)) -> None:
    """Release a model's weights but keep serving it: the next request loads it again."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            r = c.evict(name)
        console.print(f"{name}: {r['state']}" + ("" if r["evicted"] else " (nothing was resident)"), highlight=False)
    _managed(run)


@models_app.command("scale")
def models_scale(name: str, instances: int = typer.Argument(..., help="Worker instances (1..64)."),
                 url: str = _URL, token: Optional[str] = _TOKEN,
                 data_dir: Path = typer.Option(None, help=DATA_DIR_HELP)) -> None:
    """Change a model's instance count without dropping requests."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            r = c.scale(name, instances)
        console.print(f"{name}: {r['instances']} instance(s)")
    _managed(run)
