"""A direct call's intake and a batch's answers by the compiled lane (``_directlane.Lane``:
``intake``, ``outputs``, ``finish``) and by the Python path it stands in for: the same call
records, rows, flow control and counters for any sequence of reads (plain calls of either
class, duplicates, refusals, a full batch, a suspended best-effort batch, the connection's
and the worker's limits); the same bytes on every connection and the same counters for any
batch (calls of several connections in any order, closed connections, SLOs met and missed,
bytes already waiting to go, a socket that takes only part)."""

from __future__ import annotations

import mmap
import select
import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestClass, unpack_header
from splitserve.worker.counters import BINS, PAGE_BYTES, DirectCalls, Duration, WorkerCounters, duration_bin
from splitserve.worker.direct import _IN_FLIGHT, DirectServer
from splitserve.worker.direct_conn import _Call
from splitserve.worker.poller import Poller
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.spec import DirectSpec

pytest.importorskip("splitserve._directlane", reason="the compiled lane was not built")

MAX_BATCH = 8
# two outputs of different sizes and dtypes, so that each answer's parts are in order
CFG = ModelConfig.from_dict({
    "name": "two", "max_batch_size": MAX_BATCH, "artifact": {"kind": "zoo", "arch": "vecadd1k"},
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [300]}, {"name": "z", "datatype": "INT16", "shape": [5]}],
})
ONE_CALL = ModelConfig.from_dict({**CFG.to_dict(), "batching": {"policy": "none"}})  # a batch holds one call
ANSWER = 1200 + 10  # one sample's answer payload: more than a small send buffer takes for a batch
T0, T1, T2 = 10_000_000, 10_250_000, 10_260_000  # a batch's start, its compute's end, its answers' stamp (ns)


class _Endpoint:
    """A DirectServer over a real Unix endpoint, its connections accepted, and their clients."""

    def __init__(self, root: Path, compiled: bool, conns: int, max_in_flight: int = 64, cfg: ModelConfig = CFG) -> None:
        self.flag = PreemptFlag()
        self.counters = WorkerCounters(self.flag.page)
        self.poller = Poller()
        spec = DirectSpec(str(root / f"d{int(compiled)}.sock"), 1, 16, max_in_flight, 1 << 20, 1 << 19, 1 << 24, 5.0,
                          4, False, 0.001, 1 << 16, compiled=compiled)
        self.server = DirectServer(spec, cfg, self.counters, self.poller, lambda: None, lambda i, n: False)
        assert (self.server.lane is not None) == compiled
        self.clients, self.conns = [], []
        for _ in range(conns):  # one at a time: a Unix client has no name to pair it with its connection by
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(spec.path)
            self.clients.append(s)
            known = set(self.server.conns)
            self.server._on_accept(self.server.listeners[0], 0)
            (conn,) = self.server.conns - known
            self.conns.append(conn)

    def drain(self) -> list[bytes]:
        """Everything each client was sent, the connections' queued bytes written out as they go."""
        got = [bytearray() for _ in self.clients]
        while True:
            moved = False
            for conn, client, buf in zip(self.conns, self.clients, got):
                try:
                    chunk = client.recv(1 << 20, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    chunk = b""
                buf += chunk
                if conn.out and not conn.closed:
                    conn.write_some()
                    moved = True
                moved = moved or bool(chunk)
            if not moved:
                return [bytes(b) for b in got]

    def close(self) -> None:
        self.server.close()
        for s in self.clients:
            s.close()
        self.poller.close()
        self.flag.close()


@st.composite
def batches(draw):
    conns = draw(st.integers(1, 4))
    calls, rows = [], 0
    while rows < MAX_BATCH and (not calls or draw(st.booleans())):
        count = draw(st.integers(1, MAX_BATCH - rows))
        slo = draw(st.sampled_from([0, 1, 2]))  # none, met, missed
        calls.append((draw(st.integers(0, conns - 1)), draw(st.integers(0, 2**64 - 1)), count, slo))
        rows += count
    closed = draw(st.sets(st.integers(0, conns - 1), max_size=conns))
    waiting = draw(st.sets(st.integers(0, conns - 1), max_size=conns))  # connections with bytes already queued
    small = draw(st.booleans())  # a send buffer that takes only part of the answers
    cls = draw(st.sampled_from([RequestClass.RT, RequestClass.BE]))
    return conns, calls, closed, waiting, small, cls, draw(st.integers(0, 2**32 - 1))


def _answer(root: Path, compiled: bool, batch) -> tuple[list[bytes], tuple, list[set], bool]:
    """What each client was sent, the counters, each connection's req_ids in flight after
    the batch, and whether some connection's answers waited for its socket."""
    conns, calls, closed, waiting, small, cls, seed = batch
    ep = _Endpoint(root, compiled, conns)
    t_ms = time.time_ns() // 1_000_000
    try:
        d = ep.server
        rng = np.random.default_rng(seed)
        for rows in d.out_rows[cls]:  # what the model left in the answer rows
            rows[...] = rng.integers(-1000, 1000, rows.shape).astype(rows.dtype)
        if small:
            for conn in ep.conns:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made, row = [], 0
        for j, req_id, count, slo in calls:
            t_rx = T0 - 1000 * (len(made) + 1)
            slo_us = {0: 0, 1: 1_000, 2: 100}[slo]  # met: the stamp is 270 µs after t_rx at most
            c = _Call(ep.conns[j], req_id, cls, count, count * 8, 0, t_rx, slo_us)
            c.place(row, d.flat[cls], d.sizes)
            c.got = c.total
            row += count
            ep.conns[j].ids.add(req_id)
            d.counters.accepted(_IN_FLIGHT[cls])
            made.append(c)
        for j in waiting:  # as after a write the socket did not take whole: the answers go behind
            ep.conns[j].out += b"queued before the batch:" + bytes([j])
        for j in closed:
            ep.conns[j].close()
        if compiled:
            d._answer_compiled(cls, made, row, T0, T1, T2)
            assert d.counters.snapshot() == WorkerCounters(ep.flag.page).snapshot()  # in the page as counted
        else:
            d._answer(cls, made, row, T0, T1, T2)
        ids = [set(conn.ids) for conn in ep.conns]
        queued = any(conn.out for conn in ep.conns)
        page = WorkerCounters(ep.flag.page).tally()
        # when its calls were answered (a wall-clock stamp: both paths' differ), then the counts
        assert all(bool(c.last_ms >= t_ms) == bool(c.ok) for c in page.calls)
        return ep.drain(), (d.counters.snapshot(), page.sizes, tuple(replace(c, last_ms=0) for c in page.calls)), \
            ids, queued
    finally:
        ep.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches())
