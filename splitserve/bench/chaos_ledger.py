"""The chaos benchmark's client side: a ledger of every request, and lanes that feed it.

The ledger is pure bookkeeping: each request sent gets an entry, and each answer that comes
back for it (a result, an error frame with a status, or the connection breaking under it)
is recorded against that entry. From it follow the numbers the chaos run must prove:
nothing lost (every entry answered before its client gave up), nothing answered twice, no
answer that belongs to another request (outputs are checked by an ``Oracle``).

A lane is one client connection whose answers go to the ledger. The library clients hide
what the ledger must see (they drop a second answer to a request silently), so the fast
path lanes speak the wire protocol themselves with ``protocol.header``; HTTP and gRPC are
request/response per call, so those lanes wrap the library's asyncio clients. No lane
waits for ever: a request that outlives ``answer_timeout_s`` is recorded as lost.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.results import percentiles
from splitserve.client.common import Endpoint, ModelInfo, decode_outputs
from splitserve.errors import SplitServeError, Status, error_for_status
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, RequestClass, unpack_header

logger = logging.getLogger(__name__)

OK = "ok"
WRONG = "wrong"  # an answer whose outputs belong to some other input
CONN = "connection"  # the connection broke under the request: a clean, visible failure
LOST = "lost"  # no answer before the client gave up


@dataclass(slots=True)
class Entry:
    """One request as the ledger saw it; times in seconds on the run's clock."""

    key: int
    transport: str
    model: str
    cls: str
    phase: str
    sent: float
    done: float | None = None
    outcome: str | None = None  # OK, WRONG, CONN, LOST, or "error:<STATUS>"
    answers: int = 0  # answers received; more than one is a duplicate
    transmissions: int = 1  # UDP retransmits the same request; the server may replay its answer
    detail: str | None = None

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.sent


@dataclass(frozen=True, slots=True)
class Stray:
    """An answer for no request this client has open: a req_id never sent, or one given up on."""

    t: float
    transport: str
    detail: str


