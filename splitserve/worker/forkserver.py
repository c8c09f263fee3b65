"""A node's fork server: one process that has imported torch and the worker's code once, and
forks every new worker from itself.

A worker started as a new interpreter spends about 2.5 s of CPU importing torch before it can
answer anything (2.7 s of wall time on the 2-vCPU machines here). Every load without a spare,
every restart, every instance Packrat or PROTEAN adds paid that. Forked from a process that paid
it once, a worker is up in milliseconds: ``fork`` copies page tables (≈ 3 ms), not imports.

The fork server is the node's child, started first thing by a node with start-up models or
spare workers (its imports overlap the rest of the node's start-up), else with the node's
first worker, in the environment a worker gets (OpenMP reads its settings when torch loads).
It never runs an operator, starts no thread and never touches CUDA, so a fork of it is what a
new interpreter would be after its imports: torch's thread pools and CUDA start in the worker, after the fork,
under the worker's own environment (``CUDA_VISIBLE_DEVICES`` included, ``worker/gpu_env.py``).

The protocol, on a private SOCK_SEQPACKET socketpair: the node sends one request per worker,
a JSON document (the worker's arguments, its environment, the fd numbers it expects) with those
fds as SCM_RIGHTS, then the node's stdout and stderr. The fork server answers the requests in
order, each with the worker's pid and a pidfd of it; pid 0 and no fd when it could not fork.
The request's fds are closed in the fork server either way, so a worker that never started
shows as one that died at start: its control socket reads EOF. The node kills and waits for a
forked worker through its pidfd, which names that process and no later one with its pid; the
fork server reaps it. It exits when the node's end of the socket closes.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import gc
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import NoReturn

log = logging.getLogger(__name__)

_READY = b"R"  # sent once, when the imports are done
_PID = struct.Struct("=i")
_MAX_REQUEST = 1 << 20  # a worker's spec and environment are a few KiB
_MAX_FDS = 16
_REAP_INTERVAL_MS = 500  # how often the fork server reaps exited workers while no request comes


# -- the fork server's process ---------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """``python -m splitserve.worker.forkserver FD [NODE]``: import what a worker needs, then fork
    workers for the requests on the socket ``FD`` until it closes. ``NODE`` (the node's data dir)
    is there for ``ps``: it names the node of the fork server and of every worker forked from it."""
    # The terminal's Ctrl-C is the node's to handle (it drains the workers); the workers forked
    # from here inherit this, as a worker started on its own sets it first thing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    import splitserve.worker.process  # noqa: F401  (torch, numpy and the worker's code: what each fork skips)

    # The imports' ~190,000 objects out of the collector's way, in here and in every fork (which
    # inherits them frozen): a full collection, ≈ 100-200 ms over them, is then one over the
    # worker's own objects, and it no longer writes to their pages, which stay shared with this
    # process instead of being copied into each worker. (Not collected first: that found 23
    # objects of garbage and cost every node's start 200 ms.)
    gc.freeze()
    sock.send(_READY)
    serve(sock)
    return 0


def serve(sock: socket.socket) -> None:
    """Answer fork requests on ``sock`` until the node closes its end; reap exited workers."""
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    while True:
        ready = poll.poll(_REAP_INTERVAL_MS)
        _reap()
        if not ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST, _MAX_FDS)
        except InterruptedError:
            continue
        except OSError:
            return
        if not msg:
            for fd in fds:
                os.close(fd)
            return
        pid, pidfd = _fork(sock, msg, fds)
        try:
            socket.send_fds(sock, [_PID.pack(pid)], [pidfd] if pidfd is not None else [])
        except OSError:
            return  # the node is gone; its workers see their control sockets close
        finally:
            if pidfd is not None:
                os.close(pidfd)


def _reap() -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _fork(sock: socket.socket, msg: bytes, fds: list[int]) -> tuple[int, int | None]:
    """Fork one worker for a request: (its pid, a pidfd of it), or (0, None) if it cannot be."""
    try:
        req = json.loads(msg)
        args, env, targets = list(req["args"]), dict(req["env"]), [int(t) for t in req["fds"]]
        if len(fds) != len(targets) + 2 or len(set(targets)) != len(targets) or min(targets, default=3) < 3:
            raise ValueError(f"{len(fds)} fds for targets {targets} and stdout, stderr")
        pid = os.fork()
    except Exception:
        traceback.print_exc()
        pid = -1
    if pid == 0:
        _become_worker(sock, args, env, fds, targets)
    for fd in fds:
        os.close(fd)
    if pid < 0:
        return 0, None
    try:
        return pid, os.pidfd_open(pid)
    except OSError:  # it cannot have been reaped yet (only _reap reaps, and not before this answer)
        traceback.print_exc()
        return pid, None


def _become_worker(sock: socket.socket, args: list[str], env: dict[str, str], fds: list[int],
                   targets: list[int]) -> NoReturn:
    """In the forked child: the fds a worker started by ``Popen`` would have, the worker's
    environment, then the worker; never returns into the fork server's loop."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, as ``Popen(process_group=0)`` gives a worker
        os.close(sock.detach())
        _arrange_fds(fds, [*targets, 1, 2])
        os.environ.clear()
        os.environ.update(env)
        import numpy as np

        np.random.seed()  # numpy's global generator: a fresh seed per worker, as a new interpreter draws
        from splitserve.worker.process import exit_after

        exit_after(args)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _arrange_fds(fds: list[int], targets: list[int]) -> None:
    """``fds[i]`` at fd number ``targets[i]``, /dev/null at 0, every other fd closed."""
    floor = max(targets) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]  # above every target: no dup2 clobbers one
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in high:
            try:
                os.close(fd)
            except OSError:  # the listing's own fd, closed already
                pass
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:
        os.dup2(null, 0)
        os.close(null)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
    for fd in high:
        os.close(fd)


