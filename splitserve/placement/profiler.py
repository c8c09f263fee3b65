"""The one profiler: per model, mean batch latency L[t, b], per-segment latency, the memory
one batch adds, and slowdowns under co-location.

Packrat's optimizer reads L[t, b]; REEF's padding rule and the worker's segment budget
read the per-segment times; PROTEAN reads L[t, b] as its solo time per partition size (so
its RDF), the per-batch footprint, and the FBRs fitted from co-location runs. All come
from the same stored profile (registry table ``profiles``, keyed by model, machine and
kind). Each thread count runs in its own isolated process pinned to that many CPUs of one
socket, one at a time, so measurements do not disturb each other; co-location runs pin
several such processes to the same CPUs on purpose.

Kinds: ``latency`` and ``segments`` (``profile_model``), ``footprint`` (``{batch: peak bytes
one batch added}``, from the same measuring process), ``colocation`` (a list of
``ColocationRun.to_dict()``, kept under every member model) and ``fbr``
(``slowdown.FbrFit.to_dict()`` of the latest fit over a model's stored runs). Measured on a
MIG device (``placement.mig_profiler``) each kind is kept per MIG profile, as
``kind@profile`` (``latency@1g.18gb``: ``profile_kind``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.errors import InvalidInput
from splitserve.launcher import stop_process
from splitserve.modelconfig import ModelConfig
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.topology import allocate, read_topology


def machine_id() -> str:
    """What a profile was measured on: host, CPU model and usable CPU count."""
    model = "unknown-cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{model}|{len(os.sched_getaffinity(0))}cpu"


@dataclass(frozen=True)
class ModelProfile:
    """L[t, b] and the per-segment split of it, for one model on one machine."""

    latency: LatencyProfile
    segments: dict[tuple[int, int], list[float]]  # (t, b) -> seconds per segment
    machine: str
    # b -> peak bytes one batch of b added (the largest over the thread counts measured);
    # empty where the peak could not be measured
    footprint: dict[int, int] = field(default_factory=dict)

    def segments_to_dict(self) -> dict[str, list[float]]:
        return {f"{t},{b}": v for (t, b), v in self.segments.items()}

    def segment_times_ns(self, threads: int) -> list[tuple[int, int, int]]:
        """For a worker with ``threads`` threads: (segment, batch, ns) (its padding budget)."""
        return [(i, b, int(s * 1e9)) for (t, b), segs in self.segments.items() if t == threads
                for i, s in enumerate(segs)]


def profile_kind(kind: str, profile: str | None = None) -> str:
    """The stored kind of a profile measured on the MIG ``profile`` (``latency@1g.18gb``), or
    on the CPUs (None: ``kind`` itself)."""
    return kind if profile is None else f"{kind}@{profile}"


def default_batches(max_batch: int) -> list[int]:
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b *= 2
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def profile_model(config: ModelConfig, model_dir: Path | None, cache_dir: Path, threads: Sequence[int],
                  batches: Sequence[int], *, min_iters: int = 5, max_iters: int = 50, budget_s: float = 2.0,
                  on_point: Callable[[int, int, float], None] | None = None) -> ModelProfile:
    """Measure every (t, b); ``on_point(t, b, seconds)`` is called as each one finishes."""
    cores = read_topology()
    if max(threads) > len(cores):
        raise InvalidInput(f"cannot profile {max(threads)} threads on a machine with {len(cores)} usable CPUs")
    if any(b < 1 or b > config.max_batch_size for b in batches):
        raise InvalidInput(f"batch sizes must be within 1..{config.max_batch_size} for {config.name!r}")
    sweeps = []
    for t in sorted(set(threads)):
        (cpus,) = allocate([t], cores)
        sweeps.append((t, cpus, {}))
    return sweep_profile(config, model_dir, cache_dir, sweeps, batches, min_iters=min_iters, max_iters=max_iters,
                         budget_s=budget_s, on_point=on_point)


def sweep_profile(config: ModelConfig, model_dir: Path | None, cache_dir: Path,
                  sweeps: Sequence[tuple[int, Sequence[int], Mapping[str, str]]], batches: Sequence[int], *,
                  min_iters: int = 5, max_iters: int = 50, budget_s: float = 2.0,
                  on_point: Callable[[int, int, float], None] | None = None) -> ModelProfile:
    """One isolated measuring process per ``(threads, cpus, env)`` of ``sweeps``, one after
    another, each timing every batch size of ``batches``: L[threads, b]. ``env`` is added to
    the process's environment (a MIG device's ``CUDA_VISIBLE_DEVICES``)."""
    table: dict[tuple[int, int], float] = {}
    segments: dict[tuple[int, int], list[float]] = {}
    footprint: dict[int, int] = {}
    for t, cpus, env in sweeps:
        job = {"config": config.to_dict(), "model_dir": str(model_dir) if model_dir else None,
               "cache_dir": str(cache_dir), "threads": t, "cpus": list(cpus), "batches": sorted(set(batches)),
               "min_iters": min_iters, "max_iters": max_iters, "budget_s": budget_s}
        # stderr goes to a file: a chatty child must never block on a full pipe we do not read
        with tempfile.TemporaryFile() as err, subprocess.Popen(
                [sys.executable, "-m", "splitserve.placement.measure", json.dumps(job)],
                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **env}) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                point = json.loads(line)
                key = (t, int(point["batch"]))
                table[key] = float(point["mean_s"])
                segments[key] = [float(x) for x in point["segments_s"]]
                if point.get("footprint_bytes") is not None:
                    footprint[key[1]] = max(footprint.get(key[1], 0), int(point["footprint_bytes"]))
                if on_point is not None:
                    on_point(t, key[1], table[key])
            if proc.wait() != 0:
                err.seek(0)
                where = f" on {env}" if env else ""
                raise InvalidInput(f"profiling {config.name!r} with {t} threads{where} failed: "
                                   f"{err.read().decode(errors='replace')[-2000:]}")
    return ModelProfile(LatencyProfile(config.name, table), segments, machine_id(), footprint)


def save_profile(registry: Any, profile: ModelProfile, mig: str | None = None) -> None:
    """Store ``profile``, as measured on the CPUs or (``mig``) on a device of that MIG profile."""
    model, machine = profile.latency.model, profile.machine
    registry.save_profile(model, machine, profile_kind("latency", mig), profile.latency.to_dict())
    registry.save_profile(model, machine, profile_kind("segments", mig), profile.segments_to_dict())
    if profile.footprint:  # a profile without one (e.g. merged by a benchmark) keeps the stored one
        registry.save_profile(model, machine, profile_kind("footprint", mig),
                              {str(b): n for b, n in sorted(profile.footprint.items())})


def load_profile(registry: Any, model: str, machine: str | None = None, mig: str | None = None) -> ModelProfile | None:
    """The stored profile of ``model`` on this machine's CPUs or (``mig``) on its MIG profile;
    None if it was never profiled there."""
    machine = machine or machine_id()
    lat = registry.load_profile(model, machine, profile_kind("latency", mig))
    if lat is None:
        return None
    segs = registry.load_profile(model, machine, profile_kind("segments", mig)) or {}
    foot = registry.load_profile(model, machine, profile_kind("footprint", mig)) or {}
    return ModelProfile(
        LatencyProfile.from_dict(lat),
        {tuple(int(x) for x in k.split(",")): v for k, v in segs.items()},  # type: ignore[misc]
        machine,
        {int(b): int(n) for b, n in foot.items()},
    )


def footprint_at(table: Mapping[int, int], batch: int) -> int | None:
    """Peak bytes a batch of ``batch`` adds, from ``{batch: bytes}`` measured at some sizes:
    exact where measured, linear between two measured sizes, the smallest size's bytes below
    it (never assumed smaller than measured), and proportional to the batch beyond the
    largest (activations grow with the batch). None when nothing was measured."""
    if not table:
        return None
    sizes = sorted(table)
    if batch >= sizes[-1]:
        return int(round(table[sizes[-1]] * batch / sizes[-1]))
    return int(round(np.interp(batch, sizes, [table[b] for b in sizes])))


def load_footprint(registry: Any, model: str, batch: int, machine: str | None = None) -> int | None:
    """The stored per-batch footprint of ``model`` at ``batch`` (``footprint_at``); None if
    ``splitserve profile`` measured none here."""
    stored = registry.load_profile(model, machine or machine_id(), "footprint") or {}
    return footprint_at({int(b): int(n) for b, n in stored.items()}, batch)


# -- co-location (PROTEAN's FBRs) -------------------------------------------------------------


def member_key(model: str, batch: int) -> str:
    """A co-location member's key: the model at one batch size (``"resnet18@8"``)."""
    return f"{model}@{batch}"


