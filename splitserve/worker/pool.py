"""Front-end side of worker processes: start, talk to, watch and restart them.

A ``WorkerHandle`` owns one process and the front end's end of its control socket, which
the event loop watches. Messages arriving from the worker are handed to the owner's
callbacks; an EOF on the socket means the process died.

A process outlives the models bound to it: ``send_load`` binds one (its queues and
artifact), ``send_unload`` releases it (or parks it: the weights kept in page-locked host
memory until ``send_reload``), and ``residency`` says where the handle is in that
cycle, so the owner never dispatches to an instance that is loading or unloading. Its
owner changes too: a spare belongs to the node's ``SparePool`` (``worker/spares.py``)
until a runtime takes it (``adopt``), and goes back to it after an UNLOAD.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

from splitserve.worker.messages import (ADOPT, START_BINDING, DoneMsg, FailedMsg, LoadedMsg, LoadMsg, Msg, RunMsg,
                                        UnloadedMsg, unpack_ready)
from splitserve.worker.counters import WorkerCounters
from splitserve.worker.forkserver import ForkedProcess, ForkServer
from splitserve.worker.gpu_counters import GpuCopies, read_copies
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.spec import BindSpec, WorkerSpec

log = logging.getLogger(__name__)


def worker_env(omp_wait_policy: str | None) -> dict[str, str]:
    """The environment a worker process starts with (and the fork server, whose imports read it)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread until a LOAD places it
    if omp_wait_policy is not None:  # OpenMP reads it when torch loads it: before any LOAD
        env.setdefault("OMP_WAIT_POLICY", omp_wait_policy)
        if omp_wait_policy == "PASSIVE":  # Intel's OpenMP spins for KMP_BLOCKTIME whatever the policy
            env.setdefault("KMP_BLOCKTIME", "0")
    return env


class WorkerOwner(Protocol):
    """Who a worker reports to (the model runtime), on the event loop.

    ``on_ready``: the process started, bound to nothing (``info["pid"]``).
    ``on_failed``: a batch failed (``batch_id``), or with ``batch_id`` 0 the process could
    not start, after which it exits. ``on_loaded`` / ``on_load_failed``
    answer ``send_load`` (a failed load leaves the process up and unbound); ``on_unloaded``
    answers ``send_unload``. ``on_direct``: its direct path's real-time work began or
    ended (its page says which). ``on_exit``: the process is gone."""

    def on_ready(self, instance: int, info: dict) -> None: ...
    def on_done(self, instance: int, msg: DoneMsg) -> None: ...
    def on_failed(self, instance: int, batch_id: int, text: str) -> None: ...
    def on_loaded(self, instance: int, msg: LoadedMsg) -> None: ...
    def on_load_failed(self, instance: int, binding: int, text: str) -> None: ...
    def on_unloaded(self, instance: int, msg: UnloadedMsg) -> None: ...
    def on_direct(self, instance: int) -> None: ...
    def on_exit(self, instance: int, handle: "WorkerHandle") -> None: ...


class Residency(StrEnum):
    """Where a worker is in the bind cycle, as its handle knows it (RUN only while BOUND)."""

    STARTING = "starting"  # the process has not reported READY yet
    UNBOUND = "unbound"  # no model: a RUN would be refused
    LOADING = "loading"  # LOAD sent; LOADED or FAILED not back yet
    BOUND = "bound"  # a model is resident and serves RUN
    UNLOADING = "unloading"  # UNLOAD (or PARK) sent; UNLOADED not back yet
    PARKED = "parked"  # the model stays bound, its weights in page-locked host memory only (RELOAD serves it again)


