"""``splitserve`` command line: serve | infer | models (and later profile | plan | bench)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from splitserve.config import ServerConfig, default_data_dir

app = typer.Typer(add_completion=False, no_args_is_help=True, help="splitserve: inference serving without the RPC tax")
console = Console()


def _port(value: int) -> int | None:
    """-1 turns a front end off; 0 picks a free port."""
    return None if value < 0 else value


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback unless you mean otherwise."),
    fast_port: int = typer.Option(8100, help="Fast path TCP port (-1: off, 0: any free port)."),
    udp_port: int = typer.Option(8101, help="Fast path UDP port (-1: off)."),
    http_port: int = typer.Option(8000, help="HTTP / Open Inference Protocol port (-1: off)."),
    grpc_port: int = typer.Option(8001, help="gRPC / Open Inference Protocol port (-1: off)."),
    unix_path: Optional[Path] = typer.Option(None, help="Fast path Unix socket (default: DATA_DIR/fast.sock)."),
    data_dir: Path = typer.Option(None, help="Registry, repository, token and caches (default: ./.splitserve)."),
    repository: Optional[Path] = typer.Option(None, help="Extra model repository: a directory per model with config.toml."),
    load: list[str] = typer.Option([], help="Models to load at start-up (others load on first use)."),
    queue_slots: int = typer.Option(None, help="Tensor-queue slots per model and class."),
    preemption: str = typer.Option(None, help="reef | seq | concurrent | rt-only"),
    log_level: str = typer.Option("INFO", help="DEBUG, INFO, WARNING or ERROR."),
) -> None:
    """Start the server: fast path (TCP, Unix, UDP), HTTP and gRPC, on embedded defaults."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ServerConfig.from_env(
        host=host, fast_port=_port(fast_port), udp_port=_port(udp_port), http_port=_port(http_port),
        grpc_port=_port(grpc_port), unix_path=unix_path, data_dir=data_dir or default_data_dir(),
        repository=repository, load=tuple(load), queue_slots=queue_slots, preemption=preemption,
        log_level=log_level.upper(),
    )
    from splitserve.server.app import Server

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    console.print(f"[bold]splitserve[/] data dir {cfg.data_dir}; Ctrl-C to stop", highlight=False)
    runner(Server(cfg).serve_forever())


@app.command()
def infer(
    model: str = typer.Argument(..., help="Model name."),
    url: str = typer.Option("tcp://127.0.0.1:8100", help="Server URL: tcp://, unix://, udp://, http://, grpc://."),
    sample: Optional[int] = typer.Option(None, help="digits only: index of a bundled held-out test image."),
    input: Optional[Path] = typer.Option(None, "--input", help="A .npy file with the input (single-input models)."),
    random: bool = typer.Option(False, help="Send a random input of the model's shape (seed 0)."),
    cls: str = typer.Option("default", "--class", help="rt (real-time) or be (best-effort)."),
) -> None:
    """Send one request and print the answer."""
    from splitserve.client import connect

    with connect(url) as c:
        info = c.lookup(model)
        label = None
        if sample is not None:
            if model != "digits":
                raise typer.BadParameter("--sample only applies to the digits model")
            from splitserve.models import digits_dataset

            _, _, x_test, y_test = digits_dataset()
            x, label = x_test[sample], int(y_test[sample])
        elif input is not None:
            x = np.load(input, allow_pickle=False)
        elif random:
            rng = np.random.default_rng(0)
            x = [(rng.random(t.shape) * 4).astype(t.dtype) for t in info.inputs]
            x = x[0] if len(x) == 1 else x
        else:
            raise typer.BadParameter("give --sample, --input or --random")
        res = c.infer_result(model, x, cls=cls)
    for name, y in res.outputs.items():
        if y.ndim == 1 and y.size <= 1000 and np.issubdtype(y.dtype, np.floating):
            top = int(np.argmax(y))
            console.print(f"{name}: prediction {top} (score {float(y[top]):.3f})" +
                          (f", true label {label}" if label is not None else ""))
        else:
            console.print(f"{name}: {y.dtype} {list(y.shape)} mean {float(np.mean(y)):.4f}")
    console.print(f"server: queue {res.queue_us} us, compute {res.compute_us} us, total {res.total_us} us")


@app.command()
def models(
    data_dir: Path = typer.Option(None, help="The server's data directory (default: ./.splitserve)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List registered models with their func ids, shapes and instances."""
    from splitserve.registry import Registry

    reg = Registry(data_dir or default_data_dir())
    try:
        if not reg.list():
            reg.sync()
        recs = reg.list()
    finally:
        reg.close()
    if as_json:
        console.print_json(json.dumps([{"name": r.name, "func_id": r.func_id, **r.config.to_dict()} for r in recs]))
        return
    t = Table("func_id", "name", "inputs", "outputs", "max batch", "instances x threads", "source")
    for r in recs:
        c = r.config
        t.add_row(str(r.func_id), r.name, ", ".join(f"{s.name} {s.datatype}{list(s.shape)}" for s in c.inputs),
                  ", ".join(f"{s.name} {s.datatype}{list(s.shape)}" for s in c.outputs),
                  str(c.max_batch_size), f"{c.instances} x {c.threads}", r.source)
    console.print(t)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
