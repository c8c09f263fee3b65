"""The sync fast-path client's buffered reader against a scripted peer on loopback: answers
that share one recv, answers out of order, and a payload bigger than the client's receive
buffer (read past it), all land with the right call."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np

from splitserve.client.fastpath import _RX_BYTES, Client
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


def _peer(listener: socket.socket, calls: int) -> None:
    """Answer a LOOKUP with a body bigger than the client's buffer, then take ``calls``
    requests and answer them all with one write, last first."""
    conn, _ = listener.accept()
    with conn:
        h = unpack_header(_recv_exact(conn, HEADER_SIZE))
        _recv_exact(conn, h.payload_len)
        body = json.dumps({"name": "m", "func_id": 7, "max_batch_size": 4,
                           "inputs": [{"name": "x", "datatype": "FP32", "shape": [_OUT]}],
                           "outputs": [{"name": "y", "datatype": "FP32", "shape": [_OUT]}],
                           "pad": "p" * (2 * _RX_BYTES)}).encode()
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
