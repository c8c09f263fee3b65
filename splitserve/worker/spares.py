"""The node's spare worker processes: started ahead (torch imported, bound to nothing), so a
load binds a model to a process that is already up instead of paying a process start
(about 4.6 s of interpreter and torch import for a new interpreter here, against milliseconds to map
weights; a fork from the node's fork server, ``worker/forkserver.py``, takes milliseconds too).

The pool owns its spares (it is their ``WorkerOwner``). A runtime ``take``s one for an
instance, which makes the runtime its owner; after an UNLOAD the runtime ``give_back``s it,
and the pool keeps it if its anonymous memory came back to within
``recycle_slack_bytes`` of what the process held when it started (else it exits, taking
whatever it could not return with it). The pool refills itself in the background up to
``spare_workers`` processes, never more; ``spare_workers = 0`` turns it off (every load
starts a process, every unload ends one).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from splitserve.config import ServerConfig
from splitserve.worker.messages import DoneMsg, LoadedMsg, UnloadedMsg
from splitserve.worker.pool import Residency, WorkerOwner
from splitserve.worker.spec import WorkerSpec

log = logging.getLogger(__name__)


class PooledWorker(Protocol):
    """A worker process as the pool holds it (``worker.pool.WorkerHandle``, or a fake)."""

    pid: int
    alive: bool
    started: bool
    stopping: bool  # asked to exit
    residency: Residency
    rss_anon_at_start: int | None  # its anonymous RSS when it reported READY

    def adopt(self, owner: WorkerOwner, instance: int) -> None: ...
    def kill(self, reason: str) -> None: ...
    async def stop(self, timeout: float) -> None: ...


W = TypeVar("W", bound=PooledWorker)


class SparePool(Generic[W]):
    """Idle worker processes for the whole node; runs on the event loop. ``spawn`` starts
    one (``WorkerHandle(owner, instance, make_spec(ctrl_fd, flag_fd), loop)``, or a fake)."""

    def __init__(self, config: ServerConfig, loop: asyncio.AbstractEventLoop,
                 spawn: Callable[[WorkerOwner, int, Callable[[int, int], WorkerSpec], asyncio.AbstractEventLoop], W],
                 node_stopping: Callable[[], bool] = lambda: False) -> None:
        self.config = config
        self.loop = loop
        self._spawn = spawn
        self._node_stopping = node_stopping  # the node is shutting down: nothing new starts
        self.target = config.memory.spare_workers
        # A spare returned by an eviction is kept even when the pool is full, once: the
        # load that the eviction made room for takes it, so no process starts or exits.
        self.capacity = self.target + 1 if self.target else 0
        self.idle: list[W] = []  # up, bound to nothing; the last one given back is taken first
        self.starting: dict[int, W] = {}  # by their pool id, until READY
        self._ids = itertools.count(1)  # a spare reports to the pool as instance -id
        self._failed_starts = 0  # in a row: refilling pauses at worker_start_attempts, until the next take
        self._stopping: set[asyncio.Task] = set()
        self.stopped = False

    @property
    def spares(self) -> int:
        """Spare processes ready to be bound now (for ``/v2/memory``)."""
        return len(self.idle)

    def start(self) -> None:
        """Start the first spares (in the background: they report READY when up)."""
        self._refill()

    def take(self, owner: WorkerOwner, instance: int) -> W:
        """A process for ``instance`` of ``owner``, which owns it from now on: an idle
        spare (up: ``residency`` UNBOUND, bind it now), else one still starting, else a
        new process (both report READY to ``owner``)."""
        self._failed_starts = 0  # demand retries a refill that had given up
        if self.idle:
            handle = self.idle.pop()
        elif self.starting:
            _, handle = self.starting.popitem()
        else:
            handle = self._spawn(owner, instance, self._spec, self.loop)
            self._refill()
            return handle
        handle.adopt(owner, instance)
        log.info("worker %s (a spare) taken for instance %d", handle.pid, instance)
        self._refill()
        return handle

    def give_back(self, handle: W, rss_anon: int) -> bool:
        """Take back a process whose model was unloaded (``rss_anon``: its anonymous RSS
        after the UNLOAD). It stays as a spare if the pool has room and its memory came
        back to within ``recycle_slack_bytes`` of its level at start; otherwise it is
        stopped. True if it was kept. One that is being stopped already (its model is
        unloading for good) is left to that."""
        if handle.stopping:
            return False
        start = handle.rss_anon_at_start
        recycled = (not self.stopped and handle.alive and handle.residency is Residency.UNBOUND
                    and start is not None and rss_anon - start <= self.config.memory.recycle_slack_bytes)
        handle.adopt(self, -next(self._ids))
        if recycled and len(self.idle) < self.capacity:
            self.idle.append(handle)
            log.info("worker %s recycled as a spare (anonymous RSS %d MiB, %+d MiB from its start)", handle.pid,
                     rss_anon >> 20, (rss_anon - (start or 0)) >> 20)
            return True
        why = "the pool is full" if recycled else f"its anonymous RSS ({rss_anon >> 20} MiB) did not come back"
        log.info("worker %s exits: %s", handle.pid, why)
        self._stop(handle)
        return False

    async def stop(self) -> None:
        """Stop every spare and wait until they are gone (with the node). One still
        starting holds nothing and would read the STOP only once torch is imported: it is
        killed at once instead."""
        self.stopped = True
        for handle in self.idle:
            self._stop(handle)
        for handle in self.starting.values():
            self._stop(handle, grace_s=0.0)
        self.idle.clear()
        self.starting.clear()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    def kill_all(self, reason: str) -> None:
        """Kill every spare now (the node exits without draining)."""
        for handle in [*self.idle, *self.starting.values()]:
            handle.kill(reason)

    def _stop(self, handle: W, grace_s: float | None = None) -> None:
        """Ask ``handle`` to exit (killed after ``grace_s``, default stop_timeout_s)."""
        grace = self.config.workers.stop_timeout_s if grace_s is None else grace_s
        task = self.loop.create_task(handle.stop(grace))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def _spec(self, ctrl_fd: int, flag_fd: int) -> WorkerSpec:
        cfg = self.config
        return WorkerSpec(ctrl_fd=ctrl_fd, flag_fd=flag_fd, cache_dir=str(cfg.cache_path), log_level=cfg.log_level,
                          segment_time_weight=cfg.reef.segment_time_weight)

    def _refill(self) -> None:
        """Start spares until ``spare_workers`` are up or starting (bounded: never more,
        and not after worker_start_attempts spares in a row died before they were up)."""
        while (not self.stopped and not self._node_stopping() and len(self.idle) + len(self.starting) < self.target
               and self._failed_starts < self.config.workers.worker_start_attempts):
            ident = next(self._ids)
            handle = self._spawn(self, -ident, self._spec, self.loop)
            self.starting[ident] = handle
            self.loop.call_later(self.config.workers.worker_start_timeout_s, self._start_timed_out, handle)

    def _start_timed_out(self, handle: W) -> None:
        if handle.alive and not handle.started and any(h is handle for h in self.starting.values()):
            handle.kill(f"spare worker (pid {handle.pid}) was not ready within worker_start_timeout_s")

    # -- WorkerOwner: what the pool's own spares report -------------------------------------

    def on_ready(self, instance: int, info: dict) -> None:
        handle = self.starting.pop(-instance, None)
        if handle is None:
            return
        self._failed_starts = 0
        if self.stopped:
            self._stop(handle)
            return
        self.idle.append(handle)
        log.info("spare worker %s ready (anonymous RSS %d MiB)", handle.pid, (info.get("rss_anon") or 0) >> 20)

    def on_exit(self, instance: int, handle: W) -> None:
        if self.starting.pop(-instance, None) is not None:
            self._failed_starts += 1
            log.error("spare worker %s exited before it was up", handle.pid)
        elif handle in self.idle:
            self.idle.remove(handle)
            log.warning("spare worker %s exited", handle.pid)
        self._refill()  # a spare that died is replaced

    def on_failed(self, instance: int, batch_id: int, text: str) -> None:
        log.error("spare worker (instance %d) failed: %s", instance, text)

    def on_done(self, instance: int, msg: DoneMsg) -> None:
        log.error("spare worker (instance %d) reported batch %d, but it runs none", instance, msg.batch_id)

    def on_loaded(self, instance: int, msg: LoadedMsg) -> None:
        log.error("spare worker (instance %d) loaded binding %d, which nobody sent", instance, msg.binding)

    def on_load_failed(self, instance: int, binding: int, text: str) -> None:
        log.error("spare worker (instance %d) failed binding %d, which nobody sent", instance, binding)

    def on_unloaded(self, instance: int, msg: UnloadedMsg) -> None:
        log.error("spare worker (instance %d) unloaded binding %s, which nobody sent", instance, msg.binding)

    def on_direct(self, instance: int) -> None:
        log.error("spare worker (instance %d) rang for direct work, but it serves no model", instance)
