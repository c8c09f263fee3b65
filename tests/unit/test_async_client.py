"""``AsyncClient`` (splitserve/client/aio.py) against in-memory connections: answers in
any split over reads, timeouts on a fake clock, direct connections that close, back-pressure.

The client opens its connections through ``_open_async``; here that gives each one a fake
transport that keeps what the client writes, and the test plays the server by handing
bytes to the connection's ``get_buffer``/``buffer_updated`` as an event loop does after a
``recv_into``. The loop's clock is the test's: nothing here waits on real time.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from splitserve.client import aio
from splitserve.client.aio import AsyncClient
from splitserve.client.common import Endpoint
from splitserve.client.frames import _RX_BYTES
from splitserve.errors import QueueFull, Status
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header

SMALL = {"name": "small", "func_id": 1, "max_batch_size": 8,
         "inputs": [{"name": "x", "datatype": "INT64", "shape": [1]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}]}
BIG = {**SMALL, "name": "big", "func_id": 2, "outputs": [{"name": "y", "datatype": "FP32", "shape": [20000]}]}
assert 20000 * 4 > _RX_BYTES  # an answer that cannot fit the receive buffer


class FakeClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test moves it."""

    now = 0.0

    def time(self) -> float:
        return self.now


class FakeTransport(asyncio.Transport):
    """Keeps what the client writes; closing it reports the loss on the loop's next turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: asyncio.BufferedProtocol) -> None:
        super().__init__()
        self.loop, self.conn = loop, conn
        self.sent = bytearray()
        self.closing = False

    def write(self, data) -> None:
        self.sent += data

    def writelines(self, parts) -> None:
        # asyncio's own transports (3.12 on) size what they keep with len(): every part must be flat bytes
        for p in parts:
            assert len(memoryview(p)) == memoryview(p).nbytes, "a part whose len() is not its size in bytes"
            self.write(p)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self.conn.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def frames(self) -> list[tuple[Header, bytes]]:
        """The frames written since the last call, taken."""
        out, buf, at = [], bytes(self.sent), 0
        while at < len(buf):
            h = unpack_header(buf, at)
            out.append((h, buf[at + HEADER_SIZE : at + HEADER_SIZE + h.payload_len]))
            at += HEADER_SIZE + h.payload_len
        self.sent.clear()
        return out

    def answer(self, data: bytes, chunk: int | None = None) -> None:
        """``data`` from the server, in reads of at most ``chunk`` bytes (None: as big as the client offers)."""
        at = 0
        while at < len(data):
            buf = self.conn.get_buffer(-1)
            n = min(len(buf), len(data) - at, chunk or len(data))
            buf[:n] = data[at : at + n]
            self.conn.buffer_updated(n)
            at += n


class FakeNet:
    """Where the client's connections go: the fake transport of each endpoint, by URL."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.at: dict[str, FakeTransport] = {}

    async def open(self, ep: Endpoint, protocol):
        conn = protocol()
        t = FakeTransport(self.loop, conn)
        conn.connection_made(t)
        self.at[f"unix://{ep.path}" if ep.scheme == "unix" else f"tcp://{ep.host}:{ep.port}"] = t
        return conn


FRONT = "unix:///front.sock"
DIRECT = "unix:///worker-0.sock"


def frame(kind: Kind, req_id: int, payload: bytes = b"", status: int = 0) -> bytes:
    return Header(kind, req_id=req_id, status=status, payload_len=len(payload)).pack() + payload


def answer_of(h: Header, n: int) -> bytes:
    """The answer to request ``h``: ``n`` FP32 values, all its input's value."""
    return frame(Kind.RESPONSE, h.req_id, np.full(n, float(h.req_id % 1000), np.float32).tobytes())


def run(scenario, monkeypatch) -> None:
    loop = FakeClockLoop()
    net = FakeNet(loop)
    monkeypatch.setattr(aio, "_open_async", net.open)
    try:
        loop.run_until_complete(scenario(loop, net))
    finally:
        loop.close()


async def looked_up(c: AsyncClient, net: FakeNet, info: dict) -> None:
    """``c`` looks ``info``'s model up; the front end answers."""
    task = asyncio.ensure_future(c.lookup(info["name"]))
    await asyncio.sleep(0)
    ((h, body),) = net.at[FRONT].frames()
    assert (h.kind, body) == (Kind.LOOKUP, info["name"].encode())
    net.at[FRONT].answer(frame(Kind.LOOKUP_REPLY, h.req_id, json.dumps(info).encode()))
    await task


async def sent(c: AsyncClient, model: str, n: int) -> list[asyncio.Task]:
    tasks = [asyncio.ensure_future(c.infer(model, np.array([i], np.int64))) for i in range(n)]
    await asyncio.sleep(0)  # each runs up to waiting for its answer
    return tasks