def key_model(key: str) -> str:
    """The model of a member key."""
    return key.rsplit("@", 1)[0]


@dataclass(frozen=True)
class ColocationRun:
    """One co-location run: its members ran together, in a closed loop with full overlap, in
    processes pinned to the same ``cores`` CPUs (each with ``cores`` threads). ``mean_s`` is
    each member's mean batch latency in the overlapping window, ``solo_s`` its latency alone
    on the same CPUs measured in the same call, ``slowdowns`` their ratio (Eq. 1's T_k/Solo_k)."""

    cores: int
    members: tuple[str, ...]  # member keys, a key twice for a model run beside itself
    slowdowns: tuple[float, ...]
    solo_s: tuple[float, ...]
    mean_s: tuple[float, ...]

    def same_set(self, other: ColocationRun) -> bool:
        return self.cores == other.cores and sorted(self.members) == sorted(other.members)

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "members": list(self.members), "slowdowns": list(self.slowdowns),
                "solo_s": list(self.solo_s), "mean_s": list(self.mean_s)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ColocationRun:
        members = tuple(str(m) for m in d["members"])
        slowdowns = tuple(float(x) for x in d["slowdowns"])
        solo = tuple(float(x) for x in d["solo_s"])
        mean = tuple(float(x) for x in d.get("mean_s", [a * b for a, b in zip(slowdowns, solo)]))
        if not members or not len(members) == len(slowdowns) == len(solo) == len(mean):
            raise InvalidInput(f"co-location run {dict(d)!r}: members, slowdowns and times differ in length")
        return cls(int(d["cores"]), members, slowdowns, solo, mean)