def test_the_lane_writes_every_answer_the_python_path_writes(tmp_path, batch):
    compiled = _answer(tmp_path, True, batch)
    python = _answer(tmp_path, False, batch)
    assert compiled == python
    conns, calls, closed, waiting, _, cls, _ = batch
    sent, (counts, by_size, by_class), ids, _ = python
    # and what the Python path wrote is each open connection's calls, in order, with their rows
    for j in range(conns):
        data = sent[j]
        if j in closed:
            assert data == b""
            continue
        if j in waiting:
            prefix = b"queued before the batch:" + bytes([j])
            assert data.startswith(prefix)
            data = data[len(prefix):]
        mine = [(req_id, count) for k, req_id, count, _ in calls if k == j]
        for req_id, count in mine:
            h = unpack_header(data[:HEADER_SIZE])
            assert (h.kind, h.req_id, h.cls, h.payload_len) == (Kind.RESPONSE, req_id, cls, count * ANSWER)
            assert (h.compute_us, h.queue_us) == ((T1 - T0) // 1000, h.total_us - (T2 - T0) // 1000)
            data = data[HEADER_SIZE + h.payload_len:]
        assert data == b""
        assert ids[j] == set()
    answered = sum(1 for j, *_ in calls if j not in closed)
    assert counts.answered == answered and counts.in_flight_rt + counts.in_flight_be == 0
    slo = [s for j, _, _, s in calls if j not in closed and cls == RequestClass.RT]
    assert (counts.slo_met, counts.slo_missed) == (slo.count(1), slo.count(2))
    # the batch counted by its size (rows), with the time it ran, in the page as by both paths
    assert by_size == {sum(count for _, _, count, _ in calls): (1, T1 - T0)}
    # and its answered calls in their class's block: their samples, durations, queue waits,
    # and the batch's model run and output copy once per call
    mine = by_class[int(cls)]
    assert by_class[1 - int(cls)] == DirectCalls()
    t_rx = [T0 - 1000 * (i + 1) for i, (j, *_) in enumerate(calls) if j not in closed]
    assert (mine.ok, mine.samples) == (answered, sum(c for j, _, c, _ in calls if j not in closed))
    assert (mine.ok_ns, mine.queue_ns) == (sum(T2 - t for t in t_rx), sum(T0 - t for t in t_rx))
    assert (mine.input_ns, mine.infer_ns, mine.output_ns) == (0, answered * (T1 - T0), answered * (T2 - T1))
    assert mine.failed == mine.fail_ns == 0
    # and each one's durations binned as /metrics shows them (the same on both paths, above)
    def binned(values):
        return tuple(sum(1 for v in values if duration_bin(v) == i) for i in range(BINS))

    assert mine.bins(Duration.REQUEST) == binned([T2 - t for t in t_rx])
    assert mine.bins(Duration.QUEUE) == binned([T0 - t for t in t_rx])
    assert mine.bins(Duration.COMPUTE) == binned([T2 - T0] * answered)
    assert [mine.sum_ns(d) for d in Duration] == [mine.ok_ns, mine.queue_ns, answered * (T2 - T0)]


@st.composite
def intakes(draw):
    frames = []
    for _ in range(draw(st.integers(1, 8))):
        count = draw(st.integers(1, 5))
        frames.append((draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 255, 7])), count,
                       draw(st.sampled_from([0, 50_000])), draw(st.sampled_from([0, 2_000])),
                       draw(st.sampled_from([0, 1]))))  # req_id, class byte, samples, deadline, SLO, extra byte
    return frames, draw(st.integers(1, 5)), draw(st.integers(0, 6)), draw(st.booleans()), draw(st.booleans())


