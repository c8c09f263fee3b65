"""``splitserve`` command line: serve | infer | models | profile | plan | gpus, and bench with the ``bench`` extra."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from splitserve.config import ServerConfig, default_data_dir, parse_bytes
from splitserve.placement.packrat import PlacementKind
from splitserve.placement.partition import Partitioning, StrictPlacement
from splitserve.scheduler.model_scheduler import ClassOrder, RtPolicy
from splitserve.scheduler.priority import PriorityMode
from splitserve.types import TensorSpec

if TYPE_CHECKING:
    from splitserve.placement.gpus import MigDriver
    from splitserve.placement.mig import GpuListing


class _Commands(TyperGroup):
    """The top-level commands, with ``bench`` and ``cluster`` imported only when named or
    listed: the server and the other commands never import them, and they work in an install
    without the ``bench`` or ``cluster`` extra."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return [*super().list_commands(ctx), *_EXTRAS]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        return _extra_command(cmd_name) if cmd_name in _EXTRAS else super().get_command(ctx, cmd_name)


# command -> (module, its typer app, the extra that installs what it imports)
_EXTRAS = {"bench": ("splitserve.bench.cli", "bench_app", "bench"),
           "cluster": ("splitserve.cluster.cli", "cluster_app", "cluster")}


def _extra_command(name: str) -> Any:
    """``splitserve bench``/``cluster``, or without its extra a stand-in that says how to get it."""
    module, attr, extra = _EXTRAS[name]
    try:
        sub = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        reason = str(e)
        missing = typer.Typer(add_completion=False)

        @missing.command(name, help=f"Not installed (pip install 'splitserve[{extra}]').", add_help_option=False,
                         context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
        def stand_in() -> None:
            typer.echo(f"splitserve {name} is not installed ({reason}): pip install 'splitserve[{extra}]'", err=True)
            raise typer.Exit(1)

        return typer.main.get_command(missing)
    command = typer.main.get_command(sub)
    command.name = name
    return command


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True,
                  help="splitserve: inference serving without the RPC tax")
console = Console()


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback unless you mean otherwise."),
    fast_port: int = typer.Option(8100, help="Fast path TCP port (-1: off, 0: any free port)."),
    udp_port: int = typer.Option(8101, help="Fast path UDP port (-1: off)."),
    http_port: int = typer.Option(8000, help="HTTP / Open Inference Protocol port (-1: off)."),
    grpc_port: int = typer.Option(8001, help="gRPC / Open Inference Protocol port (-1: off)."),
    unix_path: Optional[Path] = typer.Option(None, help="Fast path Unix socket (default: DATA_DIR/fast.sock)."),
    data_dir: Path = typer.Option(None, help="Registry, repository, token and caches (default: ./.splitserve)."),
    repository: Optional[Path] = typer.Option(None, help="Extra model repository: a directory per model with config.toml."),
    load: list[str] = typer.Option([], help="Models to load at start-up (others load on first use)."),
    queue_slots: int = typer.Option(None, help="Tensor-queue slots per model and class."),
    preemption: Optional[PriorityMode] = typer.Option(None, help="How real-time and best-effort work share CPUs."),
    rt_policy: Optional[RtPolicy] = typer.Option(None, help="Order among real-time requests (edf: earliest deadline)."),
    placement: Optional[PlacementKind] = typer.Option(None, help="Placement of models whose config names none."),
    log_level: Optional[str] = typer.Option(None, help="DEBUG, INFO, WARNING or ERROR (default: INFO)."),
    allow_code_artifacts: bool = typer.Option(
        None, help="Accept TorchScript and torch.export uploads: they run code, so every token holder can."),
    memory_budget: Optional[str] = typer.Option(
        None, help="Bytes resident models may take (2GiB, 512MiB, 500MB or bytes); the least recently used go."),
    max_resident_models: Optional[int] = typer.Option(None, help="Models resident at once; more load on demand."),
    class_order: Optional[ClassOrder] = typer.Option(
        None, help="Which waiting request goes first: priority (rt, then be) or arrival (oldest, any class)."),
    partitioning: Optional[Partitioning] = typer.Option(
        None, help="Carve the worker cores into partitions (protean also defaults --preemption to concurrent)."),
    geometry: Optional[str] = typer.Option(None, help="Static partition core counts, e.g. 1,1 or 4,2,1."),
    strict_placement: Optional[StrictPlacement] = typer.Option(
        None, help="Partition of each rt batch (auto: eta under protean, balanced otherwise)."),
    fast_direct: bool = typer.Option(
        None, help="Workers also take fast-path frames on their own Unix sockets (LOOKUP names them)."),
) -> None:
    """Start the server: fast path (TCP, Unix, UDP), HTTP and gRPC, on embedded defaults."""
    given = dict(unix_path=unix_path, repository=repository, queue_slots=queue_slots, preemption=preemption,
                 rt_policy=rt_policy, placement=placement, allow_code_artifacts=allow_code_artifacts,
                 log_level=log_level.upper() if log_level else None, max_resident_models=max_resident_models,
                 memory_budget_bytes=parse_bytes(memory_budget, "--memory-budget") if memory_budget else None,
                 class_order=class_order, partitioning=partitioning, geometry=geometry,
                 strict_placement=strict_placement, fast_direct=fast_direct)
    cfg = ServerConfig.from_env(
        host=host, fast_port=fast_port, udp_port=udp_port, http_port=http_port, grpc_port=grpc_port,
        data_dir=data_dir or default_data_dir(), load=tuple(load),
        **{k: v for k, v in given.items() if v is not None},
    )
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from splitserve.server.app import Server

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    console.print(f"[bold]splitserve[/] data dir {cfg.data_dir}; Ctrl-C to stop", highlight=False)
    runner(Server(cfg).serve_forever())
    # Stopped cleanly: workers reaped, registry closed, files in place. What is left is the
    # interpreter's teardown of torch, gRPC and their threads (~1 s of CPU), which frees nothing
    # the kernel does not free at exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@app.command()
