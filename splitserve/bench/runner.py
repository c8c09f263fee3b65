"""Run one scenario end to end: parameters, results folder, progress, refusal, files.

``run_scenario`` is what ``splitserve bench <scenario>`` calls. It builds the parameters
(full or ``--quick``, narrowed by ``--models``/``--transports``, ``-p NAME=VALUE`` overrides),
creates the ``ResultsDir``, runs the scenario inside a rich progress bar, and writes
``result.json``, ``report.md`` and the PNG plots. A scenario whose server answered wrongly in
the validation phase writes a refusal instead of numbers and ends with ``EXIT_REFUSED``.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.bench.results import ResultsDir, git_commit, machine_info
from splitserve.bench.scenarios import get
from splitserve.bench.scenarios.base import Context, Params, apply_overrides, md_table, narrow
from splitserve.bench.validate import ValidationFailed

EXIT_OK = 0
EXIT_FAILED = 1  # the run broke (server died, a generator failed...): report.md has the traceback
EXIT_REFUSED = 3  # the server answered wrongly: no numbers were reported
EXIT_BROKEN = 4  # the run finished, and found the server breaking a promise (see report.md)


@dataclass
class RunSummary:
    """What the CLI prints: exit code, results folder and the scenario's summary lines."""

    exit_code: int
    path: Path
    lines: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def build_params(name: str, quick: bool = False, models: Sequence[str] = (), transports: Sequence[str] = (),
                 overrides: Mapping[str, str] | None = None) -> Params:
    """The parameters a run of scenario ``name`` will use."""
    mod = get(name).load()
    params: Params = mod.Params.quick() if quick else mod.Params()
    if models:
        params = dataclasses.replace(params, models=narrow(models, mod.MODELS, "models"))
    if transports:
        params = dataclasses.replace(params, transports=narrow(transports, mod.TRANSPORTS, "transports"))
    params = apply_overrides(params, overrides or {}).resolved()
    params.check()
    return params


def _header(name: str, quick: bool, params: Params) -> str:
    m = machine_info()
    gpus = ", ".join(m["gpus"]) or "none"
    return "\n".join([
        f"# splitserve bench {name}" + (" (quick)" if quick else ""),
        "",
        (f"Machine: {m['usable_cores']} usable cores ({m['cpu_model'] or 'unknown CPU'}), "
         f"{(m['memory_bytes'] or 0) / 2**30:.0f} GiB, GPUs: {gpus}; Python {m['python']}, torch {m['torch']}; "
         f"commit {git_commit() or 'unknown'}."),
        "",
        "Parameters: " + ", ".join(f"`{k}={v}`" for k, v in params.to_dict().items()),
        "",
        "",
    ])


def _validation_md(ctx: Context) -> str:
    if not ctx.checks:
        return ""
    rows = [(c.model, c.transport, "ok" if c.ok else "**WRONG**", c.samples,
             "-" if c.max_rel_error is None else f"{c.max_rel_error:.2g}", c.detail or "")
            for c in ctx.checks]
    return "\n## Validation\n\nEvery answer was compared with the model run locally before timing.\n\n" + \
        md_table(("model", "transport", "result", "inputs", "max rel. error", "detail"), rows) + "\n"


def _unavailable_md(ctx: Context) -> str:
    if not ctx.unavailable:
        return ""
    rows = [(t, reason) for t, reason in ctx.unavailable.items()]
    return "\n## Unavailable transports\n\n" + md_table(("transport", "why"), rows) + "\n"


def _notes_md(ctx: Context) -> str:
    if not ctx.notes:
        return ""
    return "\n## Notes\n\n" + "\n".join(f"- {n}" for n in ctx.notes) + "\n"


def run_scenario(name: str, *, quick: bool = False, out: Path = Path("results"), urls: Sequence[str] = (),
                 models: Sequence[str] = (), transports: Sequence[str] = (),
                 overrides: Mapping[str, str] | None = None, console: Any = None) -> RunSummary:
    """Run scenario ``name`` and write its results folder under ``out``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    mod = get(name).load()
    params = build_params(name, quick, models, transports, overrides)
    recorded = {"quick": quick, "urls": list(urls), **params.to_dict()}
    rd = ResultsDir(Path(out), name, params=recorded)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        ctx = Context(rd, params, urls, progress, quick)
        try:
            output = mod.run(ctx)
        except ValidationFailed as e:
            ctx.close()
            rd.write_json({"status": "refused", "reason": str(e), "server": ctx.server_info,
                           "validation": [c.to_dict() for c in e.checks], "unavailable": ctx.unavailable})
            rd.write_report(_header(name, quick, params) +
                            "\n## Refused\n\nThe server answered wrongly in the validation phase, so this run "
                            "reports no numbers. Fix the server (or point `--url` at the right one) and run "
                            f"again.\n\n{e}\n" + _validation_md(ctx) + _notes_md(ctx))
            return RunSummary(EXIT_REFUSED, rd.path, [f"REFUSED: the server answered wrongly: {e}"],
                              [rd.path / "result.json", rd.path / "report.md"])
        except Exception as e:
            ctx.close()
            detail = traceback.format_exc()
            rd.write_json({"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": detail,
                           "server": ctx.server_info, "validation": [c.to_dict() for c in ctx.checks],
                           "unavailable": ctx.unavailable, "notes": ctx.notes})
            rd.write_report(_header(name, quick, params) + f"\n## Failed\n\n{type(e).__name__}: {e}\n\n"
                            f"```\n{detail}```\n" + _notes_md(ctx))
            return RunSummary(EXIT_FAILED, rd.path, [f"FAILED: {type(e).__name__}: {e}", *ctx.notes],
                              [rd.path / "result.json", rd.path / "report.md"])
        except BaseException:  # Ctrl-C: stop what was started, write nothing
            ctx.close()
            raise
        ctx.close()
    files = [rd.write_json({"status": "ok", "server": ctx.server_info,
                            "validation": [c.to_dict() for c in ctx.checks], "unavailable": ctx.unavailable,
                            "notes": ctx.notes, **output.result})]
    for fig_name, fig in output.figures.items():
        files.append(rd.save_plot(fig, fig_name))
    files.append(rd.write_report(_header(name, quick, params) + output.report.rstrip() + "\n" +
                                 _unavailable_md(ctx) + _validation_md(ctx) + _notes_md(ctx)))
    lines = list(output.summary)
    if ctx.unavailable:
        lines.append("unavailable: " + "; ".join(f"{t} ({why})" for t, why in ctx.unavailable.items()))
    lines += [f"BROKEN: {b}" for b in output.broken]
    return RunSummary(EXIT_BROKEN if output.broken else EXIT_OK, rd.path, lines, files)


__all__ = ["EXIT_BROKEN", "EXIT_FAILED", "EXIT_OK", "EXIT_REFUSED", "RunSummary", "build_params", "run_scenario"]
