"""The asyncio fast-path client over TCP and Unix streams (``AsyncClient``): many calls in
flight, answers parsed in the transport's read callback."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from splitserve.client.common import Endpoint, InferResult, ModelInfo, encode_inputs
from splitserve.client.failover import FrontChoice, front_endpoints
from splitserve.client.frames import (
    _DUPLICATE,
    _ERROR,
    _RX_BYTES,
    _check,
    _request_fields,
    _request_header,
    _result,
    _with_func_id,
)
from splitserve.client.handoff import hand_over_async
from splitserve.client.route import _direct_targets, _lookup_interval, _Route, direct_mode, handed_over_only
from splitserve.errors import InvalidInput, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header


# req_id -> the call's future, how to decode its answer, its frame while it is on a direct
# connection (re-sent through the front end if that closes), and when it times out (loop time)
_AsyncEntry = tuple[asyncio.Future, Callable[[Header, bytearray], Any], "list | None", float]


class _AsyncConn(asyncio.BufferedProtocol):
    """One connection of an ``AsyncClient`` (the front end's, or a worker's direct endpoint)
    and the calls awaiting their answer on it.

    Answers are parsed in the transport's read callback, out of one receive buffer reused
    for the connection's life, and their futures resolved there: no reader task and no
    ``StreamReader`` between the socket and the caller, so an answer costs one wake-up of
    its caller. A payload that has not arrived whole with its header is received straight
    into a buffer of its own (the decoded arrays keep it)."""

    def __init__(self, client: "AsyncClient", model: str | None = None, url: str = "") -> None:
        self.client = client
        self.model = model  # a direct connection's model (None: the front end's)
        self.func_id: int | None = None  # a cluster node's worker: that node's func id (None: the model's)
        self.best_effort = False  # a direct connection to an instance kept for best-effort calls (``_Route.pick``)
        self.url = url  # a direct connection's endpoint
        self.pending: dict[int, _AsyncEntry] = {}
        self.transport: asyncio.Transport | None = None
        self.lost = False  # closed by the client, or its loss handled: its calls are not moved again
        self.dead = False  # the transport is gone: nothing more is sent on it
        self.paused = False  # the transport's write buffer is over its high-water mark
        # One timer per connection, not one per call: it fires at the earliest deadline of the
        # calls waiting here (an answered call leaves it armed; it re-arms when it fires).
        self.sweep: asyncio.TimerHandle | None = None
        self.sweep_at = math.inf
        self.closed: asyncio.Future = client._loop.create_future()
        self._resumed: list[asyncio.Future] = []  # callers waiting for the write buffer to drain
        self._error: BaseException | None = None  # why the client dropped the connection (a bad frame)
        self._rx = bytearray(_RX_BYTES)
        self._rx_mv = memoryview(self._rx)
        self._rx_end = 0  # rx[:rx_end] is an answer's header not yet whole (always < HEADER_SIZE bytes)
        self._body: bytearray | None = None  # the payload being received past the buffer, its header, bytes in
        self._body_mv = memoryview(b"")
        self._body_h: Header | None = None
        self._body_got = 0

    # -- asyncio.BufferedProtocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body_mv[self._body_got :]
        return self._rx_mv[self._rx_end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._body_got += nbytes
            if self._body_got == len(self._body):
                body, h, self._body, self._body_mv = self._body, self._body_h, None, memoryview(b"")
                self._answer(h, body)  # type: ignore[arg-type]
            return
        rx = self._rx
        end = self._rx_end + nbytes
        start = 0
        try:
            while end - start >= HEADER_SIZE:
                h = unpack_header(rx, start)
                begin = start + HEADER_SIZE
                stop = begin + h.payload_len
                if stop > end:  # the rest of the payload is still coming
                    self._body = body = bytearray(h.payload_len)
                    body[: end - begin] = self._rx_mv[begin:end]
                    self._body_mv, self._body_h, self._body_got = memoryview(body), h, end - begin
                    start = end
                    break
                self._answer(h, rx[begin:stop])
                start = stop
        except SplitServeError as e:  # framing lost: nothing after it can be trusted
            self._error, self._rx_end = e, 0
            if self.transport is not None:
                self.transport.abort()
            return
        if start < end:
            rx[: end - start] = rx[start:end]
        self._rx_end = end - start

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        self.paused = False
        for w in self._resumed:
            if not w.done():
                w.set_result(None)  # the caller finds the connection dead and goes elsewhere or fails
        self._resumed = []
        self.client._connection_lost(self, self._error or exc)
        if self.sweep is not None:  # no call waits here any more
            self.sweep.cancel()
            self.sweep, self.sweep_at = None, math.inf
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for w in self._resumed:
            if not w.done():
                w.set_result(None)
        self._resumed = []

    # -- the client's side --------------------------------------------------------------

    def _answer(self, h: Header, payload: bytearray) -> None:
        if h.kind == _ERROR and h.status == _DUPLICATE:
            return  # the server refused a duplicate of a call in flight: its own answer comes later
        entry = self.pending.pop(h.req_id, None)
        if entry is None:
            return  # a call that timed out: its late answer is dropped
        fut, decode = entry[0], entry[1]
        if fut.done():  # its caller cancelled it
            return
        try:
            fut.set_result(decode(h, payload))
        except Exception as e:
            fut.set_exception(e)

    def fail_all(self, err: BaseException) -> None:
        """Every call still waiting here ends with ``err``."""
        calls, self.pending = self.pending, {}
        for fut, _, _, _ in calls.values():
            if not fut.done():
                fut.set_exception(err)

    async def writable(self, timeout: float | None) -> None:
        """Until the write buffer drained below its low-water mark (or the connection died),
        at most ``timeout`` seconds (None: no limit)."""
        loop = self.client._loop
        waiter = loop.create_future()  # type: ignore[union-attr]
        self._resumed.append(waiter)
        timer = None if timeout is None else loop.call_later(  # type: ignore[union-attr]
            timeout, _time_out, waiter, f"the connection took no data for {timeout:g} s")
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            if waiter in self._resumed:  # timed out or cancelled: a peer that never reads must not grow the list
                self._resumed.remove(waiter)


def _time_out(fut: asyncio.Future, message: str) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(message))


async def _open_async(ep: Endpoint, protocol: Callable[[], _AsyncConn],
                      handoff: tuple[int, str, str] | None = None) -> _AsyncConn:
    """A connection to ``ep`` served by ``protocol()``; TCP ones have TCP_NODELAY (asyncio
    sets it). With ``handoff`` (req_id, model, a worker's endpoint URL) ``ep`` is the front
    end, which hands the connection to that worker (``protocol/handoff.py``) before
    ``protocol()`` serves it; raises what the front end or the worker answered instead."""
    loop = asyncio.get_running_loop()
    if ep.scheme not in ("tcp", "unix"):
        raise InvalidInput("AsyncClient speaks tcp:// and unix://")
    if handoff is None:
        if ep.scheme == "tcp":
            _, conn = await loop.create_connection(protocol, ep.host, ep.port)
        else:
            _, conn = await loop.create_unix_connection(protocol, ep.path)
        return conn
    if ep.scheme == "tcp":
        infos = await loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        where: Any = infos[0][4]
    else:
        sock, where = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), ep.path
    try:
        await hand_over_async(sock, where, *handoff)
        if ep.scheme == "tcp":
            _, conn = await loop.create_connection(protocol, sock=sock)
        else:
            _, conn = await loop.create_unix_connection(protocol, sock=sock)
        return conn
    except BaseException:
        sock.close()
        raise


class AsyncClient:
    """asyncio fast-path client for ``tcp://`` and ``unix://``: many calls in flight.

    It follows the workers' direct endpoints where the server offers them, as ``Client``
    does (one connection per instance, calls in turn; a worker whose own port cannot be
    reached is reached through a connection the front end hands over to it, and
    ``direct="via-front"`` reaches every worker so; a closed one's calls go through the
    front end and the model is looked up again); ``direct=False`` sends every call through
    the front end. Every call ends exactly once:
    with its result, its error, ``TimeoutError`` after ``timeout`` seconds (a later answer
    is dropped), or ``ConnectionError`` when its connection (the front end's) is lost or
    the client closed.

    ``url`` may name several front ends (a list, or URLs separated by commas: a cluster's
    gateways), used one at a time as ``Client`` uses them: the calls on a lost one end with
    ``ConnectionError`` and the next call connects to the next front end that takes it.

    ``async with AsyncClient(url) as c`` connects at once; without it, the first call
    connects (a refused connection is that call's ``ConnectionError``)."""

    def __init__(self, url: "str | Sequence[str]", timeout: float | None = 60.0, *, direct: "bool | str" = True,
                 direct_retry_s: float = 1.0, direct_connect_s: float = 2.0) -> None:
        self.endpoints = front_endpoints(url)
        self.endpoint = self.endpoints[0]  # the front end in use
        self._fronts = FrontChoice(len(self.endpoints), direct_retry_s)
        self._front_lock: asyncio.Lock | None = None  # one task connects to the next front end
        self.timeout = timeout  # seconds a call may wait for its answer (None: no limit)
        self.direct, self._via_front = direct_mode(direct)
        self.direct_retry_s = direct_retry_s
        self.direct_connect_s = direct_connect_s
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        self._routes: dict[str, _Route] = {}
        self._front: _AsyncConn | None = None
        self._direct_streams: list[_AsyncConn] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting = asyncio.Lock()  # the first calls of a client not yet connected connect once
        self._closed = False

    async def connect(self) -> "AsyncClient":
        """Connect to the first front end that takes the connection (``async with`` does)."""
        self._loop = asyncio.get_running_loop()
        self._front_lock = asyncio.Lock()
        self._closed = False
        front = await self._open_front(fresh=True)
        if self._closed:  # closed while it connected
            front.lost = True
            if front.transport is not None:
                front.transport.abort()
            raise ConnectionError("the client is closed")
        self._front = front
        return self

    async def _open_front(self, fresh: bool = False) -> _AsyncConn:
        """A connection to the first front end, in ``FrontChoice``'s order, that takes one."""
        errors = []
        for i in self._fronts.order(time.monotonic(), fresh=fresh):
            try:
                conn = await asyncio.wait_for(_open_async(self.endpoints[i], lambda: _AsyncConn(self)),
                                              self.direct_connect_s if len(self.endpoints) > 1 else None)
            except (OSError, TimeoutError) as e:
                self._fronts.failed(i, time.monotonic())
                errors.append(f"{self.endpoints[i]}: {e or type(e).__name__}")
                continue
            self._fronts.connected(i)
            self.endpoint = self.endpoints[i]
            return conn
        raise ConnectionError(f"no front end took the connection: {'; '.join(errors)}")

    async def _live_front(self) -> _AsyncConn:
        """The front end's connection, made again to the next front end if it was lost."""
        front = self._front
        if front is None:
            if self._closed:
                raise ConnectionError("the client is closed")
            async with self._connecting:
                if self._front is None:
                    await self.connect()
            return await self._live_front()
        if not front.dead:
            return front
        async with self._front_lock:  # type: ignore[union-attr]
            if self._front is None:
                raise ConnectionError("the client is closed")
            if self._front.dead:
                self._front = await self._open_front()
        return self._front

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection; calls still waiting end with ``ConnectionError``."""
        conns = [self._front, *self._direct_streams] if self._front is not None else list(self._direct_streams)
        self._front, self._direct_streams, self._closed = None, [], True
        for conn in conns:
            conn.lost = True
            if conn.transport is not None:
                conn.transport.abort()  # a client's unsent requests are its own calls, which fail now
        for conn in conns:
            await conn.closed  # connection_lost comes on the loop's next turn

    # -- calls --------------------------------------------------------------------------

    def _send(self, conn: _AsyncConn, req_id: int, parts: list, decode: Callable[[Header, bytearray], Any]
              ) -> asyncio.Future:
        """Send a call's frame on ``conn`` (a dead direct one: the front end) and return the
        future of its outcome."""
        if conn.dead:
            front = self._front
            if conn.model is None or front is None or front.dead:
                raise ConnectionError("the client is closed" if front is None else "connection lost")
            conn = front
        loop = self._loop
        fut = loop.create_future()  # type: ignore[union-attr]
        deadline = loop.time() + self.timeout if self.timeout is not None else math.inf  # type: ignore[union-attr]
        conn.pending[req_id] = (fut, decode, parts if conn.model is not None else None, deadline)
        if deadline < conn.sweep_at:
            self._arm(conn, deadline)
        conn.transport.writelines(parts)  # type: ignore[union-attr]
        return fut

    def _arm(self, conn: _AsyncConn, at: float) -> None:
        """``conn``'s timeout sweep runs at loop time ``at`` (and not before)."""
        if conn.sweep is not None:
            conn.sweep.cancel()
        conn.sweep_at = at
        conn.sweep = self._loop.call_at(at, self._sweep, conn)  # type: ignore[union-attr]

    def _sweep(self, conn: _AsyncConn) -> None:
        """The calls on ``conn`` past their deadline end with ``TimeoutError`` (their late
        answers are dropped); the sweep re-arms for the earliest deadline left."""
        cutoff = max(self._loop.time(), conn.sweep_at)  # type: ignore[union-attr]
        conn.sweep, conn.sweep_at = None, math.inf
        pending = conn.pending
        for req_id in [r for r, e in pending.items() if e[3] <= cutoff]:
            fut = pending.pop(req_id)[0]
            if not fut.done():
                fut.set_exception(TimeoutError(f"no answer to call {req_id} within {self.timeout:g} s"))
        at = min((e[3] for e in pending.values()), default=math.inf)
        if at < math.inf:
            self._arm(conn, at)

    def _connection_lost(self, conn: _AsyncConn, exc: BaseException | None) -> None:
        if conn.model is not None and not conn.lost:
            self._lost(conn)
            return
        if conn is self._front and not conn.lost:  # the front end went: the next call goes to the next one
            self._fronts.failed(self.endpoints.index(self.endpoint), time.monotonic())
            for route in self._routes.values():  # looked up again there
                route.stale = True
        if conn.pending:
            conn.fail_all(ConnectionError("the client is closed" if conn.lost and exc is None
                                          else f"connection lost: {exc or 'closed by the server'}"))

    def _lost(self, conn: _AsyncConn) -> None:
        """A direct connection closed: its unanswered calls go through the front end, and
        the model is looked up again before its next call."""
        conn.lost = True
        if conn.transport is not None:
            conn.transport.abort()
        # a client that outlives many restarts keeps only the open ones
        self._direct_streams = [c for c in self._direct_streams if c is not conn]
        route = self._routes.get(conn.model or "")
        if route is not None and conn in route.streams:
            route.set_streams([c for c in route.streams if c is not conn])
            route.stale = True
        front = self._front
        if front is None or front.dead:
            conn.fail_all(ConnectionError("the client is closed" if front is None else "connection lost"))
            return
        calls, conn.pending = conn.pending, {}
        for req_id, (fut, decode, parts, deadline) in calls.items():
            if fut.done() or parts is None:
                continue
            if conn.func_id is not None and route is not None:  # the node's func id: the cluster's instead
                parts = _with_func_id(parts, route.info.func_id)
            front.pending[req_id] = (fut, decode, None, deadline)  # its deadline still counts from its first send
            if deadline < front.sweep_at:
                self._arm(front, deadline)
            front.transport.writelines(parts)  # type: ignore[union-attr]

    def _fresh(self, model: str) -> _Route | None:
        """``model``'s route when no lookup is due (``_Route.lookup_due``)."""
        route = self._routes.get(model)
        if route is not None and not route.stale and not (self.direct and route.lookup_due(time.monotonic())):
            return route
        return None

    async def _look_up(self, model: str) -> _Route:
        front = await self._live_front()
        if front.paused:
            await front.writable(self.timeout)
        body = model.encode()
        req_id = next(self._ids)
        info = await self._send(front, req_id, [Header(Kind.LOOKUP, req_id=req_id, payload_len=len(body)).pack(), body],
                                lambda h, p: _check(h, p, ModelInfo.from_json))
        route = self._routes.get(model)
        streams = []
        if self.direct:
            live = {(c.url, c.func_id): c for c in route.streams} if route is not None else {}
            for url, func_id, best_effort in _direct_targets(self.endpoint, info):
                conn = live.pop((url, func_id), None)
                if conn is None:
                    try:
                        # a cluster node's worker is reached at its own port only: the gateway hands nothing over
                        conn = await self._open_direct(url, model, handoff=func_id == info.func_id)
                    except (OSError, SplitServeError, TimeoutError):
                        continue  # gone since the lookup: the others, or the front end, serve
                    if func_id != info.func_id:  # a cluster node's worker: its calls carry that node's id
                        conn.func_id = func_id
                    self._direct_streams.append(conn)
                conn.best_effort = best_effort
                streams.append(conn)
        due_at = time.monotonic() + _lookup_interval(len(streams), info, self.direct_retry_s)
        route = self._routes[model] = _Route(info, streams, due_at)
        return route

    async def _open_direct(self, url: str, model: str, handoff: bool) -> _AsyncConn:
        """A connection to ``model``'s worker at ``url``, or handed over to it by the front
        end where that cannot be reached, as ``Client._open_direct`` has it."""
        def serve() -> _AsyncConn:
            return _AsyncConn(self, model, url)

        if not (handoff and (self._via_front or handed_over_only(self.endpoint, url))):
            try:
                return await asyncio.wait_for(_open_async(Endpoint.parse(url), serve), self.direct_connect_s)
            except (OSError, TimeoutError):
                if not handoff:
                    raise
        conn = await asyncio.wait_for(_open_async(self.endpoint, serve, (next(self._ids), model, url)),
                                      self.direct_connect_s)
        self._via_front = True  # as ``Client``'s: the workers' ports are not tried again
        return conn

    async def lookup(self, model: str) -> ModelInfo:
        """Resolve a model name to its func_id, shapes and datatypes (cached)."""
        return (self._fresh(model) or await self._look_up(model)).info

    def direct_endpoints(self, model: str) -> int:
        """Direct connections the client holds for ``model`` now (0: its calls go through the front end)."""
        route = self._routes.get(model)
        return len(route.streams) if route is not None else 0

    async def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                           slo_ms: float | None = None) -> InferResult:
        route = self._fresh(model) or await self._look_up(model)
        info = route.info
        arrays, count, batched = encode_inputs(info, x)
        req_id = next(self._ids)
        conn = route.pick(_request_fields(cls, deadline_ms, slo_ms)[0]) or await self._live_front()
        hdr = _request_header(info, req_id, arrays, cls, deadline_ms, slo_ms, conn.func_id)
        if conn.paused:  # bounded buffering: wait for the transport to take more
            await conn.writable(self.timeout)
        # flat byte views: from Python 3.12 the transport's writelines keeps memoryviews and counts
        # them with len(), which for an (n, ...) array is its rows, not its bytes
        parts = [hdr, *(memoryview(a).cast("B") for a in arrays)]
        return await self._send(conn, req_id, parts, lambda h, p: _result(info, h, p, count, batched))

    async def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        return (await self.infer_result(model, x, **kw)).value()