@dataclass(frozen=True)
class ColocationProfile:
    """What one ``profile_colocation`` call measured: solo times and runs on the same CPUs."""

    cores: int
    cpus: tuple[int, ...]
    solo_s: dict[str, float]  # member key -> seconds per batch alone on ``cpus``
    runs: list[ColocationRun]
    machine: str
    omp_wait_policy: str | None = None


@dataclass(frozen=True)
class Measurer:
    """What one measuring process runs: a model at one batch size on some CPUs."""

    config: ModelConfig
    model_dir: Path | None
    batch: int
    cpus: tuple[int, ...]
    threads: int = 0  # intra-op threads; 0: one per CPU of ``cpus``

    @property
    def key(self) -> str:
        return member_key(self.config.name, self.batch)


class _Process:
    """A ``measure`` process in loop mode: ready once its model is warm, then one mean batch
    latency per window it is given. Every read is bounded by a deadline."""

    def __init__(self, m: Measurer, cache_dir: Path, env: Mapping[str, str]) -> None:
        self.measurer = m
        job = {"mode": "loop", "config": m.config.to_dict(), "model_dir": str(m.model_dir) if m.model_dir else None,
               "cache_dir": str(cache_dir), "threads": m.threads or len(m.cpus), "cpus": list(m.cpus), "batch": m.batch}
        # stderr goes to a file: a chatty child must never block on a full pipe we do not read
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.placement.measure", json.dumps(job)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     env={**os.environ, **env}, bufsize=0)
        self._buf = b""
        self.estimate_s = 0.0  # seconds per batch: the warm-up batch's, then the latest solo mean

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        except BrokenPipeError:
            raise InvalidInput(f"measuring {self.measurer.key} failed{self._stderr()}") from None

    def read(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise InvalidInput(f"measuring {self.measurer.key} gave no answer in time{self._stderr()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise InvalidInput(f"measuring {self.measurer.key} failed{self._stderr()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def _stderr(self) -> str:
        self.err.seek(0)
        tail = self.err.read().decode(errors="replace")[-2000:]
        return f": {tail}" if tail else ""

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # end of its commands: it exits
        stop_process(self.proc, 10, terminate=False)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.err.close()


class MeasuringProcesses:
    """Warm measuring processes, one per ``Measurer``, run alone or together in windows of
    full overlap. A context manager: leaving it ends every process it started."""

    def __init__(self, measurers: Sequence[Measurer], cache_dir: Path, *, omp_wait_policy: str | None = None,
                 start_timeout_s: float = 300.0, env: Mapping[str, str] | None = None) -> None:
        env = {**(env or {}), **({"OMP_WAIT_POLICY": omp_wait_policy} if omp_wait_policy else {})}
        self.procs: list[_Process] = []
        try:
            for m in measurers:
                self.procs.append(_Process(m, cache_dir, env))
            deadline = time.monotonic() + start_timeout_s
            for p in self.procs:  # they load side by side; wait for all to be warm
                p.estimate_s = float(p.read(deadline)["warm_s"])
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> MeasuringProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in self.procs:
            p.close()
        self.procs = []

    def run(self, which: Sequence[int], window_s: float, lead_s: float = 0.05, tries: int = 4) -> list[float]:
        """Run processes ``which`` (indices) together for ``window_s`` of full overlap; each
        one's mean batch latency in that window. A window in which one of them finished no
        batch is run again twice as long, ``tries`` times in all (then InvalidInput). A
        process run alone keeps its mean as the estimate ``window`` sizes windows from."""
        procs = [self.procs[i] for i in which]
        for _ in range(tries):
            t0 = time.monotonic() + lead_s  # every process is sleeping until t0 when it comes
            w0 = t0 + lead_s
            w1 = w0 + window_s
            for p in procs:
                p.send({"t0": t0, "w0": w0, "w1": w1})
            # each finishes the batch it is in at w1: allow a generous multiple of the window
            deadline = w1 + 10 * window_s + 30.0
            means = [p.read(deadline)["mean_s"] for p in procs]
            if None not in means:
                if len(procs) == 1:
                    procs[0].estimate_s = float(means[0])
                return [float(m) for m in means]
            window_s *= 2
        raise InvalidInput(f"{', '.join(p.measurer.key for p, m in zip(procs, means) if m is None)}: no batch "
                           f"finished inside a {window_s / 2:.2f} s window; raise the budget")

    def window(self, which: Sequence[int], budget_s: float, min_iters: int) -> float:
        """A window long enough for ``min_iters`` batches of the slowest of ``which`` if each
        were slowed as much as processor sharing among them would (and some), at least
        ``budget_s``. The estimate of a batch's time is its latest solo mean (at first, the
        warm-up batch's time)."""
        slowest = max(self.procs[i].estimate_s for i in which)
        return max(budget_s, min_iters * slowest * len(which) * 1.5)


def colocation_sets(models: Sequence[str]) -> list[tuple[str, ...]]:
    """The co-location sets ``splitserve profile MODEL --colocate OTHER...`` runs: MODEL with
    each OTHER, MODEL with itself, and the whole set (when it is more than a pair)."""
    first, others = models[0], list(dict.fromkeys(m for m in models[1:]))
    sets = [(first, o) for o in others if o != first] + [(first, first)]
    if len(others) > 1:
        sets.append((first, *others))
    return sets


def profile_colocation(configs: Sequence[ModelConfig], cores: int, batch: int | Mapping[str, int],
                       cache_dir: Path, *, model_dirs: Mapping[str, Path | None] | None = None,
                       sets: Sequence[Sequence[str]] | None = None, cpus: Sequence[int] | None = None,
                       budget_s: float = 1.0, min_iters: int = 3, omp_wait_policy: str | None = None,
                       on_run: Callable[[ColocationRun], None] | None = None) -> ColocationProfile:
    """Co-location runs of ``configs`` (models by name, each at ``batch`` or ``batch[name]``)
    on one partition of ``cores`` CPUs, PROTEAN's "default MPS": every process pinned to all
    of them with ``cores`` threads.

    Each model is first measured alone on those CPUs, then each set of ``sets`` (model names;
    a name twice runs it beside itself; default ``colocation_sets``) runs together behind a
    barrier, in a closed loop, measured only while all run. Solo and co-located runs use the
    same warm processes, so each slowdown is one machine state's ratio. ``omp_wait_policy``
    sets OMP_WAIT_POLICY in the measuring processes (PASSIVE: idle OpenMP threads sleep
    instead of spinning on CPUs a co-runner needs). ``on_run`` is called as each run ends.
    ``cpus`` names the partition's CPUs (its first ``cores``); by default the topology's
    allocator picks ``cores`` neighbouring ones.
    """
    by_name, sets, batches = colocation_plan(configs, batch, sets)
    if cpus is None:
        topo = read_topology()
        if not 1 <= cores <= len(topo):
            raise InvalidInput(f"cannot co-locate on {cores} cores of a machine with {len(topo)} usable CPUs")
        (cpus,) = allocate([cores], topo)
    part = tuple(cpus)[:cores]
    if len(part) != cores:
        raise InvalidInput(f"{cores} cores asked for, {len(part)} CPUs given")
    measurers = colocation_measurers([by_name[n] for n in by_name], batches, sets, part, model_dirs)
    with MeasuringProcesses(measurers, cache_dir, omp_wait_policy=omp_wait_policy) as procs:
        solo, runs = run_colocations(procs, range(len(measurers)), sets, budget_s=budget_s, min_iters=min_iters,
                                     on_run=on_run)
    return ColocationProfile(cores, part, solo, runs, machine_id(), omp_wait_policy)


def colocation_plan(configs: Sequence[ModelConfig], batch: int | Mapping[str, int],
                    sets: Sequence[Sequence[str]] | None) -> tuple[dict[str, ModelConfig], list[tuple[str, ...]],
                                                                   dict[str, int]]:
    """What a co-location call runs, checked: the configs by name, the sets (default
    ``colocation_sets``) and each model's batch size; InvalidInput naming what is wrong."""
    by_name = {c.name: c for c in configs}
    if not by_name:
        raise InvalidInput("co-location needs at least one model")
    runs = [tuple(s) for s in sets] if sets is not None else colocation_sets(list(by_name))
    unknown = sorted({m for s in runs for m in s} - set(by_name))
    if unknown or any(len(s) < 2 for s in runs):
        raise InvalidInput(f"co-location sets {runs}: each needs two or more of {sorted(by_name)}"
                           + (f" (unknown: {unknown})" if unknown else ""))
    batches = {n: (batch if isinstance(batch, int) else batch[n]) for n in by_name}
    for n, b in batches.items():
        if not 1 <= b <= by_name[n].max_batch_size:
            raise InvalidInput(f"batch {b} of {n!r} is not within 1..{by_name[n].max_batch_size}")
    return by_name, runs, batches


def colocation_measurers(configs: Sequence[ModelConfig], batches: Mapping[str, int], sets: Sequence[Sequence[str]],
                         cpus: Sequence[int], model_dirs: Mapping[str, Path | None] | None = None) -> list[Measurer]:
    """The processes ``sets`` need on ``cpus``: as many of each model as one set runs at once."""
    return [Measurer(c, (model_dirs or {}).get(c.name), batches[c.name], tuple(cpus))
            for c in configs for _ in range(max([1, *(list(s).count(c.name) for s in sets)]))]


def run_colocations(procs: MeasuringProcesses, which: Iterable[int], sets: Sequence[Sequence[str]], *,
                    budget_s: float, min_iters: int, on_run: Callable[[ColocationRun], None] | None = None
                    ) -> tuple[dict[str, float], list[ColocationRun]]:
    """Solo times and co-location runs of ``sets`` (model names) with the processes ``which``
    of ``procs`` (``colocation_measurers``' processes, all on the same CPUs, the copies of a
    model next to each other): every model alone first, then each set. Returns (solo
    seconds per member key, runs)."""
    mine = list(which)
    names = list(dict.fromkeys(procs.procs[i].measurer.config.name for i in mine))
    first = {n: next(i for i in mine if procs.procs[i].measurer.config.name == n) for n in names}
    keys = {n: procs.procs[first[n]].measurer.key for n in names}
    cores = len(procs.procs[mine[0]].measurer.cpus)
    solo = {n: procs.run([first[n]], procs.window([first[n]], budget_s, min_iters))[0] for n in names}
    runs: list[ColocationRun] = []
    for s in sets:
        together = [first[n] + list(s[:i]).count(n) for i, n in enumerate(s)]
        means = procs.run(together, procs.window(together, budget_s, min_iters))
        run = ColocationRun(cores, tuple(keys[n] for n in s), tuple(m / solo[n] for m, n in zip(means, s)),
                            tuple(solo[n] for n in s), tuple(means))
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return {keys[n]: v for n, v in solo.items()}, runs


def load_colocations(registry: Any, model: str, machine: str | None = None,
                     mig: str | None = None) -> list[ColocationRun]:
    """The co-location runs stored with ``model`` as a member (on the MIG profile ``mig``)."""
    stored = registry.load_profile(model, machine or machine_id(), profile_kind("colocation", mig))
    return [ColocationRun.from_dict(d) for d in stored or []]


def save_colocation(registry: Any, profile: ColocationProfile, mig: str | None = None) -> None:
    """Store each run under every model in it, replacing an earlier run of the same set on
    the same number of cores (and keeping the others); ``mig``: runs on that MIG profile."""
    for model in sorted({key_model(k) for r in profile.runs for k in r.members}):
        new = [r for r in profile.runs if model in map(key_model, r.members)]
        kept = [r for r in load_colocations(registry, model, profile.machine, mig)
                if not any(r.same_set(n) for n in new)]
        registry.save_profile(model, profile.machine, profile_kind("colocation", mig),
                              [r.to_dict() for r in kept + new])


def fit_stored_fbr(registry: Any, models: Sequence[str], cores: int, machine: str | None = None,
                   mig: str | None = None) -> Any:
    """Fit FBRs (``slowdown.fit_fbr``) over every stored run on ``cores`` cores (on the MIG
    profile ``mig``, when given) that has one of ``models`` in it, and store the fit (kind
    ``fbr``, or ``fbr@mig``) under each model of those runs. Returns the ``FbrFit``; its
    ``unidentified`` keys got no number."""
    from splitserve.protean.slowdown import Colocation, fit_fbr  # scipy: paid only where a fit is made

    machine = machine or machine_id()
    runs: list[ColocationRun] = []
    for m in dict.fromkeys(models):
        runs += [r for r in load_colocations(registry, m, machine, mig) if r.cores == cores and r not in runs]
    fit = fit_fbr([Colocation(r.members, r.slowdowns) for r in runs])
    for m in sorted({key_model(k) for r in runs for k in r.members}):
        registry.save_profile(m, machine, profile_kind("fbr", mig), fit.to_dict())
    return fit


def fbr_of(fit: Any, model: str) -> float | None:
    """One FBR for ``model`` from an ``FbrFit``: the mean of its identified keys (one per batch
    size, the paper's averaging over co-locations); None when none is identified."""
    values = [v for k, v in fit.fbr.items() if key_model(k) == model and k not in fit.unidentified]
    return statistics.fmean(values) if values else None


def load_fbr(registry: Any, model: str, machine: str | None = None, mig: str | None = None) -> float | None:
    """``model``'s fitted FBR from its stored ``fbr`` kind (``fbr@mig`` on a MIG profile);
    None when never fitted or unidentified (an FBR is never invented)."""
    stored = registry.load_profile(model, machine or machine_id(), profile_kind("fbr", mig))
    if stored is None:
        return None
    from splitserve.protean.slowdown import FbrFit  # scipy: paid only where a fit is read

    return fbr_of(FbrFit.from_dict(stored), model)
