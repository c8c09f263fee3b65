"""cluster-tax: what the cluster gateway adds to a fast-path call.

One small local cluster (a Ray head and ``nodes`` serving raylets on 127.0.0.1, started and
stopped by the bench) serves ``lenet``; the same calls go through the gateway and straight
to one of its node servers, in the same run. Single client: gateway and direct calls
alternate in blocks of 50, so both see the same machine state; the gateway's tax is the
difference of the p50s (and p99s), with the ratios gateway / direct. Loaded: ``connections``
closed-loop connections through the gateway, then as many straight to the node, from a
separate generator process: p50, p99 and req/s of each and their ratios. With more than
one node the gateway spreads the loaded run over all of them while the direct run uses one,
so compare the loaded ratios at ``nodes = 1``. Ray is never on the path of a call.

``-p netns=true`` runs it across hosts: the Ray head (with the gateway), each serving node
and the clients each in a Linux network namespace on a bridge made for the run
(``bench/netns.py``; needs root and ``ip``), so every call crosses a veth pair and a bridge
as it would cross a LAN: the gateway's tax over a node's own, from another host.

``gateway`` and ``direct`` clients send every call to the gateway's or the node's front end;
``node-direct`` ones connect to the node and call its workers (a single node's direct path,
transport ``direct-tcp``), ``gateway-direct`` ones connect to the gateway and call the
workers its lookup names on each node (the direct path at cluster scale): their ratio to
``node-direct`` is what the cluster costs a direct client.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import bottleneck, closed_loop_run, gc_paused, lat_stats, workload

NAME = "cluster-tax"
SUMMARY = "The cluster gateway's added latency: lenet over the fast path through the gateway vs straight to a node."
MODELS: tuple[str, ...] = ("lenet",)
TRANSPORTS: tuple[str, ...] = ("tcp",)
BLOCK = 50  # calls per turn when alternating (as fastpath-latency)
PATHS = ("gateway", "direct", "node-direct", "gateway-direct")
# the direct clients ("node-direct", "gateway-direct") call the workers a lookup names
_TRANSPORT = {"gateway": "tcp", "direct": "tcp", "node-direct": "direct-tcp", "gateway-direct": "direct-tcp"}


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet",)
    transports: tuple[str, ...] = ("tcp",)
    nodes: int = 1  # serving raylets (1 or 2 on a small machine)
    requests: int = 3000  # single-client calls on each path
    warmup: int = 200
    connections: int = 8
    duration_s: float = 5.0
    warmup_s: float = 0.5
    start_timeout_s: float = 240.0
    netns: bool = False  # head, nodes and clients each on their own host (network namespaces; root)

    @classmethod
    def quick(cls) -> Params:
        return cls(requests=400, warmup=50, duration_s=1.5, warmup_s=0.3)

    def check(self) -> None:
        if not 1 <= self.nodes <= 4:
            raise ValueError("nodes must be 1 to 4 (each is a raylet and a server on this machine)")
        if self.requests < 1 or self.connections < 1 or self.duration_s <= 0:
            raise ValueError("requests and connections must be >= 1, duration_s > 0")


def compare(gateway_us: np.ndarray, direct_us: np.ndarray) -> dict[str, Any]:
    """Latency stats of both paths, the gateway's added µs at p50 and p99, and the ratios."""
    gw, direct = lat_stats(gateway_us), lat_stats(direct_us)
    out: dict[str, Any] = {"gateway_us": gw, "direct_us": direct}
    for q in ("p50", "p99"):
        g, d = gw[q], direct[q]
        out[f"added_{q}_us"] = None if g is None or d is None else g - d
        out[f"ratio_{q}"] = g / d if g is not None and d else None
    return out


def compare_loaded(gateway: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """Two closed-loop summaries side by side: p50, p99 (ms), req/s, errors and the ratios."""

    def pick(s: dict[str, Any]) -> dict[str, Any]:
        return {"p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"], "rps": s["throughput_rps"],
                "errors": s["errors"], "bottleneck": bottleneck(s)}

    g, d = pick(gateway), pick(direct)
    ratio = {k: g[k] / d[k] if g[k] is not None and d[k] else None for k in ("p50_ms", "p99_ms", "rps")}
    return {"gateway": g, "direct": d, "ratio": ratio}


def _alternate(clients: dict[str, Any], model: str, arg: Any, n: int, warmup: int) -> dict[str, np.ndarray]:
    for _ in range(warmup):
        for client in clients.values():
            client.infer_result(model, arg)
    out = {path: np.empty(n) for path in clients}
    clock = time.perf_counter
    with gc_paused():
        for start in range(0, n, BLOCK):
            for path, client in clients.items():
                for i in range(start, min(n, start + BLOCK)):
                    t0 = clock()
                    client.infer_result(model, arg)
                    out[path][i] = clock() - t0
    return {k: v * 1e6 for k, v in out.items()}


def _urls(gateway: str, node_endpoint: str) -> dict[str, str]:
    """Each path's URL: the gateway's two clients connect to it, the node's two to the node."""
    node = f"tcp://{node_endpoint}"
    return {"gateway": gateway, "direct": node, "node-direct": node, "gateway-direct": gateway}


