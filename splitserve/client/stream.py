"""The synchronous fast-path client over TCP and Unix streams (``Client``), its
connections and its calls in flight."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from splitserve.client.common import Endpoint, InferResult, ModelInfo
from splitserve.client.failover import FrontChoice, front_endpoints
from splitserve.client.frames import (_DUPLICATE, _ERROR, _PLAIN_FIELDS, _RX_BYTES, _check, _Fields, _request_fields,
                                      _result, _with_func_id)
from splitserve.client.handoff import hand_over
from splitserve.client.route import _direct_targets, _lookup_interval, _Route, direct_mode, handed_over_only
from splitserve.errors import BadFrame, InvalidInput, SplitServeError
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestPacker, pack_request, unpack_header
from splitserve.protocol.sockets import bound_waits, recv_polling
from splitserve.spin import HostLoad, SpinPolicy

try:
    from splitserve import _fastwire
except ImportError:  # installed without a compiler or Python's headers: the pure-Python wire
    _fastwire = None


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
    busy = False  # whether the last ``call``'s poll ended because a task waited for a CPU
    # a cluster node's worker: the func id its calls carry (that node's) and their header's packer;
    # None: the model's (the front end's, or a single server's worker)
    func_id: int | None = None
    plain: RequestPacker | None = None
    best_effort = False  # a direct connection to an instance kept for best-effort calls (``_Route.pick``)

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

    def call(self, parts: list, total: int, poll_s: float = 0.0,
             host: HostLoad | None = None) -> tuple["Header | _Fields", bytearray]:
        """``send`` then ``read_one``, for a caller that holds the reading turn with nothing
        else in flight here; after an error ``sent`` says which of the two failed. With
        ``poll_s`` the answer is polled for that long before the blocking read (which waits
        the timeout after it, as without), and not once ``host`` finds a task waiting for a CPU."""
        self.sent = self.busy = False
        self.send(parts, total)
        self.sent = True
        if poll_s > 0 and self.rx_end == self.rx_start:
            self.rx_start = 0  # what comes lands in the empty buffer; a closed peer is read_one's to report
            got = recv_polling(self.sock, self.rx_mv, time.monotonic() + min(poll_s, self.timeout),
                               host.cpu_free if host is not None else None)
            self.rx_end = got or 0
            self.busy = got is None and host is not None and not host.free  # the host, not the window, ended it
        return self.read_one()


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

    def call(self, parts: list, total: int, poll_s: float = 0.0,
             host: HostLoad | None = None) -> tuple[_Fields, bytearray]:
        # one C call, the GIL released once; the answer's fields come by name, no Header built
        fields, payload = self.wire.call(self.sock.fileno(), parts, self.timeout, poll_s,
                                         host.poll_check() if host is not None else None)
        if fields is None:
            _refused(payload)
        return fields, payload

    @property
    def sent(self) -> bool:  # type: ignore[override]
        return self.wire.sent

    @property
    def busy(self) -> bool:  # type: ignore[override]
        return self.wire.busy


# How long a blocking call polls for its answer before it sleeps, by default (µs; ``Client(poll_us=...)``)
DEFAULT_POLL_US = 1000.0


class Client:
    """Synchronous fast-path client for ``tcp://host:port`` or ``unix:///path``.

    Thread-safe. The thread that waits for an answer reads the socket itself (whoever
    waits first reads for everyone), so a single caller pays no thread hand-off.

    Calls go straight to the worker processes that run the model wherever the server
    offers it (``ServerConfig.transports.fast_direct``, on by default; its LOOKUP names their
    endpoints): one connection per instance, calls spread over them in turn; lookups stay
    with the front end. A ``unix://`` client connects to the workers' Unix sockets, a
    ``tcp://`` one to their TCP ports (so a client on another machine goes direct too). A
    direct connection that closes (its worker was unloaded, evicted, restarted or died, or
    refused the connection) costs no call: the calls it had not answered are re-sent
    through the front end (inference has no side effects, so a call whose answer was lost
    is run again), and the model is looked up again before its next call, then at most
    every ``direct_retry_s`` while the client holds fewer connections than the model has
    instances (and every ten such intervals regardless); an endpoint whose connection
    closed is not connected to again for ``direct_retry_s``. An endpoint that does not take
    the connection within ``direct_connect_s`` or refuses it (a firewall that lets only the
    front end's port through, a relay) is reached through a fresh connection to the front
    end, which hands it over to that worker (``protocol/handoff.py``); once that worked, the
    client reaches every worker so, and ``direct="via-front"`` does from the start (no
    ``direct_connect_s`` wait per endpoint). A refused handover is skipped as above.
    Without direct endpoints (an old server, or the direct path off) every call goes
    through the front end. ``direct=False`` sends every call through the front end.

    A call made while no other is in flight on its connection sends and reads its answer
    on the calling thread with no pending-call record; one started meanwhile on another
    thread waits for it as for any reader. ``compiled`` picks the wire: the C one
    (``splitserve._fastwire``) where it was built (None, the default) or required (True),
    or the pure-Python one (False); both send, frame, check and time out alike.

    ``poll_us`` (default 1000; 0: never) lets such a call poll for its answer for up to
    that long before it sleeps, while its connection's recent answers came within it and
    the host has no task waiting for a CPU (``splitserve/spin.py``): it spends the caller's
    core while the model runs to save the wake-up after it (on a VM whose idle vCPU halts,
    70-80 µs a call), and gives the core back as soon as another task wants one.

    ``url`` may name several front ends (a list, or URLs separated by commas: a cluster's
    gateways). The client uses one at a time; when its connection to it is lost, the calls
    it had not answered fail with ``ConnectionError`` (none is answered twice or with
    another's answer: answers are matched by request id), and the next call connects to the
    next front end that takes the connection (``FrontChoice``: those that failed within
    ``direct_retry_s`` last). A front end that refuses the first connection is skipped the
    same way; ``ConnectionError`` when none takes it.
    """

    def __init__(self, url: "str | Sequence[str]", timeout: float = 60.0, *, direct: "bool | str" = True,
                 direct_retry_s: float = 1.0, direct_connect_s: float = 2.0, compiled: bool | None = None,
                 poll_us: float = DEFAULT_POLL_US) -> None:
        if compiled and _fastwire is None:
            raise InvalidInput("compiled=True, but splitserve._fastwire is not built: "
                               "reinstall with a C compiler and Python's headers, or pass compiled=None")
        if not poll_us >= 0:  # NaN too
            raise InvalidInput(f"poll_us must be 0 (never poll) or a number of µs, not {poll_us!r}")
        self._poll_ns = int(poll_us * 1000)
        # read only by callers that may poll, and only during a poll; a host that cannot be read is never polled on
        self._load = HostLoad() if self._poll_ns else None
        if self._load is not None and not self._load.readable():
            self._load = None
        self.endpoints = front_endpoints(url)
        self.endpoint = self.endpoints[0]  # the front end in use
        self.timeout = timeout
        self.direct, self._via_front = direct_mode(direct)
        self.direct_retry_s = direct_retry_s
        self.direct_connect_s = direct_connect_s
        self._stream_type = _CStream if _fastwire is not None and compiled is not False else _Stream
        self._fronts = FrontChoice(len(self.endpoints), direct_retry_s)
        self._front_lock = threading.Lock()  # one thread connects to the next front end
        self._front = self._open_front(fresh=True)
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
                if stream.model is None and isinstance(e, OSError) and not isinstance(e, TimeoutError):
                    self._front_lost(stream, e)
                    raise ConnectionError(f"connection to {self.endpoint} lost: {e}") from e
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
            if stream.func_id is not None:  # the node's func id: the cluster's instead
                parts = _with_func_id(parts, info.func_id)
            return self._call(req_id, parts, lambda hh, p: _result(info, hh, p, count, batched), self._front).result()
        return _result(info, answer[0], answer[1], count, batched)

    def infer(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
              slo_ms: float | None = None) -> "np.ndarray | dict[str, np.ndarray]":
        """numpy in, numpy out: the single output, or a dict of outputs."""
        return self.infer_result(model, x, cls=cls, deadline_ms=deadline_ms, slo_ms=slo_ms).value()

    def ping(self) -> float:
        t = time.perf_counter()
        req_id = next(self._ids)
        self._call(req_id, [Header(Kind.PING, req_id=req_id).pack()], lambda h, p: None, self._live_front()).result()
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
            if self._load is not None:
                self._load.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------

    def _open_front(self, fresh: bool = False) -> _Stream:
        """A connection to the first front end, in ``FrontChoice``'s order, that takes one."""
        errors = []
        for i in self._fronts.order(time.monotonic(), fresh=fresh):
            try:
                sock = _connect(self.endpoints[i], self.timeout, self.direct_connect_s if len(self.endpoints) > 1 else None)
            except OSError as e:
                self._fronts.failed(i, time.monotonic())
                errors.append(f"{self.endpoints[i]}: {e}")
                continue
            self._fronts.connected(i)
            self.endpoint = self.endpoints[i]
            self.sock = sock
            return self._stream_type(sock, self.timeout, poll_ns=self._poll_ns)
        raise ConnectionError(f"no front end took the connection: {'; '.join(errors)}")

    def _live_front(self) -> _Stream:
        """The front end's connection, made again to the next front end if it was lost;
        every model is looked up again there before its next call."""
        front = self._front
        if not front.lost:
            return front
        with self._front_lock:
            if self._front.lost:
                if self.closed:
                    raise ConnectionError("the client is closed")
                fresh = self._open_front()
                with self._lock:
                    self._front = fresh
        return self._front

    def _front_lost(self, stream: _Stream, e: BaseException) -> None:
        """The front end's connection failed with ``e``: every call on it fails with a
        connection error, and the next call goes to the next front end."""
        with self._lock:
            if stream.lost:
                return
            stream.lost = True
            for route in self._routes.values():  # looked up again, at the next front end
                route.stale = True
        self._fronts.failed(self.endpoints.index(self.endpoint), time.monotonic())
        self._fail_all(stream, e)
        try:  # wakes a thread blocked reading it
            stream.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        stream.sock.close()

    def _polled_call(self, stream: _Stream, parts: list, total: int) -> tuple["Header | _Fields", bytearray]:
        """``stream.call``, polling for the answer as the connection's policy says now; the
        wait it had teaches the policy."""
        spin = stream.spin
        t0 = time.monotonic_ns()
        if spin.skipping(t0):  # backing off a busy host: a plain call, nothing asked or timed
            return stream.call(parts, total)
        window_ns = spin.window_ns()
        try:
            return stream.call(parts, total, window_ns / 1e9, self._load) if window_ns else stream.call(parts, total)
        finally:
            t1 = time.monotonic_ns()
            spin.observe(t1 - t0, stream.busy if window_ns else None, t1)

    def _prepare(self, model: str, x: Any, cls: Any, deadline_ms: float | None,
                 slo_ms: float | None) -> tuple[ModelInfo, int, list, int, int, bool, _Stream]:
        """A call's model info, req_id, frame parts and their bytes, sample count, whether
        the caller gave a batch dimension, and the connection it goes on."""
        route = self._routes.get(model)
        if route is None or route.stale or self.direct and route.lookup_due(time.monotonic()):
            route = self._route(model)
        info = route.info
        arrays, nbytes, count, batched = info.codec.frame(x)
        req_id = next(self._ids)
        fields = _request_fields(cls, deadline_ms, slo_ms)
        stream = route.pick(fields[0]) or self._front
        # a cluster node's worker takes that node's func id (``stream.plain``), any other the model's
        hdr = (stream.plain or route.plain).pack(req_id, nbytes) if fields is _PLAIN_FIELDS else \
            pack_request(req_id, stream.func_id or info.func_id, *fields, nbytes)
        parts = [hdr, *arrays]
        return info, req_id, parts, HEADER_SIZE + nbytes, count, batched, stream

    def _route(self, model: str) -> _Route:
        route = self._routes.get(model)
        if route is not None and not route.stale and not (self.direct and route.lookup_due(time.monotonic())):
            return route
        body = model.encode()
        req_id = next(self._ids)
        info = self._call(req_id, [Header(Kind.LOOKUP, req_id=req_id, payload_len=len(body)).pack(), body],
                          lambda h, p: _check(h, p, ModelInfo.from_json), self._live_front()).result()
        live = {(st.url, st.func_id): st for st in route.streams} if route is not None else {}
        streams = []
        now = time.monotonic()
        for url, func_id, best_effort in _direct_targets(self.endpoint, info) if self.direct else ():
            st = live.pop((url, func_id), None)
            if st is None and now - self._lost_at.get(url, -self.direct_retry_s) < self.direct_retry_s:
                continue  # it closed a moment ago (restarting, or at its connection limit): not yet
            if st is None:
                try:
                    # a cluster node's worker is reached at its own port only: the gateway hands nothing over
                    st = self._open_direct(url, model, handoff=func_id == info.func_id)
                    if func_id != info.func_id:  # a cluster node's worker
                        st.func_id, st.plain = func_id, RequestPacker(func_id, *_PLAIN_FIELDS)
                except (OSError, SplitServeError):
                    self._mark_lost(url)  # not tried again for direct_retry_s
                    continue  # gone since the lookup, or unreachable from here: the others, or the front end, serve
                self._direct_streams.append(st)
            st.best_effort = best_effort
            streams.append(st)
        with self._cond:
            due_at = time.monotonic() + _lookup_interval(len(streams), info, self.direct_retry_s)
            route = self._routes[model] = _Route(info, streams, due_at)
        for st in live.values():  # no longer offered: calls on it are answered there or re-sent when it closes
            if not st.pending and not st.reading:
                self._lost(st, ConnectionError("endpoint withdrawn"))
        return route

    def _open_direct(self, url: str, model: str, handoff: bool) -> _Stream:
        """A connection to ``model``'s worker whose direct endpoint is ``url``: to that
        endpoint, or, with ``handoff``, where it cannot be reached (or once one could not be,
        or with ``direct="via-front"``) a connection to the front end handed over to the
        worker (``protocol/handoff.py``). Raises why neither could be had."""
        if not (handoff and (self._via_front or handed_over_only(self.endpoint, url))):
            try:
                return self._stream_type(_connect(Endpoint.parse(url), self.timeout, self.direct_connect_s),
                                         self.timeout, model, url, self._poll_ns)
            except OSError:
                if not handoff:
                    raise
        sock = _connect(self.endpoint, self.timeout, self.direct_connect_s)
        try:
            hand_over(sock, next(self._ids), model, url)
        except BaseException:
            sock.close()
            raise
        # the workers' own ports cannot be reached from here (or are not offered), and the
        # front end's can: no connection to a worker waits for its port's connect again
        self._via_front = True
        return self._stream_type(sock, self.timeout, model, url, self._poll_ns)

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
                self._front_lost(stream, e)
                raise ConnectionError(f"connection to {self.endpoint} lost: {e}") from e
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
        if stream.model is None and isinstance(e, OSError) and not isinstance(e, TimeoutError):
            self._front_lost(stream, e)  # the next call goes to the next front end
        elif not direct:
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
        try:
            self._live_front()
        except ConnectionError:
            pass  # no front end either: the re-sent calls fail with the connection
        with self._cond:
            if stream.lost:
                return
            stream.lost = True
            calls, stream.pending = list(stream.pending.values()), {}
            # a client that outlives many restarts keeps only the connections it has open
            self._direct_streams = [st for st in self._direct_streams if st is not stream]
            route = self._routes.get(stream.model or "")
            if route is not None and stream in route.streams:
                route.set_streams([st for st in route.streams if st is not stream])
                route.stale = True
            front_id = route.info.func_id if route is not None else None
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
                if stream.func_id is not None and front_id is not None:  # the node's func id: the cluster's instead
                    parts = _with_func_id(parts, front_id)
                self._front.send(parts)

    def _fail_all(self, stream: _Stream, e: BaseException) -> None:
        with self._cond:
            pending, stream.pending = stream.pending, {}
        err = e if isinstance(e, SplitServeError) else ConnectionError(f"connection lost: {e}")
        with self._cond:
            for c in pending.values():
                c._error, c._done = err, True
