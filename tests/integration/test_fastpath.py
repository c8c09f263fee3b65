"""The serving spine end to end: real server processes, real sockets on loopback."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from splitserve import Client, UdpClient
from splitserve.errors import DeadlineMissed, SplitServeError, Status, WorkerFailed
from splitserve.models.digits import digits_dataset
from splitserve.models.zoo import build_zoo_model
from splitserve.models.gate import Gates
from splitserve.protocol.header import Header, Kind
from tests.framing import (DIRECT_TCP, PATHS, client, describe, direct_env, raw, read_frame, stream, udp, udp_describe,
                           udp_read)

MODELS = ("lenet", "vecadd1k", "digits")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers import start_server

    # HTTP and the stage trace are on for test_stage_stamps_of_a_call_are_in_order_across_processes;
    # the workers serve the direct path too, so the stream tests run over both paths.
    s = start_server(tmp_path_factory.mktemp("spine"), *sum((["--load", m] for m in MODELS), []), http=True,
                     env={**direct_env(), "SPLITSERVE_FAST_STAGE_TRACE": "64"})
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module", params=["compiled", "python"])
def gated(request, tmp_path_factory):
    """A server whose only model is the gate (one instance, max batch 8), and its gates; its
    workers' direct endpoints with the compiled intake, then without it (the same tests
    over both ways a worker takes a read)."""
    from tests.helpers import start_server
    from tests.inproc import write_model

    compiled = request.param == "compiled"
    if compiled and importlib.util.find_spec("splitserve._directlane") is None:
        pytest.skip("the compiled intake was not built")
    root = tmp_path_factory.mktemp("gated")
    write_model(root / "repo", "gate", "gate")
    gates = Gates(root / "cache")
    s = start_server(root / "data", "--repository", str(root / "repo"), "--load", "gate", cache_dir=root / "cache",
                     env=direct_env(compiled))
    yield s, gates
    gates.open_all()
    assert s.stop() == 0


@pytest.fixture(scope="module", params=["compiled", "python"])
def declared(request, tmp_path_factory):
    """vecadd1k served under two configs whose output its model does not return as declared:
    ``wide`` says FP64 (its FP32 sums are converted), ``half`` says 512 elements (1024 cannot
    fit); workers with direct endpoints, with and without the compiled lane."""
    from tests.helpers import start_server
    from tests.inproc import write_model

    compiled = request.param == "compiled"
    if compiled and importlib.util.find_spec("splitserve._directlane") is None:
        pytest.skip("the compiled lane was not built")
    root = tmp_path_factory.mktemp("declared")
    inputs = '[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1024]\n[[inputs]]\nname = "b"\ndatatype = "FP32"\n' \
             'shape = [1024]\n'
    for name, dtype, n in (("wide", "FP64", 1024), ("half", "FP32", 512)):
        write_model(root / "repo", name, "vecadd1k",
                    f'{inputs}[[outputs]]\nname = "sum"\ndatatype = "{dtype}"\nshape = [{n}]\n')
    s = start_server(root / "data", "--repository", str(root / "repo"), "--load", "wide", "--load", "half",
                     env=direct_env(compiled))
    yield s
    assert s.stop() == 0


def gate_frame(fid: int, req_id: int, key: int) -> bytes:
    """A one-sample request for the gate: held while ``key``'s gate is closed."""
    return Header(Kind.REQUEST, req_id=req_id, func_id=fid, payload_len=8).pack() + np.int64(key).tobytes()


def local_outputs(name, xs):
    import torch

    m = build_zoo_model(name)
    with torch.inference_mode():
        ys = m(*[torch.from_numpy(x) for x in xs])
    return [y.numpy() for y in ys]


