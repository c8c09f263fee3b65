"""slowdown: how well PROTEAN's slowdown model predicts co-located batch latency (PROTEAN §3, Eq. 1/2).

Each model runs in warm measuring processes pinned to one partition of ``cores`` CPUs, each
with ``cores`` threads (PROTEAN's "default MPS": no caps, the co-runners share everything).
Per partition size, every model is measured alone, then co-location sets run together in
a closed loop behind a barrier, measured only while all of them run. The sets: each model
beside itself, every pair, and all models together. FBRs are fitted (non-negative least
squares over Eq. 1, ``slowdown.fit_fbr``) on the training runs, the self-pairs and the
first pair, and ``SlowdownModel.predict`` (solo time on the partition × max{ΣFBR, 1})
predicts every member of the held-out runs: the other pairs and the full set. Solo times
are those measured in the same run, so each ratio is one machine state.

Cross-partition interference is measured too, because disjoint cores are not MIG slices:
each model alone on CPU c0, then the same while another model is busy on c1 (they share
the last-level cache and memory bandwidth). With ``omp_policies``, everything is measured
again with that OMP_WAIT_POLICY in the measuring processes (PASSIVE: idle OpenMP threads
sleep instead of spinning on cores a co-runner needs).
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams

NAME = "slowdown"
SUMMARY = "Slowdown model accuracy: FBRs fitted on some co-locations predict held-out ones (median and p90 " \
          "relative error), plus cross-partition interference (PROTEAN Eq. 1/2, Fig. 3)."
MODELS: tuple[str, ...] = ("lenet", "resnet18", "bert_tiny", "lstm", "resnet50", "distilbert", "vecadd1k",
                           "matmul8k")
TRANSPORTS: tuple[str, ...] = ()


@dataclass
class Params(BaseParams):
    models: tuple[str, ...] = ("lenet", "resnet18", "bert_tiny")
    batch: int = 4  # every model's batch size (capped at its max batch)
    cores: tuple[int, ...] = (1, 2)  # partition sizes to co-locate on
    budget_s: float = 1.0  # shortest measuring window of one run
    min_iters: int = 5  # the window holds at least this many batches of the slowest member
    omp_policies: tuple[str, ...] = ("", "PASSIVE")  # OMP_WAIT_POLICY per pass ("": unset)
    interference: bool = True  # alone on c0 vs another model busy on c1 (needs 2 CPUs)
    rounds: int = 3  # every measurement repeated, medians kept: other work on the machine drifts between windows

    def check(self) -> None:
        if len(self.models) < 2:
            raise ValueError("slowdown needs at least two models")
        if self.batch < 1 or self.budget_s <= 0 or self.min_iters < 1 or self.rounds < 1:
            raise ValueError("batch, min_iters and rounds must be >= 1 and budget_s > 0")
        usable = len(os.sched_getaffinity(0))
        if not self.cores or not all(1 <= c <= usable for c in self.cores):
            raise ValueError(f"cores {list(self.cores)} must each be within 1..{usable} (the usable CPUs)")
        if any(o.upper() not in ("", "PASSIVE", "ACTIVE") for o in self.omp_policies):
            raise ValueError(f"omp_policies {list(self.omp_policies)}: each '', PASSIVE or ACTIVE")

    @classmethod
    def quick(cls) -> Params:
        return cls(batch=2, cores=(1,), budget_s=0.2, min_iters=3, omp_policies=("",), rounds=1)


def split_sets(models: list[str]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """(training, held-out) co-location sets: the self-pairs and the first pair identify each
    model's FBR; the other pairs and the full set are predicted."""
    pairs = list(itertools.combinations(models, 2))
    train = [(m, m) for m in models] + pairs[:1]
    held = pairs[1:] + ([tuple(models)] if len(models) > 2 else [])
    return train, held


def median_rounds(rounds: list[tuple[dict[str, float], list[Any]]]) -> tuple[dict[str, float], list[Any]]:
    """One (solo, runs) from several rounds of ``run_colocations``: per member, the median of
    its solo time, co-located mean and slowdown (each slowdown a ratio within its round)."""
    from splitserve.placement.profiler import ColocationRun

    solo = {k: statistics.median(r[0][k] for r in rounds) for k in rounds[0][0]}
    runs = []
    for same in zip(*(r[1] for r in rounds)):
        def med(field: str, same: tuple[Any, ...] = same) -> tuple[float, ...]:
            return tuple(statistics.median(vals) for vals in zip(*(getattr(x, field) for x in same)))
        runs.append(ColocationRun(same[0].cores, same[0].members, med("slowdowns"), med("solo_s"), med("mean_s")))
    return solo, runs


