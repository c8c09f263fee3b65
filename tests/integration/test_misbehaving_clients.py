"""Clients that stall, trickle, drop, never read or lie about segments: each throttles or
loses only itself. Real server processes on loopback."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from splitserve import Client, UdpClient
from splitserve.errors import Status
from splitserve.protocol.header import Header, Kind
from tests.framing import DIRECT_TCP, PATHS, client, describe, direct_env, raw, read_frame, stream, udp, udp_describe, udp_read

VEC = 2 * 4096  # bytes of one vecadd1k request (two FP32[1024])
RING = 64  # vecadd1k's ring with --queue-slots 8: twice its max batch of 32
RSS_GROWTH_BOUND = 32 << 20  # stated bound on the server's RSS growth under a non-reading client


def _server(root, timeout_s: float):
    from tests.helpers import start_server

    env = {**direct_env(), "SPLITSERVE_FRAME_TIMEOUT_S": str(timeout_s)}  # the stream tests take both paths
    return start_server(root, "--load", "vecadd1k", "--queue-slots", "8", env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A frame timeout far beyond any test here, so only moving aside can save the ring."""
    s = _server(tmp_path_factory.mktemp("misbehaving"), 600)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
    """A server that gives a partial frame half a second."""
    s = _server(tmp_path_factory.mktemp("impatient"), 0.5)
    yield s
    assert s.stop() == 0


def inputs(seed: int = 0) -> tuple[np.ndarray, np.ndarray, bytes]:
    a, b = np.random.default_rng(seed).standard_normal((2, 1024), dtype=np.float32)
    return a, b, a.tobytes() + b.tobytes()