def tcp_listen_address(port: int) -> str:
    """The IPv4 address the listening TCP socket on ``port`` is bound to (/proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
    raise AssertionError(f"nothing listens on TCP port {port}")


@pytest.mark.parametrize("transport", ["tcp", "unix", "udp", "direct", DIRECT_TCP])
def test_digits_accuracy_over_every_transport(server, transport):
    _, _, x_test, y_test = digits_dataset()
    direct = transport in ("direct", DIRECT_TCP)
    with UdpClient(server.udp) if transport == "udp" else client(server, transport) if direct \
            else Client(getattr(server, transport)) as c:
        if direct:
            assert c.direct_endpoints("digits") == 0 and c.lookup("digits") and c.direct_endpoints("digits") == 1
            (st,) = c._direct_streams  # a unix:// client takes the worker's Unix socket, a tcp:// one its TCP port
            assert st.url.startswith("unix://" if transport == "direct" else "tcp://127.0.0.1:"), st.url
            if transport == DIRECT_TCP:  # bound to the fast path's own address (loopback here), never wider
                assert tcp_listen_address(st.sock.getpeername()[1]) == "127.0.0.1"
        if transport == "udp":
            preds = [int(np.argmax(c.infer("digits", x))) for x in x_test]
        else:
            calls = [c.submit("digits", x) for x in x_test]
            preds = [int(np.argmax(p.result().value())) for p in calls]
    acc = float(np.mean(np.array(preds) == y_test))
    assert acc >= 0.95, f"digits accuracy over {transport} is {acc:.3f}"


def test_batched_request_and_udp_segmentation(server):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, (40, 1, 28, 28), dtype=np.uint8)  # 31 KiB: one request of 40 samples
    (want,) = local_outputs("lenet", [x])
    with UdpClient(server.udp, segment=4096) as u:  # 8 datagrams
        got = u.infer("lenet", x[:32])
    np.testing.assert_allclose(got, want[:32], rtol=1e-4, atol=1e-5)
    with Client(server.tcp) as c, pytest.raises(SplitServeError, match="max_batch_size"):
        c.infer("lenet", x)  # 40 > max batch 32


@pytest.mark.parametrize("path", [*PATHS, "mixed"])  # mixed: half the connections each way, the same workers
def test_2000_pipelined_requests_from_32_connections(server, path):
    rng = np.random.default_rng(0)
    n_conn, per_conn, window = 32, 63, 4
    inputs = {
        "lenet": [rng.integers(0, 255, (1, 28, 28), dtype=np.uint8) for _ in range(64)],
        "vecadd1k": [(rng.standard_normal(1024).astype(np.float32), rng.standard_normal(1024).astype(np.float32))
                     for _ in range(64)],
        "digits": [rng.random((1, 8, 8), dtype=np.float32) for _ in range(64)],
    }
    expected = {}
    for name, xs in inputs.items():
        cols = list(zip(*xs)) if isinstance(xs[0], tuple) else [xs]
        (out,) = local_outputs(name, [np.stack(c) for c in cols])
        expected[name] = out
    answers: list[tuple[str, int, np.ndarray]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def connection(k: int) -> None:
        try:
            with client(server, PATHS[k % 2] if path == "mixed" else path) as c:
                inflight = []
                for i in range(per_conn):
                    name = MODELS[(k + i) % 3]
                    j = (k * per_conn + i) % 64
                    inflight.append((name, j, c.submit(name, inputs[name][j])))
                    if len(inflight) >= window:
                        n, jj, p = inflight.pop(0)
                        with lock:
                            answers.append((n, jj, p.result().value()))
                for n, jj, p in inflight:
                    with lock:
                        answers.append((n, jj, p.result().value()))
        except BaseException as e:  # surfaced below with the thread's context
            errors.append(e)

    threads = [threading.Thread(target=connection, args=(k,)) for k in range(n_conn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(answers) == n_conn * per_conn == 2016
    for name, j, y in answers:
        np.testing.assert_allclose(y, expected[name][j], rtol=1e-4, atol=1e-5, err_msg=f"{name}[{j}]")


def good_request(s, fid, req_id=99):
    s.sendall(Header(Kind.REQUEST, req_id=req_id, func_id=fid, payload_len=784).pack() + bytes(784))
    h, body = read_frame(s)
    assert h.kind == Kind.RESPONSE and h.req_id == req_id and len(body) == 40, (h, body)


@pytest.mark.parametrize("case, status, words", [
    ("unknown_func", Status.UNKNOWN_MODEL, "func_id"),
    ("bad_size", Status.BAD_SIZE, "multiple of 784"),
    ("bad_segment", Status.BAD_SEGMENT, "seg_count"),
    ("client_sends_response", Status.BAD_FRAME, "may not send"),
    ("unknown_model_lookup", Status.UNKNOWN_MODEL, "unknown model"),
    ("bad_class", Status.INVALID_INPUT, "request class"),
])
@pytest.mark.parametrize("path", [*PATHS, DIRECT_TCP])
def test_bad_input_gets_an_error_and_the_connection_survives(server, path, case, status, words):
    if path != "front" and case == "unknown_model_lookup":
        pytest.skip("lookups stay with the front end")
    s, fid = stream(server, path, "lenet")
    with s:
        if case == "unknown_func":
            s.sendall(Header(Kind.REQUEST, req_id=5, func_id=60000, payload_len=784).pack() + bytes(784))
        elif case == "bad_size":
            s.sendall(Header(Kind.REQUEST, req_id=5, func_id=fid, payload_len=700).pack() + bytes(700))
        elif case == "bad_segment":
            s.sendall(Header(Kind.REQUEST, req_id=5, func_id=fid, seg_count=3, payload_len=784).pack() + bytes(784))
        elif case == "client_sends_response":
            s.sendall(Header(Kind.RESPONSE, req_id=5, payload_len=10).pack() + bytes(10))
        elif case == "unknown_model_lookup":
            s.sendall(Header(Kind.LOOKUP, req_id=5, payload_len=5).pack() + b"nope!")
        elif case == "bad_class":
            s.sendall(Header(Kind.REQUEST, req_id=5, func_id=fid, cls=7, payload_len=784).pack() + bytes(784))
        h, body = read_frame(s)
        assert h.kind == Kind.ERROR and h.status == status and h.req_id == 5
        assert words in body.decode(), body
        good_request(s, fid)


@pytest.mark.parametrize("path", [*PATHS, DIRECT_TCP])
def test_frames_split_and_joined_anyhow_across_reads_are_each_answered(server, path):
    """However a stream's bytes fall into reads: a frame whole with the next one's header
    behind it, that header alone and its payload later in two pieces, a frame of several
    samples longer than what one read stages, with a PING right behind it: each call gets
    its own answer, right."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 2, 1024), dtype=np.float32)  # six vecadd1k samples: (a, b) each

    def frame(req_id: int, samples: np.ndarray) -> bytes:
        payload = samples[:, 0].tobytes() + samples[:, 1].tobytes()  # inputs one after the other
        return Header(Kind.REQUEST, req_id=req_id, func_id=fid, payload_len=len(payload)).pack() + payload

    def answer(req_id: int, samples: np.ndarray, frame: tuple | None = None) -> None:
        h, body = frame or read_frame(s)
        assert (h.kind, h.req_id) == (Kind.RESPONSE, req_id), (h, body[:200])
        np.testing.assert_array_equal(np.frombuffer(body, np.float32).reshape(-1, 1024), samples[:, 0] + samples[:, 1])

    s, fid = stream(server, path, "vecadd1k")
    with s:
        a, b = frame(1, x[:1]), frame(2, x[1:2])
        s.sendall(a + b[:64])  # a whole, then b's header alone
        answer(1, x[:1])  # a was answered while b's payload had not come
        s.sendall(b[64:3000])
        s.sendall(b[3000:])
        answer(2, x[1:2])
        s.sendall(frame(3, x[2:6]) + Header(Kind.PING, req_id=4).pack())  # 32 KiB of payload, then a PING
        got = {h.req_id: (h, body) for h, body in (read_frame(s), read_frame(s))}  # a PING is answered at once
        answer(3, x[2:6], got[3])
        assert got[4][0].kind == Kind.PONG


