"""fuzz: the fast path's parsers under random and mutated input.

Three targets, each a property checked on every input: the 64-byte control header (any
buffer unpacks into a header that packs back to the same bytes, or is refused with
BAD_FRAME), the stream frame state machine (a real fast-path connection on a socketpair:
no exception escapes, no byte is written outside the slots being received, every submitted
request is exactly the bytes sent, every frame gets one answer, every slot is freed) and
UDP reassembly (a real UDP endpoint on loopback: the same, and a request is submitted only
when its segments cover the client's payload exactly once). No server process is started:
the transports run in this process against a fake node with real tensor-queue rings. The
same properties run in the test suite under hypothesis at small example counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.bench.fuzz.run import TARGETS, TargetResult, fuzz
from splitserve.bench.scenarios.base import Context, ScenarioOutput, fmt, md_table, report_intro
from splitserve.bench.scenarios.base import Params as BaseParams

NAME = "fuzz"
SUMMARY = "Fuzz the control header, the stream frame state machine and UDP reassembly (>= 1M inputs)."
MODELS: tuple[str, ...] = ()
TRANSPORTS: tuple[str, ...] = ()


@dataclass
class Params(BaseParams):
    targets: tuple[str, ...] = TARGETS
    header_inputs: int = 1_000_000  # cheap: most of the count
    stream_inputs: int = 100_000  # cases of 1-10 frames each, cut at random places
    udp_inputs: int = 60_000  # cases of 1-4 segmented requests and extra datagrams
    time_limit_s: float = 900.0  # per target: a slow machine stops early (recorded) instead of running on
    keep_failures: int = 3  # failing inputs recorded per target

    @classmethod
    def quick(cls) -> Params:
        return cls(header_inputs=600_000, stream_inputs=20_000, udp_inputs=15_000, time_limit_s=40.0)

    def check(self) -> None:
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown fuzz targets {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
        if min(self.header_inputs, self.stream_inputs, self.udp_inputs) < 0 or self.time_limit_s <= 0:
            raise ValueError("input counts must be >= 0 and time_limit_s > 0")

    def budget(self, target: str) -> int:
        return {"header": self.header_inputs, "stream": self.stream_inputs, "udp": self.udp_inputs}[target]


def run(ctx: Context) -> ScenarioOutput:
    p: Params = ctx.params  # type: ignore[assignment]
    results: dict[str, TargetResult] = {}
    for name in p.targets:
        with ctx.task(f"fuzzing {name}", p.budget(name)) as advance:
            results[name] = fuzz(name, p.budget(name), p.seed, p.time_limit_s, p.keep_failures, advance)
        if results[name].stopped_early:
            ctx.notes.append(f"{name}: the time limit of {p.time_limit_s:g} s stopped it after "
                             f"{results[name].inputs:,} of {p.budget(name):,} inputs")
    return _output(results)


def _plot(results: dict[str, TargetResult]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    names = list(results)
    rates = [results[n].inputs_per_s for n in names]
    bars = ax.bar(names, rates, color=["#2b7bba", "#17becf", "#9467bd"][: len(names)])
    for bar, n in zip(bars, names):
        r = results[n]
        ax.annotate(f"{r.inputs:,} in\n{r.failures:,} failing", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=max(rates + [1.0]) * 8)  # room for the labels
    ax.set_ylabel("inputs/s")
    ax.set_title("inputs checked per second, per target", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _output(results: dict[str, TargetResult]) -> ScenarioOutput:
    total = sum(r.inputs for r in results.values())
    failures = sum(r.failures for r in results.values())
    rows = [(n, f"{r.inputs:,}", f"{r.failures:,}", fmt(r.inputs_per_s, 0), fmt(r.seconds, 1),
             "; ".join(f"{k} ({c:,})" for k, c in r.kinds.most_common(3)) or "-")
            for n, r in results.items()]
    report = [report_intro(__doc__), "",
              md_table(("target", "inputs", "failures", "inputs/s", "seconds", "most common failures"), rows), "",
              f"{total:,} inputs in all, {failures:,} failing.", ""]
    for n, r in results.items():
        if not r.examples:
            continue
        report += [f"## First failing inputs: {n}", ""]
        for ex in r.examples:
            if "case_seed" in ex:  # the whole input is in result.json; its seed replays it
                report.append(f"- {ex['message']}: replay with "
                              f"`splitserve.bench.fuzz.run.replay({n!r}, {ex['case_seed']})`")
            else:
                report.append(f"- {ex['message']}: input `{ex['input']['hex']}`")
        report += ["", "Every failing input recorded is in `result.json` (hex), under `first_failures`.", ""]
    summary = [f"fuzz: {total:,} inputs, {failures:,} failing: " +
               ", ".join(f"{n} {r.inputs:,} at {fmt(r.inputs_per_s, 0)}/s ({r.failures:,} failing)"
                         for n, r in results.items())]
    result = {"targets": {n: r.to_dict() for n, r in results.items()}, "total_inputs": total,
              "total_failures": failures}
    return ScenarioOutput(result, "\n".join(report), {"fuzz": _plot(results)} if results else {}, summary)
