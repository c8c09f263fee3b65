"""``splitserve`` command line: serve | infer | models | prepare | profile | plan | gpus, and
bench and cluster with their extras. A module per command group; this one puts them together."""

from __future__ import annotations

import typer

from splitserve.cli.extras import ExtrasGroup
from splitserve.cli.gpus import gpus_app
from splitserve.cli.infer import infer
from splitserve.cli.models import models_app
from splitserve.cli.profile import plan, prepare, profile
from splitserve.cli.serve import serve

app = typer.Typer(cls=ExtrasGroup, add_completion=False, no_args_is_help=True,
                  help="splitserve: inference serving without the RPC tax")
app.command()(serve)
app.command()(infer)
app.add_typer(models_app, name="models")
app.command()(prepare)
app.command()(profile)
app.command()(plan)
app.add_typer(gpus_app, name="gpus")


def main() -> None:
    app()