@pytest.mark.parametrize("path", PATHS)
def test_duplicate_req_id_in_flight_is_refused(gated, path):
    server, gates = gated
    gates.close(7001)
    s, fid = stream(server, path, "gate")
    with s:
        s.sendall(gate_frame(fid, 7, 7001) + gate_frame(fid, 7, 7002))  # call 7 is held in the gate
        h, body = read_frame(s)
        assert (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.DUPLICATE_REQUEST, 7), body
        gates.open(7001)
        h, body = read_frame(s)  # the original call is unaffected
        assert (h.kind, h.req_id, np.frombuffer(body, np.int64).tolist()) == (Kind.RESPONSE, 7, [7001])
        s.sendall(gate_frame(fid, 7, 7003))  # answered: its id is free again
        h, body = read_frame(s)
        assert (h.kind, h.req_id, np.frombuffer(body, np.int64).tolist()) == (Kind.RESPONSE, 7, [7003])


def test_deadline_missed_over_tcp_while_the_only_instance_is_held(gated):
    server, gates = gated
    gates.close(7010)
    with Client(server.tcp, direct=False) as c:  # the front end's queue, which times a held call's deadline
        held = c.submit("gate", np.full((8, 1), 7010, np.int64))  # a full batch: nothing can join it
        late = c.submit("gate", np.array([7011], np.int64), deadline_ms=50)
        with pytest.raises(DeadlineMissed, match="deadline passed"):
            late.result()
        gates.open(7010)
        assert held.result().value().ravel().tolist() == [7010] * 8