def request(fid: int, payload: bytes, req_id: int = 1, cls: int = 0) -> bytes:
    return Header(Kind.REQUEST, req_id=req_id, func_id=fid, cls=cls, payload_len=len(payload)).pack() + payload


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("path", PATHS)
def test_slowloris_one_stalled_frame_per_class_does_not_starve_the_model(server, path):
    a, b, payload = inputs()
    (rt_stall, fid), (be_stall, _) = stream(server, path, "vecadd1k"), stream(server, path, "vecadd1k")
    with rt_stall, be_stall, client(server, path) as c:
        for s, cls in ((rt_stall, 0), (be_stall, 1)):  # header and half the payload, then silence
            s.sendall(request(fid, payload, cls=cls)[: 64 + VEC // 2])
        for cls in ("rt", "be"):
            window: list = []
            for i in range(10 * RING + 1):
                window.append(c.submit("vecadd1k", (a, b), cls=cls))
                if len(window) == 16 or i == 10 * RING:
                    for p in window:
                        np.testing.assert_allclose(p.result().value(), a + b, rtol=1e-6)
                    window.clear()
        # the stalled request, moved off its ring meanwhile, still completes correctly
        rt_stall.sendall(payload[VEC // 2 :])
        h, body = read_frame(rt_stall)
        assert (h.kind, h.req_id) == (Kind.RESPONSE, 1), body
        np.testing.assert_allclose(np.frombuffer(body, np.float32), a + b, rtol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_non_reading_client_pipelining_100k_requests_throttles_only_itself(server, path):
    a, b, payload = inputs(1)
    hog, fid = stream(server, path, "vecadd1k")  # the last frame it ever reads (front: its lookup)
    with client(server, path) as other, hog:
        # the process that receives the hog's frames: the front end, or the model's worker
        pid = server.proc.pid if path == "front" else other.lookup("vecadd1k").extra["pids"][0]
        for _ in range(20):
            other.infer("vecadd1k", (a, b))
        base = peak = rss(pid)
        progress = {"frames": 0, "done": False}

        def pipeline() -> None:
            try:
                for start in range(0, 100_000, 16):
                    hog.sendall(b"".join(request(fid, payload, req_id=i) for i in range(start, start + 16)))
                    progress["frames"] = start + 16
            except OSError:
                pass  # the test shut the socket down
            progress["done"] = True

        sender = threading.Thread(target=pipeline, daemon=True)
        sender.start()
        try:
            # Serve another client until the hog is blocked (its frame count stood still
            # over 200 of our calls) or everything it sent was taken.
            served = still = last = 0
            while not progress["done"] and still < 200:
                np.testing.assert_allclose(other.infer("vecadd1k", (a, b)), a + b, rtol=1e-6)
                served += 1
                peak = max(peak, rss(pid))
                still, last = (still + 1, last) if progress["frames"] == last else (0, progress["frames"])
        finally:
            hog.shutdown(socket.SHUT_RDWR)
            sender.join(timeout=60)
        assert progress["frames"] < 100_000, "the server read everything a non-reading client sent"
        assert peak - base < RSS_GROWTH_BOUND, f"server RSS grew by {(peak - base) >> 20} MiB"
        assert served >= 200
        np.testing.assert_allclose(other.infer("vecadd1k", (a, b)), a + b, rtol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_client_dropping_mid_frame_frees_its_slots(server, path):
    a, b, payload = inputs(2)
    s, fid = stream(server, path, "vecadd1k")
    with s:
        s.sendall(request(fid, payload)[: 64 + 100])  # then the peer goes away mid-frame
    with client(server, path) as c:
        for _ in range(RING + 1):  # a slot never freed would pin the ring's tail within a lap
            np.testing.assert_allclose(c.infer("vecadd1k", (a, b)), a + b, rtol=1e-6)


@pytest.mark.parametrize("case", ["overlap", "gap", "total_len"])
def test_udp_segments_that_do_not_tile_the_request_are_refused(server, case):
    a, b, payload = inputs(3)
    half = VEC // 2
    segments = {  # (seq_num, offset, length, total_len)
        "overlap": [(0, 0, half, VEC), (1, 0, half, VEC)],  # both claim offset 0
        "gap": [(0, 0, half, VEC), (1, half + 1024, half - 1024, VEC)],
        "total_len": [(0, 0, half, VEC), (1, half, half, 2 * VEC)],
    }[case]
    with udp(server) as u:
        fid = udp_describe(u, "vecadd1k")["func_id"]
        for seq, off, n, total in segments:
            u.send(Header(Kind.REQUEST, req_id=21, func_id=fid, seq_num=seq, seg_count=2, payload_len=n,
                          payload_offset=off, total_len=total).pack() + payload[off : off + n])
        h, body = udp_read(u)
        assert (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.BAD_SEGMENT, 21), body
    with UdpClient(server.udp) as c:  # its slots were freed: a lap of the ring succeeds
        for _ in range(RING + 1):
            np.testing.assert_allclose(c.infer("vecadd1k", (a, b)), a + b, rtol=1e-6)


def test_lookup_reports_a_model_without_starting_its_workers(server):
    with raw(server) as s, udp(server) as u:
        for info in (describe(s, "matmul8k"), udp_describe(u, "matmul8k"), describe(s, "matmul8k")):
            assert info["state"] == "unloaded" and not any(info["pids"]), info  # no worker started
        with Client(server.tcp) as c:  # the first request starts it
            x = np.eye(64, dtype=np.float32)
            np.testing.assert_allclose(c.infer("matmul8k", (x, x)), x)
        info = describe(s, "matmul8k")
        assert info["state"] == "ready" and all(info["pids"]), info


@pytest.mark.parametrize("case", ["header", "payload", "trickle", "behind_a_frame"])
@pytest.mark.parametrize("path", PATHS)
def test_partial_frame_older_than_the_timeout_closes_its_connection(impatient, path, case):
    _, _, payload = inputs(4)
    s, fid = stream(impatient, path, "vecadd1k")
    with s:
        frame = request(fid, payload, req_id=5)
        if case == "header":
            s.sendall(frame[:20])
        elif case == "payload":
            s.sendall(frame[: 64 + 300])
        elif case == "behind_a_frame":  # a whole frame, then a part of the next one in the same write
            s.sendall(request(fid, payload, req_id=4) + frame[:20])
            h, _ = read_frame(s)
            assert (h.kind, h.req_id) == (Kind.RESPONSE, 4)
        else:  # a byte every 20 ms: the frame would take 2.7 minutes, each byte within the timeout

            def trickle() -> None:
                try:
                    for i in range(len(frame)):
                        s.send(frame[i : i + 1])
                        time.sleep(0.02)
                except OSError:
                    pass  # closed by the server, as it should be

            threading.Thread(target=trickle, daemon=True).start()
        h, body = read_frame(s)
        assert (h.kind, h.status) == (Kind.ERROR, Status.BAD_FRAME) and b"incomplete" in body, (h, body)
        assert read_frame(s)[0] is None  # then closed
    other, _ = stream(impatient, path, "vecadd1k")
    with other:  # other connections are unaffected
        other.sendall(Header(Kind.PING, req_id=9).pack())
        assert read_frame(other)[0].kind == Kind.PONG


@pytest.mark.parametrize("path", [*PATHS, DIRECT_TCP])
def test_a_connection_closed_for_a_bad_frame_reads_why_and_then_the_end_whatever_it_sent_after(server, path):
    """The server closes a connection whose framing is lost, after saying why; bytes the
    client sent behind the bad header (more than one read of the server takes, less than
    it drains) are read and dropped, not left unread: a socket closed with unread bytes is
    reset (RST over TCP, ECONNRESET on a Unix peer), which can cost the client the error
    and always its clean end of stream."""
    s, _ = stream(server, path, "vecadd1k")
    with s:
        s.settimeout(30)
        s.sendall(b"JUNK" + bytes(60) + bytes(40_000))  # a bad magic, then more than a direct stage takes
        h, body = read_frame(s)
        assert (h.kind, h.status) == (Kind.ERROR, Status.BAD_FRAME) and b"magic" in body, (h, body)
        assert read_frame(s)[0] is None  # the end of the stream, not a reset
    other, _ = stream(server, path, "vecadd1k")
    with other:  # the server serves on
        other.sendall(Header(Kind.PING, req_id=9).pack())
        assert read_frame(other)[0].kind == Kind.PONG


def test_udp_request_missing_a_segment_is_refused_after_the_timeout(impatient):
    _, _, payload = inputs(5)
    with udp(impatient) as u:
        fid = udp_describe(u, "vecadd1k")["func_id"]
        u.send(Header(Kind.REQUEST, req_id=31, func_id=fid, seq_num=0, seg_count=2, payload_len=VEC // 2,
                      total_len=VEC).pack() + payload[: VEC // 2])
        h, body = udp_read(u)
        assert (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.BAD_SEGMENT, 31) and b"incomplete" in body


def test_unix_socket_of_a_live_server_is_never_taken_over(tmp_path):
    from splitserve.protocol.sockets import unix_listener

    path = tmp_path / "fast.sock"
    live = unix_listener(path)
    try:
        assert os.stat(path).st_mode & 0o077 == 0  # other local users cannot connect
        with pytest.raises(OSError, match="another server is listening"):
            unix_listener(path)
    finally:
        live.close()
    unix_listener(path).close()  # a stale socket file (its server gone) is replaced


def test_a_direct_connection_past_the_workers_limit_is_told_and_its_calls_take_the_front_end(server_factory):
    """One limit covers a worker's Unix and TCP endpoints: with one connection open on
    either, a connection to the other is refused too."""
    s = server_factory("--load", "vecadd1k", env={**direct_env(), "SPLITSERVE_DIRECT_MAX_CONNECTIONS": "1"})
    a, b, payload = inputs(6)
    first, fid = stream(s, "direct", "vecadd1k")
    with first:
        for path in ("direct", DIRECT_TCP):
            second, _ = stream(s, path, "vecadd1k")
            with second:
                h, body = read_frame(second)
                assert (h.kind, h.status, h.req_id) == (Kind.ERROR, Status.REFUSED, 0), (path, body)
                assert b"at most 1 direct connections" in body
                assert read_frame(second)[0] is None  # then closed
            with client(s, path) as c:  # refused the same way: every call goes through the front end
                for _ in range(8):
                    np.testing.assert_allclose(c.infer("vecadd1k", (a, b)), a + b, rtol=1e-6)
                assert c.direct_endpoints("vecadd1k") == 0
        first.sendall(request(fid, payload, req_id=3))  # the connection within the limit still serves
        h, body = read_frame(first)
        assert (h.kind, h.req_id) == (Kind.RESPONSE, 3)
        np.testing.assert_allclose(np.frombuffer(body, np.float32), a + b, rtol=1e-6)


def _handoff(s: socket.socket, body: bytes, req_id: int) -> None:
    s.sendall(Header(Kind.HANDOFF, req_id=req_id, payload_len=len(body)).pack() + body)


def test_a_handoff_the_front_end_cannot_make_is_answered_why_and_the_connection_serves_on(server):
    """A HANDOFF whose payload is not the JSON it must be, names a model the node does not
    have or an endpoint none of the model's workers serves, or comes while the connection has
    a call in flight, is each answered with an ERROR naming the problem; the connection stays
    the front end's and serves the call and the lookup after them. A good one, next, hands it
    to the worker, which acknowledges with its own HANDOFF and answers the call after it."""
    import json

    s = raw(server)
    try:
        info = describe(s, "vecadd1k")
        a, b, payload = inputs(3)
        port = int(info["direct_tcp"][0].rsplit(":", 1)[1])
        bad = [
            (b"not json", Status.BAD_FRAME, "JSON"),
            (json.dumps({"model": "vecadd1k", "endpoint": "http://x"}).encode(), Status.BAD_FRAME, "tcp://host:port"),
            (json.dumps({"model": "nope", "endpoint": f"tcp://127.0.0.1:{port}"}).encode(), Status.UNKNOWN_MODEL,
             "nope"),
            (json.dumps({"model": "vecadd1k", "endpoint": "tcp://127.0.0.1:1"}).encode(), Status.REFUSED,
             "no direct endpoint"),
        ]
        for i, (body, status, words) in enumerate(bad, start=10):
            _handoff(s, body, i)
            h, msg = read_frame(s)
            assert h is not None and (h.kind, h.req_id, h.status) == (Kind.ERROR, i, status), msg
            assert words in msg.decode(), msg
        # a call in flight: its answer comes, and the HANDOFF sent behind it is refused
        good = json.dumps({"model": "vecadd1k", "endpoint": f"tcp://127.0.0.1:{port}"}).encode()
        s.sendall(request(info["func_id"], payload, req_id=20)
                  + Header(Kind.HANDOFF, req_id=21, payload_len=len(good)).pack() + good)
        frames = {h.req_id: (h, msg) for h, msg in (read_frame(s), read_frame(s))}
        assert frames[20][0].kind == Kind.RESPONSE
        np.testing.assert_array_equal(np.frombuffer(frames[20][1], np.float32), a + b)
        assert (frames[21][0].kind, frames[21][0].status) == (Kind.ERROR, Status.BAD_FRAME), frames[21][1]
        assert describe(s, "vecadd1k")["func_id"] == info["func_id"]  # still the front end's
        _handoff(s, good, 30)
        h, msg = read_frame(s)
        assert h is not None and (h.kind, h.req_id, h.payload_len) == (Kind.HANDOFF, 30, 0), msg
        s.sendall(request(info["func_id"], payload, req_id=31))
        h, msg = read_frame(s)
        assert h is not None and (h.kind, h.req_id) == (Kind.RESPONSE, 31)
        np.testing.assert_array_equal(np.frombuffer(msg, np.float32), a + b)
        s.sendall(Header(Kind.LOOKUP, req_id=32, payload_len=8).pack() + b"vecadd1k")
        h, msg = read_frame(s)  # the worker's now: it takes no LOOKUP
        assert h is not None and (h.kind, h.status) == (Kind.ERROR, Status.BAD_FRAME), msg
    finally:
        s.close()
