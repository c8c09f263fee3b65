"""A worker's own CPU per direct call, at one connection and at many, from a bare client.

    PYTHONPATH=. .venv/bin/python benchmarks/worker_cpu.py [--model vecadd1k] [--conns 1,32]
        [--seconds 3] [--py-spy PATH_TO_PY_SPY]
    PYTHONPATH=. .venv/bin/python benchmarks/worker_cpu.py --inproc [--model vecadd1k] [--conns 1,32]
        [--calls 3000] [--cprofile]

``--python`` turns the worker's compiled intake off (``direct_compiled``), for the same
figures from the frame state machine alone.

It starts ``splitserve serve`` with ``fast_direct`` on, the model loaded and no spare
worker (so the one worker process is the model's), and drives the worker's Unix endpoint
from this process with pre-built frames (only the req_id patched; answers read into one
buffer, not decoded): ``--conns`` closed-loop connections, each with one call in flight.
For each it prints, per call: the worker's CPU (``schedstat`` of all its threads), the
compute the worker reported (``compute_us`` of the answers, per batch, over the calls of
the batch), the calls per batch, the round trip at one connection and the calls per second.
With ``--py-spy`` it also samples the worker during each run and prints the functions that
take the most of its samples (own time, and with what they call).

``--inproc`` needs no server: a ``Worker`` is bound in this process with a direct endpoint,
``--conns`` connections each write one frame, then the worker's loop turns (as
``Worker.serve`` does) until every answer is out: the worker's own CPU per call with warm
caches and no wake-ups (the client's side, writing frames and reading answers, is timed
apart and taken off); ``--cprofile`` adds the functions that take the most of it, and
``--split`` the p50 wall time of a turn that runs a batch before the model and after it
(the model's call, ``Worker.run_direct``, stamped on both sides).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import selectors
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from splitserve.client.common import Endpoint
from splitserve.client import Client
from splitserve.launcher import start_server
from splitserve.protocol.header import HEADER_SIZE, Header, Kind
from splitserve.worker.forkserver import node_workers

_COMPUTE = slice(48, 52)  # compute_us in a RESPONSE header (protocol/header.py's layout)


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _worker_pid(server_pid: int) -> int:
    workers = node_workers(server_pid)
    if len(workers) != 1:
        raise RuntimeError(f"expected one worker process, found {workers}")
    return workers[0]


class _Conn:
    def __init__(self, path: str, frame: bytes, answer_len: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.frame = bytearray(frame)
        self.buf = memoryview(bytearray(answer_len))
        self.got = 0
        self.next_id = 1

    def send(self) -> None:
        self.frame[8:16] = self.next_id.to_bytes(8, "little")
        self.next_id += 1
        self.sock.sendall(self.frame)

    def read(self) -> int | None:
        """Read towards the answer; its compute_us once whole, else None."""
        self.got += self.sock.recv_into(self.buf[self.got :])
        if self.got < len(self.buf):
            return None
        self.got = 0
        return int.from_bytes(self.buf[_COMPUTE], "little")


def drive(path: str, frame: bytes, answer_len: int, conns: int, seconds: float) -> dict[str, float]:
    """``conns`` closed-loop connections for ``seconds``: calls, compute over them, wall time."""
    cs = [_Conn(path, frame, answer_len) for _ in range(conns)]
    sel = selectors.DefaultSelector()
    for c in cs:
        sel.register(c.sock, selectors.EVENT_READ, c)
        c.send()
    calls, compute_us, batch_sizes = 0, 0.0, collections.Counter()
    t0 = time.perf_counter()
    end = t0 + seconds
    try:
        while time.perf_counter() < end:
            done = []
            for key, _ in sel.select():
                c = key.data
                cu = c.read()
                if cu is not None:
                    done.append((c, cu))
            for c, cu in done:
                calls += 1
                compute_us += cu
                c.send()
            if done:
                batch_sizes[len(done)] += 1
        # the calls in flight are answered before the connections close
        for c in cs:
            while c.read() is None:
                pass
    finally:
        for c in cs:
            c.sock.close()
        sel.close()
    return {"calls": calls, "wall_s": time.perf_counter() - t0, "compute_us_sum": compute_us}


def _pyspy(py_spy: str, pid: int, seconds: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "500", "-d", str(int(seconds)),
                             "--format", "raw", "-o", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame(f: str, by_line: bool) -> str:
    """``func (path/file.py:line)`` as ``func file.py:line``, or ``func file.py``."""
    func, _, where = f.partition(" (")
    where = where.rstrip(")").rsplit("/", 1)[-1]
    return f"{func} {where if by_line else where.split(':')[0]}"


def _top(raw: Path, by_line: bool, n: int = 25) -> list[tuple[str, float, float]]:
    """(function or line, % of samples as the innermost frame, % with it anywhere on the stack)."""
    own, incl, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        k = int(count)
        total += k
        frames = [_frame(f, by_line) for f in stack.split(";")]
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    # functions by what they take with their callees, lines by their own time
    names = sorted(incl if not by_line else own, key=lambda f: -(own[f] if by_line else incl[f]))[:n]
    return [(f, 100 * own[f] / total, 100 * incl[f] / total) for f in names]


def inproc(model: str, conns: int, calls: int, profile: bool, compiled: bool = True,
           split: bool = False) -> dict[str, object]:
    """The worker's own loop per call, in this process (see the module's docstring)."""
    import cProfile
    import pstats
    import io

    from splitserve.config import ReefSection, TransportSection
    from splitserve.models.catalog import zoo_entry
    from splitserve.modelconfig import ModelConfig
    from splitserve.protocol.header import RequestClass
    from splitserve.tensorqueue import TensorQueue, ring_slots
    from splitserve.worker.counters import Word
    from splitserve.worker.messages import LoadMsg
    from splitserve.worker.preempt_flag import PreemptFlag
    from splitserve.worker.process import Worker
    from splitserve.worker.spec import BindSpec, DirectSpec, QueueFds, WorkerSpec

    cfg = ModelConfig.from_dict({"name": model, "artifact": {"kind": "zoo", "arch": model}})
    d = TransportSection()
    tmp = Path(tempfile.mkdtemp(prefix="worker-cpu-"))
    n = ring_slots([t.nbytes for t in cfg.inputs + cfg.outputs], 8)
    queues = [TensorQueue(t.nbytes, n) for t in cfg.inputs + cfg.outputs]
    flag = PreemptFlag()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    w = Worker(WorkerSpec(ctrl_fd=theirs.detach(), flag_fd=flag.fd, cache_dir=str(tmp), log_level="WARNING",
                          segment_time_weight=ReefSection.segment_time_weight))
    qfds = QueueFds(n, [os.dup(q.fd) for q in queues[: len(cfg.inputs)]],
                    [os.dup(q.fd) for q in queues[len(cfg.inputs) :]])
    spec = DirectSpec(str(tmp / "d.sock"), 1, 64, d.fast_max_in_flight, d.fast_out_high_water, d.fast_out_low_water,
                      d.fast_max_pending_out, d.frame_timeout_s, d.fast_reads_per_wakeup, False,
                      d.direct_suspend_poll_s, d.direct_stage_bytes, compiled=compiled)
    w.load(LoadMsg(1, BindSpec(cfg.to_dict(), None, {str(int(RequestClass.BE)): qfds}, cfg.capacity,
                               cpus=sorted(os.sched_getaffinity(0)), threads=1, direct=spec)))
    w.counters.set_admit(1 << 20)
    direct = w.direct
    assert direct is not None
    entry = zoo_entry(model)
    x = b"".join(np.ones(t.shape, t.dtype).tobytes() for t in entry.inputs)
    frame = bytearray(Header(Kind.REQUEST, func_id=1, payload_len=len(x)).pack() + x)
    answer = memoryview(bytearray(HEADER_SIZE + entry.response_bytes))
    socks = []
    for _ in range(conns):
        socks.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        socks[-1].connect(spec.path)
    while len(direct.conns) < conns:  # the accepts
        w.turn(direct)

    stamps: dict[str, int] = {}
    turns: list[tuple[int, int, int]] = []  # a batch's turn: before the model, the model, after it (ns)
    if split:
        run_direct = w.run_direct

        def stamped(*args):  # type: ignore[no-untyped-def]
            stamps["model"] = time.perf_counter_ns()
            try:
                return run_direct(*args)
            finally:
                stamps["after"] = time.perf_counter_ns()

        w.run_direct = stamped  # type: ignore[method-assign]

    def client(k: int) -> None:  # every connection sends a frame; the loop turns until all are answered
        for s in socks:
            frame[8:16] = k.to_bytes(8, "little")
            s.send(frame)
        target = w.counters.value(Word.ANSWERED) + conns
        while w.counters.value(Word.ANSWERED) < target:
            stamps.clear()
            t0 = time.perf_counter_ns()
            w.turn(direct)  # as Worker.serve turns it, inside its inference mode
            if "model" in stamps:
                turns.append((stamps["model"] - t0, stamps["after"] - stamps["model"],
                              time.perf_counter_ns() - stamps["after"]))
        for s in socks:
            got = 0
            while got < len(answer):
                got += s.recv_into(answer[got:])

    rounds = max(1, calls // conns)
    w.inference.__enter__()
    for k in range(1, 200):  # warm-up
        client(k)
    prof = cProfile.Profile() if profile else None
    t0 = time.thread_time()
    if prof:
        prof.enable()
    for k in range(rounds):
        client(1000 + k)
    if prof:
        prof.disable()
    total = time.thread_time() - t0
    # the client's part alone: write the frames and read them back on a second pair
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(conns)]
    back = memoryview(bytearray(len(frame)))
    t0 = time.thread_time()
    for k in range(rounds):
        for a, b in pairs:
            a.send(frame)
        for a, b in pairs:
            b.recv_into(back)
    client_s = time.thread_time() - t0
    w.inference.__exit__(None, None, None)
    out: dict[str, object] = {"worker_cpu_us": (total - client_s) / (rounds * conns) * 1e6,
                              "calls_per_batch": w.counters.snapshot().answered / max(1, w.counters.snapshot().batches)}
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out["cprofile"] = buf.getvalue().splitlines()
    if turns:
        before, model_ns, after = np.median(np.array(turns[len(turns) // 10 :]), axis=0) / 1e3
        out["batch_turn_p50_us"] = {"before_the_model": before, "the_model": model_ns, "after_the_model": after}
    for s in socks:
        s.close()
    for a, b in pairs:
        a.close()
        b.close()
    w.unload()
    w.ctrl.close()
    ours.close()
    flag.close()
    for q in queues:
        q.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vecadd1k")
    ap.add_argument("--conns", default="1,32")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--py-spy", help="path of a py-spy binary: sample the worker too")
    ap.add_argument("--inproc", action="store_true", help="no server: the worker's own loop in this process")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--cprofile", action="store_true", help="with --inproc: where the time goes")
    ap.add_argument("--split", action="store_true", help="with --inproc: a batch's turn before and after the model")
    ap.add_argument("--python", action="store_true",
                    help="the frame state machine takes every read (no compiled intake: direct_compiled off)")
    a = ap.parse_args()
    if a.inproc:
        res = {f"{k} connection(s)": inproc(a.model, int(k), a.calls, a.cprofile, not a.python, a.split)
               for k in a.conns.split(",")}
        print(json.dumps(res, indent=1))
        return
    data = Path(tempfile.mkdtemp(prefix="worker-cpu-"))
    env = {**os.environ, "SPLITSERVE_FAST_DIRECT": "1", "SPLITSERVE_SPARE_WORKERS": "0",
           "SPLITSERVE_DIRECT_COMPILED": "0" if a.python else "1"}
    server = start_server(data, "--load", a.model, env=env)
    out = {}
    try:
        with Client(server.unix, direct=True) as c:
            info = c.lookup(a.model)
            c.infer(a.model, [np.ones(t.shape, t.dtype) for t in info.inputs])
        path = Endpoint.parse(info.extra["direct"][0]).path
        x = b"".join(np.ones(t.shape, t.dtype).tobytes() for t in info.inputs)
        frame = Header(Kind.REQUEST, func_id=info.func_id, payload_len=len(x)).pack() + x
        answer_len = HEADER_SIZE + sum(t.nbytes for t in info.outputs)
        wpid = _worker_pid(server.proc.pid)
        drive(path, frame, answer_len, 1, 0.5)  # warm-up
        for conns in (int(k) for k in a.conns.split(",")):
            spy = _pyspy(a.py_spy, wpid, a.seconds, data / f"spy{conns}.txt") if a.py_spy else None
            w0 = _cpu_ns(wpid)
            r = drive(path, frame, answer_len, conns, a.seconds)
            w1 = _cpu_ns(wpid)
            calls = r["calls"]
            cell = {"calls_per_s": calls / r["wall_s"], "worker_cpu_us": (w1 - w0) / calls / 1e3,
                    "compute_us_mean": r["compute_us_sum"] / calls}
            if conns == 1:
                cell["round_trip_us"] = r["wall_s"] / calls * 1e6
            if spy is not None:
                spy.wait()
                for by_line in (False, True):
                    cell["py_spy by " + ("line" if by_line else "function")] = [
                        f"{o:5.1f} % own {i:5.1f} % incl  {f}" for f, o, i in _top(data / f"spy{conns}.txt", by_line)]
            out[f"{conns} connection(s)"] = cell
    finally:
        server.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