def test_direct_call_past_its_deadline_before_its_batch_starts_is_refused(gated):
    """The worker checks a direct call's deadline (counted from when it read the header) as
    its batch starts: a call already past it is answered DEADLINE_MISSED, the others run."""
    server, _ = gated
    with client(server, "direct") as c:
        ok = c.submit("gate", np.array([7012], np.int64))
        late = c.submit("gate", np.array([7013], np.int64), deadline_ms=0.001)
        with pytest.raises(DeadlineMissed, match="deadline passed"):
            late.result()
        assert ok.result().value().ravel().tolist() == [7012]
        assert c.direct_endpoints("gate") == 1


def test_direct_calls_pipelined_on_one_connection_into_one_batch_are_answered_in_order_each_its_own(gated):
    """The worker answers the calls of one batch that came on one connection with one gather
    write: the answers keep the order the calls were sent in, and each carries its own
    req_id and output. A held call keeps the worker busy while seven more arrive, so the
    seven are read in one turn of its loop and run as one batch."""
    server, gates = gated
    def batches() -> int:
        with raw(server) as r:  # a fresh lookup: the worker's counters now
            return describe(r, "gate")["direct_counts"]["batches"]

    s, fid = stream(server, "direct", "gate")
    with s:
        before = batches()
        gates.close(7020)
        try:
            s.sendall(gate_frame(fid, 1, 7020))
            deadline = time.monotonic() + 30
            while not gates.held(7020) and time.monotonic() < deadline:  # the worker is mid-batch
                time.sleep(0.01)
            ids, keys = [9, 3, 7, 2**64 - 1, 5, 4, 8], [7021, 7022, 7023, 7024, 7025, 7026, 7027]
            s.sendall(b"".join(gate_frame(fid, i, k) for i, k in zip(ids, keys)))
        finally:
            gates.open(7020)
        got = [read_frame(s) for _ in range(8)]
        assert [(h.kind, h.req_id) for h, _ in got] == [(Kind.RESPONSE, 1)] + [(Kind.RESPONSE, i) for i in ids]
        assert [int(np.frombuffer(p, np.int64)[0]) for _, p in got] == [7020, *keys]
        assert batches() == before + 2  # the held one, then the seven


