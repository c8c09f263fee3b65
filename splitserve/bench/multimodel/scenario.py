"""multimodel: more models than fit, served by an LRU memory manager (Rafiqi Figs 2-4).

``copies`` distinct-seed copies of one weight-heavy zoo model are registered from a generated
repository (distinct seeds, so a weight mix-up after a swap is a wrong answer, and every answer
is checked against that copy's local output). One seeded request sequence per access pattern
(sequential, uniform, zipf truncated to 1..M) and number of models accessed M is sent at
concurrency 1 to each variant, each its own server (no-limit's and lru's run side by side with
their requests interleaved, so a machine that slows down for a while slows both alike):

- ``no-limit``: no memory manager, every model resident (the throughput ceiling);
- ``load-every-request`` (same server): the client evicts the model after each answer;
- ``lru``: the memory manager, at most ``cache`` models resident under a byte budget that
  fits them;
- ``spawn-per-load``: the manager without spare workers or recycling, so each load starts a
  process as a new interpreter (its reload time against ``lru``'s, which binds a spare);
- ``fork-per-load``: the same, with each load's process forked from the node's fork server
  (``worker/forkserver.py``, the default): its reload time against both.

Before each timed sequence the cache is primed with the first min(M, cache) models in order,
so the reference LRU starts from a known content; the manager's loads (from ``/v2/memory``)
must equal the reference's misses. Hit and miss times give r = (miss - hit) / hit, and the
cost model 1 / (1 + m·r) predicts each sequence's throughput against ``no-limit``. Two
sub-runs on the ``lru`` server: a resident model's latency while other models load against
the same traffic without loads (B4), and ``clients`` concurrent clients over ``concurrent_models``
models (B5, the case the paper could not run).

With ``-p device=cuda`` the copies are served from device memory: the lru server under the
node's device budget with the pinned host tier, beside ``lru-disk`` (the tier off) on the
same sequences, for reloads from pinned memory against from disk (B6, Fig. 5;
``multimodel.device``). Without CUDA that arm says it is unavailable and reports nothing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from splitserve.bench.access import Pattern, lru_misses, sequence, shares, zipf_shares
from splitserve.bench.inputs import as_call_arg, make_inputs
from splitserve.bench.multimodel import device, report
from splitserve.bench.ownserver import get_json, own_server
from splitserve.bench.scenarios.base import Context, ScenarioOutput, report_intro, write_repository
from splitserve.bench.scenarios.base import Params as BaseParams
from splitserve.bench.timing import gc_paused, lat_stats
from splitserve.bench.transports import Target, close_async, close_sync, open_async, open_sync
from splitserve.bench.validate import Expected, compare, reference_model, reference_outputs

if TYPE_CHECKING:
    from splitserve.launcher import ServerProcess

NAME = "multimodel"
SUMMARY = "More models than fit: an LRU memory manager under sequential, uniform and zipf access vs no limit, " \
          "loading on every request and a new process per load (Rafiqi Figs 2-4)."
MODELS: tuple[str, ...] = ("resnet18", "resnet50", "resnet18_imagenet", "vgg19", "inception_v3", "densenet201",
                           "resnet152", "distilbert", "bert_tiny", "lenet")
TRANSPORTS: tuple[str, ...] = ("tcp", "unix")
VARIANTS: tuple[str, ...] = ("no-limit", "load-every-request", "lru", "spawn-per-load", "fork-per-load")
MAX_BATCH = 8  # as in the paper's Figs 2-4
# Private bytes one copy may measure at a load (activations at MAX_BATCH, allocator slack) beside
# its weights: measured here 11-36 MiB for vgg19, up to 99 MiB for resnet18 and 1.3 MiB for LeNet,
# varying from load to load.
PRIVATE_ALLOWANCE = 128 << 20


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("resnet18",)  # the architecture copied (one)
    transports: tuple[str, ...] = ("tcp",)
    copies: int = 8  # distinct-seed copies registered; seeds seed_base .. seed_base + copies - 1
    seed_base: int = 1
    cache: int = 4  # max_resident_models of the lru variants
    accessed: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # M, the number of models a sequence touches
    fig2_models: int = 5  # M of Fig. 2 and of the baselines
    patterns: tuple[str, ...] = ("sequential", "uniform", "zipf")
    zipf_a: float = 1.1
    requests: int = 200  # per (pattern, M) sequence, concurrency 1
    every_requests: int = 100  # load-every-request: requests per pattern (at fig2_models)
    spawn_reloads: int = 6  # spawn-per-load: timed reloads
    overlap_requests: int = 200  # B4: requests to the resident model per phase; 0 skips B4
    clients: int = 32  # B5: concurrent clients ...
    concurrent_models: int = 8  # ... over this many models ...
    concurrent_s: float = 20.0  # ... for this long; 0 skips B5
    memory_budget: int | None = None  # bytes; None: cache x (2 x one copy's weights + 128 MiB): the count binds
    device_budget: int | None = None  # device=cuda: bytes per GPU; None: cache x (weights + 256 MiB): the count binds
    drop_cache: bool = True  # evict_drop_cache: an evicted model's next load reads its weights from disk
    spare_workers: int = 1  # the node's pool of spare processes on the no-limit and lru servers
    variants: tuple[str, ...] = VARIANTS

    def __post_init__(self) -> None:
        if len(self.models) != 1:
            raise ValueError(f"multimodel copies one architecture; got models {list(self.models)}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
        for pattern in self.patterns:
            Pattern.parse(pattern)
        if not 1 <= self.cache < self.copies:
            raise ValueError(f"cache {self.cache} must be at least 1 and below copies {self.copies}")
        ms = (*self.accessed, self.fig2_models)
        if any(not 1 <= m <= self.copies for m in ms):
            raise ValueError(f"accessed {list(self.accessed)} and fig2_models {self.fig2_models} must lie in "
                             f"1..copies ({self.copies})")
        if min(self.requests, self.every_requests, self.spawn_reloads, self.overlap_requests, self.clients) < 0:
            raise ValueError("request counts and clients cannot be negative")
        if self.every_requests > self.requests:
            raise ValueError(f"every_requests {self.every_requests} cannot exceed requests {self.requests}: "
                             "load-every-request sends a prefix of the lru sequence")
        if self.spare_workers < 0:
            raise ValueError(f"spare_workers {self.spare_workers} cannot be negative")
        if self.concurrent_s > 0 and not 1 <= self.concurrent_models <= self.copies:
            raise ValueError(f"concurrent_models {self.concurrent_models} must lie in 1..copies ({self.copies})")
        if self.overlap_requests and not 2 <= self.cache < self.copies:
            raise ValueError("B4 needs 2 <= cache < copies (a resident model, and cache others that swap)")

    @classmethod
    def quick(cls) -> Params:
        return cls(models=("vgg19",), copies=5, accessed=(2, 5), requests=30, every_requests=10, spawn_reloads=2,
                   overlap_requests=30, clients=8, concurrent_models=5, concurrent_s=3.0)


# -- one sequence, timed -----------------------------------------------------------------------


@dataclass
class Copies:
    """The served copies: names, the one input every request sends, each copy's expected answer."""

    arch: str
    names: list[str]
    seeds: list[int]
    sample: Any
    expected: dict[str, list[np.ndarray]]
    weights_bytes: int

    def check(self, name: str, outputs: dict[str, np.ndarray]) -> bool:
        ok, _, _ = compare(list(outputs.values()), self.expected[name])
        return ok


