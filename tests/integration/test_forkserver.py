"""Workers forked from the node's fork server (``worker/forkserver.py``): what they serve, what a
dead fork server costs, the way back to new interpreters, and requests the fork server refuses."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from splitserve.config import ReefSection
from splitserve.worker.forkserver import ForkedProcess, ForkServer, node_workers
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.spec import WorkerSpec
from tests.inproc import quiet_config, run_server, until, write_model

BOUND_S = 60


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _module(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode()


def _config(tmp_path: Path, **kw):
    repo = tmp_path / "repo"
    write_model(repo, "vec", "vecadd1k", "instances = 2")
    write_model(repo, "gate", "gate")
    return quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache", **kw)


def _vec(k: float) -> list[np.ndarray]:
    return [np.full((1, 1024), k, np.float32), np.full((1, 1024), 1.0, np.float32)]


def test_workers_fork_from_one_fork_server_which_outlives_neither_a_worker_nor_the_node(tmp_path):
    async def scenario(server):
        rt = server.runtime("vec")
        out = (await server.infer("vec", _vec(2.0))).outputs[0]
        forks = server.forks
        pids = [h.pid for h in rt.workers.values()]
        fork_pid = forks.proc.pid
        # every worker is the fork server's child, found as the node's worker, in its own process group
        assert len(pids) == 2 and all(_parent(p) == fork_pid and os.getpgid(p) == p for p in pids)
        assert sorted(pids) == node_workers(os.getpid()) and forks.forked == 2
        assert _module(fork_pid) == "splitserve.worker.forkserver"
        # each names its node (the data dir) in its command line, for ps and for finding what a node left
        assert all(str(server.config.data_dir).encode() in Path(f"/proc/{p}/cmdline").read_bytes()
                   for p in (fork_pid, *pids))
        # a worker killed is restarted from the same fork server, which it did not take with it
        os.kill(pids[0], signal.SIGKILL)
        await until(lambda: len([h for h in rt.workers.values() if h.ready and h.pid not in pids]) == 1)
        assert forks.forked == 3 and forks.proc.pid == fork_pid
        out2 = (await server.infer("vec", _vec(3.0))).outputs[0]
        return out, out2, fork_pid

    out, out2, fork_pid = run_server(_config(tmp_path, load=("vec",)),
                                     lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert out.tolist() == [[3.0] * 1024] and out2.tolist() == [[4.0] * 1024]
    assert not Path(f"/proc/{fork_pid}").exists() or "Z" in Path(f"/proc/{fork_pid}/stat").read_text().split(") ")[1][0]


def test_a_dead_fork_server_costs_no_worker_and_the_next_worker_starts_a_new_one(tmp_path):
    async def scenario(server):
        rt = server.runtime("vec")
        await server.infer("vec", _vec(1.0))
        first = server.forks.proc.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: server.forks.proc is None)  # its socket closed: the node knows
        out = (await server.infer("vec", _vec(5.0))).outputs[0]  # the forked workers serve on
        # a worker the node needs now (gate's, loaded on first use) starts a new fork server
        assert (await server.infer("gate", [np.array([[7]], np.int64)])).outputs[0].tolist() == [[7]]
        (pid,) = [h.pid for h in server.runtime("gate").workers.values()]
        return out, first, server.forks.proc.pid, _parent(pid), len(rt.workers)

    out, first, second, parent, vec_workers = run_server(_config(tmp_path, load=("vec",)),
                                                         lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert out.tolist() == [[6.0] * 1024] and vec_workers == 2
    assert second != first and parent == second


def test_a_node_that_needs_no_worker_at_start_starts_its_fork_server_with_its_first_worker(tmp_path):
    async def scenario(server):
        idle = server.forks.proc is None  # no start-up model, no spare: nothing to fork yet
        out = (await server.infer("gate", [np.array([[3]], np.int64)])).outputs[0]
        return idle, out, server.forks.proc is not None

    idle, out, started = run_server(_config(tmp_path), lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert idle and out.tolist() == [[3]] and started


def test_with_fork_workers_off_each_worker_is_a_new_interpreter_of_the_node(tmp_path):
    async def scenario(server):
        rt = server.runtime("gate")
        await rt.wait_ready()
        (pid,) = [h.pid for h in rt.workers.values()]
        out = (await server.infer("gate", [np.array([[7]], np.int64)])).outputs[0]
        return out, _parent(pid), _module(pid), server.forks

    out, parent, module, forks = run_server(_config(tmp_path, load=("gate",), fork_workers=False),
                                            lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    assert out.tolist() == [[7]] and forks is None and parent == os.getpid() and module == "splitserve.worker"


def test_a_fork_server_that_cannot_start_is_given_up_and_workers_start_as_interpreters(tmp_path):
    # a torch that cannot be imported, first on its path: the fork server dies before it is ready
    (tmp_path / "torch.py").write_text("raise ImportError('not here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    async def main() -> tuple:
        loop = asyncio.get_running_loop()
        forks = ForkServer(env)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pending = forks.spawn(loop, ["{}"], [b.fileno()], env)
            await asyncio.wait_for(until(lambda: forks.broken), BOUND_S)
            assert pending is not None and pending._known.is_set()
            again = forks.spawn(loop, ["{}"], [b.fileno()], env)
            return pending.pid, again, forks.proc
        finally:
            a.close()
            b.close()
            await forks.stop()

    pid, again, proc = asyncio.run(main())
    assert pid is None and again is None and proc is None


def test_the_fork_server_refuses_bad_requests_answers_each_and_its_workers_exit_alone(tmp_path):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.worker.forkserver", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    theirs.close()
    ours.settimeout(BOUND_S)
    try:
        assert ours.recv(16) == b"R"

        def ask(doc: bytes, fds: list[int]) -> tuple[int, list[int]]:
            socket.send_fds(ours, [doc], fds)
            msg, got, _, _ = socket.recv_fds(ours, 16, 1)
            return struct.unpack("=i", msg)[0], got

        out = [sys.stdout.fileno(), sys.stderr.fileno()]
        assert ask(b"not json", []) == (0, [])
        assert ask(json.dumps({"args": [], "env": {}, "fds": [40]}).encode(), out) == (0, [])  # fd count
        assert ask(json.dumps({"args": [], "env": {}, "fds": [1]}).encode(), [0, *out]) == (0, [])  # a std fd
        # a worker whose spec is not one: forked, its pidfd answers when it has exited (it fails alone)
        ctrl_ours, ctrl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid, (pidfd,) = ask(json.dumps({"args": ["{}"], "env": {"A": "1"}, "fds": [50]}).encode(),
                            [ctrl_theirs.fileno(), *out])
        ctrl_theirs.close()
        assert pid > 0 and select.select([pidfd], [], [], BOUND_S)[0] == [pidfd]
        os.close(pidfd)
        ctrl_ours.settimeout(BOUND_S)
        assert ctrl_ours.recv(64) == b""  # its only other end, at fd 50 in the worker, closed with it
        ctrl_ours.close()
        assert proc.poll() is None  # the fork server serves on
    finally:
        ours.close()
    assert proc.wait(BOUND_S) == 0  # the node's end closed: it exits
    with proc.stderr:
        assert proc.stderr.read().count(b"Traceback") == 3  # one for each request refused


def test_a_kill_asked_before_the_fork_server_answers_is_sent_when_it_does(tmp_path):
    flag = PreemptFlag()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # a real worker, which waits on its control socket for ever once it is up: only the kill ends it
    spec = WorkerSpec(ctrl_fd=theirs.fileno(), flag_fd=flag.fd, cache_dir=str(tmp_path), log_level="WARNING",
                      segment_time_weight=ReefSection.segment_time_weight)

    async def main() -> int | None:
        forks = ForkServer(os.environ)
        try:
            proc = forks.spawn(asyncio.get_running_loop(), [spec.to_json()], spec.fds(), os.environ)
            theirs.close()  # the request holds the worker's end now
            assert proc is not None and proc.pid is None  # the fork server is still importing
            proc.kill()
            await asyncio.wait_for(until(lambda: proc._known.is_set()), BOUND_S)
            await asyncio.to_thread(proc.wait, BOUND_S)
            return proc.pid
        finally:
            await forks.stop()

    try:
        pid = asyncio.run(main())
        ours.settimeout(BOUND_S)
        assert pid is not None and ours.recv(64) == b""  # killed before its READY: nothing came, then EOF
    finally:
        ours.close()
        flag.close()


def test_a_node_stopping_while_its_fork_server_imports_waits_neither_for_it_nor_for_its_workers(tmp_path):
    """A spare, or a loading model's worker, asked for while the fork server still imports is
    killed at the node's stop: its wait ends without the fork server's answer, and the fork
    server, which has forked nothing yet, is killed rather than waited for (it would finish its
    imports, then fork what was queued). A server stopped 2 s after its start took 1.5-3 s to
    exit for it; now 0.2-0.3 s."""
    flag = PreemptFlag()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spec = WorkerSpec(ctrl_fd=theirs.fileno(), flag_fd=flag.fd, cache_dir=str(tmp_path), log_level="WARNING",
                      segment_time_weight=ReefSection.segment_time_weight)

    async def main() -> tuple[int | None, bool, int | None]:
        forks = ForkServer(os.environ)
        try:
            proc = forks.spawn(asyncio.get_running_loop(), [spec.to_json()], spec.fds(), os.environ)
            theirs.close()  # the request holds the worker's end now
            assert proc is not None and forks.proc is not None
            fork_server = forks.proc
            os.kill(fork_server.pid, signal.SIGSTOP)  # importing for as long as the test runs: no answer comes
            proc.kill()  # as a stopping node kills a worker still starting
            await asyncio.wait_for(asyncio.to_thread(proc.wait, BOUND_S), BOUND_S / 2)
            answered = proc._known.is_set()
            await asyncio.wait_for(forks.stop(timeout=BOUND_S), BOUND_S / 2)
            return fork_server.returncode, answered, proc.pid
        finally:
            await forks.stop()

    try:
        rc, answered, pid = asyncio.run(main())
        assert rc == -signal.SIGKILL and not answered and pid is None
        ours.settimeout(BOUND_S)
        assert ours.recv(64) == b""  # the worker never started: its control socket reads EOF
    finally:
        ours.close()
        flag.close()


def test_a_worker_killed_before_its_fork_is_killed_when_the_answer_comes_and_its_pidfd_closed():
    pid = os.fork()
    if pid == 0:  # a stand-in for the worker the fork server forks after the node gave up on it
        time.sleep(60)
        os._exit(0)
    try:
        proc = ForkedProcess()
        proc.kill()
        proc.wait(BOUND_S)  # at once: nobody waits for the fork server's answer
        pidfd = os.pidfd_open(pid)
        proc._resolve(pid, pidfd)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert proc._pidfd is None  # closed at once: no wait will come for it
        with pytest.raises(OSError):
            os.fstat(pidfd)
    finally:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_a_forked_worker_whose_pidfd_is_past_fd_setsize_is_killed_and_waited_for():
    """A front end with many connections holds fds past 1024, where ``select`` cannot look."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} leaves no fd past 1024 to test with")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    pid = os.fork()
    if pid == 0:  # a stand-in worker: it waits to be killed
        time.sleep(60)
        os._exit(0)
    try:
        pidfd = os.pidfd_open(pid)
        high = fcntl.fcntl(pidfd, fcntl.F_DUPFD, 1500)
        os.close(pidfd)
        proc = ForkedProcess()
        proc._resolve(pid, high)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.05)
        proc.kill()
        proc.wait(BOUND_S)
    finally:
        os.waitpid(pid, 0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