def infer(
    model: str = typer.Argument(..., help="Model name."),
    url: str = typer.Option("tcp://127.0.0.1:8100", help="Server URL: tcp://, unix://, udp://, http://, grpc://."),
    sample: Optional[int] = typer.Option(None, help="digits only: index of a bundled held-out test image."),
    input: Optional[Path] = typer.Option(None, "--input", help="A .npy file with the input (single-input models)."),
    random: bool = typer.Option(False, help="Send a random input of the model's shape (seed 0)."),
    cls: str = typer.Option("default", "--class", help="rt (real-time) or be (best-effort)."),
) -> None:
    """Send one request and print the answer."""
    from splitserve.client import connect

    with connect(url) as c:
        info = c.lookup(model)
        label = None
        if sample is not None:
            if model != "digits":
                raise typer.BadParameter("--sample only applies to the digits model")
            from splitserve.models.digits import digits_dataset

            _, _, x_test, y_test = digits_dataset()
            x, label = x_test[sample], int(y_test[sample])
        elif input is not None:
            x = np.load(input, allow_pickle=False)
        elif random:
            rng = np.random.default_rng(0)
            x = [(rng.random(t.shape) * 4).astype(t.dtype) for t in info.inputs]
            x = x[0] if len(x) == 1 else x
        else:
            raise typer.BadParameter("give --sample, --input or --random")
        with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as shown:
            status: list[Any] = []

            def show(line: str) -> None:
                if not status:  # only calls that take a while get a progress line
                    status.append(shown.enter_context(console.status(line)))
                status[0].update(line)

            pending = pool.submit(c.infer_result, model, x, cls=cls)
            res = answer_with_progress(pending, lambda: _model_state(url, model), show, model, _PROGRESS_POLL_S)
    for name, y in res.outputs.items():
        if y.ndim == 1 and y.size <= 1000 and np.issubdtype(y.dtype, np.floating):
            top = int(np.argmax(y))
            console.print(f"{name}: prediction {top} (score {float(y[top]):.3f})" +
                          (f", true label {label}" if label is not None else ""))
        else:
            console.print(f"{name}: {y.dtype} {list(y.shape)} mean {float(np.mean(y)):.4f}")
    console.print(f"server: queue {res.queue_us} us, compute {res.compute_us} us, total {res.total_us} us")


_PROGRESS_POLL_S = 0.5  # how often ``infer`` looks at a model that has not answered yet


def model_state(info: Any) -> str | None:
    """The server's state of a model (ready, loading, evicted...) in a lookup's answer, from
    any transport: the fast path says ``state``, HTTP and gRPC metadata its parameters."""
    extra = info.extra
    state = extra.get("state") or (extra.get("parameters") or {}).get("state")
    if isinstance(state, dict):  # gRPC metadata as JSON: {"string_param": ...}
        state = state.get("string_param")
    return state if isinstance(state, str) else None