def _intake(root: Path, compiled: bool, case) -> tuple:
    frames, max_in_flight, admit, suspended, one_call = case  # one_call: the batching policy none
    ep = _Endpoint(root, compiled, 1, max_in_flight, ONE_CALL if one_call else CFG)
    try:
        d, conn, client = ep.server, ep.conns[0], ep.clients[0]
        d.counters.set_admit(admit)
        if suspended:  # a best-effort batch stopped at a boundary: best-effort calls wait for rows
            d.suspended = ([], 0, 1, ())
        for req_id, cls, count, deadline_us, slo_us, extra in frames:
            payload = np.arange(count * 2, dtype=np.float32).tobytes() + bytes(extra)  # an extra byte: a bad size
            client.sendall(Header(Kind.REQUEST, req_id=req_id, func_id=1, cls=cls, deadline_us=deadline_us,
                                  slo_us=slo_us, payload_len=len(payload)).pack() + payload)
            conn.on_event(select.EPOLLIN)
        calls = [[(c.req_id, int(c.cls), c.count, c.total, c.got, c.row, c.deadline_ns and c.deadline_ns - c.t_rx_ns,
                   c.slo_ns and c.slo_ns - c.t_rx_ns) for c in d.placed[k]] for k in (0, 1)]
        rows = [[bytes(mv[: d.next_row[k] * nb]) for mv, nb in zip(d.flat[k], d.sizes)] for k in (0, 1)]
        words = list(d.counters.words)
        d.counters.flush()  # as the loop does at the end of each turn
        return (calls, rows, list(d.next_row), list(d.complete), sorted(conn.ids), conn.paused, conn.state, words,
                d.counters.snapshot(), ep.drain())
    finally:
        ep.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(intakes())
def test_the_lane_takes_a_read_as_the_python_path_does(tmp_path, case):
    compiled = _intake(tmp_path, True, case)
    python = _intake(tmp_path, False, case)
    assert compiled[:-1] == python[:-1]  # records, rows, flow control, the worker's words and the page
    assert compiled[-1] == python[-1]  # the same answers (refusals, duplicates) to the client


def test_answers_a_socket_does_not_take_wait_on_their_connection_and_all_arrive(tmp_path):
    batch = (2, [(0, 7, 3, 0), (1, 8, 1, 0), (0, 9, 4, 0)], set(), set(), True, RequestClass.RT, 3)
    sent, _, _, queued = _answer(tmp_path, True, batch)
    assert queued  # 8.5 kB for connection 0 into a 4 kB send buffer
    assert sent == _answer(tmp_path, False, batch)[0]
    assert [len(b) for b in sent] == [2 * HEADER_SIZE + 7 * ANSWER, HEADER_SIZE + ANSWER]


