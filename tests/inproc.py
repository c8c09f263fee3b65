"""Helpers for tests that drive splitserve in this process: a worker without its process
loop, and a ``Server`` (with real worker processes) on its own event loop."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from splitserve.config import ReefSection, ServerConfig
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.server.app import Server
from splitserve.tensorqueue import TensorQueue, ring_slots
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.process import Worker
from splitserve.worker.messages import LoadMsg
from splitserve.worker.spec import BindSpec, QueueFds, WorkerSpec


@contextmanager
def inproc_worker(cfg: ModelConfig, cache_dir: Path, threads: int = 1, measure: bool = False) -> Iterator[tuple[Worker, PreemptFlag, list[TensorQueue], list[TensorQueue]]]:
    """A Worker for ``cfg`` built here (best-effort queues only), with its flag and queues;
    ``measure``: the LOAD asks for the memory measure (``BindSpec.measure``)."""
    n = ring_slots([t.nbytes for t in cfg.inputs + cfg.outputs], 8)
    ins = [TensorQueue(t.nbytes, n) for t in cfg.inputs]
    outs = [TensorQueue(t.nbytes, n) for t in cfg.outputs]
    flag = PreemptFlag()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spec = WorkerSpec(ctrl_fd=theirs.detach(), flag_fd=flag.fd, cache_dir=str(cache_dir),
                      log_level=ServerConfig.log_level, segment_time_weight=ReefSection.segment_time_weight)
    w = Worker(spec)
    # the binding owns the fds it is given: it gets copies, the queues here keep theirs
    queues = QueueFds(n, [os.dup(q.fd) for q in ins], [os.dup(q.fd) for q in outs])
    w.load(LoadMsg(1, BindSpec(cfg.to_dict(), None, {str(int(RequestClass.BE)): queues}, cfg.capacity,
                               cpus=sorted(os.sched_getaffinity(0)), threads=threads, measure=measure)))
    try:
        yield w, flag, ins, outs
    finally:
        w.unload()
        w.ctrl.close()
        flag.close()
        for q in ins + outs:
            q.close()
        ours.close()


async def until(cond: Callable[[], bool]) -> None:
    """Yield to the loop until ``cond()`` holds (callers bound it with wait_for)."""
    while not cond():
        await asyncio.sleep(0.005)


def run_server(config: ServerConfig, scenario: Callable[[Server], Awaitable[Any]]) -> Any:
    """Start a Server for ``config``, run ``scenario(server)``, stop it; returns the result."""

    async def main() -> Any:
        server = Server(config)
        await server.start()
        try:
            return await scenario(server)
        finally:
            await server.stop()

    return asyncio.run(main())


@contextmanager
def server_in_thread(config: ServerConfig, name: str = "inproc-server") -> Iterator[Server]:
    """A started Server for ``config`` on its own loop in a thread (so that blocking clients
    can call it from the test's thread); stopped, and its errors raised, on exit."""
    up, stop = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        server = Server(config)
        try:
            await server.start()
            box["server"] = server
            up.set()
            await asyncio.to_thread(stop.wait)
        finally:
            await server.stop()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # reported below
            box["error"] = e
        finally:
            up.set()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    up.wait(300)
    try:
        assert "server" in box, f"the server did not start: {box.get('error')!r}"
        yield box["server"]
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive() and "error" not in box, box.get("error")


def quiet_config(data_dir: Path, **kw: Any) -> ServerConfig:
    """A config with every network front end off (in-process calls only), and no spare
    worker processes unless ``spare_workers`` is given: a spare costs a process start
    (torch's import) that most tests would pay for nothing."""
    kw.setdefault("spare_workers", 0)
    return ServerConfig.of(fast_port=None, udp_port=None, http_port=None, grpc_port=None, data_dir=data_dir, **kw)


def write_model(repo: Path, name: str, arch: str, toml: str = "") -> Path:
    """A repository directory for zoo architecture ``arch`` served as ``name``.

    ``toml`` adds top-level keys (e.g. ``'instances = 2\\nmax_batch_size = 4'``)."""
    d = repo / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text(f'name = "{name}"\n{toml}\n[artifact]\nkind = "zoo"\narch = "{arch}"\n')
    return d