def _model_state(url: str, model: str) -> str | None:
    """The model's state now, asked on a connection of its own (lookups are cached per
    client, and the first is busy with the call); None when the server does not say."""
    from splitserve.client import connect

    try:
        with connect(url) as c:
            return model_state(c.lookup(model))
    except Exception:  # noqa: BLE001 - a progress line must never fail the call it reports on
        return None


def progress_line(model: str, state: str | None, waited_s: float) -> str:
    """What ``infer`` shows while a call is unanswered: what the model is doing, and for how long."""
    if state in ("unloaded", "loading", "evicted"):
        return f"{model}: loading ({waited_s:.0f} s; its first call starts it)"
    if state == "failed":
        return f"{model}: its load failed ({waited_s:.0f} s); waiting for the server's answer"
    if state == "ready":
        return f"{model}: running ({waited_s:.0f} s)"
    return f"{model}: waiting for the answer ({waited_s:.0f} s)"


def answer_with_progress(pending: "concurrent.futures.Future[Any]", state: Callable[[], str | None],
                         show: Callable[[str], None], model: str, poll_s: float,
                         clock: Callable[[], float] = time.monotonic) -> Any:
    """The call's answer (or its error); every ``poll_s`` it is not there, ``show`` a line
    saying what the model is doing (its ``state()``)."""
    start = clock()
    while True:
        try:
            return pending.result(timeout=poll_s)
        except concurrent.futures.TimeoutError:
            show(progress_line(model, state(), clock() - start))


models_app = typer.Typer(add_completion=False, help="List, register, load, unload and scale models.")
app.add_typer(models_app, name="models")

_DATA_DIR_HELP = "The server's data directory (default: ./.splitserve)."
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
            shown = [r.residency or r.state or "?", _size(r.bytes)] if live else []
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


def _size(n: int | None) -> str:
    """Bytes for a narrow column: ``44.7M``; ``-`` when unknown."""
    if not n:
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


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
    data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP),
    as_json: bool = _JSON,
    url: Optional[str] = _STATE_URL,
    wide: bool = _WIDE,
) -> None:
    """List registered models (same as ``splitserve models list``)."""
    if ctx.invoked_subcommand is None:
        _list_models(data_dir, as_json, url, wide)


@models_app.command("list")
def models_list(
    data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP),
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
    url: str = _URL, token: Optional[str] = _TOKEN, data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP),
) -> None:
    """Upload a model directory to a running server; returns once the model is loaded."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            r = c.register(model_dir)
        console.print(f"registered {r['name']} (func_id {r['func_id']}, version {r['version']})", highlight=False)
    _managed(run)


@models_app.command("load")
def models_load(name: str, url: str = _URL, token: Optional[str] = _TOKEN,
                data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP)) -> None:
    """Start a model's workers and wait until it is ready."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            c.load(name)
        console.print(f"{name}: ready")
    _managed(run)


@models_app.command("unload")
def models_unload(name: str, url: str = _URL, token: Optional[str] = _TOKEN,
                  data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP)) -> None:
    """Stop a model's workers; it refuses requests until loaded again."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            c.unload(name)
        console.print(f"{name}: unloaded")
    _managed(run)


@models_app.command("evict")
def models_evict(name: str, url: str = _URL, token: Optional[str] = _TOKEN,
                 data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP)) -> None:
    """Release a model's weights but keep serving it: the next request loads it again."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            r = c.evict(name)
        console.print(f"{name}: {r['state']}" + ("" if r["evicted"] else " (nothing was resident)"), highlight=False)
    _managed(run)


@models_app.command("scale")
def models_scale(name: str, instances: int = typer.Argument(..., help="Worker instances (1..64)."),
                 url: str = _URL, token: Optional[str] = _TOKEN,
                 data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP)) -> None:
    """Change a model's instance count without dropping requests."""
    def run() -> None:
        with _management(url, token, data_dir) as c:
            r = c.scale(name, instances)
        console.print(f"{name}: {r['instances']} instance(s)")
    _managed(run)