@pytest.mark.parametrize("chunk", [None, 1, 63, 64, 65, 4099, _RX_BYTES + 1])
def test_answers_split_over_reads_or_many_in_one_read_each_reach_their_own_call(monkeypatch, chunk):
    """Four answers in one stream, out of order, one of them bigger than the receive buffer,
    delivered in reads of ``chunk`` bytes (None: as much as the buffer takes)."""

    async def scenario(loop, net):
        async with AsyncClient(FRONT) as c:
            await looked_up(c, net, SMALL)
            await looked_up(c, net, BIG)
            small, big = await sent(c, "small", 3), await sent(c, "big", 1)
            reqs = [h for h, _ in net.at[FRONT].frames()]
            sizes = [4, 4, 4, 20000]
            net.at[FRONT].answer(b"".join(answer_of(reqs[i], sizes[i]) for i in (3, 1, 0, 2)), chunk)
            for task, h, n in zip([*small, *big], reqs, sizes):
                y = await task
                assert y.shape == (n,) and (y == h.req_id % 1000).all()
            assert not c._front.pending

    run(scenario, monkeypatch)


def test_a_timed_out_call_ends_once_and_its_late_answer_is_dropped(monkeypatch):
    async def scenario(loop, net):
        async with AsyncClient(FRONT, timeout=5.0) as c:
            await looked_up(c, net, SMALL)
            (late,) = await sent(c, "small", 1)
            loop.now = 3.0
            (prompt,) = await sent(c, "small", 1)  # its deadline is 8
            (h_late, _), (h_prompt, _) = net.at[FRONT].frames()
            loop.now = 5.0
            with pytest.raises(TimeoutError, match="within 5 s"):
                await late
            assert not prompt.done() and list(c._front.pending) == [h_prompt.req_id]  # the timed-out call is gone
            net.at[FRONT].answer(answer_of(h_late, 4) + answer_of(h_prompt, 4))  # the late answer, then the other
            assert (await prompt).tolist() == [h_prompt.req_id % 1000] * 4
            assert not c._front.pending
            loop.now = 20.0  # the sweep armed for 8 runs now, and must not end a call sent since
            (fresh,) = await sent(c, "small", 1)
            await asyncio.sleep(0)
            assert not fresh.done() and c._front.sweep.when() == 25.0
            ((h_fresh, _),) = net.at[FRONT].frames()
            net.at[FRONT].answer(answer_of(h_fresh, 4))
            assert (await fresh).tolist() == [h_fresh.req_id % 1000] * 4

    run(scenario, monkeypatch)


def test_a_closed_direct_connection_resends_its_unanswered_calls_through_the_front_end_once(monkeypatch):
    """Calls on a direct connection that closes go to the front end once each (an answered
    one is not sent again); a DUPLICATE_REQUEST refusal there is not an answer; the model is
    looked up again before the next call."""

    async def scenario(loop, net):
        async with AsyncClient(FRONT, direct=True) as c:
            await looked_up(c, net, {**SMALL, "instances": 1, "direct": [DIRECT]})
            assert c.direct_endpoints("small") == 1
            tasks = await sent(c, "small", 3)
            assert net.at[FRONT].frames() == []
            reqs = [h for h, _ in net.at[DIRECT].frames()]
            net.at[DIRECT].answer(answer_of(reqs[1], 4))
            net.at[DIRECT].close()  # its worker went away
            await asyncio.sleep(0)
            resent = net.at[FRONT].frames()
            assert [h.req_id for h, _ in resent] == [reqs[0].req_id, reqs[2].req_id]
            assert c.direct_endpoints("small") == 0 and c._routes["small"].stale
            net.at[FRONT].answer(frame(Kind.ERROR, reqs[0].req_id, b"in flight", Status.DUPLICATE_REQUEST))
            net.at[FRONT].answer(answer_of(reqs[2], 4) + answer_of(reqs[0], 4))
            for task, h in zip(tasks, reqs):
                assert (await task).tolist() == [h.req_id % 1000] * 4
            assert net.at[FRONT].frames() == [] and not c._front.pending
            nxt = asyncio.ensure_future(c.infer("small", np.zeros(1, np.int64)))
            await asyncio.sleep(0)
            ((h, body),) = net.at[FRONT].frames()
            assert (h.kind, body) == (Kind.LOOKUP, b"small")  # stale: looked up first
            nxt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await nxt

    run(scenario, monkeypatch)


def test_an_error_answer_and_a_bad_frame_end_only_their_calls_naming_the_problem(monkeypatch):
    async def scenario(loop, net):
        async with AsyncClient(FRONT) as c:
            await looked_up(c, net, SMALL)
            refused, broken = await sent(c, "small", 2)
            (h1, _), (h2, _) = net.at[FRONT].frames()
            net.at[FRONT].answer(frame(Kind.ERROR, h1.req_id, b"queue full", Status.QUEUE_FULL))
            with pytest.raises(QueueFull, match="queue full"):
                await refused
            net.at[FRONT].answer(b"XXXX" + bytes(HEADER_SIZE - 4))
            with pytest.raises(ConnectionError, match="bad magic"):  # framing lost: the connection is dropped
                await broken

    run(scenario, monkeypatch)


def test_a_paused_connection_holds_new_calls_until_it_drains_and_close_ends_calls_in_flight(monkeypatch):
    async def scenario(loop, net):
        c = await AsyncClient(FRONT).connect()
        await looked_up(c, net, SMALL)
        c._front.pause_writing()  # the transport's buffer is over its high-water mark
        (held,) = await sent(c, "small", 1)
        assert net.at[FRONT].frames() == []
        c._front.resume_writing()
        await asyncio.sleep(0)
        assert len(net.at[FRONT].frames()) == 1
        await c.close()
        with pytest.raises(ConnectionError, match="the client is closed"):
            await held

    run(scenario, monkeypatch)