class Ledger:
    """Every request and every answer, for one run. Pure: callers pass the time."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.strays: list[Stray] = []
        self.late: int = 0  # answers that came after their request was recorded lost
        self.duplicate_samples: list[str] = []

    def open(self, transport: str, model: str, cls: str, phase: str, t: float) -> Entry:
        e = Entry(len(self.entries), transport, model, cls, phase, t)
        self.entries.append(e)
        return e

    def answer(self, e: Entry, t: float, outcome: str, detail: str | None = None) -> None:
        """An answer (or a broken connection) for ``e``; a second one counts as a duplicate."""
        if e.outcome == LOST:
            self.late += 1
            return
        e.answers += 1
        if e.answers > 1:
            if e.transport == "udp" and e.answers <= e.transmissions and outcome == e.outcome:
                e.answers -= 1  # the same answer replayed for a retransmission: by design
                return
            logger.debug("duplicate answer for request %d (%s %s): %s after %s", e.key, e.transport, e.model,
                         outcome, e.outcome)
            if len(self.duplicate_samples) < 20:
                self.duplicate_samples.append(f"request {e.key} ({e.transport} {e.model}, sent {e.transmissions}x): "
                                              f"{outcome} after {e.outcome} ({t - e.sent:.3f} s after sending)")
            return
        e.done, e.outcome, e.detail = t, outcome, detail

    def stray(self, t: float, transport: str, detail: str) -> None:
        self.strays.append(Stray(t, transport, detail))

    def give_up(self, e: Entry, t: float) -> None:
        """The client stops waiting for ``e``: lost, unless an answer came first."""
        if e.outcome is None:
            e.done, e.outcome = t, LOST

    def give_up_all(self, t: float) -> None:
        for e in self.entries:
            self.give_up(e, t)

    def outstanding(self) -> int:
        return sum(1 for e in self.entries if e.outcome is None)

    # -- the verdict -------------------------------------------------------------------------

    def counts(self, phase: str | None = None) -> dict[str, Any]:
        """Requests, answers by outcome, duplicates, lost and wrong (of one phase, or all)."""
        es = [e for e in self.entries if phase is None or e.phase == phase]
        by_outcome: dict[str, int] = {}
        by_transport: dict[str, dict[str, Any]] = {}
        for e in es:
            key = e.outcome or "pending"
            by_outcome[key] = by_outcome.get(key, 0) + 1
            t = by_transport.setdefault(e.transport, {})
            t[key] = t.get(key, 0) + 1
            if e.answers > 1:
                t["duplicates"] = t.get("duplicates", 0) + e.answers - 1
        for name, t in by_transport.items():
            lat = [e.latency for e in es if e.transport == name and e.outcome == OK]
            t["p99_ms"] = percentiles(lat, (99.0,))[0] * 1e3 if lat else None
        return {
            "requests": len(es),
            "answers": dict(sorted(by_outcome.items(), key=lambda kv: -kv[1])),
            "by_transport": by_transport,
            "duplicates": sum(e.answers - 1 for e in es if e.answers > 1),
            "lost": by_outcome.get(LOST, 0),
            "wrong": by_outcome.get(WRONG, 0),
        }

    def p99_ms(self, phase: str) -> float | None:
        """p99 latency of the requests of ``phase`` that were answered with a result."""
        lat = [e.latency for e in self.entries if e.phase == phase and e.outcome == OK]
        return percentiles(lat, (99.0,))[0] * 1e3 if lat else None


# -- what the right answer is ---------------------------------------------------------------------


class Oracle:
    """Inputs that tell requests apart, and a check that an answer is the one for its input.

    ``vecadd1k`` gets ``a = key`` (every element) and ``b = 0..1023``: its output names the
    request exactly. Other models draw from a pool of inputs whose outputs were computed
    locally once; the pool index is ``key % pool``, so an answer for another pool entry fails.
    """

    def __init__(self, models: Sequence[str], pool: int = 32, seed: int = 0) -> None:
        from splitserve.bench.inputs import make_inputs
        from splitserve.bench.validate import reference_outputs
        from splitserve.models.catalog import zoo_entry

        self.pool: dict[str, tuple[list[list[np.ndarray]], list[list[np.ndarray]]]] = {}
        self._ramp = np.arange(1024, dtype=np.float32)
        for m in models:
            if m == "vecadd1k":
                continue
            inputs = make_inputs(zoo_entry(m).inputs, pool, seed)
            self.pool[m] = (inputs, reference_outputs(m, 0, inputs))

    def inputs(self, model: str, key: int) -> list[np.ndarray]:
        if model == "vecadd1k":
            return [np.full(1024, float(key % (1 << 24)), dtype=np.float32), self._ramp]
        inputs, _ = self.pool[model]
        return inputs[key % len(inputs)]

    def check(self, model: str, key: int, outputs: Sequence[np.ndarray]) -> str | None:
        """None when ``outputs`` are the answer for request ``key``; else what is wrong."""
        from splitserve.bench.validate import compare

        if model == "vecadd1k":
            want = [self._ramp + np.float32(key % (1 << 24))]
            ok = len(outputs) == 1 and np.array_equal(np.asarray(outputs[0]).reshape(-1), want[0])
            return None if ok else f"vecadd1k output for request {key} starts {np.asarray(outputs[0]).ravel()[:3]}"
        inputs, refs = self.pool[model]
        ok, _, detail = compare([np.asarray(o).reshape(r.shape) for o, r in zip(outputs, refs[key % len(inputs)])],
                                refs[key % len(inputs)])
        return None if ok else detail


def status_name(status: int) -> str:
    """The name of a fast-path status code (the number when it is not one)."""
    try:
        return Status(status).name
    except ValueError:
        return str(status)


def _classify(error: BaseException) -> tuple[str, str]:
    """(outcome, detail) of a failed call on an HTTP or gRPC lane."""
    import httpx

    if isinstance(error, SplitServeError):
        return f"error:{error.status.name}", error.message
    if isinstance(error, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
        return LOST, f"{type(error).__name__}: {error}"
    return CONN, f"{type(error).__name__}: {error}"


# -- lanes ----------------------------------------------------------------------------------------


Clock = Callable[[], float]


class Lane:
    """One client connection; ``submit`` sends a request whose answer goes to the ledger.

    ``submit`` returns a future that is done at the request's first answer (for closed
    loops); callers that send open loop ignore it. A lane never has more than
    ``max_in_flight`` requests open; ``full()`` says when the next one must wait or be skipped.
    """

    def __init__(self, transport: str, url: str, ledger: Ledger, oracle: Oracle, clock: Clock,
                 max_in_flight: int, answer_timeout_s: float) -> None:
        self.transport, self.url = transport, url
        self.ledger, self.oracle, self.clock = ledger, oracle, clock
        self.max_in_flight = max_in_flight
        self.answer_timeout_s = answer_timeout_s
        self.ready = False  # connected, and the models looked up: requests may be sent
        self.open: dict[int, tuple[Entry, asyncio.Future[None]]] = {}
        # requests answered or given up on, so that a second or late answer is charged to them
        self.closed: dict[int, Entry] = {}

    def full(self) -> bool:
        return len(self.open) >= self.max_in_flight

    def usable(self) -> bool:
        """Whether the connection is up (stream lanes lose theirs when the server closes it)."""
        return True

    def _answered(self, rid: int, outcome: str, detail: str | None = None) -> None:
        item = self.open.pop(rid, None)
        if item is None:
            if rid in self.closed:  # a second answer, or one after the client gave up
                self.ledger.answer(self.closed[rid], self.clock(), outcome, detail)
            else:
                self.ledger.stray(self.clock(), self.transport, f"{outcome} for req_id {rid}: {detail or ''}"[:200])
            return
        e, fut = item
        self.closed[rid] = e
        self.ledger.answer(e, self.clock(), outcome, detail)
        if not fut.done():
            fut.set_result(None)

    def _fail_open(self, detail: str) -> None:
        for rid in list(self.open):
            self._answered(rid, CONN, detail)

    def sweep(self) -> None:
        """Record as lost every request open longer than the answer timeout."""
        now = self.clock()
        for rid, (e, fut) in list(self.open.items()):
            if now - e.sent > self.answer_timeout_s:
                del self.open[rid]
                self.closed[rid] = e
                self.ledger.give_up(e, now)
                if not fut.done():
                    fut.set_result(None)

    async def connect(self) -> None:
        raise NotImplementedError

    def submit(self, e: Entry, x: list[np.ndarray], cls: RequestClass) -> asyncio.Future[None]:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class WireLane(Lane):
    """What the TCP, Unix and UDP lanes share: models looked up by name, frames checked."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.ids = itertools.count(1)
        self.infos: dict[str, ModelInfo] = {}
        self.lookups: dict[int, asyncio.Future[tuple[Header, bytes]]] = {}
        self.lookup_retry_s: float | None = None  # resend a LOOKUP after this long (UDP)

    def _frame(self, h: Header, payload: bytes) -> None:
        if h.req_id in self.lookups:
            fut = self.lookups.pop(h.req_id)
            if not fut.done():
                fut.set_result((h, payload))
            return
        if h.kind == Kind.ERROR:
            self._answered(h.req_id, f"error:{status_name(h.status)}", payload.decode(errors="replace")[:300])
            return
        item = self.open.get(h.req_id)
        e = item[0] if item is not None else self.closed.get(h.req_id)
        if e is None:
            self._answered(h.req_id, f"kind {h.kind}")
            return
        info = self.infos[e.model]
        try:
            outs = decode_outputs(info, payload, 1, False)
            wrong = self.oracle.check(e.model, e.key, list(outs.values()))
        except SplitServeError as err:
            wrong = str(err)
        self._answered(h.req_id, WRONG if wrong else OK, wrong)

    def _request(self, e: Entry, x: list[np.ndarray], cls: RequestClass) -> tuple[int, list[bytes]]:
        info = self.infos[e.model]
        rid = next(self.ids)
        payload = [np.ascontiguousarray(a).tobytes() for a in x]
        h = Header(Kind.REQUEST, req_id=rid, func_id=info.func_id, cls=int(cls),
                   payload_len=sum(len(p) for p in payload), total_len=sum(len(p) for p in payload))
        return rid, [h.pack(), *payload]

    async def lookup(self, model: str) -> ModelInfo:
        """The model's description from the server (uncached: pids and state change)."""
        rid = next(self.ids)
        body = model.encode()
        fut: asyncio.Future[tuple[Header, bytes]] = asyncio.get_running_loop().create_future()
        self.lookups[rid] = fut
        wait = self.lookup_retry_s or self.answer_timeout_s
        try:
            for _ in range(max(1, round(self.answer_timeout_s / wait))):
                self._send_raw([Header(Kind.LOOKUP, req_id=rid, payload_len=len(body)).pack(), body])
                try:
                    h, payload = await asyncio.wait_for(asyncio.shield(fut), wait)
                    break
                except TimeoutError:
                    continue
            else:
                raise TimeoutError(f"no answer to LOOKUP {model!r} over {self.transport} in {self.answer_timeout_s} s")
        finally:
            self.lookups.pop(rid, None)
            fut.cancel()
        if h.kind == Kind.ERROR:
            raise error_for_status(h.status, payload.decode(errors="replace"))
        info = ModelInfo.from_json(json.loads(payload))
        self.infos[model] = info
        return info

    def _send_raw(self, parts: list[bytes]) -> None:
        raise NotImplementedError

    def submit(self, e: Entry, x: list[np.ndarray], cls: RequestClass) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        rid, parts = self._request(e, x, cls)
        self.open[rid] = (e, fut)
        try:
            self._send_request(rid, parts)
        except OSError as err:
            self._answered(rid, CONN, f"send failed: {err}")
        return fut

    def _send_request(self, rid: int, parts: list[bytes]) -> None:
        self._send_raw(parts)


