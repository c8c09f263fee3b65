"""``splitserve serve``: start a node. Its options are grouped in ``--help`` by the
configuration section each sets (``ServerConfig``'s), the rest of the sections being
``SPLITSERVE_*`` variables."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from splitserve.cli.common import console
from splitserve.config import ServerConfig, default_data_dir, parse_bytes
from splitserve.placement.packrat import PlacementKind
from splitserve.placement.partition import Partitioning, StrictPlacement
from splitserve.scheduler.model_scheduler import ClassOrder, RtPolicy
from splitserve.scheduler.priority import PriorityMode

# configuration section -> the title of its options' panel in ``serve --help``
PANELS = {None: "Node", "transports": "Transports (fast path, direct path)", "batching": "Batching",
          "memory": "Memory (Rafiqi)", "packrat": "Placement (Packrat)", "protean": "Partitions (PROTEAN)",
          "reef": "Scheduling (REEF)", "frontends": "Front ends (HTTP, gRPC)", "workers": "Workers",
          "gpu": "GPUs"}


# options named otherwise than the field they set
_FIELD_OF_OPTION = {"memory_budget": "memory_budget_bytes", "device_budget": "device_budget_bytes",
                    "pinned_tier": "pinned_tier_bytes"}


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback unless you mean otherwise."),
    fast_port: int = typer.Option(8100, help="Fast path TCP port (-1: off, 0: any free port)."),
    udp_port: int = typer.Option(8101, help="Fast path UDP port (-1: off)."),
    http_port: int = typer.Option(8000, help="HTTP / Open Inference Protocol port (-1: off)."),
    grpc_port: int = typer.Option(8001, help="gRPC / Open Inference Protocol port (-1: off)."),
    unix_path: Optional[Path] = typer.Option(None, help="Fast path Unix socket (default: DATA_DIR/fast.sock)."),
    data_dir: Path = typer.Option(None, help="Registry, repository, token and caches (default: ./.splitserve)."),
    repository: Optional[Path] = typer.Option(None, help="Extra model repository: a directory per model with config.toml."),
    load: list[str] = typer.Option([], help="Models to load at start-up, in this order, as many as fit the memory "
                                   "budgets together ('*': every registered model, in registration order); the "
                                   "others, and any skipped (logged with why), load on first use."),
    queue_slots: int = typer.Option(None, help="Tensor-queue slots per model and class."),
    preemption: Optional[PriorityMode] = typer.Option(
        None, help="How real-time and best-effort work share CPUs (seq serves every call through the front end; "
                   "idle is the CPU mode of choice: docs/reef.md)."),
    rt_policy: Optional[RtPolicy] = typer.Option(None, help="Order among real-time requests (edf: earliest deadline)."),
    placement: Optional[PlacementKind] = typer.Option(None, help="Placement of models whose config names none."),
    log_level: Optional[str] = typer.Option(None, help="DEBUG, INFO, WARNING or ERROR (default: INFO)."),
    allow_code_artifacts: bool = typer.Option(
        None, help="Accept TorchScript and torch.export uploads: they run code, so every token holder can."),
    memory_budget: Optional[str] = typer.Option(
        None, help="Bytes resident models may take (2GiB, 512MiB, 500MB or bytes); the least recently used go."),
    device_budget: Optional[str] = typer.Option(
        None, help="Device bytes resident models may take on each GPU or MIG device (every instance's copy counted)."),
    pinned_tier: Optional[str] = typer.Option(
        None, help="Page-locked host bytes an evicted GPU model's weights wait in, for a fast reload (0: off)."),
    max_resident_models: Optional[int] = typer.Option(None, help="Models resident at once; more load on demand."),
    class_order: Optional[ClassOrder] = typer.Option(
        None, help="Which waiting request goes first: priority (rt, then be) or arrival (oldest, any class)."),
    partitioning: Optional[Partitioning] = typer.Option(
        None, help="Carve the worker cores into partitions (protean also defaults --preemption to concurrent)."),
    geometry: Optional[str] = typer.Option(None, help="Static partition core counts, e.g. 1,1 or 4,2,1."),
    strict_placement: Optional[StrictPlacement] = typer.Option(
        None, help="Partition of each rt batch (auto: eta under protean, balanced otherwise)."),
    fast_direct: bool = typer.Option(
        None, "--fast-direct/--no-fast-direct",
        help="Workers take fast-path frames on their own Unix and TCP endpoints (LOOKUP names them; "
             "on by default). --no-fast-direct: every call through the front end."),
    zoo_device: Optional[str] = typer.Option(
        None, help="Device of the built-in zoo models: cpu, cuda (a GPU per instance) or cuda:N."),
    ts_inference_port: Optional[int] = typer.Option(
        None, help="Also serve TorchServe's inference API on this port (theirs is 8080; default: off)."),
    ts_management_port: Optional[int] = typer.Option(
        None, help="Also serve TorchServe's management API on this port (theirs is 8081; default: off)."),
    model_store: Optional[Path] = typer.Option(
        None, help="Where the .mar archives TorchServe's POST /models names are (default: DATA_DIR/model-store)."),
    ts_allow_remote_urls: bool = typer.Option(
        None, help="TorchServe's POST /models may download a .mar from an http(s) URL."),
) -> None:
    """Start the server: fast path (TCP, Unix, UDP), HTTP and gRPC, on embedded defaults."""
    given = dict(unix_path=unix_path, repository=repository, queue_slots=queue_slots, preemption=preemption,
                 rt_policy=rt_policy, placement=placement, allow_code_artifacts=allow_code_artifacts,
                 log_level=log_level.upper() if log_level else None, max_resident_models=max_resident_models,
                 memory_budget_bytes=parse_bytes(memory_budget, "--memory-budget") if memory_budget else None,
                 device_budget_bytes=parse_bytes(device_budget, "--device-budget") if device_budget else None,
                 pinned_tier_bytes=parse_bytes(pinned_tier, "--pinned-tier") if pinned_tier else None,
                 class_order=class_order, partitioning=partitioning, geometry=geometry,
                 strict_placement=strict_placement, fast_direct=fast_direct, zoo_device=zoo_device,
                 ts_inference_port=ts_inference_port, ts_management_port=ts_management_port, model_store=model_store,
                 ts_allow_remote_urls=ts_allow_remote_urls)
    cfg = ServerConfig.from_env(
        host=host, fast_port=fast_port, udp_port=udp_port, http_port=http_port, grpc_port=grpc_port,
        data_dir=data_dir or default_data_dir(), load=tuple(load),
        **{k: v for k, v in given.items() if v is not None},
    )
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from splitserve.server.app import Server

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    console.print(f"[bold]splitserve[/] data dir {cfg.data_dir}; Ctrl-C to stop", highlight=False)
    runner(Server(cfg).serve_forever())
    # Stopped cleanly: workers reaped, registry closed, files in place. What is left is the
    # interpreter's teardown of torch, gRPC and their threads (~1 s of CPU), which frees nothing
    # the kernel does not free at exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _group_options_by_section() -> None:
    """Puts each of ``serve``'s options in the help panel of the section its field is in,
    in one place, so an option added later is grouped without being told."""
    for name, param in inspect.signature(serve).parameters.items():
        param.default.rich_help_panel = PANELS[ServerConfig.section_of(_FIELD_OF_OPTION.get(name, name))]


_group_options_by_section()