def test_direct_answers_convert_outputs_to_the_declared_dtype_and_outputs_that_cannot_fit_fail_the_call(declared):
    """A worker answers a direct batch from its answer rows: outputs of another dtype are
    converted into them; outputs that cannot take the declared shape fail the batch's calls
    with WORKER_FAILED naming the model, and the worker serves on (no restart)."""
    rng = np.random.default_rng(5)
    a, b = rng.random((2, 3, 1024), np.float32)

    def half() -> dict:
        with raw(declared) as r:  # a fresh lookup: the worker's pid and counters now
            return describe(r, "half")

    with client(declared, "direct") as c:
        y = c.infer("wide", {"a": a, "b": b})
        assert y.dtype == np.float64 and np.array_equal(y, (a + b).astype(np.float64))
        before = half()
        for _ in range(2):
            with pytest.raises(WorkerFailed, match="'half' raised: RuntimeError: shape"):
                c.infer("half", {"a": a, "b": b})
        assert c.direct_endpoints("half") == 1 and c.direct_endpoints("wide") == 1
        after = half()
        assert after["pids"] == before["pids"]
        assert after["direct_counts"]["failed"] == before["direct_counts"]["failed"] + 2


def test_async_client_sends_direct_and_falls_back_to_the_front_end_when_the_endpoint_closes(server):
    """``AsyncClient(direct=True)`` spreads its calls over the workers' endpoints (from a
    tcp:// URL, their TCP ones), and a closed one costs no call: its unanswered calls go
    through the front end."""
    import asyncio

    from splitserve import AsyncClient

    rng = np.random.default_rng(3)
    xs = [rng.integers(0, 255, (1, 28, 28), dtype=np.uint8) for _ in range(48)]
    (want,) = local_outputs("lenet", [np.stack(xs)])

    async def scenario() -> list:
        async with AsyncClient(server.tcp, direct=True) as c:
            first = await asyncio.gather(*(c.infer("lenet", x) for x in xs[:16]))
            assert c.direct_endpoints("lenet") == 1
            (st,) = c._routes["lenet"].streams
            calls = [asyncio.ensure_future(c.infer("lenet", x)) for x in xs[16:]]
            await asyncio.sleep(0)  # sent, not answered
            st.transport.abort()  # the endpoint closes under them, as when its worker goes away
            return first + list(await asyncio.gather(*calls))

    got = asyncio.run(scenario())
    for j, y in enumerate(got):
        np.testing.assert_allclose(y, want[j], rtol=1e-4, atol=1e-5)


def test_an_async_client_used_without_connect_connects_on_its_first_calls_and_refuses_them_once_closed(server):
    """As ``httpx.AsyncClient``: no ``async with`` needed. Calls sent at once by a client not
    yet connected share one connection to the front end; once closed, a call is refused."""
    import asyncio

    from splitserve import AsyncClient

    x = np.zeros((1, 28, 28), np.uint8)

    async def scenario() -> None:
        c = AsyncClient(server.tcp)
        try:
            got = await asyncio.gather(*(c.infer("lenet", x) for _ in range(4)))
            front = c._front
            assert all(y.shape == (10,) for y in got) and front is not None
            await c.infer("lenet", x)
            assert c._front is front  # one connection to the front end, made once
        finally:
            await c.close()
        with pytest.raises(ConnectionError, match="the client is closed"):
            await c.infer("lenet", x)

    asyncio.run(scenario())


@pytest.mark.parametrize("direct", [False, True], ids=["front", "direct"])
def test_async_client_close_ends_each_call_in_flight_with_connection_error(gated, direct):
    """Closing an ``AsyncClient`` ends every call still waiting (here one held by the gate)
    with ``ConnectionError`` at once, not when its timeout comes."""
    import asyncio

    from splitserve import AsyncClient

    server, gates = gated
    gates.close(7300)

    async def scenario() -> None:
        c = await AsyncClient(server.tcp, timeout=20.0, direct=direct).connect()
        await c.lookup("gate")
        assert c.direct_endpoints("gate") == int(direct)
        held = asyncio.ensure_future(c.infer("gate", np.array([7300], np.int64)))
        await asyncio.sleep(0)  # sent, held in the batch
        await c.close()
        with pytest.raises(ConnectionError, match="the client is closed"):
            await held

    try:
        asyncio.run(scenario())
    finally:
        gates.open(7300)