class StreamLane(WireLane):
    """A fast-path TCP or Unix connection; reconnects after the server closes it."""

    writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        ep = Endpoint.parse(self.url)
        if ep.scheme == "tcp":
            reader, self.writer = await asyncio.wait_for(asyncio.open_connection(ep.host, ep.port), 10.0)
        else:
            reader, self.writer = await asyncio.wait_for(asyncio.open_unix_connection(ep.path), 10.0)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(reader))

    def usable(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    def full(self) -> bool:
        # a server that does not read our requests must not make this client buffer without bound
        w = self.writer
        return super().full() or (w is not None and w.transport.get_write_buffer_size() > 4 << 20)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        detail = "lane closed"
        try:
            while True:
                h = unpack_header(await reader.readexactly(HEADER_SIZE))
                payload = await reader.readexactly(h.payload_len) if h.payload_len else b""
                self._frame(h, payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, SplitServeError) as err:
            detail = f"{type(err).__name__}: {err}"
        finally:
            if self.writer is not None:
                self.writer.close()
            self.writer = None
            self._fail_open(f"connection lost: {detail}")

    def _send_raw(self, parts: list[bytes]) -> None:
        if self.writer is None or self.writer.is_closing():
            raise ConnectionError("not connected")
        self.writer.writelines(parts)

    async def close(self) -> None:
        if self.writer is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, lane: UdpLane) -> None:
        self.lane = lane

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            h = unpack_header(data)
        except SplitServeError as err:
            self.lane.ledger.stray(self.lane.clock(), "udp", f"bad datagram: {err}")
            return
        if h.seg_count > 1 and h.kind == Kind.RESPONSE:
            self.lane.ledger.stray(self.lane.clock(), "udp", "segmented answer (outputs over one datagram)")
            return
        self.lane._frame(h, data[HEADER_SIZE:HEADER_SIZE + h.payload_len])

    def error_received(self, exc: Exception) -> None:
        logger.debug("udp lane: %s", exc)