class WorkerHandle:
    """One worker process: it starts bound to nothing; ``send_load`` binds a model."""

    def __init__(self, owner: WorkerOwner, instance: int, make_spec: Callable[[int, int], WorkerSpec],
                 loop: asyncio.AbstractEventLoop, reap_timeout_s: float, omp_wait_policy: str | None = None,
                 forks: ForkServer | None = None) -> None:
        self.owner = owner
        self.reap_timeout_s = reap_timeout_s  # an exiting worker is killed after this long
        self.instance = instance
        self.loop = loop
        self.flag = PreemptFlag()
        self.counters = WorkerCounters(self.flag.page)  # its direct path's, in the same page
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self.sock = ours
        spec = make_spec(theirs.fileno(), self.flag.fd)
        self.spec = spec
        env = worker_env(omp_wait_policy)
        # Forked from the node's fork server where it has one (``worker/forkserver.py``: no
        # torch import to wait for), else a new interpreter. Either way in its own process group:
        # a terminal's Ctrl-C reaches the server, which drains the workers, instead of failing
        # every batch at once (the worker also ignores SIGINT).
        forked = forks.spawn(loop, [spec.to_json()], spec.fds(), env) if forks is not None else None
        self.proc: ForkedProcess | subprocess.Popen = forked if forked is not None else subprocess.Popen(
            [sys.executable, "-m", "splitserve.worker", spec.to_json()],
            pass_fds=spec.fds(), env=env, stdin=subprocess.DEVNULL, process_group=0,
        )
        theirs.close()
        self.alive = True
        self.started = False  # it reported READY once (a death before that is a failed start)
        self.rss_anon_at_start: int | None = None  # its anonymous RSS when it reported READY
        self.start_error: str | None = None  # the worker's own report of why it could not start
        self.killed_for: str | None = None  # why the front end killed it
        self.stopping = False  # set when the front end asked it to exit: no restart then
        self.residency = Residency.STARTING
        # The binding the worker holds or is loading; LOADs number theirs from 1, so
        # answers can be checked against the request.
        self.binding: int | None = None
        self.reloading = False  # the LOAD in flight is a RELOAD of parked weights
        self._last_binding = START_BINDING
        loop.add_reader(ours.fileno(), self._on_readable)

    @property
    def pid(self) -> int | None:
        """Its pid (None while the fork server has not answered yet, and for a fork that failed)."""
        return self.proc.pid

    def adopt(self, owner: WorkerOwner, instance: int) -> None:
        """Report to ``owner`` as ``instance`` from now on (a spare taken by a runtime, or
        given back to the pool). Only a process with no model bound changes hands."""
        if self.residency not in (Residency.STARTING, Residency.UNBOUND):
            raise RuntimeError(f"worker {self.pid} is {self.residency}: only an unbound worker changes owner")
        self.owner, self.instance = owner, instance

    @property
    def ready(self) -> bool:
        """The process is up with a model bound: a RUN would be served."""
        return self.alive and self.residency is Residency.BOUND

    def gpu_copies(self) -> tuple[GpuCopies, int, int]:
        """What its GPU path copied, its page-locked queues and CUDA graph sizes (``gpu_counters``)."""
        return read_copies(self.flag.page)

    def send_run(self, msg: RunMsg) -> bool:
        """Send a batch descriptor; False if the worker is gone (its exit is being handled)."""
        try:
            self.sock.send(msg.pack())
            return True
        except OSError:
            return False

    def send_adopt(self, sock: socket.socket, req_id: int) -> bool:
        """Hand a client's connection to the bound worker's direct endpoint (its descriptor
        rides as SCM_RIGHTS; the caller closes its own): the worker acknowledges to the client
        with a HANDOFF frame of ``req_id`` and serves it from then on, or says why not there
        and closes it. Nothing comes back on the control socket. False if the worker is gone
        or not bound (the connection is still the caller's then)."""
        if self.residency is not Residency.BOUND:
            return False
        try:
            socket.send_fds(self.sock, [ADOPT.pack(Msg.ADOPT, req_id)], [sock.fileno()])
            return True
        except OSError:
            return False

    def send_load(self, bind: BindSpec) -> bool:
        """Bind the (unbound) worker to a model: its queue memfds go with the message, the
        worker loads the weights from the artifact. The answer is ``on_loaded`` or
        ``on_load_failed``; False if the worker is gone (its exit is being handled)."""
        if self.residency is not Residency.UNBOUND:
            raise RuntimeError(f"worker {self.pid} is {self.residency}, not unbound: it cannot load a model now")
        self._fresh_flag()
        self._last_binding += 1
        data, fds = LoadMsg(self._last_binding, bind).pack()
        try:
            socket.send_fds(self.sock, [data], fds)
        except OSError:
            return False
        self.binding = self._last_binding
        self.residency, self.reloading = Residency.LOADING, False
        return True

    def _fresh_flag(self) -> None:
        """The flag outlives bindings and parks, and batch ids are per binding: a target or
        deadline left from before must not stop the next binding's batches."""
        self.flag.clear()
        self.flag.hold_direct(False)
        self.flag.set_padding_deadline(0)

    def send_unload(self, park: bool = False) -> bool:
        """Release the bound (or parked) model's weights and queue mappings; with ``park``,
        keep the binding, its weights in page-locked host memory only (the worker may still
        release it: nothing to park). The answer is ``on_unloaded``. False if the worker is
        gone. Send it only with no batch running: the worker answers in order, so a batch
        sent before still finishes first."""
        if self.residency is not Residency.BOUND and (park or self.residency is not Residency.PARKED):
            raise RuntimeError(f"worker {self.pid} is {self.residency}, not bound: nothing to unload")
        try:
            self.sock.send(bytes([Msg.PARK if park else Msg.UNLOAD]))
        except OSError:
            return False
        self.residency = Residency.UNLOADING
        return True

    def send_reload(self) -> bool:
        """Serve the parked model again; the answer is ``on_loaded`` (its first batch copies
        the weights back as it runs) or ``on_load_failed`` (then unbound). False if gone."""
        if self.residency is not Residency.PARKED:
            raise RuntimeError(f"worker {self.pid} is {self.residency}, not parked: nothing to reload")
        self._fresh_flag()
        try:
            self.sock.send(bytes([Msg.RELOAD]))
        except OSError:
            return False
        self.residency, self.reloading = Residency.LOADING, True
        return True

    def _on_readable(self) -> None:
        """One message a wake-up: the loop's readiness is level-triggered, so a message still
        queued wakes it again at once, and the usual single DONE costs no second ``recv`` that
        finds the socket empty."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone()
            return
        kind = data[0]
        if kind in (Msg.DONE, Msg.PREEMPTED):
            self.owner.on_done(self.instance, DoneMsg.unpack(data))
        elif kind == Msg.FAILED:
            self._on_failed(FailedMsg.unpack(data))
        elif kind == Msg.READY:
            self.started = True
            self.residency = Residency.UNBOUND
            info = unpack_ready(data)
            self.rss_anon_at_start = info.get("rss_anon")
            self.owner.on_ready(self.instance, info)
        elif kind == Msg.LOADED:
            self._on_loaded(LoadedMsg.unpack(data))
        elif kind == Msg.UNLOADED:
            self._on_unloaded(UnloadedMsg.unpack(data))
        elif kind == Msg.DIRECT:
            self.owner.on_direct(self.instance)
        else:
            log.error("worker %s sent unknown message kind %d", self.pid, kind)

    def _on_loaded(self, msg: LoadedMsg) -> None:
        if self.residency is not Residency.LOADING or msg.binding != self.binding:
            log.error("worker %s loaded binding %d, but binding %s was %s", self.pid, msg.binding, self.binding,
                      self.residency)
        self.residency, self.reloading = Residency.BOUND, False
        self.binding = msg.binding
        self.owner.on_loaded(self.instance, msg)

    def _on_unloaded(self, msg: UnloadedMsg) -> None:
        if self.residency is not Residency.UNLOADING:
            log.error("worker %s unloaded binding %s, which was not asked for", self.pid, msg.binding)
        if msg.parked_bytes > 0:
            self.residency = Residency.PARKED
        else:
            self.residency, self.binding = Residency.UNBOUND, None
        self.owner.on_unloaded(self.instance, msg)

    def _on_failed(self, msg: FailedMsg) -> None:
        if msg.op == Msg.RUN:
            self.owner.on_failed(self.instance, msg.ident, msg.text)
        elif msg.op != Msg.LOAD:  # this handle sends no such message: a bug on one side
            log.error("worker %s refused a message of kind %d: %s", self.pid, msg.op, msg.text)
        elif not self.started:  # the process could not start: it exits now, and on_exit follows
            self.start_error = msg.text
            self.owner.on_failed(self.instance, 0, msg.text)
        else:
            if self.residency is not Residency.LOADING or msg.ident != self.binding:
                log.error("worker %s failed binding %d, but binding %s was %s", self.pid, msg.ident, self.binding,
                          self.residency)
            self.residency = Residency.UNBOUND
            self.binding = None
            self.owner.on_load_failed(self.instance, msg.ident, msg.text)  # ``reloading`` says which it was
            self.reloading = False

    def _gone(self) -> None:
        """The control socket closed (on the loop): the process is exiting or gone.

        The owner hears of it at once; reaping the process happens off the loop."""
        if not self.alive:
            return
        self.alive = False
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.owner.on_exit(self.instance, self)
        self.flag.close()
        self.loop.run_in_executor(None, self._reap, self.reap_timeout_s)

    def _reap(self, timeout: float) -> None:
        """Wait for the process to exit, killing it after ``timeout`` (runs off the loop)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self, reason: str) -> None:
        """SIGKILL the process (also one that is stopped); its exit is handled as any other."""
        self.killed_for = self.killed_for or reason
        log.error("killing worker %s: %s", self.pid, reason)
        self.proc.kill()

    async def stop(self, timeout: float) -> None:
        """Ask the worker to exit after its current batch, and wait until it has; a worker
        still there after ``timeout`` s is killed (its batch is then lost: WORKER_FAILED)."""
        self.stopping = True
        if self.alive:
            try:
                self.sock.send(bytes([Msg.STOP]))
            except OSError:
                pass
        await asyncio.to_thread(self._reap, timeout)
        self._gone()
