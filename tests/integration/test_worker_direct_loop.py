"""The worker's direct loop (``Worker.serve`` / ``Worker.turn``): one epoll over the control
socket and the direct endpoint, the turns in inference mode between two control messages
and every control message handled outside it. An in-process worker serves on a thread
of this test (inference mode is per thread: the loop's thread is the one that loads)."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest
import torch

from splitserve.config import ReefSection, TransportSection
from splitserve.errors import Status
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestClass, unpack_header
from splitserve.tensorqueue import TensorQueue, ring_slots
from splitserve.spin import BUSY_READS_AFTER_RUN
from splitserve.worker.messages import ADOPT, DoneMsg, LoadedMsg, LoadMsg, Msg, RunMsg, UnloadedMsg
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.process import Worker
from splitserve.worker.spec import BindSpec, DirectSpec, QueueFds, WorkerSpec

WAIT_S = 60.0  # a bound on each wait, so a broken loop fails the test instead of hanging it
FUNC_ID = 7


def zoo(name: str) -> ModelConfig:
    return ModelConfig.from_dict({"name": name, "artifact": {"kind": "zoo", "arch": name}})


def _queues(cfg: ModelConfig) -> tuple[list[TensorQueue], int]:
    n = ring_slots([t.nbytes for t in cfg.inputs + cfg.outputs], 8)
    return [TensorQueue(t.nbytes, n) for t in cfg.inputs + cfg.outputs], n


def _bind(tmp_path, cfg: ModelConfig, queues: list[TensorQueue], n: int, spin_us: int = 0,
          front_end_spin_us: int = 0) -> BindSpec:
    """A best-effort binding of ``cfg`` with a direct endpoint at ``tmp_path/d.sock``."""
    d = TransportSection()
    direct = DirectSpec(str(tmp_path / "d.sock"), FUNC_ID, 4, d.fast_max_in_flight, d.fast_out_high_water,
                        d.fast_out_low_water, d.fast_max_pending_out, d.frame_timeout_s, d.fast_reads_per_wakeup,
                        False, d.direct_suspend_poll_s, d.direct_stage_bytes, spin_us=spin_us,
                        front_end_spin_us=front_end_spin_us)
    k = len(cfg.inputs)
    qfds = QueueFds(n, [os.dup(q.fd) for q in queues[:k]], [os.dup(q.fd) for q in queues[k:]])
    return BindSpec(cfg.to_dict(), None, {str(int(RequestClass.BE)): qfds}, cfg.capacity,
                    threads=torch.get_num_threads(), direct=direct)


def _worker(tmp_path) -> tuple[Worker, socket.socket, PreemptFlag]:
    """An in-process worker, the front end's end of its control socket and its preemption page."""
    flag = PreemptFlag()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.settimeout(WAIT_S)
    w = Worker(WorkerSpec(ctrl_fd=theirs.detach(), flag_fd=flag.fd, cache_dir=str(tmp_path), log_level="WARNING",
                          segment_time_weight=ReefSection.segment_time_weight))
    return w, ours, flag


def _close(w: Worker, ours: socket.socket, flag: PreemptFlag, queues: list[TensorQueue]) -> None:
    """Unload the worker; close its control socket, the front end's end of it, its page and the queues."""
    w.unload()
    w.ctrl.close()
    ours.close()
    flag.close()
    for q in queues:
        q.close()