def _lane_rows():
    from splitserve import _directlane

    d = {c: [np.zeros((MAX_BATCH, 3), np.float32), np.zeros((MAX_BATCH, 5), np.int16)] for c in (0, 1)}
    counters = WorkerCounters(mmap.mmap(-1, PAGE_BYTES))
    lane = _directlane.Lane(1, [8], MAX_BATCH, bytes(256), [[np.zeros(MAX_BATCH * 8, np.uint8)]] * 2, [12, 10],
                            [d[0], d[1]], *counters.lane_counts())
    return lane, d


def test_outputs_copies_cpu_tensors_of_the_declared_dtype_and_size_and_declines_the_rest():
    lane, rows = _lane_rows()
    y = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    z = torch.arange(10, dtype=torch.int16).reshape(2, 5)
    assert lane.outputs(1, 2, (y, z)) is True
    np.testing.assert_array_equal(rows[1][0][:2], y.numpy())
    np.testing.assert_array_equal(rows[1][1][:2], z.numpy())
    assert not rows[0][0].any()  # the other class's rows untouched
    # those dtypes are known now: later tensors are copied from their own memory, a view at
    # an offset too (the first call went through numpy views)
    offset = torch.arange(12, dtype=torch.float32).reshape(4, 3)[2:]
    assert lane.outputs(0, 2, (offset, z + 1)) is True
    np.testing.assert_array_equal(rows[0][0][:2], offset.numpy())
    np.testing.assert_array_equal(rows[0][1][:2], (z + 1).numpy())
    strided = torch.arange(6, dtype=torch.float32).reshape(3, 2).t()
    assert not strided.is_contiguous()
    negated = torch._neg_view(y)  # its memory holds y: the negation is pending
    assert negated.is_neg()
    declined = [
        (y.double(), z),  # another dtype: converted by the caller
        (strided, z),  # the right size, not C-contiguous
        (negated, z),  # numpy() refuses it, and its memory is not its value
        (torch.zeros(2, 3, requires_grad=True), z),  # numpy() refuses it
        (torch.empty(2, 3, device="meta"), z),  # no CPU memory
        (torch.zeros(3, 3), z),  # another size
        (y,),  # fewer outputs than declared
        [y, z],  # not a tuple
    ]
    for acts in declined:
        assert lane.outputs(0, 2, acts) is False
    with pytest.raises(ValueError):
        lane.outputs(0, MAX_BATCH + 1, (y, z))


def _outputs(cls, acts, first, n):
    """The model's outputs for a batch of ``n`` (the direct path's ``SegmentRunner``): zeros of CFG's outputs."""
    return None, (torch.zeros(n, 300), torch.zeros(n, 5, dtype=torch.int16))


@pytest.mark.parametrize("compiled", [True, False])
def test_a_late_payloads_rows_count_in_its_batchs_size_and_its_samples_once(tmp_path, compiled):
    """A call whose payload is still coming when its batch starts leaves a hole there (rows
    computed and ignored) and is answered by the next batch: the first batch's size counts
    the hole, the call's samples count once, when it is answered."""
    ep = _Endpoint(tmp_path, compiled, 3)
    try:
        d = ep.server
        frames = [(0, 2), (1, 1), (2, 1)]  # (connection, samples): connection 1's payload comes in two parts
        for j, count in frames:
            payload = np.arange(2 * count, dtype=np.float32).tobytes()
            frame = Header(Kind.REQUEST, req_id=10 + j, func_id=1, cls=RequestClass.RT,
                           payload_len=len(payload)).pack() + payload
            ep.clients[j].sendall(frame[:-4] if j == 1 else frame)
            ep.conns[j].on_event(select.EPOLLIN)
        assert [(c.row, c.count) for c in d.placed[0]] == [(0, 2), (2, 1), (3, 1)]
        d.run_one(_outputs)  # rows 0..3, row 2 a hole: connection 1's call is moved aside
        ep.clients[1].sendall(np.float32(1).tobytes())
        ep.conns[1].on_event(select.EPOLLIN)
        d.run_one(_outputs)  # it runs alone, from aside
        answers = [unpack_header(b[:HEADER_SIZE]) for b in ep.drain()]
        assert [(h.kind, h.req_id, h.payload_len) for h in answers] == [(Kind.RESPONSE, 10 + j, c * ANSWER)
                                                                         for j, c in frames]
        page = WorkerCounters(ep.flag.page).tally()
        assert {size: n for size, (n, _) in page.sizes.items()} == {4: 1, 1: 1}
        assert page.counts.samples == 5  # the rows the model ran, the hole's included
        assert (page.calls[0].ok, page.calls[0].samples) == (3, 4)  # each call's samples, once
    finally:
        ep.close()
