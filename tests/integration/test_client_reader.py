"""The sync fast-path client's buffered reader against a scripted peer on loopback: answers
that share one recv, answers out of order, and a payload bigger than the client's receive
buffer (read past it), all land with the right call; a single caller reads its own answer
(an error one included), and callers on several threads each get their own."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from splitserve.client.fastpath import _RX_BYTES, Client
from splitserve.errors import InvalidInput, Status
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header

_OUT = 3  # floats per answer


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("client went away")
        buf += chunk
    return bytes(buf)


def _model(pad: int = 0) -> bytes:
    return json.dumps({"name": "m", "func_id": 7, "max_batch_size": 4,
                       "inputs": [{"name": "x", "datatype": "FP32", "shape": [_OUT]}],
                       "outputs": [{"name": "y", "datatype": "FP32", "shape": [_OUT]}],
                       "pad": "p" * pad}).encode()


def _peer(listener: socket.socket, calls: int) -> None:
    """Answer a LOOKUP with a body bigger than the client's buffer, then take ``calls``
    requests and answer them all with one write, last first."""
    conn, _ = listener.accept()
    with conn:
        h = unpack_header(_recv_exact(conn, HEADER_SIZE))
        _recv_exact(conn, h.payload_len)
        body = _model(2 * _RX_BYTES)
        conn.sendall(Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=7, payload_len=len(body)).pack() + body)
        answers = []
        for _ in range(calls):
            h = unpack_header(_recv_exact(conn, HEADER_SIZE))
            x = np.frombuffer(_recv_exact(conn, h.payload_len), np.float32)
            answers.append(Header(Kind.RESPONSE, req_id=h.req_id, func_id=7, payload_len=x.nbytes).pack()
                           + (x * 2).tobytes())
        conn.sendall(b"".join(reversed(answers)))


def test_answers_sharing_a_recv_and_a_payload_past_the_buffer_reach_their_calls():
    listener = socket.create_server(("127.0.0.1", 0))
    calls = 5
    t = threading.Thread(target=_peer, args=(listener, calls), daemon=True)
    t.start()
    try:
        with Client(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout=30) as c:
            assert len(c.lookup("m").extra["pad"]) == 2 * _RX_BYTES
            xs = [np.full(_OUT, i, np.float32) for i in range(calls)]
            pending = [c.submit("m", x) for x in xs]
            for x, p in zip(xs, pending):
                np.testing.assert_array_equal(p.result().value(), x * 2)
    finally:
        t.join(timeout=30)
        listener.close()
    assert not t.is_alive()


def _doubling_peer(listener: socket.socket, rounds: list[int]) -> None:
    """Answer a LOOKUP, then per round take that many requests before answering them, last
    first, one write each: x * 2, or an INVALID_INPUT error for a call whose x is negative."""
    conn, _ = listener.accept()
    with conn:
        h = unpack_header(_recv_exact(conn, HEADER_SIZE))
        _recv_exact(conn, h.payload_len)
        body = _model()
        conn.sendall(Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=7, payload_len=len(body)).pack() + body)
        for n in rounds:
            held = []
            for _ in range(n):
                h = unpack_header(_recv_exact(conn, HEADER_SIZE))
                held.append((h.req_id, np.frombuffer(_recv_exact(conn, h.payload_len), np.float32)))
            for req_id, x in reversed(held):
                if x[0] < 0:
                    msg = f"x must not be negative, got {x[0]}".encode()
                    conn.sendall(Header(Kind.ERROR, req_id=req_id, status=Status.INVALID_INPUT,
                                        payload_len=len(msg)).pack() + msg)
                else:
                    y = x * 2
                    conn.sendall(Header(Kind.RESPONSE, req_id=req_id, func_id=7, payload_len=y.nbytes).pack()
                                 + y.tobytes())


def _serve(rounds: list[int]) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=_doubling_peer, args=(listener, rounds), daemon=True)
    t.start()
    return listener, t


def test_a_single_caller_reads_its_own_answers_and_an_error_answer_raises_its_typed_error():
    listener, t = _serve([1, 1, 1])
    try:
        with Client(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout=30) as c:
            np.testing.assert_array_equal(c.infer("m", np.full(_OUT, 1, np.float32)), np.full(_OUT, 2, np.float32))
            with pytest.raises(InvalidInput, match="must not be negative") as e:
                c.infer("m", np.full(_OUT, -1, np.float32))
            assert e.value.status == Status.INVALID_INPUT
            y = c.infer("m", np.full(_OUT, 3, np.float32))  # the connection and the client carry on
            np.testing.assert_array_equal(y, np.full(_OUT, 6, np.float32))
    finally:
        t.join(timeout=30)
        listener.close()
    assert not t.is_alive()


def test_callers_on_several_threads_interleaving_on_one_client_each_get_their_own_answer():
    """The peer holds every call until all threads have sent theirs, then answers last first:
    whichever thread reads hands the others their answers (an error among them) and they
    read on after it; a second round mixes a thread's pipelined calls in."""
    threads_n = 6
    listener, t = _serve([threads_n, threads_n + 2])
    got: dict[float, object] = {}
    lock = threading.Lock()

    def call(c: Client, v: float) -> None:
        try:
            out = c.infer("m", np.full(_OUT, v, np.float32))
        except InvalidInput as e:
            out = e
        with lock:
            got[v] = out

    try:
        with Client(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout=30) as c:
            c.lookup("m")
            for round_ in range(2):
                values = [round_ * 100 + k for k in range(threads_n - 1)] + [-(round_ + 1)]
                threads = [threading.Thread(target=call, args=(c, v)) for v in values]
                pipelined = []
                for th in threads:
                    th.start()
                if round_:
                    pipelined = [c.submit("m", np.full(_OUT, 1000 + k, np.float32)) for k in range(2)]
                for th in threads:
                    th.join(timeout=30)
                assert not any(th.is_alive() for th in threads)
                for k, p in enumerate(pipelined):
                    np.testing.assert_array_equal(p.result().value(), np.full(_OUT, 2 * (1000 + k), np.float32))
                for v in values:
                    if v < 0:
                        assert isinstance(got[v], InvalidInput) and "must not be negative" in str(got[v])
                    else:
                        np.testing.assert_array_equal(got[v], np.full(_OUT, 2 * v, np.float32))
    finally:
        t.join(timeout=30)
        listener.close()
    assert not t.is_alive()
