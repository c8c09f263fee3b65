"""peers: splitserve next to Triton (via PyTriton) and Ray Serve, same models, same clients.

Every server runs the same function: splitserve's zoo model with its seeded weights, which
Triton and Ray Serve receive as a ``torch.export`` program of it (each peer runs from an
environment of its own, built once in a cache folder; see ``splitserve.bench.peers``). Every
answer is checked against the model run locally before anything is timed. The v2 servers,
splitserve's HTTP and gRPC front ends included, are driven by the same third-party client,
``tritonclient`` (HTTP with binary tensors, and gRPC), Ray Serve by plain HTTP (``httpx``,
raw bytes), and splitserve's fast path by its own client on its defaults (a ``tcp://`` URL,
which goes straight to the workers: what a user gets). Per model and endpoint: one client's
sequential p50/p99, then closed-loop throughput with 1, 8 and 32 clients. One server runs at
a time (splitserve last), with one model instance on one torch thread in each, and dynamic
batching without a queue delay (splitserve's work-conserving policy; Triton's dynamic batcher
with ``max_queue_delay_microseconds=0``; ``@serve.batch`` with ``batch_wait_timeout_s=0``).
A ratio is the peer's number over splitserve's from the same run: how many times lower
splitserve's p50 is, and how many times higher its throughput.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.bench.jobs import Workload
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import bottleneck, closed_loop_run, lat_stats, time_calls
from splitserve.bench.transports import Unavailable, close_sync, open_sync
from splitserve.bench.validate import Check, check, check_all, reference_outputs

NAME = "peers"
SUMMARY = "splitserve vs Triton (PyTriton) and Ray Serve: same models, same clients, p50/p99 and throughput."
MODELS: tuple[str, ...] = ("lenet", "resnet18")


@dataclass(frozen=True)
class Endpoint:
    """One server's front end as measured: the client that drives it and its label."""

    name: str
    server: str  # splitserve, or a key of splitserve.bench.peers.PEERS
    front_end: str  # tcp, http or grpc
    client: str  # the benchmark transport name of the client
    label: str


ENDPOINTS: tuple[Endpoint, ...] = (
    # the client on its defaults (a tcp:// URL, straight to the workers), as a user gets it
    Endpoint("splitserve/fast-path", "splitserve", "tcp", "direct-tcp",
             "splitserve fast path (own client on defaults: direct, TCP)"),
    Endpoint("splitserve/http", "splitserve", "http", "tritonclient-http", "splitserve HTTP (tritonclient)"),
    Endpoint("splitserve/grpc", "splitserve", "grpc", "tritonclient-grpc", "splitserve gRPC (tritonclient)"),
    Endpoint("triton/http", "triton", "http", "tritonclient-http", "Triton HTTP (tritonclient)"),
    Endpoint("triton/grpc", "triton", "grpc", "tritonclient-grpc", "Triton gRPC (tritonclient)"),
    Endpoint("ray/http", "ray", "http", "httpx-raw", "Ray Serve HTTP (httpx)"),
)
BY_NAME: dict[str, Endpoint] = {e.name: e for e in ENDPOINTS}
TRANSPORTS: tuple[str, ...] = tuple(BY_NAME)
FAST_PATH = "splitserve/fast-path"
# the splitserve endpoint each peer endpoint is compared with: the same client where one exists
COUNTERPART: dict[str, str] = {"triton/http": "splitserve/http", "triton/grpc": "splitserve/grpc",
                               "ray/http": "splitserve/http"}
COLOURS = {"splitserve/fast-path": "#2b7bba", "splitserve/http": "#ff7f0e", "splitserve/grpc": "#2ca02c",
           "triton/http": "#d62728", "triton/grpc": "#9467bd", "ray/http": "#8c564b"}


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = MODELS
    transports: tuple[str, ...] = TRANSPORTS  # endpoints
    requests: int = 1000  # timed sequential calls per model and endpoint (one client)
    warmup: int = 100  # untimed calls before them
    clients: tuple[int, ...] = (1, 8, 32)  # closed-loop client counts
    duration_s: float = 5.0  # per closed-loop point
    warmup_s: float = 1.0  # left out of each closed-loop point
    threads: int = 1  # torch threads of the peers' one model instance (splitserve's default)
    cache_dir: str = ""  # where the peers' environments are built once; empty: ~/.cache/splitserve/bench-peers
    python: str = ""  # interpreter the environments are built from; empty: /usr/bin/python3.11 if present
    torch_spec: str = "torch==2.13.0"  # torch for the peers' environments (a CPU wheel on local disk here)
    build_timeout_s: float = 1800.0  # building one peer's environment, the first time
    peer_start_timeout_s: float = 300.0  # a peer's server loading every model

    @classmethod
    def quick(cls) -> Params:
        return cls(models=("lenet",), requests=200, warmup=20, duration_s=2.0, warmup_s=0.5)

    def check(self) -> None:
        if not self.clients or min(self.clients) < 1:
            raise ValueError("clients must be counts >= 1")
        if self.requests < 1 or self.warmup < 0 or self.threads < 1:
            raise ValueError("requests and threads must be >= 1, warmup >= 0")
        if not self.duration_s > self.warmup_s >= 0:
            raise ValueError("duration_s must be longer than warmup_s")


