"""``splitserve bench <scenario>``: one command per scenario, with the same options each.

``splitserve.cli`` imports this only for ``splitserve bench`` and the top-level help, so it
imports nothing heavy: scenarios, torch and matplotlib load only when a benchmark runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.console import Console

from splitserve.bench.scenarios import SCENARIOS, ScenarioInfo

bench_app = typer.Typer(
    name="bench",
    add_completion=False,
    no_args_is_help=True,
    short_help="Benchmarks that reproduce the papers' experiments.",
    help="Benchmarks that reproduce the papers' experiments. Each scenario writes result.json, "
         "report.md and PNG plots into a new folder under --out.",
)
console = Console()


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _overrides(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        if "=" not in v:
            raise typer.BadParameter(f"{v!r}: write NAME=VALUE, e.g. -p requests=500", param_hint="--param")
        k, _, val = v.partition("=")
        out[k.strip()] = val.strip()
    return out


def _print_params(name: str) -> None:
    from splitserve.bench.runner import build_params
    from splitserve.bench.scenarios import get

    mod = get(name).load()
    full, quick = build_params(name), build_params(name, quick=True)
    console.print(f"[bold]{name}[/] parameters (full / --quick):")
    for f in dataclasses.fields(full):
        a, b = getattr(full, f.name), getattr(quick, f.name)
        console.print(f"  {f.name} = {a!r}" + ("" if a == b else f"   (--quick: {b!r})"), highlight=False)
    console.print(f"--models from: {', '.join(mod.MODELS)}", highlight=False)
    console.print(f"--transports from: {', '.join(mod.TRANSPORTS)}", highlight=False)


def _extras(args: list[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Words the fixed options did not take: bare ones name models (``bench packrat resnet18``),
    ``--NAME VALUE`` and ``--NAME=VALUE`` set parameter NAME (as ``-p NAME=VALUE``), a
    ``--NAME`` with no value sets it to true."""
    models: list[str] = []
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and len(a) > 2:
            name, eq, value = a[2:].partition("=")
            if not eq:
                if i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value, i = args[i + 1], i + 1
                else:
                    value = "true"
            out[name] = value
        elif a.startswith("-") and len(a) > 1:
            raise typer.BadParameter(f"unknown option {a!r}; scenario parameters are --NAME VALUE")
        else:
            models += [m for m in a.split(",") if m]
        i += 1
    return tuple(models), out


def _register(info: ScenarioInfo) -> None:
    def command(
        ctx: typer.Context,
        quick: bool = typer.Option(False, "--quick", help="The small size: under a minute on 2 cores."),
        out: Path = typer.Option(Path("results"), "--out", help="Folder that receives <scenario>-<time>/."),
        url: list[str] = typer.Option(
            [], "--url",
            help="Measure a running server instead of starting one: a tcp://, unix://, udp://, http:// or "
                 "grpc:// URL (repeat for several), or the path of its server.json or data directory."),
        models: str | None = typer.Option(None, "--models", help="Comma-separated subset of the models."),
        transports: str | None = typer.Option(None, "--transports",
                                                 help="Comma-separated subset of the transports."),
        param: list[str] = typer.Option([], "--param", "-p", help="Override a parameter: NAME=VALUE "
                                        "(lists comma-separated). See --list-params."),
        list_params: bool = typer.Option(False, "--list-params", help="Show the parameters and exit."),
    ) -> None:
        if list_params:
            _print_params(info.name)
            return
        from splitserve.bench.runner import EXIT_OK, run_scenario

        extra_models, extra = _extras(list(ctx.args))
        try:
            summary = run_scenario(info.name, quick=quick, out=out, urls=url,
                                   models=_split(models) or extra_models, transports=_split(transports),
                                   overrides={**_overrides(param), **extra}, console=console)
        except ValueError as e:
            console.print(f"[red]error:[/] {e}", highlight=False)
            raise typer.Exit(2) from None
        for line in summary.lines:
            console.print(line, highlight=False)
        style = "green" if summary.exit_code == EXIT_OK else "red"
        console.print(f"[{style}]results in {summary.path}[/]", highlight=False)
        raise typer.Exit(summary.exit_code)

    command.__doc__ = info.summary
    # Any parameter may also be given as --NAME VALUE, and models as bare words (see _extras).
    bench_app.command(info.name, help=info.summary + " Parameters can be set as --NAME VALUE (see --list-params); "
                      "bare words name the models.",
                      context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


for _info in SCENARIOS.values():
    _register(_info)


@bench_app.command("list")
def list_scenarios() -> None:
    """List the scenarios."""
    for info in SCENARIOS.values():
        console.print(f"[bold]{info.name}[/]  {info.summary}", highlight=False)
