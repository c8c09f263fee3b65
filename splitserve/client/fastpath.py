"""Fast-path clients: TCP and Unix streams (sync and asyncio) and UDP (sync).

A request is one gather write of the 64-byte header and the input arrays' own buffers.
Many calls may be in flight on one connection; answers are matched by ``req_id``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from splitserve.client.common import Endpoint, InferResult, ModelInfo, encode_inputs, target_ms
from splitserve.errors import BadFrame, InvalidInput, SplitServeError, Status, error_for_status
from splitserve.protocol.header import (HEADER_SIZE, Flags, Header, Kind, RequestClass, RequestPacker, pack_request,
                                        unpack_header)
from splitserve.protocol.sockets import bound_waits, recv_polling
from splitserve.spin import HostLoad, SpinPolicy


_RX_BYTES = 64 * 1024  # the sync client's receive buffer; bigger payloads are read past it

try:
    from splitserve import _fastwire
except ImportError:  # installed without a compiler or Python's headers: the pure-Python wire
    _fastwire = None

# An answer's header as a solo call reads it: a Header, or on the compiled wire the same
# fields by the same names (``_fastwire.Fields``), with no Header built
_Fields = Any


_PLAIN_FIELDS = (RequestClass.DEFAULT.value, 0, 0)  # a call that names no class, deadline or SLO
# plain ints: an enum member's attribute lookup is a descriptor call, once per answer
_ERROR, _DUPLICATE = int(Kind.ERROR), int(Status.DUPLICATE_REQUEST)


def _request_fields(cls: Any, deadline_ms: float | None, slo_ms: float | None) -> tuple[int, int, int]:
    """A request header's class, ``deadline_us`` and ``slo_us``. ``deadline_ms`` is hard (still
    queued then, the call fails), ``slo_ms`` soft (a late real-time call is served and counted
    missed); None: none (``common.target_ms`` refuses 0 and less)."""
    if cls is None and deadline_ms is None and slo_ms is None:  # the usual call: no enum lookups
        return _PLAIN_FIELDS
    deadline, slo = target_ms(deadline_ms, "deadline_ms"), target_ms(slo_ms, "slo_ms")
    return (RequestClass.DEFAULT.value if cls is None else int(RequestClass.parse(cls)),
            round(deadline * 1000) if deadline else 0, round(slo * 1000) if slo else 0)


def _request_header(info: ModelInfo, req_id: int, arrays: list[np.ndarray], cls: Any, deadline_ms: float | None,
                    slo_ms: float | None) -> bytes:
    """The packed header of a call on a stream (one struct call, no ``Header`` built)."""
    return pack_request(req_id, info.func_id, *_request_fields(cls, deadline_ms, slo_ms),
                        sum(a.nbytes for a in arrays))


def _result(info: ModelInfo, h: "Header | _Fields", payload: bytes, count: int, batched: bool) -> InferResult:
    if h.kind == _ERROR:
        raise error_for_status(h.status, bytes(payload).decode(errors="replace"))
    return InferResult(info.codec.decode(payload, count, batched), h.queue_us, h.compute_us, h.total_us)


class PendingCall:
    """A call in flight on a sync client; ``result()`` waits for (and helps read) its answer."""

    __slots__ = ("_client", "req_id", "_decode", "_done", "_value", "_error", "_stream", "_parts")

    def __init__(self, client: "Client", req_id: int, decode: Callable[[Header, bytes], Any],
                 stream: "_Stream", parts: list | None) -> None:
        self._client = client
        self.req_id = req_id
        self._decode = decode
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._stream = stream  # the connection its answer will come on
        self._parts = parts  # kept while it is on a direct connection: re-sent through the front end if that closes

    def done(self) -> bool:
        return self._done

    def _resolve(self, h: Header, payload: bytes) -> None:
        """Decode its answer; the reader then marks it done under the client's condition."""
        try:
            self._value = self._decode(h, payload)
        except BaseException as e:
            self._error = e
        self._parts = None

    def result(self, timeout: float | None = None) -> Any:
        self._client._wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value