def test_udp_retransmit_of_an_answered_request_gets_the_remembered_answer(gated):
    server, gates = gated
    with udp(server) as u:
        fid = udp_describe(u, "gate")["func_id"]
        u.send(gate_frame(fid, 11, 7020))
        first = udp_read(u)
        assert first[0].kind == Kind.RESPONSE and np.frombuffer(first[1], np.int64).tolist() == [7020]
        gates.close(7020)  # run again, the retransmit would now be held until the gate opens
        try:
            u.send(gate_frame(fid, 11, 7020))
            again = udp_read(u)
        finally:
            gates.open(7020)
        assert (again[0].kind, again[0].req_id, again[1]) == (Kind.RESPONSE, 11, first[1])


def test_udp_retransmit_of_a_running_request_does_not_start_it_again(gated):
    server, gates = gated
    gates.close(7030)
    with udp(server) as u:
        fid = udp_describe(u, "gate")["func_id"]
        for _ in range(3):  # the request and two retransmits while it is held
            u.send(gate_frame(fid, 12, 7030))
        gates.open(7030)
        h, body = udp_read(u)
        assert (h.kind, h.req_id, np.frombuffer(body, np.int64).tolist()) == (Kind.RESPONSE, 12, [7030])
        # A second run of call 12 would sit before this one in the ring, so its answer
        # would come first.
        u.send(gate_frame(fid, 13, 7031))
        h, body = udp_read(u)
        assert (h.kind, h.req_id) == (Kind.RESPONSE, 13)


@pytest.mark.parametrize("case", ["bad_magic", "bad_version", "truncated"])
@pytest.mark.parametrize("path", PATHS)
def test_lost_framing_closes_only_that_connection(server, path, case):
    (s, fid), (other, _) = stream(server, path, "lenet"), stream(server, path, "lenet")
    with s, other:
        hdr = bytearray(Header(Kind.REQUEST, req_id=3, func_id=fid, payload_len=784).pack())
        if case == "bad_magic":
            hdr[:4] = b"HTTP"
            s.sendall(bytes(hdr))
        elif case == "bad_version":
            hdr[4] = 77
            s.sendall(bytes(hdr))
        else:  # dropped mid-frame: half a payload, then the peer goes away
            s.sendall(bytes(hdr) + bytes(300))
            s.shutdown(socket.SHUT_WR)
        h, body = read_frame(s)
        if case != "truncated":
            assert h.kind == Kind.ERROR and h.status == Status.BAD_FRAME and body
            assert read_frame(s)[0] is None  # then closed
        else:
            assert h is None
        good_request(other, fid)


def test_queue_full_is_refused_not_buffered(tmp_path):
    from tests.helpers import start_server

    s = start_server(tmp_path / "small", "--load", "lenet", "--queue-slots", "8")
    try:
        with Client(s.tcp, direct=False) as c:  # the front end's rings
            # lenet's ring rounds up to 512 slots; overfill it with big multi-sample calls
            calls = [c.submit("lenet", np.zeros((32, 1, 28, 28), np.uint8)) for _ in range(40)]
            outcomes = []
            for p in calls:
                try:
                    p.result()
                    outcomes.append("ok")
                except SplitServeError as e:
                    outcomes.append(e.status.name)
            assert set(outcomes) <= {"ok", "QUEUE_FULL"} and "ok" in outcomes
            assert "QUEUE_FULL" in outcomes
            c.infer("lenet", np.zeros((1, 28, 28), np.uint8))
    finally:
        s.stop()


def test_worker_killed_mid_batch_fails_its_calls_and_comes_back(tmp_path):
    from tests.helpers import start_server
    from tests.inproc import write_model

    write_model(tmp_path / "repo", "gate", "gate")
    gates = Gates(tmp_path / "cache")
    s = start_server(tmp_path / "kill", "--repository", str(tmp_path / "repo"), "--load", "gate",
                     cache_dir=tmp_path / "cache")
    try:
        with Client(s.tcp, direct=False) as c:  # the front end's answer (a direct call is re-sent instead)
            pid = c.lookup("gate").extra["pids"][0]
            gates.close(7020)
            held = c.submit("gate", np.full((4, 1), 7020, np.int64))
            deadline = time.monotonic() + 60
            while not gates.held(7020):  # its batch is mid-run in the worker
                assert time.monotonic() < deadline, "the batch never reached its gate"
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerFailed, match="died|not running"):
                held.result(timeout=60)
            gates.open_all()  # the restarted worker's samples run
            deadline = time.monotonic() + 120
            while True:  # the worker is restarted; later calls succeed
                try:
                    y = c.infer("gate", np.array([7021], np.int64))
                    break
                except SplitServeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert y.ravel().tolist() == [7021]
            with Client(s.tcp) as c2:
                assert c2.lookup("gate").extra["pids"][0] != pid
    finally:
        gates.open_all()
        s.stop()


