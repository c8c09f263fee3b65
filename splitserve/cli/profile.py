"""``splitserve prepare``, ``profile`` and ``plan``: weights trained ahead of the first
request, latency profiles measured on this machine, and Packrat's plan from them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from splitserve.cli.common import DATA_DIR_HELP, console
from splitserve.config import ServerConfig, default_data_dir


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


def prepare(
    cache_dir: list[Path] = typer.Option(None, "--cache-dir",
                                         help="Weight caches to fill (default: the server's, DATA_DIR/cache)."),
    data_dir: Path = typer.Option(None, help=DATA_DIR_HELP),
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
    mig: bool = typer.Option(False, "--mig", help="Measure on this node's MIG devices instead of its CPUs: once "
                             "per MIG profile (on its first device), stored per profile for PROTEAN; with "
                             "--colocate, the co-location runs and FBRs per profile."),
) -> None:
    """Measure L[threads, batch], per-segment times and per-batch memory; store them for Packrat,
    REEF and PROTEAN. With --colocate, measure co-location slowdowns and fit FBRs instead. With
    --mig, measure both per MIG profile of this node's GPUs."""
    from rich.progress import Progress

    from splitserve.placement.profiler import default_batches, profile_model, save_profile

    if not colocate and (cores is not None or batch is not None or omp_wait_policy is not None):
        raise typer.BadParameter("--cores, --batch and --omp-wait-policy go with --colocate")
    if colocate and (threads or batches):
        raise typer.BadParameter("--threads and --batches profile L[t, b]; with --colocate use --cores and --batch")
    if omp_wait_policy is not None and omp_wait_policy.upper() not in ("PASSIVE", "ACTIVE"):
        raise typer.BadParameter(f"--omp-wait-policy {omp_wait_policy!r}: PASSIVE or ACTIVE")
    if mig and (threads or cores is not None or omp_wait_policy is not None):
        raise typer.BadParameter("--mig measures on MIG devices: --threads, --cores and --omp-wait-policy are for CPUs")
    if mig:
        _profile_mig(data_dir, model, colocate, batches, batch, budget_s)
        return
    reg, rec = _record(data_dir, model)
    try:
        if colocate:
            _profile_colocation(reg, _colocated(reg, rec, colocate), cores, batch, data_dir, budget_s,
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


def _colocated(reg: Any, rec: Any, colocate: list[str]) -> list[Any]:
    """MODEL's record and those of the ``--colocate`` models; BadParameter naming unknown ones."""
    others = [reg.find(o) for o in colocate]
    if None in others:
        raise typer.BadParameter(f"--colocate: unknown model(s) "
                                 f"{', '.join(o for o, r in zip(colocate, others) if r is None)}")
    return [rec, *others]


def _profile_colocation(reg: Any, records: list[Any], cores: int | None, batch: int | None,
                        data_dir: Path | None, budget_s: float, omp_wait_policy: str | None) -> None:
    """``profile MODEL --colocate OTHER...``: measure, store, fit, print."""
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


def _profile_mig(data_dir: Path | None, model: str, colocate: list[str] | None, batches: str | None,
                 batch: int | None, budget_s: float) -> None:
    """``profile MODEL --mig [--colocate OTHER...]``: per MIG profile of the node, measure,
    store, fit, print."""
    from splitserve.placement.devices import partitions_of
    from splitserve.placement.gpus import PynvmlNvml, read_gpus
    from splitserve.placement.mig_profiler import (
        MIG_THREADS, devices_by_profile, profile_mig, profile_mig_colocation,
    )
    from splitserve.placement.profiler import default_batches, fit_stored_fbr, save_colocation, save_profile

    listing = read_gpus(PynvmlNvml())
    devices = devices_by_profile(partitions_of(listing))
    if not devices:
        raise typer.BadParameter(f"--mig: this node has no MIG devices ({listing.reason or 'its GPUs have MIG off'})")
    reg, rec = _record(data_dir, model)
    cache = ServerConfig.of(data_dir=data_dir or default_data_dir()).cache_path
    try:
        if colocate:
            records = _colocated(reg, rec, colocate)
            names = list(dict.fromkeys(r.name for r in records))
            configs = {r.name: r.config for r in records}
            for name, device in devices.items():
                with console.status(f"co-locating {', '.join(names)} on MIG {name} ({device.uuid})"):
                    prof = profile_mig_colocation(list(configs.values()), device,
                                                  {n: batch or configs[n].max_batch_size for n in names}, cache,
                                                  model_dirs={r.name: r.path for r in records}, budget_s=budget_s)
                save_colocation(reg, prof, mig=name)
                fit = fit_stored_fbr(reg, names, device.compute_slices, prof.machine, mig=name)
                console.print(f"MIG {name}: " + ", ".join(
                    f"{' + '.join(r.members)} slowdowns {', '.join(f'{x:.2f}' for x in r.slowdowns)}"
                    for r in prof.runs), highlight=False)
                console.print(f"MIG {name}: FBRs " + ", ".join(
                    f"{k} {'unidentified' if k in fit.unidentified else f'{fit.fbr[k]:.3f}'}"
                    for k in sorted({*fit.fbr, *fit.unidentified})), highlight=False)
            return
        bs = _int_list(batches) or default_batches(rec.config.max_batch_size)
        with console.status(f"profiling {model} on MIG {', '.join(devices)}"):
            profs = profile_mig(rec.config, rec.path, cache, list(devices.values()), bs, budget_s=budget_s)
        for name, prof in profs.items():
            save_profile(reg, prof, mig=name)
    finally:
        reg.close()
    t = Table("MIG profile", *[f"b={b}" for b in bs], title=f"{model}: mean batch latency (ms) per MIG profile")
    for name, prof in profs.items():
        t.add_row(name, *[f"{prof.latency.table[(MIG_THREADS, b)] * 1e3:.2f}" for b in bs])
    console.print(t)


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