def _connect(ep: Endpoint, timeout: float, connect_timeout: float | None = None) -> socket.socket:
    """A connected blocking stream socket whose sends and reads wait at most ``timeout``;
    connecting waits at most ``connect_timeout`` (None: ``timeout``)."""
    if ep.scheme == "tcp":
        sock = socket.create_connection((ep.host, ep.port), timeout=connect_timeout or timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    elif ep.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(ep.path)
        except BaseException:
            sock.close()
            raise
    else:
        raise InvalidInput(f"Client speaks tcp:// and unix://; use UdpClient or splitserve.connect(), not {ep.scheme}://")
    bound_waits(sock, timeout)
    return sock


class _Stream:
    """One connection of a sync client (the front end's, or a worker's direct endpoint):
    its socket, its calls in flight and its receive buffer, read and written by the pure-
    Python wire (``_CStream``: the compiled one). The client's condition guards ``pending``
    and ``reading``; only the thread holding the reading turn calls ``read_one``."""

    sent = False  # whether the last ``call``'s send went out whole

    def __init__(self, sock: socket.socket, timeout: float, model: str | None = None, url: str = "",
                 poll_ns: int = 0) -> None:
        self.sock = sock
        self.timeout = timeout
        self.model = model  # a direct connection's model (None: the front end's)
        self.url = url  # a direct connection's endpoint
        self.reading = False
        self.lost = False
        self.pending: dict[int, PendingCall] = {}
        # how long a solo call polls for its answer: per connection, since its waits are
        # its model's (``Client(poll_us=...)``; a budget of 0 never polls)
        self.spin = SpinPolicy(poll_ns)
        self._init_wire()

    def _init_wire(self) -> None:
        """The wire's own state: a send lock and the receive buffer."""
        self.send_lock = threading.Lock()
        # Answers are read through this buffer: one recv usually brings a whole small frame
        # (header and payload), where reading them apart took two system calls per answer.
        self.rx = bytearray(_RX_BYTES)
        self.rx_mv = memoryview(self.rx)
        self.rx_start = self.rx_end = 0  # the unparsed bytes are rx[rx_start:rx_end]

    def send(self, parts: list, total: int | None = None) -> None:
        """One gather write of ``parts`` (``total``: their bytes, when the caller knows them)."""
        if total is None:
            total = sum(memoryview(p).nbytes for p in parts)
        with self.send_lock:
            try:
                sent = self.sock.sendmsg(parts)
                if sent < total:  # rare on blocking sockets; finish with a joined copy
                    rest = b"".join(bytes(memoryview(p).cast("B")) for p in parts)[sent:]
                    self.sock.sendall(rest)
            except BlockingIOError:  # SO_SNDTIMEO ran out
                raise TimeoutError("timed out") from None

    def _recv_into(self, mv: memoryview) -> int:
        try:
            n = self.sock.recv_into(mv)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError("timed out") from None
        if n == 0:
            raise ConnectionError("server closed the connection")
        return n

    def _fill(self, need: int) -> None:
        """Receive until ``need`` unparsed bytes are buffered (``need`` <= the buffer)."""
        if self.rx_start + need > len(self.rx):  # no room after them: move them to the front
            n = self.rx_end - self.rx_start
            self.rx[:n] = self.rx[self.rx_start : self.rx_end]
            self.rx_start, self.rx_end = 0, n
        while self.rx_end - self.rx_start < need:
            self.rx_end += self._recv_into(self.rx_mv[self.rx_end :])

    def _take(self, n: int) -> bytearray:
        """The next ``n`` bytes of the stream, in a buffer of their own (decoded arrays keep it)."""
        out = bytearray(n)
        have = min(n, self.rx_end - self.rx_start)
        out[:have] = self.rx_mv[self.rx_start : self.rx_start + have]
        self.rx_start += have
        if self.rx_start == self.rx_end:
            self.rx_start = self.rx_end = 0
        mv = memoryview(out)[have:]
        while len(mv):  # a payload bigger than what was buffered: straight into its own buffer
            mv = mv[self._recv_into(mv) :]
        return out

    def read_one(self) -> tuple[Header, bytearray]:
        """The next frame: its header and its payload in a buffer of its own."""
        if self.rx_end - self.rx_start < HEADER_SIZE:
            self._fill(HEADER_SIZE)
        h = unpack_header(self.rx, self.rx_start)
        n = h.payload_len
        begin = self.rx_start + HEADER_SIZE
        if self.rx_end - begin >= n:  # the usual small answer: it came whole with its header
            self.rx_start = begin + n
            if self.rx_start == self.rx_end:
                self.rx_start = self.rx_end = 0
            return h, self.rx[begin : begin + n]
        self.rx_start = begin
        return h, self._take(n)

    def call(self, parts: list, total: int, poll_s: float = 0.0) -> tuple["Header | _Fields", bytearray]:
        """``send`` then ``read_one``, for a caller that holds the reading turn with nothing
        else in flight here; after an error ``sent`` says which of the two failed. With
        ``poll_s`` the answer is polled for that long before the blocking read (which waits
        the timeout after it, as without)."""
        self.sent = False
        self.send(parts, total)
        self.sent = True
        if poll_s > 0 and self.rx_end == self.rx_start:
            self._poll(time.monotonic() + min(poll_s, self.timeout))
        return self.read_one()

    def _poll(self, until: float) -> None:
        """Receive what comes before ``until`` into the empty buffer (a closed peer is
        ``read_one``'s to report)."""
        self.rx_start = 0
        self.rx_end = recv_polling(self.sock, self.rx_mv, until) or 0


def _refused(header: bytes) -> NoReturn:
    """Raise the BadFrame that names what is wrong with a header the C wire refused (the
    parser's own message; a parser that accepts it now differs from the C checks, and the
    answer is refused all the same)."""
    unpack_header(header)
    raise BadFrame(f"the compiled wire refused an answer header the parser accepts: {header.hex()}")


class _CStream(_Stream):
    """A ``_Stream`` whose sends and reads are ``splitserve._fastwire``'s (C, the GIL
    released in the kernel, a poll only when a call would block): the same frames, errors
    and buffering as the Python wire, in one C call each."""

    def _init_wire(self) -> None:
        self.wire = _fastwire.Wire(_RX_BYTES)  # its own receive buffer and send lock

    # the fd is the socket's at each call: once closed (a lost direct connection) it is -1
    # and refused, never a number the OS may have given another socket since; the wire
    # takes its own send lock
    def send(self, parts: list, total: int | None = None) -> None:
        self.wire.send(self.sock.fileno(), parts, self.timeout)

    def read_one(self) -> tuple[Header, bytearray]:
        fields, payload = self.wire.recv_frame(self.sock.fileno(), self.timeout)
        if fields is None:
            _refused(payload)
        return Header(*fields), payload

    def call(self, parts: list, total: int, poll_s: float = 0.0) -> tuple[_Fields, bytearray]:
        # one C call, the GIL released once; the answer's fields come by name, no Header built
        fields, payload = self.wire.call(self.sock.fileno(), parts, self.timeout, poll_s)
        if fields is None:
            _refused(payload)
        return fields, payload

    @property
    def sent(self) -> bool:  # type: ignore[override]
        return self.wire.sent


def _direct_urls(front: Endpoint, info: ModelInfo) -> list[str]:
    """The direct endpoints of ``info``'s workers for a client that reached the front end at
    ``front``: from a ``unix://`` front end their Unix sockets (LOOKUP's ``direct``), from a
    ``tcp://`` one their TCP ports (``direct_tcp``) at the host the client reached the front
    end at, since the workers bind the front end's own address (which may be a wildcard,
    or have another name here). A server that offers no TCP endpoints (an older one, or
    ``direct_tcp`` off) gets a TCP client's calls through the front end."""
    if front.scheme == "unix":
        return list(info.extra.get("direct", ()))
    host = f"[{front.host}]" if ":" in front.host else front.host
    return [f"tcp://{host}:{Endpoint.parse(url).port}" for url in info.extra.get("direct_tcp", ())]


# A direct client looks a model up again at least this many retry intervals apart even when
# it holds a connection to every instance, to find instances added since (scaling).
_REFRESH_RETRIES = 10


def _lookup_interval(held: int, info: ModelInfo, retry_s: float) -> float:
    """How long after a lookup a direct client holding ``held`` connections to ``info``'s
    model looks it up again: ``retry_s`` while it holds fewer than the model has instances
    (none offered yet, one restarting or still loading), else ``_REFRESH_RETRIES`` of them."""
    return retry_s if held < int(info.extra.get("instances", 0) or 0) else _REFRESH_RETRIES * retry_s


class _Route:
    """Where a model's calls go (a ``Client``'s or an ``AsyncClient``'s): its info, and
    with ``direct`` its workers' endpoints."""

    __slots__ = ("info", "plain", "streams", "turns", "due_at", "stale")

    def __init__(self, info: ModelInfo, streams: "list[_Stream] | list[_AsyncConn]", due_at: float) -> None:
        self.info = info
        self.plain = RequestPacker(info.func_id, *_PLAIN_FIELDS)  # the header of a call that names no class
        # replaced, never changed in place, so a caller picks from it without the client's lock
        self.streams = streams
        self.turns = itertools.count()
        # when a direct client looks the model up again (its streams shrink only when one
        # closes, which sets ``stale``, so the interval is known at the lookup)
        self.due_at = due_at
        self.stale = False  # a direct connection closed: look the model up again

    def lookup_due(self, now: float) -> bool:
        """Whether a direct client looks the model up again before its next call: a direct
        connection of it closed, or ``_lookup_interval`` has passed since the last lookup."""
        return self.stale or now > self.due_at


class Client:
    """Synchronous fast-path client for ``tcp://host:port`` or ``unix:///path``.

    Thread-safe. The thread that waits for an answer reads the socket itself (whoever
    waits first reads for everyone), so a single caller pays no thread hand-off.

    ``direct=True`` sends calls straight to the worker processes that run the model when
    the server offers it (``ServerConfig.transports.fast_direct``; its LOOKUP names their endpoints):
    one connection per instance, calls spread over them in turn; lookups stay with the
    front end. A ``unix://`` client connects to the workers' Unix sockets, a ``tcp://`` one
    to their TCP ports (so a client on another machine goes direct too). A direct connection that closes (its worker was unloaded, evicted, restarted
    or died, or refused the connection) costs no call: the calls it had not answered are
    re-sent through the front end (inference has no side effects, so a call whose answer
    was lost is run again), and the model is looked up again before its next call, then at
    most every ``direct_retry_s`` while the client holds fewer connections than the model
    has instances (and every ten such intervals regardless); an endpoint whose connection
    closed is not connected to again for ``direct_retry_s``. An endpoint that does not take
    the connection within ``direct_connect_s`` (e.g. a firewall that lets the front end's
    port through and drops the rest) is skipped the same way. Without direct endpoints (an
    old server, or the direct path off) every call goes through the front end as before.

    A call made while no other is in flight on its connection sends and reads its answer
    on the calling thread with no pending-call record; one started meanwhile on another
    thread waits for it as for any reader. ``compiled`` picks the wire: the C one
    (``splitserve._fastwire``) where it was built (None, the default) or required (True),
    or the pure-Python one (False); both send, frame, check and time out alike.

    ``poll_us`` (default 0: never) lets such a call poll for its answer for up to that
    long before it sleeps, while its connection's recent answers came within it and the
    host has no task waiting for a CPU (``splitserve/spin.py``): it spends the caller's
    core while the model runs to save the wake-up after it (on a VM whose idle vCPU
    halts, 70-80 µs a call), for callers whose core is their own.
    """

    def __init__(self, url: str, timeout: float = 60.0, *, direct: bool = False,
                 direct_retry_s: float = 1.0, direct_connect_s: float = 2.0, compiled: bool | None = None,
                 poll_us: float = 0.0) -> None:
        if compiled and _fastwire is None:
            raise InvalidInput("compiled=True, but splitserve._fastwire is not built: "
                               "reinstall with a C compiler and Python's headers, or pass compiled=None")
        if not poll_us >= 0:  # NaN too
            raise InvalidInput(f"poll_us must be 0 (never poll) or a number of µs, not {poll_us!r}")
        self._poll_ns = int(poll_us * 1000)
        self._load = HostLoad() if self._poll_ns else None  # read only by callers that may poll
        self.endpoint = Endpoint.parse(url)
        self.timeout = timeout
        self.direct = direct
        self.direct_retry_s = direct_retry_s
        self.direct_connect_s = direct_connect_s
        self._stream_type = _CStream if _fastwire is not None and compiled is not False else _Stream
        self._front = self._stream_type(_connect(self.endpoint, timeout), timeout, poll_ns=self._poll_ns)
        self.sock = self._front.sock
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        # the hot sections take the plain lock itself: Condition's own ``with`` is Python code
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads in self._cond.wait: only then is a notify worth its cost
        self._routes: dict[str, _Route] = {}
        self._direct_streams: list[_Stream] = []  # the direct connections open, to close with the client
        self._lost_at: dict[str, float] = {}  # endpoint -> when its connection closed (not retried sooner)
        self.closed = False

    # -- public API -------------------------------------------------------------------

    def lookup(self, model: str) -> ModelInfo:
        """Resolve a model name to its func_id, shapes and datatypes (cached)."""
        return self._route(model).info

    def submit(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
               slo_ms: float | None = None) -> PendingCall:
        """Send a call and return at once; ``.result()`` gives an ``InferResult``."""
        info, req_id, parts, total, count, batched, stream = self._prepare(model, x, cls, deadline_ms, slo_ms)
        return self._call(req_id, parts, lambda hh, p: _result(info, hh, p, count, batched), stream, total)

    def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                     slo_ms: float | None = None) -> InferResult:
        """Send a call and wait for its ``InferResult``."""
        info, req_id, parts, total, count, batched, stream = self._prepare(model, x, cls, deadline_ms, slo_ms)
        with self._lock:
            # alone on its connection: this thread sends and reads, no pending-call record
            solo = not (stream.reading or stream.pending or stream.lost)
            if solo:
                stream.reading = True
        if not solo:
            return self._call(req_id, parts, lambda hh, p: _result(info, hh, p, count, batched), stream,
                              total).result()
        try:
            answer = stream.call(parts, total) if self._load is None else self._polled_call(stream, parts, total)
        except BaseException as e:
            if stream.sent:
                answer = self._read_failed(stream, e)
            else:
                with self._lock:
                    stream.reading = False
                    if self._waiting:
                        self._cond.notify_all()
                if stream.model is None or not isinstance(e, OSError):
                    raise
                self._lost(stream, e)
                answer = None
        else:
            h = answer[0]
            if h.req_id == req_id and not (h.kind == _ERROR and h.status == _DUPLICATE):
                with self._lock:  # its own answer, the usual case: the turn is given up
                    stream.reading = False
                    if self._waiting:
                        self._cond.notify_all()
            else:  # another thread's call started meanwhile: read on for both
                answer = self._read_for(stream, req_id, answer)
        if answer is None:  # a direct connection closed before the answer came
            return self._call(req_id, parts, lambda hh, p: _result(info, hh, p, count, batched), self._front).result()
        return _result(info, answer[0], answer[1], count, batched)

    def infer(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
              slo_ms: float | None = None) -> "np.ndarray | dict[str, np.ndarray]":
        """numpy in, numpy out: the single output, or a dict of outputs."""
        return self.infer_result(model, x, cls=cls, deadline_ms=deadline_ms, slo_ms=slo_ms).value()

    def ping(self) -> float:
        t = time.perf_counter()
        req_id = next(self._ids)
        self._call(req_id, [Header(Kind.PING, req_id=req_id).pack()], lambda h, p: None, self._front).result()
        return time.perf_counter() - t

    def direct_endpoints(self, model: str) -> int:
        """Direct connections the client holds for ``model`` now (0: its calls go through the front end)."""
        route = self._routes.get(model)
        return len(route.streams) if route is not None else 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._front.sock.close()
            for st in self._direct_streams:
                st.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------

    def _polled_call(self, stream: _Stream, parts: list, total: int) -> tuple["Header | _Fields", bytearray]:
        """``stream.call``, polling for the answer as the connection's policy says now; the
        wait it had teaches the policy."""
        t0 = time.monotonic_ns()
        window_ns = stream.spin.window_ns(self._load.cpu_free(t0))  # type: ignore[union-attr]
        try:
            return stream.call(parts, total, window_ns / 1e9)
        finally:
            stream.spin.observe(time.monotonic_ns() - t0)

    @staticmethod
    def _check(h: Header, payload: bytes, parse: Callable[[bytes], Any]) -> Any:
        if h.kind == Kind.ERROR:
            raise error_for_status(h.status, payload.decode(errors="replace"))
        return parse(payload)

    def _prepare(self, model: str, x: Any, cls: Any, deadline_ms: float | None,
                 slo_ms: float | None) -> tuple[ModelInfo, int, list, int, int, bool, _Stream]:
        """A call's model info, req_id, frame parts and their bytes, sample count, whether
        the caller gave a batch dimension, and the connection it goes on."""
        route = self._routes.get(model)
        if route is None or self.direct and route.lookup_due(time.monotonic()):
            route = self._route(model)
        info = route.info
        arrays, nbytes, count, batched = info.codec.frame(x)
        req_id = next(self._ids)
        fields = _request_fields(cls, deadline_ms, slo_ms)
        hdr = route.plain.pack(req_id, nbytes) if fields is _PLAIN_FIELDS else \
            pack_request(req_id, info.func_id, *fields, nbytes)
        parts = [hdr, *arrays]
        streams = route.streams
        stream = streams[next(route.turns) % len(streams)] if streams else self._front
        return info, req_id, parts, HEADER_SIZE + nbytes, count, batched, stream

    def _route(self, model: str) -> _Route:
        route = self._routes.get(model)
        if route is not None and not (self.direct and route.lookup_due(time.monotonic())):
            return route
        body = model.encode()
        req_id = next(self._ids)
        info = self._call(req_id, [Header(Kind.LOOKUP, req_id=req_id, payload_len=len(body)).pack(), body],
                          lambda h, p: self._check(h, p, ModelInfo.from_json), self._front).result()
        live = {st.url: st for st in route.streams} if route is not None else {}
        streams = []
        now = time.monotonic()
        for url in _direct_urls(self.endpoint, info) if self.direct else ():
            st = live.pop(url, None)
            if st is None and now - self._lost_at.get(url, -self.direct_retry_s) < self.direct_retry_s:
                continue  # it closed a moment ago (restarting, or at its connection limit): not yet
            if st is None:
                try:
                    st = self._stream_type(_connect(Endpoint.parse(url), self.timeout, self.direct_connect_s),
                                           self.timeout, model, url, self._poll_ns)
                except (OSError, SplitServeError):
                    self._mark_lost(url)  # not tried again for direct_retry_s
                    continue  # gone since the lookup, or unreachable from here: the others, or the front end, serve
                self._direct_streams.append(st)
            streams.append(st)
        with self._cond:
            due_at = time.monotonic() + _lookup_interval(len(streams), info, self.direct_retry_s)
            route = self._routes[model] = _Route(info, streams, due_at)
        for st in live.values():  # no longer offered: calls on it are answered there or re-sent when it closes
            if not st.pending and not st.reading:
                self._lost(st, ConnectionError("endpoint withdrawn"))
        return route

    def _call(self, req_id: int, parts: list, decode: Callable[[Header, bytes], Any], stream: _Stream,
              total: int | None = None) -> PendingCall:
        with self._lock:
            if stream.lost:  # closed since it was picked: its calls go through the front end now
                stream = self._front
            call = PendingCall(self, req_id, decode, stream, parts if stream.model is not None else None)
            stream.pending[req_id] = call
        try:
            stream.send(parts, total)
        except OSError as e:
            if stream.model is None:
                raise
            self._lost(stream, e)  # re-sends it, and any other call on it, through the front end
        return call

    def _wait(self, call: PendingCall, timeout: float | None) -> None:
        """Until ``call`` is answered: the first thread to wait on a connection reads it for
        every call on it (a single caller reads its own answer, no hand-off); the others
        wait on the condition until their answer is in or the reading turn is free."""
        deadline = None
        while True:
            with self._lock:
                while not call._done and call._stream.reading:
                    if deadline is None:
                        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
                    left = deadline - time.monotonic()
                    self._waiting += 1
                    try:
                        answered = left > 0 and self._cond.wait(left)
                    finally:
                        self._waiting -= 1
                    if not answered:
                        raise TimeoutError(f"no answer to call {call.req_id}")
                if call._done:
                    return
                stream = call._stream
                stream.reading = True
            if self._read_for(stream, call.req_id) is not None:
                return

    def _read_for(self, stream: _Stream, req_id: int, first: "tuple[Header | _Fields, bytearray] | None" = None
                  ) -> "tuple[Header | _Fields, bytearray] | None":
        """Read ``stream`` (this thread holds its reading turn) and hand each answer to its
        call until ``req_id``'s is in (resolving its call too, if it has a record): that
        answer then, the turn given up; None if ``stream`` was a direct connection and
        closed, its calls moved to the front end. ``first``: a frame already read."""
        while True:
            if first is not None:
                (h, payload), first = first, None
            else:
                try:
                    h, payload = stream.read_one()
                except BaseException as e:
                    return self._read_failed(stream, e)
            if h.kind == _ERROR and h.status == _DUPLICATE:
                continue  # the server refused a duplicate of a call still in flight: its own answer comes later
            mine = h.req_id == req_id
            got = stream.pending.get(h.req_id)  # None for a solo call's own answer: it has no record
            if not mine and (got is None or got._done):
                continue  # e.g. the late answer of a call that timed out
            if got is not None:
                got._resolve(h, bytes(payload) if h.kind == _ERROR else payload)
            with self._lock:
                if got is not None:
                    got._done = True
                    stream.pending.pop(h.req_id, None)
                if mine:
                    stream.reading = False
                if self._waiting:
                    self._cond.notify_all()
            if mine:
                return h, payload

    def _read_failed(self, stream: _Stream, e: BaseException) -> None:
        """Reading ``stream`` (this thread's turn) raised ``e``: the turn is given up; a
        direct connection's calls move to the front end (None), else every call on it
        fails and ``e`` is raised."""
        direct = stream.model is not None and isinstance(e, (OSError, SplitServeError))
        if not direct:
            self._fail_all(stream, e)
        with self._lock:
            stream.reading = False
            if self._waiting:
                self._cond.notify_all()
        if not direct:
            raise e
        self._lost(stream, e)
        return None

    def _mark_lost(self, url: str) -> None:
        """``url`` is not connected to again for ``direct_retry_s``. Entries past that are
        dropped: every restarted worker has a new endpoint, and a long-lived client must not
        keep one per restart."""
        now = time.monotonic()
        self._lost_at = {u: t for u, t in self._lost_at.items() if now - t < self.direct_retry_s}
        self._lost_at[url] = now

    def _lost(self, stream: _Stream, e: BaseException) -> None:
        """A direct connection closed: its unanswered calls go through the front end, and
        the model is looked up again before its next call."""
        with self._cond:
            if stream.lost:
                return
            stream.lost = True
            calls, stream.pending = list(stream.pending.values()), {}
            # a client that outlives many restarts keeps only the connections it has open
            self._direct_streams = [st for st in self._direct_streams if st is not stream]
            route = self._routes.get(stream.model or "")
            if route is not None and stream in route.streams:
                route.streams = [st for st in route.streams if st is not stream]
                route.stale = True
            self._mark_lost(stream.url)
            for c in calls:
                c._stream = self._front
                self._front.pending[c.req_id] = c
            self._cond.notify_all()
        try:  # wakes a thread blocked reading it (close alone would not)
            stream.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        stream.sock.close()
        for c in calls:
            parts, c._parts = c._parts, None
            if parts is not None and not c.done():
                self._front.send(parts)

    def _fail_all(self, stream: _Stream, e: BaseException) -> None:
        with self._cond:
            pending, stream.pending = stream.pending, {}
        err = e if isinstance(e, SplitServeError) else ConnectionError(f"connection lost: {e}")
        with self._cond:
            for c in pending.values():
                c._error, c._done = err, True


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