@dataclass
class Timed:
    """One sequence sent at concurrency 1: per-request latency, the time it took, what went wrong."""

    models: list[int]
    latency_ms: np.ndarray
    busy_s: float = 0.0  # its requests' latency plus what ran after each answer (``after``)
    wrong: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def throughput_rps(self) -> float:
        return len(self.models) / self.busy_s if self.busy_s > 0 else 0.0


def drive(clients: Sequence[Any], copies: Copies, seq: Sequence[int],
          after: Callable[[str], None] | None = None) -> list[Timed]:
    """Send ``seq`` to every client (each its own server), one request at a time: request i
    goes to each client in turn before request i + 1, so a moment when the machine is slow
    falls on all of them alike. A failed request is counted, not retried; ``after`` runs after
    each answer, in its client's busy time but not in the request's latency. Throughput is
    requests over busy time: the other clients' turns are not counted."""
    from splitserve.errors import SplitServeError

    out = [Timed(list(seq), np.empty(len(seq))) for _ in clients]
    clock = time.perf_counter
    with gc_paused():
        for i, m in enumerate(seq):
            name = copies.names[m]
            for client, timed in zip(clients, out):
                t0 = clock()
                try:
                    r = client.infer_result(name, copies.sample)
                    timed.wrong += not copies.check(name, r.outputs)
                except (SplitServeError, OSError, TimeoutError) as e:
                    timed.errors.append(f"{name}: {type(e).__name__}: {e}")
                t1 = clock()
                timed.latency_ms[i] = (t1 - t0) * 1e3
                if after is not None:
                    after(name)
                timed.busy_s += clock() - t0
    return out