def rel_errors(predictions: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median and p90 of |predicted − measured| / measured (interpolated percentiles)."""
    from splitserve.bench.results import percentiles

    errs = [abs(x["predicted_s"] - x["measured_s"]) / x["measured_s"] for x in predictions
            if x["predicted_s"] is not None]
    if not errs:
        return {"median": None, "p90": None, "n": 0}
    median, p90 = percentiles(errs, (50, 90))
    return {"median": median, "p90": p90, "n": len(errs)}


def predict(fit: Any, runs: list[Any], solo: dict[tuple[str, int], float], whole: int) -> list[dict[str, Any]]:
    """Each member of ``runs``: predicted (``SlowdownModel.predict``) vs measured batch latency."""
    from splitserve.placement.profiler import key_model
    from splitserve.protean.slowdown import SlowdownModel

    fbr = {key_model(k): v for k, v in fit.fbr.items() if k not in fit.unidentified}
    model = SlowdownModel(lambda m, c, b: solo.get((m, c)), fbr, whole)
    out = []
    for r in runs:
        names = [key_model(k) for k in r.members]
        for i, (key, name) in enumerate(zip(r.members, names)):
            batch = int(key.rsplit("@", 1)[1])
            corunners = names[:i] + names[i + 1:]
            out.append({"cores": r.cores, "run": list(r.members), "member": key, "measured_s": r.mean_s[i],
                        "predicted_s": model.predict(name, batch, r.cores, corunners),
                        "measured_slowdown": r.slowdowns[i],
                        # an unidentified FBR counts as the model's unknown_fbr (1.0): said, not hidden
                        "fbrs_fitted": all(n in fbr for n in names)})
    return out


def _pass(ctx: Context, p: Params, configs: list[Any], cache: Path, omp: str) -> dict[str, Any]:
    """Everything measured with one OMP_WAIT_POLICY, in one set of warm processes."""
    from splitserve.placement.profiler import Measurer, MeasuringProcesses, colocation_measurers, run_colocations
    from splitserve.placement.topology import allocate, read_topology

    names = [c.name for c in configs]
    batches = {c.name: min(p.batch, c.max_batch_size) for c in configs}
    train, held = split_sets(names)
    groups: dict[int, range] = {}
    measurers: list[Measurer] = []
    for cores in p.cores:
        (cpus,) = allocate([cores], read_topology())
        group = colocation_measurers(configs, batches, train + held, cpus)
        groups[cores] = range(len(measurers), len(measurers) + len(group))
        measurers += group
    cross = p.interference and len(os.sched_getaffinity(0)) >= 2
    if cross:  # per model one process on c0 (the 1-core group's first, where there is one) and one on c1
        c0, c1 = allocate([1, 1], read_topology())
        on_c0 = {m.config.name: i for i, m in reversed(list(enumerate(measurers))) if m.cpus == tuple(c0)}
        for c in configs:
            if c.name not in on_c0:
                on_c0[c.name] = len(measurers)
                measurers.append(Measurer(c, None, batches[c.name], tuple(c0)))
        on_c1 = {c.name: len(measurers) + i for i, c in enumerate(configs)}
        measurers += [Measurer(c, None, batches[c.name], tuple(c1)) for c in configs]
    # the measurements share the machine with whatever else runs: its load is part of the result
    out: dict[str, Any] = {"omp_wait_policy": omp or None, "batches": batches, "cores": {},
                           "load_average_before": os.getloadavg()}
    with ctx.task(f"starting {len(measurers)} measuring processes" + (f" (OMP_WAIT_POLICY={omp})" if omp else ""), 1):
        procs = MeasuringProcesses(measurers, cache, omp_wait_policy=omp or None)
    with procs:
        for cores, which in groups.items():
            with ctx.task(f"co-locating on {cores} core(s)", p.rounds) as advance:
                rounds = []
                for _ in range(p.rounds):
                    rounds.append(run_colocations(procs, which, train + held, budget_s=p.budget_s,
                                                  min_iters=p.min_iters))
                    advance(1)
            solo, runs = median_rounds(rounds)
            out["cores"][cores] = {"solo_s": solo, "train": runs[:len(train)], "held_out": runs[len(train):]}
        if cross:
            rows = []
            with ctx.task("cross-partition interference", len(names) * (len(names) - 1)) as advance:
                for a, b in itertools.permutations(names, 2):
                    alone_s, beside_s = [], []
                    for _ in range(p.rounds):  # alone, then beside, in each round: one machine state per ratio
                        alone_s.append(procs.run([on_c0[a]], procs.window([on_c0[a]], p.budget_s, p.min_iters))[0])
                        together = [on_c0[a], on_c1[b]]
                        beside_s.append(procs.run(together, procs.window(together, p.budget_s, p.min_iters))[0])
                    rows.append({"model": a, "busy": b, "alone_s": statistics.median(alone_s),
                                 "beside_s": statistics.median(beside_s),
                                 "ratio": statistics.median(x / y for x, y in zip(beside_s, alone_s))})
                    advance(1)
            out["interference"] = rows
    out["load_average_after"] = os.getloadavg()
    return out


def _fit(result: dict[str, Any]) -> None:
    """FBRs fitted per partition size on the training runs; predictions of the held-out runs."""
    from splitserve.protean.slowdown import Colocation, fit_fbr
    whole = max(result["cores"])
    solo = {(k.rsplit("@", 1)[0], c): v for c, r in result["cores"].items() for k, v in r["solo_s"].items()}
    for cores, r in result["cores"].items():
        fit = fit_fbr([Colocation(x.members, x.slowdowns) for x in r["train"]])
        r["fit"] = fit.to_dict()
        r["predictions"] = predict(fit, r["held_out"], solo, whole)
        r["error"] = rel_errors(r["predictions"])


def run(ctx: Context) -> ScenarioOutput:
    from splitserve.registry import builtin_configs

    p: Params = ctx.params  # type: ignore[assignment]
    if ctx.urls:
        raise ValueError("slowdown measures in its own pinned processes; it takes no server (--url)")
    by_name = {c.name: c for c in builtin_configs()}
    configs = [by_name[m] for m in p.models]
    passes = []
    with tempfile.TemporaryDirectory(prefix="splitserve-slowdown-") as cache:
        for omp in p.omp_policies:
            result = _pass(ctx, p, configs, Path(cache), omp.upper())
            _fit(result)
            passes.append(result)
    return _output(p, passes)


# -- report ---------------------------------------------------------------------------------------


def _jsonable(passes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for ps in passes:
        cores = {str(c): {**r, "train": [x.to_dict() for x in r["train"]],
                          "held_out": [x.to_dict() for x in r["held_out"]]} for c, r in ps["cores"].items()}
        out.append({**ps, "cores": cores})
    return out


def _plot(passes: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    ax_pred, ax_int = fig.subplots(1, 2)
    lo, hi = float("inf"), 0.0
    for ps in passes:
        tag = ps["omp_wait_policy"] or "default"
        for cores, r in ps["cores"].items():
            pts = [x for x in r.get("predictions", []) if x["predicted_s"] is not None]
            if pts:
                xs = [x["measured_s"] * 1e3 for x in pts]
                ys = [x["predicted_s"] * 1e3 for x in pts]
                ax_pred.scatter(xs, ys, s=18, label=f"{cores} core(s), OMP {tag}")
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax_pred.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--", label="predicted = measured")
        ax_pred.set_xscale("log")
        ax_pred.set_yscale("log")
        ax_pred.legend(fontsize=7)
    ax_pred.set_xlabel("measured batch latency (ms)")
    ax_pred.set_ylabel("predicted (ms)")
    ax_pred.set_title("held-out co-locations: Solo × max{ΣFBR, 1}", fontsize=9)
    rows = [(f"{x['model']} | {x['busy']}", x["ratio"]) for x in (passes[0].get("interference") or [])]
    if rows:
        ax_int.barh([r[0] for r in rows], [r[1] for r in rows], color="#2b7bba")
        ax_int.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax_int.set_xlabel("latency on c0 with the other model busy on c1 / alone")
    ax_int.set_title("cross-partition interference (shared cache and memory)", fontsize=9)
    ax_int.tick_params(axis="y", labelsize=7)
    for ax in (ax_pred, ax_int):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _output(p: Params, passes: list[dict[str, Any]]) -> ScenarioOutput:
    report = [report_intro(__doc__), ""]
    lines: list[str] = []
    for ps in passes:
        tag = f"OMP_WAIT_POLICY={ps['omp_wait_policy']}" if ps["omp_wait_policy"] else "OMP_WAIT_POLICY unset"
        load = ", ".join(f"{x:.1f}" for x in ps["load_average_before"])
        report += [f"## {tag}", "", "Batch sizes: " + ", ".join(f"{m} {b}" for m, b in ps["batches"].items()) +
                   f". Load average (1, 5, 15 min) before: {load}; after: "
                   f"{', '.join(f'{x:.1f}' for x in ps['load_average_after'])} (anything above 0 is another "
                   "process sharing these CPUs).", ""]
        for cores, r in ps["cores"].items():
            report += [f"### {cores} core(s)", "", "Solo batch latency (ms), measured in this run: " +
                       ", ".join(f"{k} {fmt(v * 1e3, 2)}" for k, v in r["solo_s"].items()), ""]
            rows = [("train" if i < len(r["train"]) else "held out", " + ".join(x.members),
                     ", ".join(fmt(v * 1e3, 2) for v in x.mean_s), ", ".join(fmt(v, 2) for v in x.slowdowns))
                    for i, x in enumerate(r["train"] + r["held_out"])]
            report += [md_table(("role", "members", "mean ms", "slowdown vs solo"), rows), ""]
            fit = r["fit"]
            unidentified = set(fit["unidentified"])
            report += ["Fitted FBRs (training runs): " + ", ".join(
                f"{k} {'unidentified' if k in unidentified else fmt(v, 3)}" for k, v in sorted(fit["fbr"].items()))
                + (f"; unidentified: {', '.join(sorted(unidentified))}" if unidentified else ""),
                "", "Fit residuals (RMS of predicted − measured slowdown per member): "
                + (", ".join(f"{k} {fmt(v, 3)}" for k, v in fit["residuals"].items()) or "none"), ""]
            prow = [(" + ".join(x["run"]), x["member"], fmt(x["measured_s"] * 1e3, 2),
                     fmt(None if x["predicted_s"] is None else x["predicted_s"] * 1e3, 2),
                     fmt(None if x["predicted_s"] is None else 100 * (x["predicted_s"] / x["measured_s"] - 1), 1, "%"),
                     "yes" if x["fbrs_fitted"] else "no: unknown_fbr used")
                    for x in r["predictions"]]
            e = r["error"]
            report += [md_table(("held-out run", "member", "measured ms", "predicted ms", "error", "every FBR fitted"),
                                prow), "",
                       f"Relative error over {e['n']} held-out members: median {fmt(_pct(e['median']), 1, '%')}, "
                       f"p90 {fmt(_pct(e['p90']), 1, '%')}.", ""]
            lines.append(f"{tag}, {cores} core(s): held-out error median {fmt(_pct(e['median']), 1, '%')}, "
                         f"p90 {fmt(_pct(e['p90']), 1, '%')} ({e['n']} members)")
        inter = ps.get("interference")
        if inter:
            report += ["### Cross-partition interference", "",
                       "Each model alone on CPU 0, then with the other model running a closed loop on CPU 1:", "",
                       md_table(("model on c0", "busy on c1", "alone ms", "beside ms", "ratio"),
                                [(x["model"], x["busy"], fmt(x["alone_s"] * 1e3, 2), fmt(x["beside_s"] * 1e3, 2),
                                  fmt(x["ratio"], 3)) for x in inter]), ""]
            worst = max(inter, key=lambda x: x["ratio"])
            lines.append(f"{tag}: cross-partition interference up to {fmt(worst['ratio'], 3)}x "
                         f"({worst['model']} on c0 beside {worst['busy']} on c1)")
        elif p.interference:
            report += ["Cross-partition interference not measured: it needs two CPUs.", ""]
    return ScenarioOutput({"passes": _jsonable(passes)}, "\n".join(report), {"slowdown": _plot(passes)}, lines)


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x