class UdpLane(WireLane):
    """A fast-path UDP socket: one datagram per request, retransmitted until answered."""

    def __init__(self, *args: Any, retry_s: float = 1.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.retry_s = self.lookup_retry_s = retry_s
        self.datagrams: dict[int, tuple[list[bytes], float]] = {}

    async def connect(self) -> None:
        ep = Endpoint.parse(self.url)
        loop = asyncio.get_running_loop()
        self.transport_, _ = await loop.create_datagram_endpoint(lambda: _Datagrams(self),
                                                                 remote_addr=(ep.host, ep.port))
        sock = self.transport_.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)

    def _send_raw(self, parts: list[bytes]) -> None:
        self.transport_.sendto(b"".join(parts))

    def _send_request(self, rid: int, parts: list[bytes]) -> None:
        self.datagrams[rid] = (parts, self.clock())
        self._send_raw(parts)

    def _answered(self, rid: int, outcome: str, detail: str | None = None) -> None:
        self.datagrams.pop(rid, None)
        super()._answered(rid, outcome, detail)

    def sweep(self) -> None:
        now = self.clock()
        for rid, (parts, last) in list(self.datagrams.items()):
            if now - last >= self.retry_s and rid in self.open:
                self.open[rid][0].transmissions += 1
                self.datagrams[rid] = (parts, now)
                self._send_raw(parts)
        for rid in [r for r in self.datagrams if r not in self.open]:
            del self.datagrams[rid]
        super().sweep()

    async def close(self) -> None:
        self.transport_.close()