# -- one server per variant ---------------------------------------------------------------------


class Served:
    """A running variant: its server, a client, and its load and eviction counters."""

    def __init__(self, ctx: Context, server: ServerProcess, copies: Copies) -> None:
        self.ctx = ctx
        self.server = server
        self.copies = copies
        self.http = server.urls["http"]
        self.url = Target(server.urls).url(ctx.params.transports[0])
        self.token = (server.data_dir / "token").read_text().strip()
        self.client = open_sync(ctx.params.transports[0], self.url)
        from splitserve.client.http import HttpClient

        self.management = HttpClient(self.http, token=self.token)

    def close(self) -> None:
        close_sync(self.client)
        self.management.close()

    def counts(self) -> tuple[int, int]:
        """(loads, evictions) so far, from ``/v2/memory``."""
        doc = self.memory()
        return int(doc["loads"]), int(doc["evictions"])

    def memory(self) -> dict[str, Any]:
        return get_json(f"{self.http}/v2/memory")

    def prime(self, models: Sequence[int]) -> None:
        """Request ``models`` in order (untimed, answers checked), so they are the most recently used."""
        (timed,) = drive([self.client], self.copies, list(models))
        if timed.wrong or timed.errors:
            raise RuntimeError(f"priming {[self.copies.names[m] for m in models]}: {timed.wrong} wrong answers, "
                               f"errors {timed.errors[:3]}")

    def evict(self, name: str) -> None:
        self.management.evict(name)


def cell(servers: dict[str, tuple[Served, int | None]], pattern: str, m: int,
         seq: list[int]) -> dict[str, dict[str, Any]]:
    """One sequence on every server at once (``drive``), each primed first, each server's
    loads against the reference LRU's misses for its capacity (None: no limit, nothing loads)."""
    refs, before = {}, {}
    for label, (s, capacity) in servers.items():
        primed = list(range(m if capacity is None else min(m, capacity)))
        s.prime(primed)
        refs[label] = lru_misses(seq, capacity, primed) if capacity is not None else [False] * len(seq)
        before[label] = s.counts()
    timed = drive([s.client for s, _ in servers.values()], next(iter(servers.values()))[0].copies, seq)
    out = {}
    for (label, (s, _)), t in zip(servers.items(), timed):
        after = s.counts()
        out[label] = summarise(pattern, m, seq, t, refs[label], after[0] - before[label][0],
                               after[1] - before[label][1])
    return out


