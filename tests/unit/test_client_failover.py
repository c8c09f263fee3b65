"""The order a client tries its front ends in (``FrontChoice``), and a sync client that
fails over between two real listeners on loopback when the one it uses goes away."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from splitserve.client.aio import AsyncClient
from splitserve.client.common import Endpoint
from splitserve.client.failover import FrontChoice, front_endpoints
from splitserve.client.stream import Client
from splitserve.errors import InvalidInput
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header


def test_urls_come_as_one_a_comma_separated_string_or_a_list() -> None:
    assert front_endpoints("tcp://a:1") == [Endpoint("tcp", "a", 1)]
    assert front_endpoints("tcp://a:1, tcp://b:2") == [Endpoint("tcp", "a", 1), Endpoint("tcp", "b", 2)]
    assert front_endpoints(["tcp://a:1", "unix:///s"]) == [Endpoint("tcp", "a", 1), Endpoint("unix", path="/s")]
    with pytest.raises(InvalidInput):
        front_endpoints(" , ")


def test_a_first_connection_starts_at_the_first_and_a_failover_at_the_next() -> None:
    c = FrontChoice(3, retry_s=1.0)
    assert c.order(0.0, fresh=True) == [0, 1, 2]
    c.connected(1)
    assert c.order(0.0) == [2, 0, 1]


def test_a_front_end_that_failed_lately_is_tried_last_and_again_after_the_retry_interval() -> None:
    c = FrontChoice(3, retry_s=1.0)
    c.failed(1, now=10.0)
    assert c.order(10.5) == [2, 0, 1]  # from 1 after 0: 1 just failed, so it goes last
    c.failed(2, now=10.5)
    assert c.order(10.6) == [0, 1, 2]  # both failed lately: still tried, after the rest, in their turn
    assert c.order(11.2) == [1, 0, 2]  # 1's failure is past the interval; 2's not yet: last
    c.connected(2)
    assert c.order(11.2) == [0, 1, 2]


_MODEL = json.dumps({"name": "m", "func_id": 7, "max_batch_size": 4,
                     "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
                     "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}).encode()


class _Peer:
    """A front end on loopback that answers PINGs and LOOKUPs until ``stop``, which closes
    every connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.pings = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = conn.recv(HEADER_SIZE, socket.MSG_WAITALL)
                if len(head) < HEADER_SIZE:
                    return
                h = unpack_header(head)
                conn.recv(h.payload_len, socket.MSG_WAITALL) if h.payload_len else b""
                self.pings += 1
                if h.kind == Kind.LOOKUP:
                    conn.sendall(Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=7, payload_len=len(_MODEL)).pack()
                                 + _MODEL)
                else:
                    conn.sendall(Header(Kind.PING, req_id=h.req_id).pack())
        except OSError:
            return

    def stop(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.mark.parametrize("compiled", [None, False])
def test_a_client_moves_to_the_next_front_end_when_its_own_goes_away(compiled: bool | None) -> None:
    first, second = _Peer(), _Peer()
    dead = socket.create_server(("127.0.0.1", 0))
    refused = f"tcp://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there: the client skips it
    with Client([refused, first.url, second.url], timeout=5.0, compiled=compiled) as c:
        c.ping()
        assert (first.pings, second.pings) == (1, 0)
        first.stop()
        with pytest.raises(ConnectionError):
            c.ping()  # the call in flight when its front end went: a clean connection error
        c.ping()
        assert c.endpoint == Endpoint.parse(second.url) and second.pings == 1
    second.stop()


def test_a_client_none_of_whose_front_ends_take_the_connection_says_so() -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    url = f"tcp://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    with pytest.raises(ConnectionError, match="no front end took the connection"):
        Client([url, url], timeout=1.0)


def test_an_async_client_moves_to_the_next_front_end_when_its_own_goes_away() -> None:
    first, second = _Peer(), _Peer()

    async def run() -> None:
        async with AsyncClient(f"{first.url},{second.url}", timeout=5.0) as c:
            assert (await c.lookup("m")).func_id == 7 and first.pings == 1
            first.stop()
            await c._front.closed  # its connection_lost has run
            assert (await c.lookup("m")).func_id == 7  # looked up again, at the next front end
            assert c.endpoint == Endpoint.parse(second.url) and second.pings == 1

    asyncio.run(run())
    second.stop()