class CallLane(Lane):
    """HTTP or gRPC through the library's asyncio client: one answer per call by construction.

    Each call times itself out, so the lane's own sweep has nothing to do.
    """

    async def connect(self) -> None:
        from splitserve.bench.transports import open_async

        self.client = await open_async(self.transport, self.url, timeout=self.answer_timeout_s)
        self.tasks: set[asyncio.Task[None]] = set()

    def sweep(self) -> None:
        pass

    def submit(self, e: Entry, x: list[np.ndarray], cls: RequestClass) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        rid = e.key
        self.open[rid] = (e, fut)
        task = asyncio.get_running_loop().create_task(self._call(rid, e, x, cls))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return fut

    async def _call(self, rid: int, e: Entry, x: list[np.ndarray], cls: RequestClass) -> None:
        try:
            r = await asyncio.wait_for(self.client.infer_result(e.model, tuple(x), cls=int(cls)),
                                       self.answer_timeout_s)
        except Exception as err:  # every failure is an outcome of this request, never of the run
            outcome, detail = _classify(err)
            self._answered(rid, outcome, detail)
            return
        wrong = self.oracle.check(e.model, e.key, list(r.outputs.values()))
        self._answered(rid, WRONG if wrong else OK, wrong)

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        from splitserve.bench.transports import close_async

        await close_async(self.client)


def make_lane(transport: str, url: str, ledger: Ledger, oracle: Oracle, clock: Clock, max_in_flight: int,
              answer_timeout_s: float) -> Lane:
    """The lane for ``transport`` (tcp, unix, udp, http-json, http-binary, grpc)."""
    cls: type[Lane] = {"tcp": StreamLane, "unix": StreamLane, "udp": UdpLane}.get(transport, CallLane)
    return cls(transport, url, ledger, oracle, clock, max_in_flight, answer_timeout_s)


__all__ = ["CONN", "LOST", "OK", "WRONG", "CallLane", "Entry", "Lane", "Ledger", "Oracle", "StreamLane",
           "UdpLane", "WireLane", "make_lane", "status_name"]