def _solo_calls(c: Client, xs: np.ndarray, want: np.ndarray, stop: threading.Event, outcomes: list[str]) -> None:
    """One call at a time (each sent and read by this thread, polling for its answer when
    the client polls) until ``stop``: each one's own result, or WORKER_FAILED."""
    j = 0
    while not stop.is_set() or j < 8:
        try:
            np.testing.assert_allclose(c.infer("lenet", xs[j % len(xs)]), want[j % len(xs)], rtol=1e-4, atol=1e-5)
            outcomes.append("ok")
        except WorkerFailed:
            outcomes.append("failed")
        j += 1


def test_direct_calls_under_a_worker_kill_get_one_answer_each_and_the_client_follows_the_restart(tmp_path,
                                                                                                  monkeypatch):
    """A ledger over a worker's SIGKILL, for a client on its Unix endpoint and one on its TCP
    endpoint at once: every direct call gets exactly one answer, its own result (re-sent
    through the front end when the endpoint closed unanswered) or WORKER_FAILED naming the
    dead worker; then each client follows the restarted worker's endpoint of its kind.
    Meanwhile a client that polls for its answers makes solo calls on the Unix endpoint
    throughout: each gets its own result or WORKER_FAILED, none hangs."""
    from splitserve.client import stream as client_stream
    from tests.helpers import start_server

    monkeypatch.setattr(client_stream.HostLoad, "cpu_free", lambda self, now_ns: True)  # it polls, however busy the host
    s = start_server(tmp_path / "kill-direct", "--load", "lenet", env=direct_env())
    try:
        xs = np.random.default_rng(5).integers(0, 255, (64, 1, 28, 28), dtype=np.uint8)
        (want,) = local_outputs("lenet", [xs])
        with client(s, "direct") as cu, client(s, DIRECT_TCP) as ct, client(s, "direct", poll_us=5000) as cp:
            clients = (cu, ct)
            pid = cu.lookup("lenet").extra["pids"][0]
            assert all(c.lookup("lenet") and c.direct_endpoints("lenet") == 1 for c in (*clients, cp))
            stop, solo = threading.Event(), []
            poller = threading.Thread(target=_solo_calls, args=(cp, xs, want, stop, solo), daemon=True)
            poller.start()
            calls = [(c, j, c.submit("lenet", xs[j])) for j in range(32) for c in clients]
            os.kill(pid, signal.SIGKILL)
            calls += [(c, j, c.submit("lenet", xs[j])) for j in range(32) for c in clients]
            answers: dict[tuple[int, int], str] = {}
            for c, j, p in calls:
                try:
                    np.testing.assert_allclose(p.result(timeout=120).value(), want[j], rtol=1e-4, atol=1e-5)
                    outcome = "ok"
                except WorkerFailed as e:
                    assert str(pid) in str(e) or "not running" in str(e), e
                    outcome = "failed"
                assert (id(c), p.req_id) not in answers
                answers[id(c), p.req_id] = outcome
            assert len(answers) == 128
            for c in clients:
                assert "ok" in [o for (k, _), o in answers.items() if k == id(c)]
            stop.set()
            poller.join(timeout=120)
            assert not poller.is_alive() and len(solo) >= 8 and "ok" in solo
            assert all(st.spin.budget_ns == 5_000_000 for st in (cp._front, *cp._direct_streams))
            deadline = time.monotonic() + 120
            for c in clients:  # the worker is restarted, and each client's calls go to it directly again
                while True:
                    c.infer("lenet", xs[0])
                    info = c.lookup("lenet")
                    if c.direct_endpoints("lenet") == 1 and info.extra["pids"][0] not in (None, pid):
                        break
                    assert time.monotonic() < deadline, info.extra
                    time.sleep(0.2)
                assert len(c._direct_streams) == 1  # the dead worker's connection is not kept
                with Client(s.tcp) as plain:  # the front end counts the call it never saw (a fresh lookup each)
                    before = plain.lookup("lenet").extra["direct_counts"]["answered"]
                    np.testing.assert_allclose(c.infer("lenet", xs[1]), want[1], rtol=1e-4, atol=1e-5)
                with Client(s.tcp) as plain:
                    assert plain.lookup("lenet").extra["direct_counts"]["answered"] == before + 1
            assert ct._direct_streams[0].url.startswith("tcp://") and cu._direct_streams[0].url.startswith("unix://")
    finally:
        s.stop()


