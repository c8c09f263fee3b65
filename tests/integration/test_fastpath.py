"""The serving spine end to end: real server processes, real sockets on loopback."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from splitserve import Client, UdpClient
from splitserve.errors import SplitServeError, Status, WorkerFailed
from splitserve.models import build_zoo_model, digits_dataset
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header

MODELS = ("lenet", "vecadd1k", "digits")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.conftest import start_server

    s = start_server(tmp_path_factory.mktemp("spine"), *sum((["--load", m] for m in MODELS), []))
    yield s
    assert s.stop() == 0


def local_outputs(name, xs):
    import torch

    m = build_zoo_model(name)
    with torch.inference_mode():
        ys = m(*[torch.from_numpy(x) for x in xs])
    return [y.numpy() for y in ys]


@pytest.mark.parametrize("transport", ["tcp", "unix", "udp"])
def test_digits_accuracy_over_every_transport(server, transport):
    _, _, x_test, y_test = digits_dataset()
    url = getattr(server, transport)
    cls = UdpClient if transport == "udp" else Client
    with cls(url) as c:
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


def test_2000_pipelined_requests_from_32_connections(server):
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

    def client(k: int) -> None:
        try:
            with Client(server.tcp) as c:
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

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_conn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(answers) == n_conn * per_conn == 2016
    for name, j, y in answers:
        np.testing.assert_allclose(y, expected[name][j], rtol=1e-4, atol=1e-5, err_msg=f"{name}[{j}]")


def raw(server):
    s = socket.create_connection(("127.0.0.1", server.info["fast_port"]))
    s.settimeout(10)
    return s


def read_frame(s):
    buf = b""
    while len(buf) < HEADER_SIZE:
        chunk = s.recv(HEADER_SIZE - len(buf))
        if not chunk:
            return None, b""
        buf += chunk
    h = unpack_header(buf)
    body = b""
    while len(body) < h.payload_len:
        body += s.recv(h.payload_len - len(body))
    return h, body


def lookup(s, name):
    s.sendall(Header(Kind.LOOKUP, req_id=1, payload_len=len(name)).pack() + name.encode())
    h, body = read_frame(s)
    assert h.kind == Kind.LOOKUP_REPLY, body
    return h.func_id


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
def test_bad_input_gets_an_error_and_the_connection_survives(server, case, status, words):
    with raw(server) as s:
        fid = lookup(s, "lenet")
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


def test_duplicate_req_id_in_flight_is_refused(server):
    with raw(server) as s:
        fid = lookup(s, "lenet")
        # header and half of the payload of call 7, then a second call 7 cannot start: the
        # first is still being received, so send the duplicate on a pipelined pair instead
        frame = Header(Kind.REQUEST, req_id=7, func_id=fid, payload_len=784 * 32).pack() + bytes(784 * 32)
        s.sendall(frame + frame)
        frames = [read_frame(s)[0] for _ in range(2)]
        kinds = sorted((f.kind, f.status) for f in frames)
        # either the first was still in flight (duplicate refused) or it had already been answered
        assert kinds in ([(Kind.RESPONSE, 0), (Kind.ERROR, Status.DUPLICATE_REQUEST)], [(Kind.RESPONSE, 0)] * 2)
        good_request(s, fid)


@pytest.mark.parametrize("case", ["bad_magic", "bad_version", "truncated"])
def test_lost_framing_closes_only_that_connection(server, case):
    with raw(server) as s, raw(server) as other:
        fid = lookup(other, "lenet")
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
    from tests.conftest import start_server

    s = start_server(tmp_path / "small", "--load", "lenet", "--queue-slots", "8")
    try:
        with Client(s.tcp) as c:
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
    from tests.conftest import start_server

    s = start_server(tmp_path / "kill", "--load", "resnet50")
    try:
        with Client(s.tcp) as c:
            info = c.lookup("resnet50")
            pid = info.extra["pids"][0]
            x = np.zeros((16, 3, 32, 32), np.float32)
            calls = [c.submit("resnet50", x) for _ in range(4)]
            time.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            outcomes = []
            for p in calls:
                try:
                    p.result(timeout=60)
                    outcomes.append("ok")
                except WorkerFailed as e:
                    assert "died" in str(e) or "not running" in str(e)
                    outcomes.append("failed")
            assert "failed" in outcomes
            deadline = time.monotonic() + 120
            while True:  # the worker is restarted; later calls succeed
                try:
                    y = c.infer("resnet50", x[0])
                    break
                except SplitServeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert y.shape == (10,)
            with Client(s.tcp) as c2:
                assert c2.lookup("resnet50").extra["pids"][0] != pid
    finally:
        s.stop()
