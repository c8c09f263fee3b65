"""rpc-tax: where one request's time goes, per model and transport (SplitRPC Fig. 1 and 8).

A single client sends N sequential requests per model over every transport. Each call's
end-to-end (E2E) time is split into: client processing (encode + decode, timed in the client
on the same input and answer), server queue, server compute, server other (the server's
receive-to-reply time minus queue and compute), and the rest: transport and data movement
(E2E minus client minus the server's total). Two reference points frame it: the model run in
this process (the ideal, like SplitRPC-local) and a plain TCP echo of the same request and
response sizes (the floor). The tax of a transport is median(E2E - compute).

The fast-path clients run on their defaults: the direct paths' go to the workers and poll
for their answers while a core is free (``Client(poll_us=...)``), the front end's opt out of
the direct path. With ``client_poll_us`` (default 1000; 0: off) each direct path, and the
echo, is timed a second time by a client that polls up to that long (rows "client polls"),
next to an echo that polls the same way. The gRPC and HTTP clients have no such mode; they
are timed as they come. The server the benchmark starts runs on its defaults, its workers
polling for their next direct call (``worker_spin_us`` sets ``direct_spin_us``; 0: never).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench import codecs
from splitserve.bench.echo import HEADER_SIZE
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro, time_transport
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import CallTimes, lat_stats, time_echo, time_local
from splitserve.bench.transports import (
    BASELINES,
    DIRECT,
    POLLS,
    SERVER_TRANSPORTS,
    path_label,
)
from splitserve.bench.validate import Expected

NAME = "rpc-tax"
SUMMARY = "E2E time per model and transport broken into client, server, compute and transport (Fig. 1/8)."
MODELS: tuple[str, ...] = ("vecadd1k", "matmul8k", "lenet", "lstm", "resnet18", "bert_tiny")
TRANSPORTS: tuple[str, ...] = SERVER_TRANSPORTS + BASELINES
COMPONENTS: tuple[tuple[str, str, str], ...] = (
    # key, label, colour
    ("compute_us", "server compute", "#2b7bba"),
    ("server_queue_us", "server queue", "#9ecae1"),
    ("server_other_us", "server other", "#6baed6"),
    ("client_us", "client processing", "#fdae6b"),
    ("transport_us", "transport & data movement", "#d62728"),
)


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = MODELS
    transports: tuple[str, ...] = TRANSPORTS
    requests: int = 1000  # timed sequential requests per model and transport
    warmup: int = 100  # untimed requests before them
    codec_reps: int = 200  # repetitions when timing the client's encode and decode
    client_poll_us: int = 1000  # the direct paths and the echo timed again by a polling client (0: not)
    worker_spin_us: int | None = None  # the started server's direct_spin_us (None: its default; 0: sleep at once)

    @classmethod
    def quick(cls) -> Params:
        return cls(requests=50, warmup=5, codec_reps=30)


def breakdown(times: CallTimes, codec: codecs.CodecTiming | None) -> dict[str, Any]:
    """Median components of one (model, transport) cell; they add up to the median E2E."""
    e2e = float(np.median(times.e2e_us))
    out: dict[str, Any] = {"e2e_us": lat_stats(times.e2e_us), "server_reported": times.server_reported,
                           "client_method": codec.method if codec else None}
    parts: dict[str, float | None] = {k: None for k, _, _ in COMPONENTS}
    if times.server_reported:
        parts["server_queue_us"] = float(np.median(times.queue_us))
        parts["compute_us"] = float(np.median(times.compute_us))
        parts["server_other_us"] = max(0.0, float(np.median(times.total_us - times.queue_us - times.compute_us)))
        out["tax_us"] = float(np.median(times.e2e_us - times.compute_us))
        out["server_total_us"] = float(np.median(times.total_us))
    else:
        out["tax_us"] = None
    if codec is not None:
        parts["client_us"] = codec.total_s * 1e6
        out["client_encode_us"], out["client_decode_us"] = codec.encode_s * 1e6, codec.decode_s * 1e6
    known = sum(v for k, v in parts.items() if v is not None and k != "transport_us")
    parts["transport_us"] = max(0.0, e2e - known)
    out["components"] = parts
    return out


def _local_cell(us: np.ndarray) -> dict[str, Any]:
    e2e = float(np.median(us))
    comps = {k: 0.0 for k, _, _ in COMPONENTS}
    comps["compute_us"] = e2e
    return {"e2e_us": lat_stats(us), "server_reported": False, "client_method": None, "tax_us": 0.0,
            "components": comps}


def _echo_cell(us: np.ndarray, req: int, resp: int) -> dict[str, Any]:
    e2e = float(np.median(us))
    comps = {k: 0.0 for k, _, _ in COMPONENTS}
    comps["transport_us"] = e2e
    return {"e2e_us": lat_stats(us), "server_reported": False, "client_method": None, "tax_us": e2e,
            "components": comps, "request_bytes": req, "response_bytes": resp}


def ratios(cells: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Fast-path (TCP) tax over the echo floor and over gRPC's and HTTP's taxes; the same for
    the direct path (to the worker) where it was measured."""
    def tax(t: str) -> float | None:
        c = cells.get(t)
        return c.get("tax_us") if c else None

    fp = tax("tcp")

    def over(other: float | None) -> float | None:
        return fp / other if fp is not None and other else None

    direct, polled, grpc = tax("direct"), tax("direct" + POLLS), tax("grpc")
    return {"fastpath_tax_us": fp, "vs_echo": over(tax("echo")), "vs_grpc": over(grpc),
            "vs_http_binary": over(tax("http-binary")), "vs_http_json": over(tax("http-json")),
            "direct_tax_us": direct, "direct_vs_grpc": direct / grpc if direct is not None and grpc else None,
            "direct_polled_tax_us": polled,
            "direct_polled_vs_grpc": polled / grpc if polled is not None and grpc else None}