def _int_list(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers") from None


def _record(data_dir: Path | None, model: str):
    from splitserve.registry import Registry

    reg = Registry(data_dir or default_data_dir())
    if not reg.list():
        reg.sync()
    return reg, reg.get(model)


@app.command()
def prepare(
    cache_dir: list[Path] = typer.Option(None, "--cache-dir",
                                         help="Weight caches to fill (default: the server's, DATA_DIR/cache)."),
    data_dir: Path = typer.Option(None, help=_DATA_DIR_HELP),
) -> None:
    """Train and cache the models that train on first use (digits), so that no first request
    waits for it; quick when the caches are full. scripts/setup.sh runs it."""
    import shutil

    from splitserve.models.catalog import DIGITS_FILE
    from splitserve.models.digits import load_or_train_digits

    dirs = cache_dir or [ServerConfig.from_env(data_dir=data_dir or default_data_dir()).cache_path]
    missing = [d for d in dirs if not (d / DIGITS_FILE).exists()]
    if not missing:
        return
    with console.status(f"training digits (once; cached in {missing[0]})"):
        missing[0].mkdir(parents=True, exist_ok=True)
        load_or_train_digits(missing[0])
    for d in missing[1:]:  # the same seeded weights: copied, not trained again
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{DIGITS_FILE}.tmp"
        shutil.copyfile(missing[0] / DIGITS_FILE, tmp)
        tmp.replace(d / DIGITS_FILE)  # a server reading the cache meanwhile never sees half a file
    console.print(f"digits: trained and cached in {', '.join(map(str, missing))}", highlight=False)


@app.command()
def profile(
    model: str = typer.Argument(..., help="Model name (registered, or a zoo model)."),
    threads: Optional[str] = typer.Option(None, help="Thread counts, e.g. 1,2,4 (default: 1..all CPUs)."),
    batches: Optional[str] = typer.Option(None, help="Batch sizes, e.g. 1,2,4,8 (default: powers of two to max)."),
    data_dir: Path = typer.Option(None, help="The server's data directory (profiles are stored in its registry)."),
    budget_s: float = typer.Option(2.0, help="Most seconds spent on one (threads, batch) point; with --colocate, "
                                             "the shortest measuring window of a run."),
    colocate: list[str] = typer.Option(None, "--colocate", help="Co-locate MODEL with this model (repeatable): "
                                       "MODEL alone, with each OTHER, with itself and with all of them on the "
                                       "same cores; stores the runs and the FBRs fitted from them (PROTEAN)."),
    cores: Optional[int] = typer.Option(None, help="With --colocate: cores of the shared partition "
                                                   "(default: every usable CPU)."),
    batch: Optional[int] = typer.Option(None, help="With --colocate: batch size of every model "
                                                   "(default: each model's max_batch_size)."),
    omp_wait_policy: Optional[str] = typer.Option(None, help="With --colocate: OMP_WAIT_POLICY of the measuring "
                                                             "processes (PASSIVE or ACTIVE; default: unset)."),
) -> None:
    """Measure L[threads, batch], per-segment times and per-batch memory; store them for Packrat,
    REEF and PROTEAN. With --colocate, measure co-location slowdowns and fit FBRs instead."""
    import os

    from rich.progress import Progress

    from splitserve.placement.profiler import default_batches, profile_model, save_profile

    if not colocate and (cores is not None or batch is not None or omp_wait_policy is not None):
        raise typer.BadParameter("--cores, --batch and --omp-wait-policy go with --colocate")
    if colocate and (threads or batches):
        raise typer.BadParameter("--threads and --batches profile L[t, b]; with --colocate use --cores and --batch")
    if omp_wait_policy is not None and omp_wait_policy.upper() not in ("PASSIVE", "ACTIVE"):
        raise typer.BadParameter(f"--omp-wait-policy {omp_wait_policy!r}: PASSIVE or ACTIVE")
    reg, rec = _record(data_dir, model)
    try:
        if colocate:
            others = [reg.find(o) for o in colocate]
            if None in others:
                raise typer.BadParameter(f"--colocate: unknown model(s) "
                                         f"{', '.join(o for o, r in zip(colocate, others) if r is None)}")
            _profile_colocation(reg, [rec, *others], cores, batch, data_dir, budget_s,
                                omp_wait_policy.upper() if omp_wait_policy else None)
            return
        ts = _int_list(threads) or list(range(1, len(os.sched_getaffinity(0)) + 1))
        bs = _int_list(batches) or default_batches(rec.config.max_batch_size)
        cache = ServerConfig.of(data_dir=data_dir or default_data_dir()).cache_path
        with Progress(console=console) as bar:
            task = bar.add_task(f"profiling {model}", total=len(ts) * len(bs))
            prof = profile_model(rec.config, rec.path, cache, ts, bs, budget_s=budget_s,
                                 on_point=lambda t, b, sec: bar.advance(task))
        save_profile(reg, prof)
    finally:
        reg.close()
    t = Table("threads", *[f"b={b}" for b in bs], title=f"{model}: mean batch latency (ms) on {prof.machine}")
    for th in ts:
        t.add_row(str(th), *[f"{prof.latency.table[(th, b)] * 1e3:.2f}" for b in bs])
    console.print(t)
    if prof.footprint:
        console.print("memory one batch adds (MiB): " + ", ".join(
            f"b={b}: {n / 2**20:.1f}" for b, n in sorted(prof.footprint.items())), highlight=False)


def _profile_colocation(reg: Any, records: list[Any], cores: int | None, batch: int | None,
                        data_dir: Path | None, budget_s: float, omp_wait_policy: str | None) -> None:
    """``profile MODEL --colocate OTHER...``: measure, store, fit, print."""
    import os

    from splitserve.placement.profiler import ColocationRun, fit_stored_fbr, profile_colocation, save_colocation

    cores = cores or len(os.sched_getaffinity(0))
    names = list(dict.fromkeys(r.name for r in records))
    configs = {r.name: r.config for r in records}
    batches = {n: batch or configs[n].max_batch_size for n in names}
    cache = ServerConfig.of(data_dir=data_dir or default_data_dir()).cache_path
    with console.status(f"co-locating {', '.join(names)} on {cores} cores") as status:
        def ran(run: ColocationRun) -> None:
            status.update(f"co-locating on {cores} cores: {' + '.join(run.members)} done")

        prof = profile_colocation(list(configs.values()), cores, batches, cache,
                                  model_dirs={r.name: r.path for r in records}, budget_s=budget_s,
                                  omp_wait_policy=omp_wait_policy, on_run=ran)
    save_colocation(reg, prof)
    t = Table("members", "mean ms", "solo ms", "slowdown",
              title=f"co-location on {cores} cores (CPUs {list(prof.cpus)}), {prof.machine}")
    for r in prof.runs:
        t.add_row(" + ".join(r.members), ", ".join(f"{x * 1e3:.2f}" for x in r.mean_s),
                  ", ".join(f"{x * 1e3:.2f}" for x in r.solo_s), ", ".join(f"{x:.2f}" for x in r.slowdowns))
    console.print(t)
    fit = fit_stored_fbr(reg, names, cores, prof.machine)
    t = Table("key", "FBR", title=f"FBRs fitted from {fit.equations} equations (Eq. 1)")
    for key in sorted({*fit.fbr, *fit.unidentified}):
        t.add_row(key, "unidentified" if key in fit.unidentified else f"{fit.fbr[key]:.3f}")
    console.print(t)
    console.print("residuals: " + (", ".join(f"{k}: {v:+.3f}" for k, v in fit.residuals.items()) or "none"),
                  highlight=False)
    if fit.unidentified:
        console.print(f"unidentified (no run slowed them past Eq. 1's floor of 1; no FBR stored for them): "
                      f"{', '.join(fit.unidentified)}", highlight=False)


@app.command()
def plan(
    model: str = typer.Argument(..., help="Model name."),
    threads: int = typer.Option(..., "--threads", "-T", help="Cores to use (T)."),
    batch: int = typer.Option(..., "--batch", "-B", help="Batch size to serve (B)."),
    data_dir: Path = typer.Option(None, help="The server's data directory."),
) -> None:
    """Print Packrat's ⟨instances, threads, batch⟩ choice for T and B as JSON."""
    from splitserve.placement.optimizer import optimize
    from splitserve.placement.profiler import load_profile

    reg, rec = _record(data_dir, model)
    try:
        prof = load_profile(reg, model)
    finally:
        reg.close()
    if prof is None:
        raise typer.BadParameter(f"{model} has no profile on this machine; run `splitserve profile {model}` first")
    p = optimize(prof.latency, threads, batch)
    out = {"model": model, "T": threads, "B": batch, **p.to_dict()}
    typer.echo(json.dumps(out, indent=2))


gpus_app = typer.Typer(add_completion=False, help="The node's GPUs and MIG slices (read-only, through NVML); "
                       "MIG geometry plans.")
app.add_typer(gpus_app, name="gpus")
_GPU_JSON = typer.Option(False, "--json", help="Print JSON instead of text.")


def gpus_table(listing: "GpuListing") -> Table:
    """One row per whole GPU and per MIG slice: what ``CUDA_VISIBLE_DEVICES`` takes, its
    memory and profile."""
    t = Table("gpu", "uuid (CUDA_VISIBLE_DEVICES)", "name / profile", "memory", "MIG", "gi", "ci")
    for g in listing.gpus:
        mig = {None: "n/a", True: "on", False: "off"}[g.mig]
        if g.mig_pending is not None and g.mig_pending != g.mig:
            mig += f" ({'on' if g.mig_pending else 'off'} after reset)"
        t.add_row(str(g.index), g.uuid, g.name, _size(g.mem_bytes), mig, "", "")
        for sl in g.slices:
            t.add_row("", sl.uuid, sl.profile, _size(sl.mem_bytes), "", str(sl.gpu_instance),
                      str(sl.compute_instance))
    return t


def _mig_driver(admin: bool | None = None) -> "MigDriver":
    """The driver over the real NVML, with the administrator's flag as ``ServerConfig`` reads
    it (``--gpu-admin``, else ``SPLITSERVE_GPU_ADMIN``)."""
    from splitserve.placement.gpus import MigDriver

    cfg = ServerConfig.from_env(**({} if admin is None else {"gpu_admin": admin}))
    return MigDriver(admin=cfg.gpu.gpu_admin, timeout_s=cfg.gpu.gpu_command_timeout_s)


@gpus_app.callback(invoke_without_command=True)
def gpus(ctx: typer.Context, as_json: bool = _GPU_JSON) -> None:
    """List the node's GPUs and their MIG slices (read through NVML; changes nothing)."""
    if ctx.invoked_subcommand is not None:
        return
    listing = _mig_driver().list()
    if as_json:
        console.print_json(json.dumps(listing.to_dict()))
    elif listing.reason:
        console.print(listing.reason, highlight=False)
    else:
        console.print(gpus_table(listing))


@gpus_app.command("plan")
def gpus_plan(
    geometry: str = typer.Argument(..., help="MIG profiles, e.g. 4g,3g or 4g.20gb,2g.10gb,1g.5gb."),
    gpu: int = typer.Option(0, "--gpu", help="GPU index."),
    apply: bool = typer.Option(False, "--apply", help="Run the plan (needs --gpu-admin)."),
    gpu_admin: bool = typer.Option(
        None, "--gpu-admin", help="Allow changing MIG geometries: only on a machine you administer."),
    as_json: bool = _GPU_JSON,
) -> None:
    """Print the nvidia-smi commands that would give a GPU this MIG geometry; with --apply and
    --gpu-admin, run them one by one, stopping at the first failure."""
    driver = _mig_driver(gpu_admin)
    if apply and not driver.admin:
        console.print("[red]error:[/] --apply changes the GPU's MIG geometry and needs --gpu-admin (or "
                      "SPLITSERVE_GPU_ADMIN=1): use it only on a machine you administer. Without --apply, "
                      "splitserve prints the plan and runs nothing.", highlight=False)
        raise typer.Exit(2)
    raise typer.Exit(run_gpu_plan(driver, gpu, geometry, apply, as_json))


def run_gpu_plan(driver: "MigDriver", gpu: int, geometry: str, apply: bool, as_json: bool) -> int:
    """``splitserve gpus plan``'s work on ``driver``: print the plan, run it when asked (the
    driver runs nothing without its admin flag); the exit status."""
    from splitserve.errors import SplitServeError

    try:
        plan = driver.plan(gpu, geometry)
    except SplitServeError as e:
        console.print(f"[red]error:[/] {e.message}", highlight=False)
        return 1
    applied = driver.apply(plan) if apply else None
    if as_json:
        out: dict[str, Any] = plan.to_dict()
        if applied is not None:
            out["applied"] = {"ran": [{"argv": list(r.argv), "returncode": r.returncode} for r in applied.ran],
                              "failed": applied.failed}
        console.print_json(json.dumps(out))
    else:
        console.print(f"GPU {plan.gpu} ({plan.gpu_name}) -> {','.join(plan.target)}"
                      + (f"; keeps GPU instances {', '.join(map(str, plan.kept))}" if plan.kept else ""),
                      highlight=False)
        for c in plan.commands:
            console.print(f"  {c}    [dim]# {c.why}[/]", highlight=False)
        for note in plan.notes:
            console.print(f"  note: {note}", style="dim", highlight=False)
        if applied is None:
            console.print("(dry run: nothing was run; --apply --gpu-admin runs it)", style="dim", highlight=False)
        elif applied.failed:
            console.print(f"[red]error:[/] {applied.failed}", highlight=False)
        else:
            console.print(f"applied: {len(applied.ran)} commands ran", highlight=False)
    return 1 if applied is not None and applied.failed else 0


def main() -> None:
    app()


if __name__ == "__main__":
    main()
