"""The front-end process: one asyncio loop that owns every transport, every model's
queues and scheduler, and the worker processes. ``Server.infer`` is the one request path
that the decoded front ends (HTTP, gRPC, in-process) share with the fast path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.config import ServerConfig
from splitserve.errors import BadSize, InvalidInput, Refused, ShuttingDown, SplitServeError, UnknownModel
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord, Registry, private_dir
from splitserve.scheduler.priority import PriorityMode
from splitserve.server.coordinator import Coordinator
from splitserve.server.fastpath import FastPathConnection, StreamListener, tcp_listener, unix_listener
from splitserve.server.intake import Intake
from splitserve.server.management import UPLOAD_DIR, exposure_warning
from splitserve.server.metrics import Metrics
from splitserve.server.monitor import Call, CallState, InferenceMonitor
from splitserve.server.runtime import ModelRuntime
from splitserve.server.udp import UdpEndpoint, udp_socket

log = logging.getLogger(__name__)


@dataclass
class InferOutcome:
    """Outputs (fresh arrays, in declared order) and the server's timings of one call."""

    outputs: list[np.ndarray]
    queue_us: int
    compute_us: int
    total_us: int


class _FutureSink:
    """Sink for in-process callers: copies the outputs out of the slots into a future."""

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future

    def deliver(self, call: Call) -> None:
        rt = call.runtime
        outs = [
            np.array(q.array(call.seq, call.count, spec.dtype, spec.shape))
            for q, spec in zip(rt.tqs[call.cls][1], rt.config.outputs)
        ]
        if not self.future.done():
            self.future.set_result(InferOutcome(outs, call.queue_us, call.compute_ns // 1000, call.total_us))

    def fail(self, call: Call, error: SplitServeError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class Server:
    """A splitserve node's front end. ``await start()``, then ``await stop()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.monitor = InferenceMonitor(self.metrics)
        self.coordinator = Coordinator(self, config.preemption, config.coordinator_events)
        self.runtimes: dict[str, ModelRuntime] = {}
        self.records: dict[str, ModelRecord] = {}
        self.by_func: dict[int, str] = {}
        self.connections: set[FastPathConnection] = set()
        self.intake = Intake(config)  # requests still arriving on the fast path
        self.listeners: list[Any] = []
        self.ports: dict[str, Any] = {}
        self.stopping = False
        self._stopped = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._cpus = sorted(os.sched_getaffinity(0))
        self._cpu_cursor = 0

    def next_cpus(self, threads: int) -> list[int]:
        """The next ``threads`` usable CPUs, round-robin over the node (fixed placement)."""
        out = [self._cpus[(self._cpu_cursor + k) % len(self._cpus)] for k in range(threads)]
        self._cpu_cursor = (self._cpu_cursor + threads) % len(self._cpus)
        return out

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open every front end and load the start-up models; on failure, undo what started."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._watchdog = self.loop.call_later(self.config.watchdog_period_s, self._sweep)
        cfg = self.config
        private_dir(cfg.data_dir)
        if (exposed := exposure_warning(cfg)) is not None:
            log.warning("%s", exposed)
        cfg.cache_path.mkdir(parents=True, exist_ok=True)
        self.registry = await asyncio.to_thread(Registry, cfg.data_dir)
        # uploads that a crash left half-written are never resumed
        await asyncio.to_thread(shutil.rmtree, cfg.data_dir / UPLOAD_DIR, True)
        for rec in await asyncio.to_thread(self.registry.sync, cfg.repository):
            self._remember(rec)
        if cfg.fast_port is not None:
            s = tcp_listener(cfg.host, cfg.fast_port)
            self.listeners.append(StreamListener(self, s))
            self.ports["fast_port"] = s.getsockname()[1]
        if cfg.unix_path is not None or cfg.fast_port is not None:
            path = cfg.unix_socket
            self.listeners.append(StreamListener(self, unix_listener(path)))
            self.ports["unix_path"] = str(path)
        if cfg.udp_port is not None:
            s = udp_socket(cfg.host, cfg.udp_port)
            self.listeners.append(UdpEndpoint(self, s))
            self.ports["udp_port"] = s.getsockname()[1]
        await self._start_frontends()
        for name in cfg.load:
            await self.runtime(name).wait_ready()
        self._write_server_file()
        log.info("splitserve ready: %s (data dir %s)", self.ports, cfg.data_dir)

    async def _start_frontends(self) -> None:
        """HTTP and gRPC front ends, when their packages are part of this install."""
        from splitserve.server import frontends

        await frontends.start(self)

    def _write_server_file(self) -> None:
        info = {"pid": os.getpid(), "host": self.config.host, **self.ports}
        tmp = self.config.data_dir / "server.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.config.data_dir / "server.json")

    def _sweep(self) -> None:
        """The watchdog: answer calls nothing answered within max_call_age_s (see monitor)."""
        self.monitor.sweep(time.perf_counter(), self.config.max_call_age_s)
        self._watchdog = self.loop.call_later(self.config.watchdog_period_s, self._sweep)

    async def stop(self) -> None:
        """Refuse new work, let running batches finish, stop workers, free memory.

        Ends within stop_timeout_s: then calls still waiting are answered SHUTTING_DOWN
        and workers still running a batch are killed (their batches: WORKER_FAILED)."""
        if self._stopped:
            return
        self._stopped = self.stopping = True
        cfg = self.config
        deadline = time.perf_counter() + cfg.stop_timeout_s
        from splitserve.server import frontends

        try:
            await asyncio.wait_for(frontends.stop(self), max(0.0, deadline - time.perf_counter()))
        except Exception:
            log.exception("stopping the HTTP and gRPC front ends failed")
        for lst in self.listeners:
            lst.close()
        self.listeners.clear()
        runtimes = list(self.runtimes.values())
        results = await asyncio.gather(*(rt.unload(deadline, "was stopped: the server is shutting down")
                                         for rt in runtimes), return_exceptions=True)
        for rt, r in zip(runtimes, results):
            if isinstance(r, BaseException):
                log.error("model %s: unload at shutdown failed", rt.name, exc_info=r)
        for call in self.monitor.open_calls():  # none should be left; if one is, it still gets its answer
            if call.state is CallState.RX_COMPLETE:
                log.error("model %s: call %d still open after its model stopped", call.runtime.name, call.req_id)
                call.answer(ShuttingDown("the server is shutting down"))
        for conn in list(self.connections):
            conn.close()
        self.intake.close()
        for rt in runtimes:
            try:
                rt.close()
            except Exception:
                log.exception("model %s: releasing its tensor queues failed", rt.name)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if hasattr(self, "registry"):
            await asyncio.to_thread(self.registry.close)
        try:
            (self.config.data_dir / "server.json").unlink()
        except FileNotFoundError:
            pass

    async def serve_forever(self) -> None:
        """Start, run until SIGINT/SIGTERM, stop. The handlers are in place before start-up,
        so a signal during a long ``--load`` stops cleanly; a second signal exits at once."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                log.warning("%s again: exiting now without draining", sig.name)
                self._kill_workers()
                os._exit(128 + sig)
            log.info("%s: shutting down (send it again to exit at once)", sig.name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        starting = asyncio.ensure_future(self._start())
        signalled = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                log.info("stopping during start-up")
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
            else:
                starting.result()  # a start-up error ends here
                await signalled
        finally:
            signalled.cancel()
            await self.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _kill_workers(self) -> None:
        for rt in self.runtimes.values():
            for handle in rt.workers.values():
                handle.proc.kill()

    # -- models ----------------------------------------------------------------------

    def _remember(self, rec: ModelRecord) -> None:
        self.records[rec.name] = rec
        self.by_func[rec.func_id] = rec.name

    def remember(self, rec: ModelRecord) -> None:
        """Make a (newly registered) model known to every front end."""
        self._remember(rec)

    def forget(self, name: str) -> None:
        """Drop a model from the name and func_id maps (its runtime must be gone)."""
        rec = self.records.pop(name, None)
        if rec is not None and self.by_func.get(rec.func_id) == name:
            del self.by_func[rec.func_id]

    def runtime(self, name: str) -> ModelRuntime:
        """The runtime of a registered model (created on first use; workers start lazily)."""
        rt = self.runtimes.get(name)
        if rt is not None:
            return rt
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        rec = self.records.get(name)
        if rec is None:
            raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(sorted(self.records)) or 'none'}")
        rt = self.runtimes[name] = ModelRuntime(self, rec)
        return rt

    def runtime_by_func(self, func_id: int) -> ModelRuntime:
        name = self.by_func.get(func_id)
        if name is None:
            raise UnknownModel(f"unknown func_id {func_id}; look the model up by name first")
        return self.runtime(name)

    def request_class(self, rt: ModelRuntime, cls: int) -> RequestClass:
        """The class a call runs in: its own, or the model's default; policy may refuse BE."""
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        try:
            c = RequestClass(cls)
        except ValueError:
            raise InvalidInput(f"unknown request class {cls}; use 0 (real-time) or 1 (best-effort)") from None
        if c == RequestClass.DEFAULT:
            c = rt.default_class
        if c == RequestClass.BE and self.config.preemption is PriorityMode.RT_ONLY:
            raise Refused("best-effort requests are refused in rt-only mode")
        return c

    def describe(self, rt: ModelRuntime) -> dict[str, Any]:
        cfg = rt.config
        return {
            "name": rt.name, "func_id": rt.func_id, "version": cfg.version, "state": rt.state,
            "inputs": [t.to_dict() for t in cfg.inputs], "outputs": [t.to_dict() for t in cfg.outputs],
            "max_batch_size": cfg.max_batch_size, "default_class": cfg.default_class,
            "instances": rt.instance_count,
            "threads": [rt.threads[i] for i in rt.sched.serving()],
            "cpus": [rt.cpus[i] for i in rt.sched.serving()],
            "pids": [rt.workers[i].pid if i in rt.workers else None for i in rt.sched.serving()],
        }

    def model_state(self, name: str) -> str:
        rt = self.runtimes.get(name)
        return rt.state if rt is not None else ("unloaded" if name in self.records else "unknown")

    # -- the shared request path for decoded front ends --------------------------------

    async def infer(self, name: str, inputs: Sequence[np.ndarray], cls: "str | int | None" = None,
                    deadline_s: float | None = None) -> InferOutcome:
        """Run one call: inputs in declared order, each shaped ``(n, *shape)``."""
        rt = self.runtime(name)
        cfg = rt.config
        if len(inputs) != len(cfg.inputs):
            raise InvalidInput(f"model {name!r} takes {len(cfg.inputs)} inputs "
                               f"({', '.join(t.name for t in cfg.inputs)}), got {len(inputs)}")
        count = None
        for arr, spec in zip(inputs, cfg.inputs):
            if arr.dtype != spec.dtype:
                raise InvalidInput(f"input {spec.name!r} of {name!r} must be {spec.datatype}, got {arr.dtype}")
            if arr.shape[1:] != spec.shape or arr.ndim != len(spec.shape) + 1:
                raise BadSize(f"input {spec.name!r} of {name!r} must have shape [n, {', '.join(map(str, spec.shape))}],"
                              f" got {list(arr.shape)}")
            if count is not None and arr.shape[0] != count:
                raise BadSize(f"inputs of {name!r} disagree on the batch size")
            count = arr.shape[0]
        if not count:
            raise BadSize("empty batch")
        c = self.request_class(rt, int(RequestClass.parse(cls)))
        seq = self.intake.alloc(rt, c, count)
        fut = self.loop.create_future()
        deadline = time.perf_counter() + deadline_s if deadline_s else None
        call = Call(self.monitor, rt, 0, c, seq, count, _FutureSink(fut), deadline)
        for q, spec, arr in zip(rt.tqs[c][0], cfg.inputs, inputs):
            np.copyto(q.array(seq, count, spec.dtype, spec.shape), arr)
        rt.submit(call)
        return await fut