def test_stage_stamps_of_a_call_are_in_order_across_processes(server):
    """The front end's and the worker's stamps share one clock: a call's stages are in order."""
    from splitserve.bench.ownserver import get_json
    from splitserve.server.stages import STAMPS

    with Client(server.tcp, direct=False) as c:  # the front end's stages
        rid = c.submit("vecadd1k", {"a": np.ones(1024, np.float32), "b": np.ones(1024, np.float32)}).req_id
        c.infer_result("vecadd1k", {"a": np.ones(1024, np.float32), "b": np.ones(1024, np.float32)})
    trace = get_json(f"{server.http}/v2/debug/stages")
    rec = next(r for r in trace["calls"] if r["req_id"] == rid)
    stamps = [rec[s] for s in STAMPS]
    assert trace["enabled"] and rec["model"] == "vecadd1k" and rec["compute_ns"] > 0
    assert stamps == sorted(stamps) and stamps[0] > 0, " ".join(f"{s}={t:.6f}" for s, t in zip(STAMPS, stamps))
    assert rec["t_start_w"] + rec["compute_ns"] / 1e9 <= rec["t_done"]


def test_direct_real_time_calls_slo_outcomes_join_the_slo_metric_and_statistics(server):
    """A direct real-time call never passes the front end: its worker counts its SLO outcome
    (the front end's rule) in its page, and the front end adds it to the same metric and
    statistics. One with an SLO it cannot meet (1 µs) is served and counted missed; one with
    a minute is counted met."""
    import httpx

    from tests.integration.test_request_classes import slo_counts

    x = (np.ones(1024, np.float32), np.ones(1024, np.float32))
    with httpx.Client(base_url=server.http, timeout=30) as web, client(server, "direct") as c:
        before = slo_counts(web.get("/metrics").text, "vecadd1k")
        direct_before = web.get("/v2/models/vecadd1k/stats").json()["model_stats"][0]["direct"]
        assert c.lookup("vecadd1k") and c.direct_endpoints("vecadd1k") == 1
        for slo_ms in (0.001, 60000):  # the first is served late
            np.testing.assert_array_equal(c.infer("vecadd1k", x, cls="rt", slo_ms=slo_ms).ravel(), np.full(1024, 2.0))
        after = slo_counts(web.get("/metrics").text, "vecadd1k")
        (stats,) = web.get("/v2/models/vecadd1k/stats").json()["model_stats"]
    assert stats["direct"]["answered"] == direct_before["answered"] + 2  # both went direct
    assert {o: after.get(o, 0.0) - before.get(o, 0.0) for o in ("met", "missed", "dropped")} == \
        {"met": 1.0, "missed": 1.0, "dropped": 0.0}
    assert (stats["direct"]["slo_met"], stats["direct"]["slo_missed"]) == (
        direct_before["slo_met"] + 1, direct_before["slo_missed"] + 1)
    assert stats["slo"] == {k: int(after.get(k, 0.0)) for k in ("met", "missed", "dropped")}  # one tally