def summarise(pattern: str, m: int, seq: list[int], timed: Timed, ref: list[bool], loads: int,
              evictions: int) -> dict[str, Any]:
    """One sequence's record: shares, reference misses, server loads, latency split by hit and miss."""
    miss = np.asarray(ref, dtype=bool)
    return {"pattern": pattern, "models": m, "requests": len(seq), "shares": shares(seq, m),
            "reference_misses": int(miss.sum()), "miss_ratio": float(miss.mean()) if len(seq) else None,
            "loads": loads, "evictions": evictions, "loads_equal_reference": loads == int(miss.sum()),
            "busy_s": timed.busy_s, "throughput_rps": timed.throughput_rps, "wrong": timed.wrong,
            "errors": len(timed.errors), "first_errors": timed.errors[:3],
            "latency_ms": lat_stats(timed.latency_ms), "hit_ms": lat_stats(timed.latency_ms[~miss]),
            "miss_ms": lat_stats(timed.latency_ms[miss]), "_latency": timed.latency_ms, "_miss": miss}


def _repository(ctx: Context, copies: Copies) -> Any:
    cfg = {n: {"max_batch_size": MAX_BATCH, "artifact": {"kind": "zoo", "arch": copies.arch, "seed": s}}
           for n, s in zip(copies.names, copies.seeds)}
    return write_repository(ctx.results.path / "repository", cfg, ctx.params.device)


def _copies(p: Params) -> Copies:
    from splitserve.models.catalog import zoo_entry

    arch = p.models[0]
    seeds = [p.seed_base + i for i in range(p.copies)]
    names = [f"{arch}_s{s}" for s in seeds]
    sample = make_inputs(zoo_entry(arch).inputs, 1, p.seed)[0]
    expected = {n: reference_outputs(arch, s, [sample])[0] for n, s in zip(names, seeds)}
    weights = sum(t.numel() * t.element_size() for t in reference_model(arch, seeds[0]).state_dict().values())
    return Copies(arch, names, seeds, as_call_arg(sample), expected, weights)


def _server_env(p: Params, spares: bool, fork: bool = True) -> dict[str, str]:
    """Settings without a flag, always spelled out: the bench's own environment may carry others."""
    env = {"SPLITSERVE_EVICT_DROP_CACHE": "1" if p.drop_cache else "0",
           "SPLITSERVE_SPARE_WORKERS": str(p.spare_workers if spares else 0),
           "SPLITSERVE_FORK_WORKERS": "1" if fork else "0"}
    if not spares:  # every load starts a process, every unload ends one
        env["SPLITSERVE_RECYCLE_SLACK_BYTES"] = "0"
    return env


def _args(repo: Any, budget: int | None, cache: int | None) -> list[str]:
    args = ["--repository", str(repo)]
    if budget is not None and cache is not None:
        args += ["--memory-budget", str(budget), "--max-resident-models", str(cache)]
    return args


@contextmanager
def _variant(ctx: Context, copies: Copies, label: str, args: list[str], env: dict[str, str],
             validate: Sequence[str]) -> Iterator[Served]:
    """One variant's own server, its answers for the ``validate`` copies checked before timing."""
    with own_server(ctx, label, args, env=env) as server:
        expected = {n: Expected(copies.arch, copies.seeds[copies.names.index(n)]) for n in validate}
        ctx.validate(Target(server.urls), expected, ctx.params.transports[:1])
        served = Served(ctx, server, copies)
        try:
            yield served
        finally:
            served.close()


# -- the sub-runs ----------------------------------------------------------------------------------


def _grid(p: Params) -> list[tuple[str, int]]:
    return [(pat, m) for pat in p.patterns for m in sorted({*p.accessed, p.fig2_models})]


def _seq(p: Params, pattern: str, m: int, n: int) -> list[int]:
    """The one sequence every variant gets for (pattern, M)."""
    return sequence(pattern, m, n, seed=p.seed * 1000 + list(Pattern).index(Pattern.parse(pattern)) * 100 + m,
                    zipf_a=p.zipf_a)


