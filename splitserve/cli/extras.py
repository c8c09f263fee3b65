"""The top-level command group that imports ``bench`` and ``cluster`` only when they are
named or listed, so the server and the other commands never load them."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup


class ExtrasGroup(TyperGroup):
    """The top-level commands, with ``bench`` and ``cluster`` imported only when named or
    listed: the server and the other commands never import them, and they work in an install
    without the ``bench`` or ``cluster`` extra."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return [*super().list_commands(ctx), *_EXTRAS]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        return _extra_command(cmd_name) if cmd_name in _EXTRAS else super().get_command(ctx, cmd_name)


# command -> (module, its typer app, the extra that installs what it imports)
_EXTRAS = {"bench": ("splitserve.bench.cli", "bench_app", "bench"),
           "cluster": ("splitserve.cluster.cli", "cluster_app", "cluster")}


def _extra_command(name: str) -> Any:
    """``splitserve bench``/``cluster``, or without its extra a stand-in that says how to get it."""
    module, attr, extra = _EXTRAS[name]
    try:
        sub = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        reason = str(e)
        missing = typer.Typer(add_completion=False)

        @missing.command(name, help=f"Not installed (pip install 'splitserve[{extra}]').", add_help_option=False,
                         context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
        def stand_in() -> None:
            typer.echo(f"splitserve {name} is not installed ({reason}): pip install 'splitserve[{extra}]'", err=True)
            raise typer.Exit(1)

        return typer.main.get_command(missing)
    command = typer.main.get_command(sub)
    command.name = name
    return command