def run(ctx: Context) -> ScenarioOutput:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("bench cluster-tax runs a local Ray cluster: install the cluster extra "
                           "(pip install -e '.[cluster]', which scripts/setup.sh does)") from e

    from splitserve.bench.inputs import as_call_arg, make_inputs
    from splitserve.cluster.actors.local import LocalCluster
    from splitserve.cluster.actors.node_server import NodeSpec
    from splitserve.cluster.config import ClusterConfig
    from splitserve.config import env_cache_dir
    from splitserve.models.catalog import zoo_entry

    p: Params = ctx.params  # type: ignore[assignment]
    p.check()
    model = p.models[0]
    arg = as_call_arg(make_inputs(zoo_entry(model).inputs, 1, p.seed)[0])
    if p.netns:
        return _across_hosts(ctx, p, model, arg)
    cfg = ClusterConfig.from_env(min_nodes=p.nodes, max_nodes=p.nodes)
    cache = env_cache_dir()
    root = tempfile.mkdtemp(prefix="ssray-")
    local = LocalCluster(cfg, root, NodeSpec(token="cluster-tax", cache_dir=str(cache) if cache else None,
                                             tmp_root=root), gateway_port=0, models=(model,))
    try:
        with ctx.task(f"starting a Ray head and {p.nodes} serving node(s)", 1):
            h = local.start(timeout_s=p.start_timeout_s)
        status = ray.get(h.controller.status.remote())
        node = status["nodes"][0]
        urls = _urls(f"tcp://127.0.0.1:{h.gateway_port}", node["endpoint"])
        with ctx.task("single client, alternating; then closed loops", 1 + len(PATHS)) as advance:
            seq, loaded = _measure(p, urls, model, arg, advance)
        gw_stats = ray.get(h.gateway.stats.remote())
    finally:
        local.stop()
    return _output(p, _result(p, model, urls, node, seq, loaded, gw_stats), seq)


def _across_hosts(ctx: Context, p: Params, model: str, arg: Any) -> ScenarioOutput:
    """The same measurement with the head, each node and the clients on hosts of their own."""
    from splitserve.bench import netns
    from splitserve.config import env_cache_dir

    why = netns.unavailable()
    if why is not None:
        raise RuntimeError(f"-p netns=true needs network namespaces: {why}")
    hosts = netns.Hosts()
    driver = None
    try:
        with ctx.task(f"starting hosts: a Ray head and {p.nodes} serving node(s), each in a network namespace", 1):
            head, clients = hosts.add("head"), hosts.add("clients")
            address = hosts.ray_head(head)
            for i in range(p.nodes):
                hosts.ray_worker(hosts.add(f"n{i}"), address, {netns.raycompat.MARKET_LABEL: "on-demand"})
            driver = netns.Driver(hosts, head, address, p.nodes, "cluster-tax", str(env_cache_dir() or ""),
                                  p.start_timeout_s, (model,))
            node = next(iter(driver.wait_active(p.nodes, p.start_timeout_s).values()))
        urls = _urls(f"tcp://{head.ip}:{driver.gateway_port}", node["endpoint"])
        with ctx.task("from the clients' host: single client, alternating; then closed loops",
                      1 + len(PATHS)) as advance:
            seq, loaded = netns.run_in(clients.ns, lambda: _measure(p, urls, model, arg, advance),
                                       timeout_s=p.duration_s * 2 + p.requests + 600)
        gw_stats = driver.ask("gateway")
    finally:
        if driver is not None:
            driver.close()
        hosts.close()
    return _output(p, _result(p, model, urls, node, seq, loaded, gw_stats), seq)