def _sweep(ctx: Context, servers: dict[str, tuple[Served, int | None]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every (pattern, M) sequence on every server, their requests interleaved (``drive``), so a
    machine that slows down for a while slows the ratios' numerator and denominator alike."""
    p: Params = ctx.params  # type: ignore[assignment]
    grid = _grid(p)
    out: dict[str, dict[str, dict[str, Any]]] = {label: {} for label in servers}
    with ctx.task(f"{' and '.join(servers)}: {len(grid)} sequences of {p.requests} requests each",
                  len(grid)) as advance:
        for pattern, m in grid:
            for label, record in cell(servers, pattern, m, _seq(p, pattern, m, p.requests)).items():
                out[label][f"{pattern}/{m}"] = record
            advance(1)
    return out


def _every_request(ctx: Context, s: Served) -> dict[str, dict[str, Any]]:
    """Load on every request: after each answer the client evicts the model (no manager)."""
    p: Params = ctx.params  # type: ignore[assignment]
    m = p.fig2_models
    out: dict[str, dict[str, Any]] = {}
    with ctx.task(f"load-every-request: {len(p.patterns)} x {p.every_requests} requests", len(p.patterns)) as adv:
        for pattern in p.patterns:
            for name in s.copies.names[:m]:  # start cold: every request of the sequence loads
                s.evict(name)
            seq = _seq(p, pattern, m, p.requests)[:p.every_requests]
            before = s.counts()
            (timed,) = drive([s.client], s.copies, seq, after=s.evict)
            after = s.counts()
            out[pattern] = summarise(pattern, m, seq, timed, [True] * len(seq), after[0] - before[0],
                                     after[1] - before[1])
            # the client's evict calls: in the wall time, not in any request's latency
            out[pattern]["evict_ms_mean"] = (timed.busy_s * 1e3 - float(timed.latency_ms.sum())) / max(1, len(seq))
            adv(1)
    return out


def _process_per_load(ctx: Context, s: Served, label: str) -> dict[str, Any]:
    """Two models with room for one: every request after the first is a reload by a new process."""
    p: Params = ctx.params  # type: ignore[assignment]
    s.prime([0])
    seq = [(i + 1) % 2 for i in range(p.spawn_reloads)]
    with ctx.task(f"{label}: {len(seq)} reloads", 1):
        before = s.counts()
        (timed,) = drive([s.client], s.copies, seq)
        after = s.counts()
    return summarise("alternate", 2, seq, timed, [True] * len(seq), after[0] - before[0], after[1] - before[1])


def _overlap(ctx: Context, s: Served) -> dict[str, Any]:
    """B4: model 0's latency while a second client's requests make other models load, against
    the same second client touching only resident models.

    Both phases keep two clients busy, so the only difference is the loads: in ``quiet`` the
    second client cycles over cache - 1 other models (all fit beside model 0); in ``loading``
    over cache others, so every one of its requests swaps one of them (model 0, used all the
    time, stays the most recently used)."""
    p: Params = ctx.params  # type: ignore[assignment]
    phases = {"quiet": list(range(1, p.cache)), "loading": list(range(1, p.cache + 1))}
    out: dict[str, Any] = {}
    with ctx.task(f"B4: model 0 with and without other loads, {p.overlap_requests} requests each", 2) as advance:
        for phase, others in phases.items():
            s.prime([*others, 0])
            before = s.counts()
            out[phase] = _beside(ctx, s, others, p.overlap_requests)
            after = s.counts()
            out[phase] |= {"loads": after[0] - before[0], "evictions": after[1] - before[1]}
            advance(1)
    q, ld = out["quiet"]["latency_ms"], out["loading"]["latency_ms"]
    out["p99_ratio"] = ld["p99"] / q["p99"] if q["p99"] else None
    out["p50_ratio"] = ld["p50"] / q["p50"] if q["p50"] else None
    return out


def _beside(ctx: Context, s: Served, others: list[int], n: int) -> dict[str, Any]:
    """``n`` requests to model 0 while a second client cycles over ``others`` until they end."""
    stop = threading.Event()
    moving = threading.Event()
    background: dict[str, Any] = {}

    def cycle() -> None:
        # not through ``drive``: its pause of the collector is process-wide, and the timed
        # loop in the main thread pauses it already
        from splitserve.errors import SplitServeError

        client = open_sync(ctx.params.transports[0], s.url)
        counts = {"requests": 0, "wrong": 0, "errors": 0}
        try:
            while not stop.is_set():
                name = s.copies.names[others[counts["requests"] % len(others)]]
                try:
                    r = client.infer_result(name, s.copies.sample)
                    counts["wrong"] += not s.copies.check(name, r.outputs)
                except (SplitServeError, OSError, TimeoutError):
                    counts["errors"] += 1
                counts["requests"] += 1
                moving.set()
        finally:
            background.update(counts)
            moving.set()
            close_sync(client)

    thread = threading.Thread(target=cycle, name="multimodel-b4", daemon=True)
    thread.start()
    try:
        moving.wait()  # the second client has answered once: both are running
        (timed,) = drive([s.client], s.copies, [0] * n)
    finally:
        stop.set()
        thread.join()
    return {"requests": n, "latency_ms": lat_stats(timed.latency_ms), "wrong": timed.wrong,
            "errors": len(timed.errors), "background": background}


def _concurrent(ctx: Context, s: Served) -> dict[str, Any]:
    """B5: ``clients`` closed-loop clients, each over ``concurrent_models`` models uniformly."""
    p: Params = ctx.params  # type: ignore[assignment]
    before = s.counts()
    with ctx.task(f"B5: {p.clients} clients over {p.concurrent_models} models, {p.concurrent_s:g} s", 1):
        res = asyncio.run(_clients(ctx, s))
    after = s.counts()
    return res | {"clients": p.clients, "models": p.concurrent_models, "duration_s": p.concurrent_s,
                  "loads": after[0] - before[0], "evictions": after[1] - before[1]}


async def _clients(ctx: Context, s: Served) -> dict[str, Any]:
    from splitserve.errors import SplitServeError

    p: Params = ctx.params  # type: ignore[assignment]
    lat: list[float] = []
    counts = {"sent": 0, "ok": 0, "wrong": 0}
    kinds: dict[str, int] = {}
    clock = time.perf_counter
    end = clock() + p.concurrent_s

    async def one(i: int) -> None:
        rng = np.random.default_rng(p.seed * 7919 + i)  # uniform, as Pattern.UNIFORM, drawn as it goes
        client = await open_async(p.transports[0], s.url)
        try:
            while clock() < end:
                name = s.copies.names[int(rng.integers(p.concurrent_models))]
                counts["sent"] += 1
                t0 = clock()
                try:
                    r = await client.infer_result(name, s.copies.sample)
                except (SplitServeError, OSError, TimeoutError) as e:
                    kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
                    continue
                lat.append((clock() - t0) * 1e3)
                counts["ok"] += 1
                counts["wrong"] += not s.copies.check(name, r.outputs)
        finally:
            await close_async(client)

    start = clock()
    await asyncio.gather(*(one(i) for i in range(p.clients)))
    wall = clock() - start
    return {**counts, "errors": sum(kinds.values()), "error_kinds": kinds, "wall_s": wall,
            "throughput_rps": counts["ok"] / wall if wall > 0 else 0.0, "latency_ms": lat_stats(lat)}


# -- the run ------------------------------------------------------------------------------------------


def _budget(p: Params, copies: Copies) -> int:
    """The lru variant's byte budget: room for ``cache`` copies whatever private bytes each
    load measures (up to its weights again plus ``PRIVATE_ALLOWANCE``), so the model count is
    what binds and the reference LRU applies; the report says how many the bytes would hold."""
    if p.memory_budget is not None:
        return p.memory_budget
    return p.cache * (2 * copies.weights_bytes + PRIVATE_ALLOWANCE)


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    if ctx.urls:
        raise ValueError("multimodel starts its own servers (with and without a memory budget); it cannot "
                         "measure a running server (--url)")
    device.require_cuda(p.device)
    with ctx.task(f"building {p.copies} local copies of {p.models[0]} for validation", 1):
        copies = _copies(p)
    repo = _repository(ctx, copies)
    budget = _budget(p, copies)
    gpu = p.device != "cpu"
    dev_budget = device.device_budget(p.cache, copies.weights_bytes, p.device_budget) if gpu else None
    results: dict[str, Any] = {"arch": copies.arch, "copies": copies.names, "seeds": copies.seeds,
                               "weights_bytes": copies.weights_bytes, "budget_bytes": budget, "cache": p.cache,
                               "device": p.device, "device_budget_bytes": dev_budget,
                               "zipf_shares": {str(m): list(zipf_shares(m, p.zipf_a))
                                               for m in sorted({*p.accessed, p.fig2_models})}}
    lookup = copies.names[:max(p.accessed + (p.fig2_models,))]
    with ExitStack() as stack:  # no-limit and lru side by side: their sequences interleave
        servers: dict[str, tuple[Served, int | None]] = {}
        if {"no-limit", "load-every-request"} & set(p.variants):
            servers["no-limit"] = (stack.enter_context(_variant(ctx, copies, "no-limit", _args(repo, None, None),
                                                                _server_env(p, True), lookup)), None)
        lru_arms = {"lru": True, **({"lru-disk": False} if gpu else {})} if "lru" in p.variants else {}
        for label, pinned in lru_arms.items():  # on a GPU: the pinned tier's reloads against the disk's
            args = _args(repo, budget, p.cache) + (device.server_args(dev_budget, pinned) if dev_budget else [])
            servers[label] = (stack.enter_context(_variant(ctx, copies, label, args, _server_env(p, True),
                                                           copies.names)), p.cache)
        results |= _sweep(ctx, {k: v for k, v in servers.items() if k in (*p.variants, "lru-disk")})
        if "load-every-request" in p.variants:
            results["load-every-request"] = _every_request(ctx, servers["no-limit"][0])
        if "lru" in servers:
            lru = servers["lru"][0]
            if p.overlap_requests:
                results["overlap"] = _overlap(ctx, lru)
            if p.concurrent_s > 0 and p.clients:
                results["concurrent"] = _concurrent(ctx, lru)
            results["memory"] = lru.memory()
    for label, fork in (("spawn-per-load", False), ("fork-per-load", True)):
        if label in p.variants and p.spawn_reloads:
            with _variant(ctx, copies, label, _args(repo, budget, 1), _server_env(p, False, fork),
                          copies.names[:2]) as s:
                results[label] = _process_per_load(ctx, s, label)
    if importlib.util.find_spec("ray") is None:
        ctx.notes.append("Ray Serve is not installed here, so the peer (@serve.multiplexed("
                         f"max_num_models_per_replica={p.cache}) on the same sequences) was not run")
    return _output(p, results)


def _output(p: Params, r: dict[str, Any]) -> ScenarioOutput:
    f = report.figures(p, r)
    lines, markdown = report.markdown(report_intro(__doc__), p, r, f, MAX_BATCH)
    result = {k: report.public(v) for k, v in r.items()} | {"figures": f}
    return ScenarioOutput(result, markdown, report.plots(p, r, f), lines, report.broken(r))


__all__ = ["MODELS", "NAME", "Params", "SUMMARY", "TRANSPORTS", "run"]