def _direct_call(path: str, x: bytes, answer_bytes: int) -> bytes:
    """One REQUEST over a fresh connection to the endpoint; the answer's payload."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(WAIT_S)
        s.connect(path)
        s.sendall(Header(Kind.REQUEST, req_id=1, func_id=FUNC_ID, payload_len=len(x)).pack() + x)
        got = bytearray()
        while len(got) < HEADER_SIZE + answer_bytes:
            chunk = s.recv(65536)
            assert chunk, "the worker closed the connection"
            got += chunk
    assert unpack_header(got).kind == Kind.RESPONSE
    return bytes(got[HEADER_SIZE:])


@pytest.mark.parametrize("spin_us", [0, 50_000], ids=["sleeps", "polls"])
def test_direct_calls_run_in_the_loops_inference_mode_and_control_messages_outside_it(tmp_path, spin_us):
    """A direct call is answered through the loop's epoll; every control message (UNLOAD,
    LOAD, STOP) is handled with inference mode off, so a model bound while the loop serves
    a direct endpoint has ordinary (not inference) weights, and its direct calls work. The
    same when the loop polls before it sleeps (``splitserve/spin.py``; the host's load is taken
    as free so that it does): the control socket is in the same epoll, so a message that
    comes while it polls is taken at once."""
    vecadd, lenet = zoo("vecadd1k"), zoo("lenet")
    (vq, vn), (lq, ln) = _queues(vecadd), _queues(lenet)
    path = str(tmp_path / "d.sock")
    w, ours, flag = _worker(tmp_path)
    modes: list[tuple[int, bool]] = []  # (message kind, inference mode on) as each control message is handled
    step = w.step

    def recording_step() -> bool:
        on = torch.is_inference_mode_enabled()
        going_on = step()
        modes.append((w._buf[0], on))  # noqa: SLF001 (the kind of the message just handled)
        return going_on

    w.step = recording_step  # type: ignore[method-assign]
    w.host.cpu_free = lambda _now: True  # type: ignore[method-assign]
    loop = threading.Thread(target=w.serve, daemon=True)
    try:
        w.load(LoadMsg(1, _bind(tmp_path, vecadd, vq, vn, spin_us)))
        w.counters.set_admit(64)
        loop.start()
        ours.recv(65536)  # READY
        a, b = np.arange(1024, dtype=np.float32), np.full(1024, 2.0, np.float32)
        y = np.frombuffer(_direct_call(path, a.tobytes() + b.tobytes(), a.nbytes), np.float32)
        np.testing.assert_array_equal(y, a + b)

        ours.send(bytes([Msg.UNLOAD]))
        assert UnloadedMsg.unpack(ours.recv(65536)).binding == 1
        data, fds = LoadMsg(2, _bind(tmp_path, lenet, lq, ln, spin_us)).pack()
        socket.send_fds(ours, [data], fds)
        for fd in fds:
            os.close(fd)
        assert LoadedMsg.unpack(ours.recv(65536)).binding == 2
        y = np.frombuffer(_direct_call(path, bytes(lenet.request_bytes), lenet.response_bytes), np.float32)
        assert y.shape == (10,) and np.isfinite(y).all()
        assert w.spin.budget_ns == spin_us * 1000
        ours.send(bytes([Msg.STOP]))
        loop.join(WAIT_S)
        assert not loop.is_alive()
        # the STOP came while a direct endpoint was open: the loop left inference mode for it too
        assert [kind for kind, _ in modes] == [Msg.UNLOAD, Msg.LOAD, Msg.STOP]
        assert not any(on for _, on in modes)
        bound = w.bound
        assert bound is not None and not any(p.is_inference() for p in bound.model.parameters())
        assert not any(t.is_inference() for t in bound.model.buffers())
        assert w.direct is None and w.poller is None  # serve's end closed the endpoint and its epoll
    finally:
        if loop.is_alive():
            ours.send(bytes([Msg.STOP]))
            loop.join(WAIT_S)
        _close(w, ours, flag, vq + lq)


def test_after_a_front_end_batch_the_loop_polls_as_front_end_spin_us_says_and_after_a_direct_one_as_direct_spin_us(
        tmp_path):
    """The front end's path brings a worker its next RUN later than a direct client brings its
    next call (``ServerConfig.transports.front_end_spin_us``): the waits after a front-end batch
    poll with that budget, ended only by a task that keeps waiting for a CPU
    (``BUSY_READS_AFTER_RUN`` reads); the waits after a direct batch as ``direct_spin_us`` says."""
    vecadd = zoo("vecadd1k")
    vq, vn = _queues(vecadd)
    path = str(tmp_path / "d.sock")
    w, ours, flag = _worker(tmp_path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        w.load(LoadMsg(1, _bind(tmp_path, vecadd, vq, vn, spin_us=20, front_end_spin_us=50_000)))
        w.counters.set_admit(64)
        direct, poller = w.direct, w.poller
        assert direct is not None and poller is not None
        waits: list[tuple[int, object]] = []  # each poll's budget and whose host reads end it
        real_wait = poller.wait

        def wait(timeout, spin_ns, cpu_free=None):
            waits.append((spin_ns, getattr(cpu_free, "__self__", None)))
            return real_wait(timeout, spin_ns, lambda _now: True)  # the host taken as free: the poll runs

        poller.wait = wait  # type: ignore[method-assign]
        with torch.inference_mode():
            ours.send(RunMsg(int(RequestClass.BE), 1, 0, 1).pack())
            assert w.turn(direct)  # a control message waits: handed to step, no batch run
        assert waits == [(20_000, w.host)]  # nothing ran yet: the direct budget
        assert w.step() and DoneMsg.unpack(ours.recv(65536)).batch_id == 1 and w.after_run
        a = np.arange(1024, dtype=np.float32)
        client.connect(path)
        client.sendall(Header(Kind.REQUEST, req_id=1, func_id=FUNC_ID, payload_len=2 * a.nbytes).pack()
                       + a.tobytes() + a.tobytes())
        client.settimeout(WAIT_S)
        with torch.inference_mode():
            for _ in range(10):  # the accept, the frame's read and its batch, one event each at most
                if not w.after_run:
                    break
                w.turn(direct)
        _, got = _frame(client)
        np.testing.assert_array_equal(np.frombuffer(got, np.float32), a + a)
        after_run = waits[1:]
        assert after_run and all(budget == 50_000_000 and host is w.run_host for budget, host in after_run)
        assert w.run_host.busy_reads_needed == BUSY_READS_AFTER_RUN
        del waits[:]
        with torch.inference_mode():
            ours.send(RunMsg(int(RequestClass.BE), 2, 0, 1).pack())
            assert w.turn(direct)
        assert waits == [(20_000, w.host)]  # the last batch was direct: its budget again
        assert w.step() and DoneMsg.unpack(ours.recv(65536)).batch_id == 2
    finally:
        client.close()
        _close(w, ours, flag, vq)


def _frame(s: socket.socket) -> tuple[Header, bytes]:
    got = bytearray()
    while len(got) < HEADER_SIZE or len(got) < HEADER_SIZE + unpack_header(got).payload_len:
        chunk = s.recv(65536)
        assert chunk, "the worker closed the connection"
        got += chunk
    h = unpack_header(got)
    return h, bytes(got[HEADER_SIZE:HEADER_SIZE + h.payload_len])


def test_a_connection_handed_over_by_the_front_end_is_acknowledged_and_served_or_refused_and_closed(tmp_path):
    """ADOPT brings a client's connection (SCM_RIGHTS) and no answer on the control socket:
    with its direct endpoint open the worker acknowledges with a HANDOFF frame of the
    client's req_id before anything else, then answers calls on it; with none open (after an
    UNLOAD) it says why in an ERROR frame and closes the connection. An ADOPT without its
    descriptor is dropped; the loop serves the next message (a STOP) either way."""
    vecadd = zoo("vecadd1k")
    vq, vn = _queues(vecadd)
    w, ours, flag = _worker(tmp_path)
    loop = threading.Thread(target=w.serve, daemon=True)
    clients = []
    try:
        w.load(LoadMsg(1, _bind(tmp_path, vecadd, vq, vn)))
        w.counters.set_admit(64)
        loop.start()
        ours.recv(65536)  # READY

        def adopt(req_id: int) -> socket.socket:
            client, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(WAIT_S)
            clients.append(client)
            socket.send_fds(ours, [ADOPT.pack(Msg.ADOPT, req_id)], [server_end.fileno()])
            server_end.close()
            return client

        c = adopt(0xABCDEF0123)
        h, body = _frame(c)
        assert (h.kind, h.req_id, body) == (Kind.HANDOFF, 0xABCDEF0123, b"")
        a, b = np.arange(1024, dtype=np.float32), np.full(1024, 3.0, np.float32)
        x = a.tobytes() + b.tobytes()
        c.sendall(Header(Kind.REQUEST, req_id=5, func_id=FUNC_ID, payload_len=len(x)).pack() + x)
        h, body = _frame(c)
        assert (h.kind, h.req_id) == (Kind.RESPONSE, 5)
        np.testing.assert_array_equal(np.frombuffer(body, np.float32), a + b)

        ours.send(ADOPT.pack(Msg.ADOPT, 9))  # no descriptor: dropped, nothing answered
        ours.send(bytes([Msg.UNLOAD]))
        assert UnloadedMsg.unpack(ours.recv(65536)).binding == 1  # the next message's answer, not the ADOPT's
        late = adopt(6)
        h, body = _frame(late)
        assert (h.kind, h.status) == (Kind.ERROR, int(Status.REFUSED)), body
        assert late.recv(1) == b""  # then closed
        ours.send(bytes([Msg.STOP]))
        loop.join(WAIT_S)
        assert not loop.is_alive()
    finally:
        if loop.is_alive():
            ours.send(bytes([Msg.STOP]))
            loop.join(WAIT_S)
        for c in clients:
            c.close()
        _close(w, ours, flag, vq)