def _measure(p: Params, urls: dict[str, str], model: str, arg: Any,
             advance: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Single client alternating between the paths, then a closed loop on each."""
    from splitserve.bench.transports import close_sync, open_sync

    clients = {path: open_sync(_TRANSPORT[path], url) for path, url in urls.items()}
    try:
        seq = _alternate(clients, model, arg, p.requests, p.warmup)
    finally:
        for c in clients.values():
            close_sync(c)
    advance(1)
    loaded = {}
    for path, url in urls.items():
        loaded[path] = closed_loop_run(workload(_TRANSPORT[path], url, model, model, p.seed), p.connections,
                                       p.duration_s, warmup_s=p.warmup_s).summary(warmup_s=p.warmup_s)
        advance(1)
    return seq, loaded


def _result(p: Params, model: str, urls: dict[str, str], node: dict, seq: dict[str, np.ndarray],
            loaded: dict[str, Any], gw_stats: dict) -> dict[str, Any]:
    return {"model": model, "nodes": p.nodes, "netns": p.netns, "urls": urls, "direct_node": node["node"],
            "sequential": compare(seq["gateway"], seq["direct"]),
            "loaded": {"connections": p.connections, **compare_loaded(loaded["gateway"], loaded["direct"])},
            # the same comparisons of the two direct clients: "gateway" the gateway's, "direct" the node's
            "gateway_direct": {"sequential": compare(seq["gateway-direct"], seq["node-direct"]),
                               "loaded": compare_loaded(loaded["gateway-direct"], loaded["node-direct"])},
            "gateway": {k: gw_stats.get(k) for k in ("delivered", "resent", "dropped", "answers_by_node", "accepted")}}


def _output(p: Params, r: dict[str, Any], seq: dict[str, np.ndarray]) -> ScenarioOutput:
    s, ld, gd = r["sequential"], r["loaded"], r["gateway_direct"]
    # each path's own figures: the front ends' from the first comparison, the direct clients' from the second
    lat = {"gateway": s["gateway_us"], "direct": s["direct_us"], "node-direct": gd["sequential"]["direct_us"],
           "gateway-direct": gd["sequential"]["gateway_us"]}
    runs = {"gateway": ld["gateway"], "direct": ld["direct"], "node-direct": gd["loaded"]["direct"],
            "gateway-direct": gd["loaded"]["gateway"]}
    seq_rows = [(path, fmt(lat[path]["p50"]), fmt(lat[path]["p99"]), fmt(lat[path]["mean"])) for path in PATHS]
    load_rows = [(path, fmt(runs[path]["p50_ms"], 3), fmt(runs[path]["p99_ms"], 3), fmt(runs[path]["rps"], 0),
                  runs[path]["errors"]) for path in PATHS]
    gds, gdl = gd["sequential"], gd["loaded"]["ratio"]
    report = [report_intro(__doc__), "",
              f"{r['model']}, {r['nodes']} node(s){', each host a network namespace' if r['netns'] else ''}; "
              f"direct = node {r['direct_node'][:12]}.", "",
              f"## Single client ({p.requests} calls per path)", "",
              md_table(("path", "p50 µs", "p99 µs", "mean µs"), seq_rows), "",
              f"Gateway adds {fmt(s['added_p50_us'])} µs at p50 ({fmt(s['ratio_p50'], 2)}x) and "
              f"{fmt(s['added_p99_us'])} µs at p99 ({fmt(s['ratio_p99'], 2)}x). The gateway's direct clients: "
              f"{fmt(gds['ratio_p50'], 2)}x the node's direct path at p50, {fmt(gds['ratio_p99'], 2)}x at p99.", "",
              f"## {ld['connections']} connections, closed loop, {p.duration_s:g} s each", "",
              md_table(("path", "p50 ms", "p99 ms", "req/s", "errors"), load_rows), "",
              f"Ratios gateway / direct: p50 {fmt(ld['ratio']['p50_ms'], 2)}x, p99 {fmt(ld['ratio']['p99_ms'], 2)}x, "
              f"req/s {fmt(ld['ratio']['rps'], 2)}x; gateway-direct / node-direct: p50 {fmt(gdl['p50_ms'], 2)}x, "
              f"p99 {fmt(gdl['p99_ms'], 2)}x, req/s {fmt(gdl['rps'], 2)}x.", ""]
    notes = [f"{path}: {runs[path]['bottleneck']}" for path in PATHS if runs[path]["bottleneck"]]
    if notes:
        report += ["The load generator was the bottleneck:", ""] + [f"- {n}" for n in notes] + [""]
    lines = [f"single client: gateway p50 {fmt(s['gateway_us']['p50'])} µs vs direct {fmt(s['direct_us']['p50'])} µs "
             f"(+{fmt(s['added_p50_us'])} µs, {fmt(s['ratio_p50'], 2)}x); p99 {fmt(s['ratio_p99'], 2)}x",
             f"{ld['connections']} connections: p50 {fmt(ld['ratio']['p50_ms'], 2)}x, p99 {fmt(ld['ratio']['p99_ms'], 2)}x, "
             f"req/s {fmt(ld['ratio']['rps'], 2)}x of direct",
             f"gateway's direct clients: p50 {fmt(gds['ratio_p50'], 2)}x of the node's direct path "
             f"({fmt(gds['gateway_us']['p50'])} vs {fmt(gds['direct_us']['p50'])} µs); {ld['connections']} connections: "
             f"p50 {fmt(gdl['p50_ms'], 2)}x, req/s {fmt(gdl['rps'], 2)}x"]
    errors = sum(runs[path]["errors"] for path in PATHS)
    broken = [f"{errors} calls answered with an error"] if errors else []
    return ScenarioOutput(r, "\n".join(report), {"cluster_tax": _plot(seq)}, lines, broken)


def _plot(seq: dict[str, np.ndarray]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.8))
    ax = fig.subplots()
    for path, colour in (("gateway", "#2b7bba"), ("direct", "#7f7f7f"), ("node-direct", "#1b9e77"),
                         ("gateway-direct", "#d95f02")):
        xs = np.sort(seq[path])
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=path, color=colour)
    ax.set_xscale("log")
    ax.set_xlabel("round trip (µs)")
    ax.set_ylabel("fraction of calls")
    ax.set_title("lenet over the fast path: through the gateway, a node's direct path, the gateway's direct clients",
                 fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
