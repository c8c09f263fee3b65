"""Drive a peer server (Ray Serve, PyTriton) with splitserve's load generator.

    python benchmarks/peers/drive.py raw http://127.0.0.1:8010/lenet          # Ray Serve peer
    python benchmarks/peers/drive.py v2 http://127.0.0.1:8020                 # PyTriton peer
    ... --splitserve tcp://127.0.0.1:8100 --splitserve-model lenet_b8         # same run, splitserve too

First the validation phase (the peer's answers against LeNet run locally; a peer that answers
wrongly gets no numbers), then closed-loop runs at each client count from generator processes,
optionally the same against a splitserve server. Writes result.json, report.md and a plot into
``--out``/peer-<kind>-<time>/ like the built-in scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.bench.loadgen import Outcome, RunResult, closed_loop, run_in_processes
from splitserve.bench.results import ResultsDir

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PeerJob:
    kind: str  # raw | v2 | a splitserve transport name (tcp, grpc, http-binary)
    url: str
    model: str  # the name the server knows
    inputs: tuple[dict[str, Any], ...]  # the zoo architecture's tensor specs, as dicts
    outputs: tuple[dict[str, Any], ...]
    clients: int
    duration_s: float
    seed: int = 0


async def _open(kind: str, url: str, outputs: tuple[dict[str, Any], ...], clients: int) -> Any:
    if kind == "raw":
        from http_adapter import RawHttpClient

        from splitserve.bench.inputs import specs_from_dicts

        return RawHttpClient(url, specs_from_dicts(outputs), connections=max(clients, 1))
    if kind == "v2":
        from http_adapter import V2HttpClient

        return V2HttpClient(url)
    from splitserve.bench.transports import open_async

    return await open_async(kind, url)


async def closed_job(index: int, count: int, job: PeerJob) -> RunResult:
    """This process's share of the closed-loop clients (module level: spawn pickles it by name)."""
    from splitserve.bench.transports import close_async

    mine = job.clients // count + (1 if index < job.clients % count else 0)
    if mine == 0:
        return RunResult(mode="closed", origin=time.time())
    client = await _open(job.kind, job.url, job.outputs, mine)
    samples = [as_call_arg(s) for s in make_inputs(job.inputs, 8, job.seed)]
    sent = 0

    async def send(arrival: Any) -> Outcome:
        nonlocal sent
        sent += 1
        await client.infer_result(job.model, samples[sent % len(samples)])
        return Outcome(ok=True)

    try:
        return await closed_loop(send, mine, duration_s=job.duration_s, model=job.model)
    finally:
        await close_async(client)


def validate(kind: str, url: str, model: str, arch: str, n: int = 3) -> list[str]:
    """Problems with the peer's answers (empty when it answers like the local model)."""
    from splitserve.bench.transports import close_async
    from splitserve.bench.validate import compare, reference_outputs
    from splitserve.models.zoo import ZOO

    samples = make_inputs(ZOO[arch].inputs, n, seed=7)
    want = reference_outputs(arch, 0, samples)

    async def go() -> list[str]:
        client = await _open(kind, url, tuple(s.to_dict() for s in ZOO[arch].outputs), 1)
        problems = []
        try:
            for s, w in zip(samples, want):
                r = await client.infer_result(model, as_call_arg(s))
                ok, _, detail = compare(list(r.outputs.values()), w)
                if not ok:
                    problems.append(detail)
        finally:
            await close_async(client)
        return problems

    return asyncio.run(go())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("raw", "v2"), help="raw bytes over HTTP (Ray Serve peer) or OIP v2 (PyTriton)")
    ap.add_argument("url")
    ap.add_argument("--model", default="lenet", help="the model's name on the peer")
    ap.add_argument("--arch", default="lenet", help="the zoo architecture it runs (for validation and inputs)")
    ap.add_argument("--clients", default="1,2,4,8,16,32")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--processes", type=int, default=1, help="load generator processes")
    ap.add_argument("--splitserve", default=None, help="also measure this splitserve URL (tcp://, grpc://, http://)")
    ap.add_argument("--splitserve-model", default="lenet_b8")
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))  # http_adapter; generator processes inherit the path
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    targets = [(f"peer-{args.kind}", args.kind, args.url, args.model)]
    if args.splitserve:
        scheme = args.splitserve.split("://", 1)[0]
        transport = {"tcp": "tcp", "unix": "unix", "grpc": "grpc", "http": "http-binary"}[scheme]
        targets.append((f"splitserve-{transport}", transport, args.splitserve, args.splitserve_model))
    from splitserve.models.zoo import ZOO

    entry = ZOO[args.arch]
    specs_in, specs_out = tuple(s.to_dict() for s in entry.inputs), tuple(s.to_dict() for s in entry.outputs)
    rd = ResultsDir(args.out, f"peer-{args.kind}", params={**vars(args), "clients": clients})
    for label, kind, url, model in targets:
        problems = validate(kind, url, model, args.arch)
        if problems:
            rd.write_json({"status": "refused", "target": label, "problems": problems})
            rd.write_report(f"# peer benchmark: refused\n\n{label} at {url} answered wrongly: {problems[0]}\n")
            print(f"REFUSED: {label} answered wrongly: {problems[0]}", file=sys.stderr)
            return 3
    results: dict[str, list[dict[str, Any]]] = {}
    for label, kind, url, model in targets:
        results[label] = []
        for n in clients:
            job = PeerJob(kind, url, model, specs_in, specs_out, n, args.duration + args.warmup)
            res = run_in_processes(closed_job, (job,), processes=min(args.processes, n),
                                   timeout_s=args.duration * 4 + 120)
            s = res.summary(warmup_s=args.warmup)
            results[label].append({"clients": n, "throughput_rps": s["throughput_rps"], "p50_ms": s["latency_ms"]["p50"],
                                   "p99_ms": s["latency_ms"]["p99"], "errors": s["errors"],
                                   "generator_bottleneck": s["generator_bottleneck"]})
            print(f"{label} {n:>3} clients: {s['throughput_rps'] or 0:8.0f} req/s, p99 {s['latency_ms']['p99'] or 0:.2f} ms",
                  flush=True)
    rd.write_json({"status": "ok", "targets": {t[0]: t[2] for t in targets}, "results": results})
    lines = ["# peer benchmark", "", "| target | clients | req/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for label, pts in results.items():
        lines += [f"| {label} | {p['clients']} | {p['throughput_rps'] or 0:.0f} | {p['p50_ms'] or 0:.2f} | "
                  f"{p['p99_ms'] or 0:.2f} | {p['errors']} |" for p in pts]
    rd.write_report("\n".join(lines))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    ax_tp, ax_p99 = fig.subplots(1, 2)
    for label, pts in results.items():
        xs = [p["clients"] for p in pts]
        ax_tp.plot(xs, [p["throughput_rps"] or 0 for p in pts], marker="o", label=label)
        ax_p99.plot(xs, [p["p99_ms"] or np.nan for p in pts], marker="o", label=label)
    for ax, ylabel in ((ax_tp, "req/s"), (ax_p99, "p99 ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    rd.save_plot(fig, "peer")
    print(f"results in {rd.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