async def _open_async(ep: Endpoint, protocol: Callable[[], _AsyncConn]) -> _AsyncConn:
    """A connection to ``ep`` served by ``protocol()``; TCP ones have TCP_NODELAY (asyncio sets it)."""
    loop = asyncio.get_running_loop()
    if ep.scheme == "tcp":
        _, conn = await loop.create_connection(protocol, ep.host, ep.port)
        return conn
    if ep.scheme == "unix":
        _, conn = await loop.create_unix_connection(protocol, ep.path)
        return conn
    raise InvalidInput("AsyncClient speaks tcp:// and unix://")


class AsyncClient:
    """asyncio fast-path client for ``tcp://`` and ``unix://``: many calls in flight.

    ``direct=True`` follows the workers' direct endpoints as ``Client`` does (one
    connection per instance, calls in turn; a closed one's unanswered calls are re-sent
    through the front end and the model is looked up again). Every call ends exactly once:
    with its result, its error, ``TimeoutError`` after ``timeout`` seconds (a later answer
    is dropped), or ``ConnectionError`` when its connection (the front end's) is lost or
    the client closed."""

    def __init__(self, url: str, timeout: float | None = 60.0, *, direct: bool = False,
                 direct_retry_s: float = 1.0, direct_connect_s: float = 2.0) -> None:
        self.endpoint = Endpoint.parse(url)
        self.timeout = timeout  # seconds a call may wait for its answer (None: no limit)
        self.direct = direct
        self.direct_retry_s = direct_retry_s
        self.direct_connect_s = direct_connect_s
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        self._routes: dict[str, _Route] = {}
        self._front: _AsyncConn | None = None
        self._direct_streams: list[_AsyncConn] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def connect(self) -> "AsyncClient":
        self._loop = asyncio.get_running_loop()
        self._front = await _open_async(self.endpoint, lambda: _AsyncConn(self))
        return self

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection; calls still waiting end with ``ConnectionError``."""
        conns = [self._front, *self._direct_streams] if self._front is not None else list(self._direct_streams)
        self._front, self._direct_streams = None, []
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
        elif conn.pending:
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
            route.streams = [c for c in route.streams if c is not conn]
            route.stale = True
        front = self._front
        if front is None or front.dead:
            conn.fail_all(ConnectionError("the client is closed" if front is None else "connection lost"))
            return
        calls, conn.pending = conn.pending, {}
        for req_id, (fut, decode, parts, deadline) in calls.items():
            if fut.done() or parts is None:
                continue
            front.pending[req_id] = (fut, decode, None, deadline)  # its deadline still counts from its first send
            if deadline < front.sweep_at:
                self._arm(front, deadline)
            front.transport.writelines(parts)  # type: ignore[union-attr]

    def _fresh(self, model: str) -> _Route | None:
        """``model``'s route when no lookup is due (``_Route.lookup_due``)."""
        route = self._routes.get(model)
        if route is not None and not (self.direct and route.lookup_due(time.monotonic())):
            return route
        return None

    async def _look_up(self, model: str) -> _Route:
        front = self._front
        if front is None:
            raise ConnectionError("the client is not connected")
        if front.paused:
            await front.writable(self.timeout)
        body = model.encode()
        req_id = next(self._ids)
        info = await self._send(front, req_id, [Header(Kind.LOOKUP, req_id=req_id, payload_len=len(body)).pack(), body],
                                lambda h, p: Client._check(h, p, ModelInfo.from_json))
        route = self._routes.get(model)
        streams = []
        if self.direct:
            live = {c.url: c for c in route.streams} if route is not None else {}
            for url in _direct_urls(self.endpoint, info):
                conn = live.pop(url, None)
                if conn is None:
                    try:
                        conn = await asyncio.wait_for(
                            _open_async(Endpoint.parse(url), lambda url=url: _AsyncConn(self, model, url)),
                            self.direct_connect_s)
                    except (OSError, SplitServeError, TimeoutError):
                        continue  # gone since the lookup: the others, or the front end, serve
                    self._direct_streams.append(conn)
                streams.append(conn)
        due_at = time.monotonic() + _lookup_interval(len(streams), info, self.direct_retry_s)
        route = self._routes[model] = _Route(info, streams, due_at)
        return route

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
        hdr = _request_header(info, req_id, arrays, cls, deadline_ms, slo_ms)
        streams = route.streams
        conn = streams[next(route.turns) % len(streams)] if streams else self._front
        if conn is None:
            raise ConnectionError("the client is not connected")
        if conn.paused:  # bounded buffering: wait for the transport to take more
            await conn.writable(self.timeout)
        # flat byte views: from Python 3.12 the transport's writelines keeps memoryviews and counts
        # them with len(), which for an (n, ...) array is its rows, not its bytes
        parts = [hdr, *(memoryview(a).cast("B") for a in arrays)]
        return await self._send(conn, req_id, parts, lambda h, p: _result(info, h, p, count, batched))

    async def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        return (await self.infer_result(model, x, **kw)).value()


