"""``splitserve infer``: one request from the command line, with a progress line while a
model that is not resident yet loads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer

from splitserve.cli.common import console


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
            from splitserve.models.digits import digits_dataset

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
        with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as shown:
            status: list[Any] = []

            def show(line: str) -> None:
                if not status:  # only calls that take a while get a progress line
                    status.append(shown.enter_context(console.status(line)))
                status[0].update(line)

            pending = pool.submit(c.infer_result, model, x, cls=cls)
            res = answer_with_progress(pending, lambda: _model_state(url, model), show, model, _PROGRESS_POLL_S)
    for name, y in res.outputs.items():
        if y.ndim == 1 and y.size <= 1000 and np.issubdtype(y.dtype, np.floating):
            top = int(np.argmax(y))
            console.print(f"{name}: prediction {top} (score {float(y[top]):.3f})" +
                          (f", true label {label}" if label is not None else ""))
        else:
            console.print(f"{name}: {y.dtype} {list(y.shape)} mean {float(np.mean(y)):.4f}")
    console.print(f"server: queue {res.queue_us} us, compute {res.compute_us} us, total {res.total_us} us")


_PROGRESS_POLL_S = 0.5  # how often ``infer`` looks at a model that has not answered yet


def model_state(info: Any) -> str | None:
    """The server's state of a model (ready, loading, evicted...) in a lookup's answer, from
    any transport: the fast path says ``state``, HTTP and gRPC metadata its parameters."""
    extra = info.extra
    state = extra.get("state") or (extra.get("parameters") or {}).get("state")
    if isinstance(state, dict):  # gRPC metadata as JSON: {"string_param": ...}
        state = state.get("string_param")
    return state if isinstance(state, str) else None


def _model_state(url: str, model: str) -> str | None:
    """The model's state now, asked on a connection of its own (lookups are cached per
    client, and the first is busy with the call); None when the server does not say."""
    from splitserve.client import connect

    try:
        with connect(url) as c:
            return model_state(c.lookup(model))
    except Exception:  # noqa: BLE001 - a progress line must never fail the call it reports on
        return None


def progress_line(model: str, state: str | None, waited_s: float) -> str:
    """What ``infer`` shows while a call is unanswered: what the model is doing, and for how long."""
    if state in ("unloaded", "loading", "evicted"):
        return f"{model}: loading ({waited_s:.0f} s; its first call starts it)"
    if state == "failed":
        return f"{model}: its load failed ({waited_s:.0f} s); waiting for the server's answer"
    if state == "ready":
        return f"{model}: running ({waited_s:.0f} s)"
    return f"{model}: waiting for the answer ({waited_s:.0f} s)"


def answer_with_progress(pending: "concurrent.futures.Future[Any]", state: Callable[[], str | None],
                         show: Callable[[str], None], model: str, poll_s: float,
                         clock: Callable[[], float] = time.monotonic) -> Any:
    """The call's answer (or its error); every ``poll_s`` it is not there, ``show`` a line
    saying what the model is doing (its ``state()``)."""
    start = clock()
    while True:
        try:
            return pending.result(timeout=poll_s)
        except concurrent.futures.TimeoutError:
            show(progress_line(model, state(), clock() - start))
