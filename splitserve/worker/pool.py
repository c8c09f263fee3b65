"""Front-end side of worker processes: start, talk to, watch and restart them.

A ``WorkerHandle`` owns one process and the front end's end of its control socket, which
the event loop watches. Messages arriving from the worker are handed to the owner's
callbacks; an EOF on the socket means the process died.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol

from splitserve.worker.messages import DoneMsg, Msg, RunMsg, unpack_text
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)


class WorkerOwner(Protocol):
    """Who a worker reports to (the model runtime)."""

    def on_ready(self, instance: int, info: dict) -> None: ...
    def on_done(self, instance: int, msg: DoneMsg) -> None: ...
    def on_failed(self, instance: int, batch_id: int, text: str) -> None: ...
    def on_exit(self, instance: int, handle: "WorkerHandle") -> None: ...


class WorkerHandle:
    """One worker process serving one model instance."""

    def __init__(self, owner: WorkerOwner, instance: int, make_spec: Callable[[int, int], WorkerSpec],
                 loop: asyncio.AbstractEventLoop, reap_timeout_s: float) -> None:
        self.owner = owner
        self.reap_timeout_s = reap_timeout_s  # an exiting worker is killed after this long
        self.instance = instance
        self.loop = loop
        self.flag = PreemptFlag()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self.sock = ours
        spec = make_spec(theirs.fileno(), self.flag.fd)
        self.spec = spec
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(spec.threads))
        # Its own process group: a terminal's Ctrl-C reaches the server, which drains the
        # workers, instead of failing every batch at once (the worker also ignores SIGINT).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.worker", spec.to_json()],
            pass_fds=spec.fds(), env=env, stdin=subprocess.DEVNULL, process_group=0,
        )
        theirs.close()
        self.alive = True
        self.ready = False
        self.started = False  # it reported READY once (a death before that is a failed start)
        self.load_error: str | None = None  # the worker's own report of why it could not load
        self.killed_for: str | None = None  # why the front end killed it
        self.stopping = False  # set when the front end asked it to exit: no restart then
        loop.add_reader(ours.fileno(), self._on_readable)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send_run(self, msg: RunMsg) -> bool:
        """Send a batch descriptor; False if the worker is gone (its exit is being handled)."""
        try:
            self.sock.send(msg.pack())
            return True
        except OSError:
            return False

    def _on_readable(self) -> None:
        while True:
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
            if kind == Msg.READY:
                self.ready = self.started = True
                self.owner.on_ready(self.instance, json.loads(unpack_text(data)[2]))
            elif kind in (Msg.DONE, Msg.PREEMPTED):
                self.owner.on_done(self.instance, DoneMsg.unpack(data))
            elif kind == Msg.FAILED:
                _, bid, text = unpack_text(data)
                if bid == 0:
                    self.load_error = text
                self.owner.on_failed(self.instance, bid, text)
            else:
                log.error("worker %d sent unknown message kind %d", self.pid, kind)

    def _gone(self) -> None:
        """The control socket closed (on the loop): the process is exiting or gone.

        The owner hears of it at once; reaping the process happens off the loop."""
        if not self.alive:
            return
        self.alive = False
        self.ready = False
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
        log.error("killing worker %d: %s", self.pid, reason)
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