def node_workers(server_pid: int) -> list[int]:
    """The pids of the worker processes of the node ``server_pid`` (read from ``/proc``): its
    children started as workers (``-m splitserve.worker``) and the children of its fork server
    (which is not one). Anything else a node may run briefly (a helper that importing torch
    starts) is left out."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = _ppid(int(name))
            if ppid is not None:
                parents.setdefault(ppid, []).append(int(name))
    workers = []
    for pid in parents.get(server_pid, []):
        module = _module(pid)
        if module == "splitserve.worker":
            workers.append(pid)
        elif module == "splitserve.worker.forkserver":
            workers.extend(parents.get(pid, []))
    return sorted(workers)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _module(pid: int) -> str | None:
    """The module a ``python -m`` process runs (None: not one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    return argv[2].decode(errors="replace") if len(argv) > 2 and argv[1] == b"-m" else None


# -- the node's side ---------------------------------------------------------------------

class ForkedProcess:
    """A worker the fork server forked, as ``WorkerHandle`` uses a ``Popen``: ``pid``,
    ``kill`` and ``wait``. Its pid arrives with the fork server's answer (None until then, and
    for good when the fork failed); a kill asked for before that is sent when it arrives."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._pidfd: int | None = None
        self._known = threading.Event()  # the fork server answered (or is gone)
        self._lock = threading.Lock()  # kill (the loop, or a reaping thread) against wait's close of the pidfd
        self._kill_asked = False
        self._waited = False  # a wait returned before the answer: nobody will wait on its pidfd

    def _resolve(self, pid: int | None, pidfd: int | None) -> None:
        with self._lock:
            self.pid, self._pidfd = pid, pidfd
            if self._kill_asked:
                self._signal()
                if self._waited and pidfd is not None:
                    os.close(pidfd)
                    self._pidfd = None
        self._known.set()

    def kill(self) -> None:
        """SIGKILL it (now, or as soon as its pid is known)."""
        with self._lock:
            self._kill_asked = True
            self._signal()

    def _signal(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:  # exited already
                pass

    def wait(self, timeout: float | None = None) -> None:
        """Wait until it has exited (``subprocess.TimeoutExpired`` after ``timeout`` s). One killed
        before the fork server answered returns at once: it never runs past its fork, as the kill
        goes with the answer (``_resolve``), and the answer may be a fork server's import away
        (≈ 2.5 s), which a node stopping, or a start given up on, should not wait for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._kill_asked and not self._known.is_set():
                self._waited = True
                return
        if not self._known.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        with self._lock:
            pidfd = self._pidfd
        if pidfd is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        poll = select.poll()  # not select(): a busy front end's fds go past FD_SETSIZE
        poll.register(pidfd, select.POLLIN)
        if not poll.poll(None if left is None else int(left * 1000)):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        with self._lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None


class ForkServer:
    """The node's end of its fork server, on the node's event loop: started at the first
    ``spawn``, restarted at the next one after it died, and given up on (``spawn`` returns None:
    the caller starts a new interpreter) if it ever dies before it is ready."""

    def __init__(self, env: Mapping[str, str], node: str = "") -> None:
        self.env = dict(env)  # its own environment: what OpenMP and torch read at import
        self.node = node  # the node's data dir, in its command line (and so in its workers')
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = False  # its imports are done (spawns before are answered after them)
        self.broken = False  # it died before it was ever ready: spawn no more through it
        self.forked = 0  # workers it forked
        self._pending: collections.deque[ForkedProcess] = collections.deque()

    def spawn(self, loop: asyncio.AbstractEventLoop, args: Sequence[str], fds: Sequence[int],
              env: Mapping[str, str]) -> ForkedProcess | None:
        """Ask for a worker run with ``args`` (the worker's argv), ``fds`` at their own numbers
        and ``env``; None if there is no fork server to ask (the caller starts the worker as a
        new interpreter). The fds may be closed by the caller at once."""
        if not self.start(loop):
            return None
        assert self.sock is not None
        doc = json.dumps({"args": list(args), "env": dict(env), "fds": list(fds)}).encode()
        try:
            # the node's fds 1 and 2 (not ``sys.stdout``, which a host may have replaced), as Popen passes them
            socket.send_fds(self.sock, [doc], [*fds, 1, 2])
        except OSError as e:  # gone, or its queue full: this one starts as a new interpreter
            log.warning("the worker fork server took no request (%s); starting a worker as a new interpreter", e)
            return None
        proc = ForkedProcess()
        self._pending.append(proc)
        return proc

    def start(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Start it now if it is not running (a node that knows it will need workers starts it
        early, so that its imports overlap the rest of its start-up); False if it cannot run."""
        if self.broken:
            return False
        if self.sock is None:
            try:
                self._start(loop)
            except OSError:
                log.exception("the worker fork server could not start; workers start as new interpreters")
                self.broken = True
                return False
        return True

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-m", "splitserve.worker.forkserver", str(theirs.fileno())]
            self.proc = subprocess.Popen([*argv, self.node] if self.node else argv, pass_fds=[theirs.fileno()],
                                         env=self.env, stdin=subprocess.DEVNULL, process_group=0)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock, self.loop, self.ready = ours, loop, False
        loop.add_reader(ours.fileno(), self._on_readable)
        log.info("worker fork server pid %d started", self.proc.pid)

    def _on_readable(self) -> None:
        assert self.sock is not None
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.sock, 64, 1)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        if not msg:
            for fd in fds:
                os.close(fd)
            self._lost()
            return
        if msg == _READY:
            self.ready = True
            return
        pid = _PID.unpack(msg)[0] if len(msg) == _PID.size else 0
        proc = self._pending.popleft() if self._pending else None
        if proc is None:  # an answer nobody asked for: a bug on one side
            log.error("the worker fork server answered pid %d, which no request waits for", pid)
            for fd in fds:
                os.close(fd)
            return
        if pid <= 0:  # it could not fork: no process, and no pidfd should have come
            for fd in fds:
                os.close(fd)
            proc._resolve(None, None)
            return
        self.forked += 1
        proc._resolve(pid, fds[0] if fds else None)

    def _lost(self) -> None:
        """Its socket closed: it died (or was stopped). Requests it had not answered fail
        (their workers' control sockets read EOF, as for a worker that died at start)."""
        if not self.ready:
            log.error("the worker fork server exited before it was ready; workers start as new interpreters")
            self.broken = True
        else:
            log.warning("the worker fork server exited; the next worker starts a new one")
        self._close_socket()
        while self._pending:
            self._pending.popleft()._resolve(None, None)
        if self.proc is not None:
            proc, self.proc = self.proc, None
            threading.Thread(target=proc.wait, daemon=True).start()  # reaped off the loop

    def _close_socket(self) -> None:
        if self.sock is not None:
            if self.loop is not None:
                self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop it: it exits when its socket closes (killed after ``timeout`` s), or at once while
        it is still importing, before which it has forked nothing (it would finish its imports
        first, and then fork the requests still queued; one whose READY came but is not read yet
        may have forked a worker, which the node does not know of: that worker reads EOF on its
        control socket, closed with its handle, and exits). The workers it forked are not its:
        they stay until the node stops them."""
        self._close_socket()
        while self._pending:
            self._pending.popleft()._resolve(None, None)
        if self.proc is not None:
            proc, self.proc = self.proc, None
            if not self.ready:
                proc.kill()
            await asyncio.to_thread(_end, proc, timeout)


def _end(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

if __name__ == "__main__":
    sys.exit(main())
