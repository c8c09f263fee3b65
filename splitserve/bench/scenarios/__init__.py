"""The benchmark scenarios by name. Each lives in its own module, imported only when run.

Every module defines ``NAME``, ``SUMMARY``, ``MODELS`` and ``TRANSPORTS`` (what ``--models``
and ``--transports`` may choose from), a ``Params`` dataclass and ``run(ctx)``; see ``base``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class ScenarioInfo:
    name: str
    summary: str
    module: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


SCENARIOS: dict[str, ScenarioInfo] = {
    s.name: s
    for s in (
        ScenarioInfo("rpc-tax", "Where a request's time goes, per model and transport, against the "
                     "in-process ideal and a plain TCP echo (SplitRPC Fig. 1 and 8).",
                     "splitserve.bench.scenarios.rpc_tax"),
        ScenarioInfo("load", "Open-loop Poisson load over a range of rates: mean and p99 latency, "
                     "and the knee, per transport (Fig. 9).", "splitserve.bench.scenarios.load"),
        ScenarioInfo("batching", "Closed loop with 1-32 clients on ResNet-18/50, dynamic batching on vs "
                     "off: throughput and p99 (Fig. 10).", "splitserve.bench.scenarios.batching"),
        ScenarioInfo("trace", "Diurnal and bursty traces replayed open loop with dynamic batching: "
                     "p99 over time (Fig. 11).", "splitserve.bench.scenarios.trace"),
        ScenarioInfo("micro", "VecAdd1K and MatMul8K: single-client latency and peak throughput "
                     "(Fig. 12).", "splitserve.bench.scenarios.micro"),
        ScenarioInfo("fastpath-latency", "Fast path round trip and 32-connection throughput, through the front "
                     "end and direct to the worker, next to a plain TCP echo of the same sizes.",
                     "splitserve.bench.scenarios.fastpath_latency"),
        ScenarioInfo("polling", "Polling on vs off in the same minutes, servers of each kind side by side: "
                     "one client's calls/s and 32 connections' req/s on a quiet host and with the other cores "
                     "busy (goal: at most 5 % lost when busy).", "splitserve.bench.scenarios.polling"),
        ScenarioInfo("fastpath-breakdown", "Per-stage breakdown of one fast-path call: client, front end, "
                     "hand-off, worker, the way back (timestamps and py-spy).",
                     "splitserve.bench.scenarios.fastpath_breakdown"),
        ScenarioInfo("disb", "DISB workloads A-E and REAL (or a DISB workload file) under rt-only, seq, concurrent "
                     "and reef: RT latency and throughput vs rt-only, preemption latency, restore overhead, "
                     "padding pairs (REEF Fig. 11/12/15b/16).", "splitserve.bench.disb.scenario"),
        ScenarioInfo("packrat", "Profile a model, then Packrat's <instances, threads, batch> choice vs one fat "
                     "instance per batch size, expected vs measured, and adaptive reconfiguration under a load "
                     "step (Packrat Fig. 4/5/6).", "splitserve.bench.scenarios.packrat"),
        ScenarioInfo("slowdown", "PROTEAN's slowdown model: FBRs fitted on some co-locations of zoo models on 1..C "
                     "cores predict held-out ones (median and p90 relative error, fit residuals); cross-partition "
                     "interference of disjoint cores (PROTEAN Eq. 1/2, Fig. 3).",
                     "splitserve.bench.scenarios.slowdown"),
        ScenarioInfo("chaos", "Mixed RT/BE load at 2x capacity over every transport while workers are killed, "
                     "clients stall or stop reading, frames are malformed and models are resized, reconfigured "
                     "and reloaded: a ledger proves one answer per request.",
                     "splitserve.bench.scenarios.chaos"),
        ScenarioInfo("fuzz", "The control header, the stream frame state machine and UDP reassembly under random "
                     "and mutated input: inputs tried and failures found per target (>= 1M inputs).",
                     "splitserve.bench.scenarios.fuzz"),
        ScenarioInfo("loadgen", "The load generator's own accuracy against an in-process server that answers after a "
                     "fixed time: open-loop send lag (p50, p99, max) and achieved rate per asked rate, closed-loop "
                     "calls against the ideal.", "splitserve.bench.scenarios.loadgen"),
        ScenarioInfo("multimodel", "More models than fit: an LRU memory manager under sequential, uniform and zipf "
                     "access against no limit, loading on every request and a new process per load; miss ratios vs "
                     "a reference LRU, throughput vs 1/(1+m·r) (Rafiqi Fig. 2/3/4).",
                     "splitserve.bench.multimodel.scenario"),
        ScenarioInfo("peers", "splitserve vs Triton (PyTriton) and Ray Serve on the same models with the same "
                     "clients (tritonclient, httpx): single-client p50/p99, closed-loop throughput at 1, 8 and 32 "
                     "clients, and ratios from the same run.", "splitserve.bench.scenarios.peers"),
        ScenarioInfo("protean", "PROTEAN on one node: protean vs naive, colocate, timeshare and smart-static on "
                     "identical Wikipedia- or Twitter-like arrivals, 50/50 strict/BE: strict SLO compliance, p99 "
                     "breakdown, SLO-crossing percentile, BE tail, cold starts (PROTEAN Fig. 5/6/8/11/13/15).",
                     "splitserve.bench.protean.scenario"),
        ScenarioInfo("cluster-spot", "PROTEAN Fig. 9 simulated at the paper's scale: normalised cost and strict SLO "
                     "compliance of protean, spot-only and on-demand-only at P_rev 0, 0.354 and 0.708 on emulated "
                     "revocations; evictions, fallbacks, requeued and lost requests.",
                     "splitserve.bench.scenarios.cluster_spot"),
        ScenarioInfo("cluster-tax", "The cluster gateway's added latency: lenet over the fast path through the gateway "
                     "vs straight to one node server of the same local Ray cluster, p50 and p99 and their ratios, "
                     "single client and N connections.", "splitserve.bench.scenarios.cluster_tax"),
        ScenarioInfo("cluster-check", "The cluster simulator checked against a real local Ray cluster: one seeded "
                     "trace of strict and best-effort lenet calls with emulated revocations through both, nodes per "
                     "market, notices, evictions, lost and answered requests, normalised cost, strict SLO compliance "
                     "and nodes over time side by side.", "splitserve.bench.scenarios.cluster_check"),
        ScenarioInfo("torchserve", "TorchServe's /predictions against /v2 infer for the same model (a .mar with the "
                     "image_classifier handler, and one with base_handler): single-client p50/p99 and their ratio.",
                     "splitserve.bench.scenarios.torchserve"),
    )
}


def get(name: str) -> ScenarioInfo:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None


__all__ = ["SCENARIOS", "ScenarioInfo", "get"]