class UdpClient:
    """Synchronous UDP fast-path client: segments big requests, retransmits on timeout."""

    def __init__(self, url: str, timeout: float = 60.0, retry_s: float = 0.5, segment: int = 60000) -> None:
        self.endpoint = ep = Endpoint.parse(url)
        if ep.scheme != "udp":
            raise InvalidInput("UdpClient speaks udp://")
        self.addr = (ep.host, ep.port)
        self.timeout = timeout
        self.retry_s = retry_s
        self.segment = segment
        family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.connect(self.addr)
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        self._models: dict[str, ModelInfo] = {}
        self._buf = bytearray(65536)
        self._lock = threading.Lock()
        self.retransmits = 0

    def _exchange(self, datagrams: list[list], req_id: int) -> tuple[Header, bytes]:
        """Send all datagrams, gather the (possibly segmented) answer; retransmit on silence."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            parts: dict[int, bytes] = {}
            first: Header | None = None
            while True:
                for d in datagrams:
                    self.sock.sendmsg(d)
                resend_at = time.monotonic() + self.retry_s
                while time.monotonic() < resend_at:
                    self.sock.settimeout(max(1e-3, resend_at - time.monotonic()))
                    try:
                        n = self.sock.recv_into(self._buf)
                    except TimeoutError:
                        break
                    h = unpack_header(self._buf)
                    if h.req_id != req_id:
                        continue  # a late answer to an earlier, retransmitted call
                    if h.kind != Kind.RESPONSE:
                        return h, bytes(self._buf[HEADER_SIZE:n])
                    first = first or h
                    parts[h.seq_num] = bytes(self._buf[HEADER_SIZE : HEADER_SIZE + h.payload_len])
                    if len(parts) == h.seg_count:
                        return first, b"".join(parts[i] for i in range(h.seg_count))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to UDP call {req_id} after {self.timeout:.1f}s")
                self.retransmits += 1

    def lookup(self, model: str) -> ModelInfo:
        info = self._models.get(model)
        if info is None:
            rid = next(self._ids)
            body = model.encode()
            h, p = self._exchange([[Header(Kind.LOOKUP, req_id=rid, payload_len=len(body)).pack(), body]], rid)
            info = self._models[model] = Client._check(h, p, ModelInfo.from_json)
        return info

    def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                     slo_ms: float | None = None) -> InferResult:
        info = self.lookup(model)
        arrays, count, batched = encode_inputs(info, x)
        rid = next(self._ids)
        payload = memoryview(b"".join(memoryview(a).cast("B") for a in arrays)) if len(arrays) > 1 else memoryview(arrays[0]).cast("B")
        total = len(payload)
        segs = max(1, -(-total // self.segment))
        rcls, deadline_us, slo_us = _request_fields(cls, deadline_ms, slo_ms)
        base = Header(Kind.REQUEST, req_id=rid, func_id=info.func_id, cls=rcls, deadline_us=deadline_us, slo_us=slo_us)
        dgrams = []
        for i in range(segs):
            chunk = payload[i * self.segment : (i + 1) * self.segment]
            base.seq_num, base.seg_count, base.payload_offset = i, segs, i * self.segment
            base.payload_len, base.total_len = len(chunk), total
            base.flags = int(Flags.SEGMENTED) if segs > 1 else 0
            dgrams.append([base.pack(), chunk])
        h, p = self._exchange(dgrams, rid)
        return _result(info, h, p, count, batched)

    def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        return self.infer_result(model, x, **kw).value()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "UdpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(url: str, **kw: Any) -> Any:
    """A sync client for any URL scheme: ``tcp://``, ``unix://``, ``udp://`` (fast path),
    ``http://`` (``HttpClient``) or ``grpc://`` (``GrpcClient``); all share one infer API."""
    if url.startswith("udp://"):
        return UdpClient(url, **kw)
    if url.startswith("http://"):
        from splitserve.client.http import HttpClient

        return HttpClient(url, **kw)
    if url.startswith("grpc://"):
        from splitserve.client.grpc import GrpcClient

        return GrpcClient(url, **kw)
    return Client(url, **kw)