def _plot(models: list[str], cells: dict[str, dict[str, dict[str, Any]]], normalise: bool) -> Any:
    from matplotlib.figure import Figure

    cols = min(3, len(models))
    rows = -(-len(models) // cols)
    fig = Figure(figsize=(4.6 * cols, 3.6 * rows + 0.6))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        row = cells[model]
        transports = list(row)
        ref_name = "grpc" if "grpc" in row else max(row, key=lambda t: row[t]["e2e_us"]["p50"] or 0)
        ref = sum(row[ref_name]["components"].values()) if normalise else 1.0
        bottom = np.zeros(len(transports))
        for key, label, colour in COMPONENTS:
            vals = np.array([(row[t]["components"].get(key) or 0.0) / ref for t in transports])
            ax.bar(range(len(transports)), vals, bottom=bottom, color=colour, label=label, width=0.7)
            bottom += vals
        for i, t in enumerate(transports):
            ax.text(i, bottom[i], f"{row[t]['e2e_us']['p50']:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(transports)), [path_label(t, short=True) for t in transports], rotation=45,
                      fontsize=8)
        ax.set_title(model + (f" (normalised to {path_label(ref_name, short=True)})" if normalise else ""),
                     fontsize=9)
        ax.set_ylabel("E2E / reference" if normalise else "µs (median)", fontsize=8)
        ax.margins(y=0.12)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(COMPONENTS), fontsize=8, frameon=False)
    fig.suptitle("RPC tax: median E2E by component" + (" (numbers: E2E µs)" if normalise else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return fig


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.bench.inputs import make_inputs
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    models = list(p.models)
    server_side = [t for t in p.transports if t in SERVER_TRANSPORTS]
    target = ctx.target(load=models, direct=any(t in DIRECT for t in server_side),
                        spin_us=p.worker_spin_us) if server_side else None
    usable = ctx.validate(target, {m: Expected(m) for m in models}, p.transports) if target else \
        [t for t in p.transports if t in BASELINES]
    cells: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in models}
    with ctx.task("timing requests", len(models) * len(usable)) as advance:
        for model in models:
            entry = zoo_entry(model)
            sample = make_inputs(entry.inputs, 1, p.seed)[0]
            for t in usable:
                # the sleeping client, then (a direct path or the echo) the polling one
                polls = (0, p.client_poll_us) if p.client_poll_us and t in (*DIRECT, "echo") else (0,)
                if t == "local":
                    cells[model][t] = _local_cell(time_local(model, 0, sample, p.requests, p.warmup))
                elif t == "echo":
                    echo = ctx.echo()
                    req, resp = HEADER_SIZE + entry.request_bytes, HEADER_SIZE + entry.response_bytes
                    for poll_us in polls:
                        cells[model][t + (POLLS if poll_us else "")] = _echo_cell(
                            time_echo(echo.host, echo.port, req, resp, p.requests, p.warmup, poll_us), req, resp)
                else:
                    assert target is not None
                    for poll_us in polls:
                        times = time_transport(ctx, t, target.url(t), model, sample, p.requests, p.warmup,
                                               **({"poll_us": poll_us} if poll_us else {}))
                        if times is None:
                            break
                        codec = codecs.measure(t, entry.inputs, entry.outputs, sample, times.last_outputs,
                                               p.codec_reps)
                        cells[model][t + (POLLS if poll_us else "")] = breakdown(times, codec)
                        if codec is None:
                            ctx.notes.append(f"client processing over {t} could not be timed; it is counted in "
                                             "transport")
                advance(1)
    ctx.notes[:] = list(dict.fromkeys(ctx.notes))
    return _output(models, usable, cells)


def _output(models: list[str], usable: list[str], cells: dict[str, dict[str, dict[str, Any]]]) -> ScenarioOutput:
    rat = {m: ratios(cells[m]) for m in models}
    lines: list[str] = []
    report = [report_intro(__doc__), ""]
    for m in models:
        row = cells[m]
        report += [f"## {m}", "", md_table(
            ("transport", "E2E p50 µs", "E2E p99 µs", "compute", "server queue", "server other", "client",
             "transport & data", "tax µs", "vs gRPC"),
            [(path_label(t), fmt(c["e2e_us"]["p50"]), fmt(c["e2e_us"]["p99"]),
              *(fmt(c["components"][k]) for k in ("compute_us", "server_queue_us", "server_other_us",
                                                   "client_us", "transport_us")),
              fmt(c.get("tax_us")),
              fmt(c["e2e_us"]["p50"] / row["grpc"]["e2e_us"]["p50"], 2, "x") if "grpc" in row else "-")
             for t, c in row.items()]), ""]
        r = rat[m]
        if r["fastpath_tax_us"] is not None:
            parts = [f"{m}: fast-path tax {r['fastpath_tax_us']:.0f} µs"]
            for key, label in (("vs_echo", "echo"), ("vs_grpc", "gRPC tax"), ("vs_http_binary", "HTTP binary tax"),
                               ("vs_http_json", "HTTP JSON tax")):
                if r[key] is not None:
                    parts.append(f"{r[key]:.2f}x {label}")
            if r["direct_vs_grpc"] is not None:
                parts.append(f"direct-path tax {r['direct_tax_us']:.0f} µs = {r['direct_vs_grpc']:.2f}x gRPC tax")
            if r["direct_polled_vs_grpc"] is not None:
                parts.append(f"{r['direct_polled_tax_us']:.0f} µs = {r['direct_polled_vs_grpc']:.2f}x with a "
                             "client that polls")
            lines.append(", ".join(parts))
    report += ["## Ratios", "", ("Fast-path tax = median(E2E - compute) over TCP; the echo's tax is its whole "
                                 "round trip. Below 1 is better than the other transport."), "",
               md_table(("model", "fast-path tax µs", "/ echo", "/ gRPC", "/ HTTP binary", "/ HTTP JSON",
                         "direct-path tax µs", "direct / gRPC", "direct, client polls: tax µs", "/ gRPC"),
                        [(m, fmt(r["fastpath_tax_us"]), fmt(r["vs_echo"], 2, "x"), fmt(r["vs_grpc"], 2, "x"),
                          fmt(r["vs_http_binary"], 2, "x"), fmt(r["vs_http_json"], 2, "x"), fmt(r["direct_tax_us"]),
                          fmt(r["direct_vs_grpc"], 2, "x"), fmt(r["direct_polled_tax_us"]),
                          fmt(r["direct_polled_vs_grpc"], 2, "x"))
                         for m, r in rat.items()]), ""]
    methods = sorted({(t, c["client_method"]) for row in cells.values() for t, c in row.items() if c["client_method"]})
    if methods:
        report += ["Client processing was timed with: " + "; ".join(f"{t}: {meth}" for t, meth in methods) + ".", ""]
    figures = {"rpc_tax": _plot(models, cells, True), "rpc_tax_us": _plot(models, cells, False)} if usable else {}
    return ScenarioOutput({"models": cells, "ratios": rat, "transports": usable}, "\n".join(report), figures, lines)