# -- the pure part: ratios -----------------------------------------------------------------


def _p50(cell: Mapping[str, Any] | None) -> float | None:
    return cell["single_us"]["p50"] if cell else None


def _tput(cell: Mapping[str, Any] | None, clients: str) -> float | None:
    point = (cell or {}).get("closed", {}).get(clients)
    return point.get("throughput_rps") if point else None


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(cells: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per peer endpoint of one model: its p50 over splitserve's (counterpart front end and
    fast path), and splitserve's throughput over its own at each client count. Above 1 is
    splitserve ahead; None where either side was not measured.

    ``cells[endpoint]`` holds ``single_us`` (``lat_stats``) and ``closed[str(clients)]`` with
    ``throughput_rps``.
    """
    fast = cells.get(FAST_PATH)
    out: dict[str, dict[str, Any]] = {}
    for name, cell in cells.items():
        if BY_NAME[name].server == "splitserve":
            continue
        mine = cells.get(COUNTERPART[name])
        counts = list(cell.get("closed", {}))
        out[name] = {
            "counterpart": COUNTERPART[name],
            "p50_vs_counterpart": _over(_p50(cell), _p50(mine)),
            "p50_vs_fast_path": _over(_p50(cell), _p50(fast)),
            "throughput_vs_counterpart": {c: _over(_tput(mine, c), _tput(cell, c)) for c in counts},
            "throughput_vs_fast_path": {c: _over(_tput(fast, c), _tput(cell, c)) for c in counts},
        }
    return out


# -- measuring ----------------------------------------------------------------------------


def _validate(ctx: Context, endpoints: Sequence[tuple[Endpoint, str]], models: Sequence[str],
              inputs: Mapping[str, Any], references: Mapping[str, Any]) -> list[tuple[Endpoint, str]]:
    """The endpoints whose every answer agrees with the local model; the others are noted."""
    usable: list[tuple[Endpoint, str]] = []
    with ctx.task(f"validating {endpoints[0][0].server}", len(endpoints) * len(models)) as advance:
        for ep, url in endpoints:
            try:
                client = open_sync(ep.client, url)
            except Unavailable as e:
                ctx.unavailable[ep.name] = str(e)
                advance(len(models))
                continue

            def send(model: str, x: Any, client: Any = client) -> dict[str, Any]:
                return client.infer_result(model, x).outputs

            checks: list[Check] = []
            try:
                for m in models:
                    checks.append(check(send, m, ep.name, inputs[m], references[m]))
                    advance(1)
            finally:
                close_sync(client)
            ctx.checks.extend(checks)
            bad = [c for c in checks if not c.ok]
            if bad and ep.server == "splitserve":
                check_all(ctx.checks)  # splitserve answering wrongly: the run reports no numbers
            if bad:
                ctx.unavailable[ep.name] = "answered wrongly: " + "; ".join(f"{c.model}: {c.detail}" for c in bad)
            else:
                usable.append((ep, url))
    return usable


def _measure(ctx: Context, p: Params, ep: Endpoint, url: str, model: str, sample: Any) -> dict[str, Any] | None:
    from splitserve.models.catalog import zoo_entry

    try:
        client = open_sync(ep.client, url)
        try:
            times = time_calls(client, model, sample, p.requests, p.warmup)
        finally:
            close_sync(client)
    except Exception as e:  # a peer that breaks while timed loses its numbers, not the run
        ctx.failed(ep.name, model, e)
        return None
    entry = zoo_entry(model)
    w = Workload(ep.client, url, model, tuple(s.to_dict() for s in entry.inputs),
                 tuple(s.to_dict() for s in entry.outputs), p.seed)
    closed: dict[str, Any] = {}
    for n in p.clients:
        s = closed_loop_run(w, n, p.duration_s, warmup_s=p.warmup_s).summary(p.warmup_s)
        closed[str(n)] = {"throughput_rps": s["throughput_rps"], "p50_ms": s["latency_ms"]["p50"],
                          "p99_ms": s["latency_ms"]["p99"], "ok": s["ok"], "errors": s["errors"],
                          "error_kinds": s.get("error_kinds", {}), "bottleneck": bottleneck(s)}
        if s["errors"]:
            ctx.notes.append(f"{ep.name} {model} with {n} clients: {s['errors']} errors "
                             f"({', '.join(s.get('error_kinds', {}))})")
        if closed[str(n)]["bottleneck"]:
            ctx.notes.append(f"{ep.name} {model} with {n} clients: {closed[str(n)]['bottleneck']}")
    return {"client": ep.client, "single_us": lat_stats(times.e2e_us), "closed": closed}


def _time_server(ctx: Context, p: Params, endpoints: Sequence[tuple[Endpoint, str]], models: Sequence[str],
                 inputs: Mapping[str, Any], references: Mapping[str, Any],
                 cells: dict[str, dict[str, Any]]) -> None:
    usable = _validate(ctx, endpoints, models, inputs, references)
    with ctx.task(f"timing {endpoints[0][0].server}", len(usable) * len(models)) as advance:
        for ep, url in usable:
            for m in models:
                cell = _measure(ctx, p, ep, url, m, inputs[m][0])
                if cell is not None:
                    cells[m][ep.name] = cell
                advance(1)


def _run_peer(ctx: Context, p: Params, peer_name: str, wanted: Sequence[Endpoint], manifest: Callable[[], Path],
              work: Path, timed: Callable[[Sequence[tuple[Endpoint, str]]], None]) -> None:
    """Build (once), start, time and stop one peer; if it cannot be built or started, say why."""
    from splitserve.bench.peers import PEERS, PeerServer, PeerUnavailable, build_env, default_cache, default_python

    peer = PEERS[peer_name]
    log = ctx.results.path / f"peer-{peer_name}.log"
    server: PeerServer | None = None
    try:
        with ctx.task(f"{peer.label}: environment (built once)", 1):
            cache = Path(p.cache_dir) if p.cache_dir else default_cache()
            python = build_env(peer, p.python or default_python(), cache, p.torch_spec, p.build_timeout_s, log)
        with ctx.task(f"{peer.label}: starting", 1):
            server = PeerServer(peer, python, manifest(), work, log)
            server.wait_ready(p.peer_start_timeout_s)
        urls = server.urls()
        timed([(ep, urls[ep.front_end][1]) for ep in wanted])
    except PeerUnavailable as e:
        for ep in wanted:
            ctx.unavailable[ep.name] = f"{peer.label}: {e}"
    finally:
        if server is not None:
            code = server.stop()
            if code != 0:
                ctx.notes.append(f"{peer.label} exited with code {code} when stopped (see {log.name})")


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.bench.inputs import make_inputs
    from splitserve.bench.peers import export_models
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    models = list(p.models)
    wanted = [BY_NAME[t] for t in p.transports]
    inputs = {m: make_inputs(zoo_entry(m).inputs, max(1, p.validate_samples), p.seed + 7) for m in models}
    references = {m: reference_outputs(m, 0, inputs[m]) for m in models}
    cells: dict[str, dict[str, Any]] = {m: {} for m in models}

    def timed(endpoints: Sequence[tuple[Endpoint, str]]) -> None:
        _time_server(ctx, p, endpoints, models, inputs, references, cells)

    work = Path(tempfile.mkdtemp(prefix="splitserve-peers-"))

    @functools.cache
    def manifest() -> Path:  # once, and only for a peer that could be built
        with ctx.task("exporting the models for the peers", 1):
            return export_models(models, work, p.threads)

    try:
        peers = [s for s in dict.fromkeys(e.server for e in wanted) if s != "splitserve"]
        for name in peers:
            _run_peer(ctx, p, name, [e for e in wanted if e.server == name], manifest, work, timed)
        mine = [e for e in wanted if e.server == "splitserve"]
        if mine:
            target = ctx.target(load=models)
            found: list[tuple[Endpoint, str]] = []
            for ep in mine:
                try:
                    found.append((ep, target.url("http-binary" if ep.front_end == "http" else ep.front_end)))
                except Unavailable as e:
                    ctx.unavailable[ep.name] = str(e)
            if found:
                timed(found)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ctx.notes[:] = list(dict.fromkeys(ctx.notes))
    return _output(models, [e.name for e in wanted], cells, p.clients)


# -- the report ---------------------------------------------------------------------------


def _plot_latency(models: Sequence[str], cells: Mapping[str, Mapping[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * len(models), 3.8))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, m in zip(axes, models):
        names = list(cells[m])
        p50 = [cells[m][n]["single_us"]["p50"] for n in names]
        p99 = [cells[m][n]["single_us"]["p99"] for n in names]
        ax.bar(range(len(names)), p50, color=[COLOURS[n] for n in names], width=0.7, label="p50")
        ax.scatter(range(len(names)), p99, color="black", marker="_", s=200, label="p99", zorder=3)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("µs, one client", fontsize=8)
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle("Single-client latency (p50 bars, p99 marks)", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_throughput(models: Sequence[str], cells: Mapping[str, Mapping[str, Any]], clients: Sequence[int]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * len(models), 3.8))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, m in zip(axes, models):
        for n, cell in cells[m].items():
            ys = [(cell["closed"].get(str(c)) or {}).get("throughput_rps") for c in clients]
            ax.plot(clients, [y if y is not None else float("nan") for y in ys], marker="o", color=COLOURS[n],
                    label=n)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(clients), [str(c) for c in clients])
        ax.set_xlabel("closed-loop clients", fontsize=8)
        ax.set_ylabel("requests/s", fontsize=8)
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle("Closed-loop throughput", fontsize=10)
    fig.tight_layout()
    return fig


def _output(models: Sequence[str], endpoints: Sequence[str], cells: dict[str, dict[str, Any]],
            clients: Sequence[int]) -> ScenarioOutput:
    # in ENDPOINTS order (splitserve first), whatever order the servers ran in
    cells = {m: {e.name: cells[m][e.name] for e in ENDPOINTS if e.name in cells[m]} for m in models}
    rat = {m: ratios(cells[m]) for m in models}
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    for m in models:
        row = cells[m]
        report += [f"## {m}", "", md_table(
            ("endpoint", "client", "p50 µs", "p99 µs", *(f"req/s @{c}" for c in clients),
             f"p50 ms @{clients[-1]}"),
            [(BY_NAME[n].label, c["client"], fmt(c["single_us"]["p50"]), fmt(c["single_us"]["p99"]),
              *(fmt((c["closed"].get(str(k)) or {}).get("throughput_rps")) for k in clients),
              fmt((c["closed"].get(str(clients[-1])) or {}).get("p50_ms"), 2))
             for n, c in row.items()]), ""]
        if rat[m]:
            report += [f"### {m}: ratios (peer / splitserve; above 1 is splitserve ahead)", "", md_table(
                ("peer endpoint", "vs", "p50 ratio", "p50 ratio vs fast path",
                 *(f"throughput ratio @{c}" for c in clients), *(f"fast path @{c}" for c in clients)),
                [(n, r["counterpart"], fmt(r["p50_vs_counterpart"], 2, "x"), fmt(r["p50_vs_fast_path"], 2, "x"),
                  *(fmt(r["throughput_vs_counterpart"].get(str(c)), 2, "x") for c in clients),
                  *(fmt(r["throughput_vs_fast_path"].get(str(c)), 2, "x") for c in clients))
                 for n, r in rat[m].items()]), ""]
        last = str(clients[-1])
        for n, r in rat[m].items():
            mine = r["counterpart"]
            lines.append(f"{m}: {n} p50 {fmt(_p50(row[n]), 0)} µs = {fmt(r['p50_vs_counterpart'], 2, 'x')} "
                         f"{mine}'s {fmt(_p50(row.get(mine)), 0)} µs, {fmt(r['p50_vs_fast_path'], 2, 'x')} the fast "
                         f"path's {fmt(_p50(row.get(FAST_PATH)), 0)} µs; {mine} has "
                         f"{fmt(r['throughput_vs_counterpart'].get(last), 2, 'x')} its throughput at {last} clients, "
                         f"the fast path {fmt(r['throughput_vs_fast_path'].get(last), 2, 'x')}")
    figures = {}
    if any(cells[m] for m in models):
        figures = {"peers_latency": _plot_latency(models, cells),
                   "peers_throughput": _plot_throughput(models, cells, clients)}
    return ScenarioOutput({"models": cells, "ratios": rat, "endpoints": list(endpoints)}, "\n".join(report), figures,
                          lines)
