"""``splitserve gpus``: the node's GPUs and MIG slices, and MIG geometry plans."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from splitserve.cli.common import console, size_text
from splitserve.config import ServerConfig

if TYPE_CHECKING:
    from splitserve.placement.gpus import MigDriver
    from splitserve.placement.mig import GpuListing


gpus_app = typer.Typer(add_completion=False, help="The node's GPUs and MIG slices (read-only, through NVML); "
                       "MIG geometry plans.")
_GPU_JSON = typer.Option(False, "--json", help="Print JSON instead of text.")


def gpus_table(listing: "GpuListing") -> Table:
    """One row per whole GPU and per MIG slice: what ``CUDA_VISIBLE_DEVICES`` takes, its
    memory and profile."""
    t = Table("gpu", "uuid (CUDA_VISIBLE_DEVICES)", "name / profile", "memory", "MIG", "gi", "ci")
    for g in listing.gpus:
        mig = {None: "n/a", True: "on", False: "off"}[g.mig]
        if g.mig_pending is not None and g.mig_pending != g.mig:
            mig += f" ({'on' if g.mig_pending else 'off'} after reset)"
        t.add_row(str(g.index), g.uuid, g.name, size_text(g.mem_bytes), mig, "", "")
        for sl in g.slices:
            t.add_row("", sl.uuid, sl.profile, size_text(sl.mem_bytes), "", str(sl.gpu_instance),
                      str(sl.compute_instance))
    return t


def _mig_driver(admin: bool | None = None) -> "MigDriver":
    """The driver over the real NVML, with the administrator's flag as ``ServerConfig`` reads
    it (``--gpu-admin``, else ``SPLITSERVE_GPU_ADMIN``)."""
    from splitserve.placement.gpus import MigDriver

    cfg = ServerConfig.from_env(**({} if admin is None else {"gpu_admin": admin}))
    return MigDriver(admin=cfg.gpu.gpu_admin, timeout_s=cfg.gpu.gpu_command_timeout_s)


@gpus_app.callback(invoke_without_command=True)
def gpus(ctx: typer.Context, as_json: bool = _GPU_JSON) -> None:
    """List the node's GPUs and their MIG slices (read through NVML; changes nothing)."""
    if ctx.invoked_subcommand is not None:
        return
    listing = _mig_driver().list()
    if as_json:
        console.print_json(json.dumps(listing.to_dict()))
    elif listing.reason:
        console.print(listing.reason, highlight=False)
    else:
        console.print(gpus_table(listing))


@gpus_app.command("plan")
def gpus_plan(
    geometry: str = typer.Argument(..., help="MIG profiles, e.g. 4g,3g or 4g.20gb,2g.10gb,1g.5gb."),
    gpu: int = typer.Option(0, "--gpu", help="GPU index."),
    apply: bool = typer.Option(False, "--apply", help="Run the plan (needs --gpu-admin)."),
    gpu_admin: bool = typer.Option(
        None, "--gpu-admin", help="Allow changing MIG geometries: only on a machine you administer."),
    as_json: bool = _GPU_JSON,
) -> None:
    """Print the nvidia-smi commands that would give a GPU this MIG geometry; with --apply and
    --gpu-admin, run them one by one, stopping at the first failure."""
    driver = _mig_driver(gpu_admin)
    if apply and not driver.admin:
        console.print("[red]error:[/] --apply changes the GPU's MIG geometry and needs --gpu-admin (or "
                      "SPLITSERVE_GPU_ADMIN=1): use it only on a machine you administer. Without --apply, "
                      "splitserve prints the plan and runs nothing.", highlight=False)
        raise typer.Exit(2)
    raise typer.Exit(run_gpu_plan(driver, gpu, geometry, apply, as_json))


def run_gpu_plan(driver: "MigDriver", gpu: int, geometry: str, apply: bool, as_json: bool) -> int:
    """``splitserve gpus plan``'s work on ``driver``: print the plan, run it when asked (the
    driver runs nothing without its admin flag); the exit status."""
    from splitserve.errors import SplitServeError

    try:
        plan = driver.plan(gpu, geometry)
    except SplitServeError as e:
        console.print(f"[red]error:[/] {e.message}", highlight=False)
        return 1
    applied = driver.apply(plan) if apply else None
    if as_json:
        out: dict[str, Any] = plan.to_dict()
        if applied is not None:
            out["applied"] = {"ran": [{"argv": list(r.argv), "returncode": r.returncode} for r in applied.ran],
                              "failed": applied.failed}
        console.print_json(json.dumps(out))
    else:
        console.print(f"GPU {plan.gpu} ({plan.gpu_name}) -> {','.join(plan.target)}"
                      + (f"; keeps GPU instances {', '.join(map(str, plan.kept))}" if plan.kept else ""),
                      highlight=False)
        for c in plan.commands:
            console.print(f"  {c}    [dim]# {c.why}[/]", highlight=False)
        for note in plan.notes:
            console.print(f"  note: {note}", style="dim", highlight=False)
        if applied is None:
            console.print("(dry run: nothing was run; --apply --gpu-admin runs it)", style="dim", highlight=False)
        elif applied.failed:
            console.print(f"[red]error:[/] {applied.failed}", highlight=False)
        else:
            console.print(f"applied: {len(applied.ran)} commands ran", highlight=False)
    return 1 if applied is not None and applied.failed else 0
