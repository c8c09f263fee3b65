"""The cluster gateway's data plane: the fast path in front of many node servers (docs/cluster.md §2.4).

One asyncio process, no Ray: Ray is never on the per-request path. Clients speak the
ordinary fast path (docs/protocol.md) to the gateway; for each request the gateway

- keeps it in the ``Ledger`` (header and payload) until its first answer,
- chooses a node with the ``Dispatcher`` (ACTIVE nodes with the model, the class's market
  first, the least loaded),
- rewrites ``req_id`` to the ledger's gateway-unique id and ``func_id`` to that node's own
  id for the model (node registries assign ids independently; the cluster's ids are the
  controller's), and forwards the frame over one persistent TCP link to the node,
- maps the answer back to the client's ``req_id`` and cluster ``func_id``.

A link's EOF, or a node silent for ``ping_misses`` pings (``HealthTracker``), or the
controller's routes saying DEAD, takes the node out and re-sends what it held; a late
answer for a request already answered is dropped by the ledger. What the gateway holds is
bounded: the ledger's capacity, the payload bytes held, each node's window, each client
connection's unanswered calls (its reading pauses past ``gateway_client_in_flight``).

Every front end goes through ``GatewayCore.submit`` with a ``Reply`` of its own: fast-path
frames here, HTTP calls through ``cluster/gateway/dataplane.py`` (the process's composition root),
so exactly-once, re-sends and health checks are the same for both. Routes (which nodes
exist, their state, market and models; the cluster's model ids) come from the controller
through the Gateway actor (``dataplane.run``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from splitserve.client.common import ModelInfo
from splitserve.cluster.gateway.direct import direct_routes
from splitserve.cluster.policy.dispatch import Dispatcher, NodeState, NodeView
from splitserve.cluster.policy.health import Health, HealthTracker
from splitserve.cluster.policy.ledger import Deliver, Drop, Entry, Ledger, Outcome, Resend
from splitserve.cluster.pools import Market
from splitserve.cluster.config import ClusterConfig
from splitserve.errors import (
    BadFrame, ModelNotReady, PayloadTooLarge, QueueFull, SplitServeError, UnknownModel, error_for_status,
)
from splitserve.protocol.header import Header, Kind, RequestClass
from splitserve.protocol.stream import read_frame
from splitserve.slo import SloOutcome, slo_outcome

log = logging.getLogger(__name__)

# A node's LOOKUP reply names its workers' direct endpoints, which take that node's func id and
# bind the node's own address: a client of the gateway gets them per node instead (``nodes``,
# ``direct.direct_routes``), never as the model's own.
_NODE_ROUTES = frozenset({"direct", "direct_tcp", "direct_classes", "direct_tcp_classes"})

# Ids the gateway uses for its own LOOKUPs and PINGs on a node link: above every ledger id.
_CONTROL_BIT = 1 << 63


@dataclass(frozen=True)
class NodeRoute:
    """One node server as the controller publishes it."""

    node: str
    host: str
    port: int
    market: Market
    state: NodeState
    models: frozenset[str] = frozenset()
    http_port: int | None = None  # its HTTP front end (the gateway reads its /metrics there)


@dataclass(frozen=True)
class Routes:
    """The controller's routing table: every node, and the cluster's func id per model."""

    version: int
    nodes: tuple[NodeRoute, ...] = ()
    models: tuple[tuple[str, int], ...] = ()  # (name, cluster func id)

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "models": [list(m) for m in self.models],
                           "nodes": [asdict(n) | {"market": str(n.market), "state": str(n.state),
                                                  "models": sorted(n.models)} for n in self.nodes]})

    @classmethod
    def from_json(cls, text: str) -> "Routes":
        doc = json.loads(text)
        nodes = tuple(NodeRoute(n["node"], n["host"], int(n["port"]), Market.parse(n["market"]),
                                NodeState.parse(n["state"]), frozenset(n["models"]), n.get("http_port"))
                      for n in doc["nodes"])
        return cls(int(doc["version"]), nodes, tuple((str(m), int(f)) for m, f in doc["models"]))


class Reply(Protocol):
    """Who gets one request's single answer: a fast-path client connection, or an HTTP call."""

    def result(self, h: Header, payload: bytes) -> None:
        """The node's RESPONSE (its header, with the node's ids) and the outputs' bytes."""

    def error(self, e: SplitServeError) -> None:
        """The request failed: ``e`` names why."""


@dataclass
class _Held:
    """What the ledger keeps per request: who is answered, and the frame to send again."""

    reply: Reply
    header: Header  # as the client sent it: class, deadline, SLO
    payload: bytes
    deadline: float | None
    slo: float | None  # a strict call's soft SLO (the core's clock), its own or its model's


@dataclass
class _ClientConn:
    writer: asyncio.StreamWriter
    limit: int
    unanswered: int = 0
    room: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    def __post_init__(self) -> None:
        self.room.set()

    def write(self, parts: list[bytes]) -> None:
        if not self.closed:
            self.writer.writelines(parts)

    def answered(self) -> None:
        self.unanswered -= 1
        if self.unanswered < self.limit:
            self.room.set()


@dataclass
class _FrameReply:
    """A fast-path client's answer: a frame with its own req_id and the cluster's func_id."""

    conn: _ClientConn
    req_id: int
    func_id: int

    def result(self, h: Header, payload: bytes) -> None:
        h.req_id, h.func_id = self.req_id, self.func_id
        self.conn.write([h.pack(), payload])
        self.conn.answered()

    def error(self, e: SplitServeError) -> None:
        self.conn.write(_error(Header(Kind.ERROR, req_id=self.req_id, func_id=self.func_id), e))
        self.conn.answered()


@dataclass
class _Link:
    """One persistent TCP connection to a node server."""

    node: str
    writer: asyncio.StreamWriter
    func_ids: dict[str, int] = field(default_factory=dict)  # model -> the node's func id
    lookups: dict[str, bytes] = field(default_factory=dict)  # model -> the node's LOOKUP_REPLY JSON
    learning: set[str] = field(default_factory=set)  # models a LOOKUP is out for
    pending: dict[int, asyncio.Future] = field(default_factory=dict)  # control id -> reply


class GatewayCore:
    """The gateway's state and request path; ``serve`` binds it to a TCP port."""

    def __init__(self, cfg: ClusterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.ledger = Ledger(cfg.ledger_capacity, cfg.max_attempts)
        self.dispatcher = Dispatcher(cfg.node_window, cfg.two_choices_above, random.Random(cfg.revocation_seed),
                                     cfg.dispatch_prefer_below)
        self.health = HealthTracker(cfg.ping_interval_s, cfg.ping_misses)
        self.routes = Routes(0)
        self._by_node: dict[str, NodeRoute] = {}
        self._names: dict[int, str] = {}  # cluster func id -> model
        self._links: dict[str, _Link] = {}
        self._link_tasks: dict[str, asyncio.Task] = {}
        self._control_ids = itertools.count(1)
        self._held_bytes = 0
        # requests waiting for a node with their model (ledger id -> entry, exclude); bounded
        # by the ledger's capacity, each for at most gateway_dispatch_wait_s
        self._parked: dict[int, tuple[Entry, frozenset[str]]] = {}
        self._parked_since: dict[int, float] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self.answers_by_node: dict[str, int] = {}  # results delivered, per node (status and tests)
        # what became of the requests (cumulative: /metrics, and the controller's autoscaler takes
        # the strict SLO outcomes' differences between its decisions)
        self.accepted = 0
        self.answered: Counter[str] = Counter()  # "result", or the error's status name
        self.refused: Counter[str] = Counter()  # not accepted, by status name
        self.waits = 0  # requests that waited for a node with their model
        self.strict_slo: Counter[SloOutcome] = Counter({o: 0 for o in SloOutcome})
        self._model_slo: dict[str, float] = {}  # a model's own SLO, from its nodes' lookup replies
        self._news = asyncio.Event()  # set (and replaced) whenever routes, links or health may have changed

    # -- routes -----------------------------------------------------------------------------

    def update(self, routes: Routes) -> None:
        """Apply a newer routing table: links to new nodes, lost work of DEAD or removed ones."""
        if routes.version <= self.routes.version:
            return
        self.routes = routes
        self._names = {f: m for m, f in routes.models}
        self._by_node = {n.node: n for n in routes.nodes}
        for node in list(self._link_tasks):
            route = self._by_node.get(node)
            if route is None or route.state is NodeState.DEAD:
                self._link_tasks.pop(node).cancel()
                self._lose(node, "the controller retired it")
        for route in routes.nodes:
            if route.state is not NodeState.DEAD and route.node not in self._link_tasks:
                self._link_tasks[route.node] = self._spawn(self._keep_link(route.node))
            link = self._links.get(route.node)
            if link is not None:
                # a model moved off the node is forgotten there: loaded again later, its workers
                # (and their direct endpoints) are new ones, learned afresh
                for model in link.func_ids.keys() - route.models:
                    del link.func_ids[model]
                    link.lookups.pop(model, None)
                for model in route.models - link.func_ids.keys():
                    self._learn_once(link, model)
        self._unpark()
        log.info("routes v%d: %s", routes.version,
                 ", ".join(f"{n.node[:12]}={n.state}" for n in routes.nodes) or "no nodes")

    def views(self) -> list[NodeView]:
        """Dispatch's view: a node is ACTIVE only while its route says so, its link is up and
        its health is ALIVE; it has the models whose node func id the link learned."""
        now = self.clock()
        serving = self.health.serving(now)
        out = []
        for node, link in self._links.items():
            route = self._by_node.get(node)
            if route is None:
                continue
            state = route.state if node in serving else NodeState.STARTING
            out.append(NodeView(node, route.market, state, frozenset(route.models & link.func_ids.keys())))
        return out

    # -- clients ----------------------------------------------------------------------------

    async def serve(self, host: str, port: int) -> int:
        """Listen for clients; returns the bound port."""
        self._server = await asyncio.start_server(self._client, host, port)
        self._spawn(self._pinger())
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for link in self._links.values():
            link.writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _ClientConn(writer, self.cfg.gateway_client_in_flight)
        try:
            while True:
                await conn.room.wait()
                try:
                    h, payload = await read_frame(reader, self.cfg.gateway_held_bytes)
                except BadFrame as e:
                    conn.write(_error(Header(Kind.ERROR), e))
                    break
                if payload is None:
                    conn.write(_error(h, PayloadTooLarge(
                        f"payload of {h.payload_len} bytes is over the gateway's {self.cfg.gateway_held_bytes}")))
                    continue
                self._frame(conn, h, payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            conn.closed = True
            writer.close()

    def _frame(self, conn: _ClientConn, h: Header, payload: bytes) -> None:
        if h.kind == Kind.PING:
            conn.write([Header(Kind.PONG, req_id=h.req_id).pack()])
        elif h.kind == Kind.LOOKUP:
            conn.write(self._lookup(h, payload))
        elif h.kind == Kind.REQUEST:
            self._request(conn, h, payload)
        else:
            conn.write(_error(h, BadFrame(f"a client may not send frame kind {h.kind}")))

    def _lookup(self, h: Header, payload: bytes) -> list[bytes]:
        try:
            info = self.model_info(payload.decode(errors="replace"))
        except SplitServeError as e:
            return _error(h, e)
        body = json.dumps(info.extra | {"nodes": self._direct_routes(info.name)}).encode()
        # the nodes' workers change under a model's evictions and reloads there: what a client
        # is told now is asked afresh for its next lookup (a direct client looks up again while
        # it holds fewer connections than it was offered)
        for link in self._links.values():
            if info.name in link.lookups:
                self._learn_once(link, info.name)
        return [Header(Kind.LOOKUP_REPLY, req_id=h.req_id, func_id=info.func_id, payload_len=len(body)).pack(), body]

    def _request(self, conn: _ClientConn, h: Header, payload: bytes) -> None:
        model = self._names.get(h.func_id)
        if model is None:
            conn.write(_error(h, UnknownModel(f"no model with func_id {h.func_id} in the cluster")))
            return
        # counted before it is held: a refusal by dispatch answers (and uncounts) it at once
        conn.unanswered += 1
        if conn.unanswered >= conn.limit:
            conn.room.clear()
        try:
            self.submit(model, h, payload, _FrameReply(conn, h.req_id, h.func_id))
        except SplitServeError as e:
            conn.write(_error(h, e))
            conn.answered()

    def submit(self, model: str, h: Header, payload: bytes, reply: Reply) -> None:
        """Hold one request for ``model`` (``h``: its class, deadline and SLO) until ``reply``
        has its one answer, and send it to a node: the path of every front end. Raises when
        the gateway refuses it (then ``reply`` is never called)."""
        try:
            entry = self._accept(model, h, payload, reply)
        except SplitServeError as e:
            self.refused[e.status.name] += 1
            raise
        self.accepted += 1
        self._held_bytes += len(payload)
        self._dispatch(entry, frozenset())

    def _accept(self, model: str, h: Header, payload: bytes, reply: Reply) -> Entry:
        if self._held_bytes + len(payload) > self.cfg.gateway_held_bytes:
            raise QueueFull(f"the gateway holds {self._held_bytes} bytes of unanswered requests")
        try:
            cls = RequestClass(h.cls)
        except ValueError:
            raise BadFrame(f"unknown request class {h.cls}") from None
        now = self.clock()
        deadline = now + h.deadline_us / 1e6 if h.deadline_us else None
        # the node measures a call's SLO from its own arrival; the cluster's autoscaler wants
        # the client's view, from here, with the gateway's waits and re-sends in it
        slo_s = h.slo_us / 1e6 if h.slo_us else self._model_slo.get(model)
        slo = now + slo_s if cls is RequestClass.RT and slo_s else None
        return self.ledger.accept(model, cls, _Held(reply, h, payload, deadline, slo), now, deadline)

    def model_info(self, name: str) -> ModelInfo:
        """``name`` as its nodes describe it (their lookup reply), with the cluster's func id.
        Raises UnknownModel when the cluster has no such model, ModelNotReady while no node
        has answered its lookup."""
        fid = next((f for m, f in self.routes.models if m == name), None)
        if fid is None:
            raise UnknownModel(f"no model named {name!r} in the cluster; models: "
                               f"{', '.join(m for m, _ in self.routes.models) or 'none'}")
        reply = next((link.lookups[name] for link in self._links.values() if name in link.lookups), None)
        if reply is None:
            raise ModelNotReady(f"model {name!r}: no node serves it yet")
        described = {k: v for k, v in json.loads(reply).items() if k not in _NODE_ROUTES}
        return ModelInfo.from_json(described | {"func_id": fid})

    def _direct_routes(self, name: str) -> list[dict]:
        """``name``'s workers on each active node with a link, for a direct client."""
        return direct_routes((node, route.host, link.func_ids[name], link.lookups[name])
                             for node, link in self._links.items()
                             if name in link.lookups and (route := self._by_node.get(node)) is not None
                             and route.state is NodeState.ACTIVE and name in route.models)

    def serves(self, name: str | None = None) -> bool:
        """Some node takes work now (for ``name``: one with that model)."""
        return any(v.state is NodeState.ACTIVE and (name is None or name in v.models) for v in self.views())

    def _dispatch(self, entry: Entry, exclude: frozenset[str]) -> None:
        try:
            node = self.dispatcher.choose(entry.model, entry.cls, self.views(), self.ledger.in_flight(), exclude)
        except ModelNotReady as e:
            # no node serves it right now (one lost, its replacement starting, the others
            # suspect): wait a bounded time for one rather than refuse at once
            since = self._parked_since.get(entry.req_id, self.clock())
            if self.clock() - since < self.cfg.gateway_dispatch_wait_s:
                if entry.req_id not in self._parked_since:
                    self.waits += 1
                self._parked_since[entry.req_id] = since
                self._parked[entry.req_id] = (entry, exclude)
            else:
                self._parked_since.pop(entry.req_id, None)
                self._outcome(self.ledger.fail(entry.req_id, e))
            return
        except QueueFull as e:
            self._parked_since.pop(entry.req_id, None)
            self._outcome(self.ledger.fail(entry.req_id, e))
            return
        self._parked_since.pop(entry.req_id, None)
        held: _Held = entry.handle  # type: ignore[assignment]
        link = self._links[node]
        h = held.header
        remaining = 0
        if held.deadline is not None:
            remaining = max(1, int((held.deadline - self.clock()) * 1e6))
        fwd = Header(Kind.REQUEST, req_id=entry.req_id, func_id=link.func_ids[entry.model], cls=h.cls,
                     deadline_us=remaining, payload_len=len(held.payload), slo_us=h.slo_us)
        self.ledger.sent(entry.req_id, node)
        link.writer.writelines([fwd.pack(), held.payload])

    def _outcome(self, out: Outcome, reply: tuple[Header, bytes] | None = None) -> None:
        if isinstance(out, Resend):
            self._dispatch(out.entry, out.exclude)
            return
        if isinstance(out, Drop):
            log.debug("dropped an answer for %d from %s: %s", out.req_id, out.node, out.reason)
            return
        held: _Held = out.entry.handle  # type: ignore[assignment]
        self._held_bytes -= len(held.payload)
        self.answered["result" if out.error is None else out.error.status.name] += 1
        if held.slo is not None:
            self.strict_slo[slo_outcome(held.slo, self.clock(), out.error)] += 1
        if out.error is not None:
            held.reply.error(out.error)
            return
        assert reply is not None, "a result comes only with a node's answer"
        held.reply.result(*reply)
        self.answers_by_node[out.node or ""] = self.answers_by_node.get(out.node or "", 0) + 1

    # -- node links -------------------------------------------------------------------------

    async def _keep_link(self, node: str) -> None:
        """Connect to ``node`` and read its answers; reconnect after a loss while its route
        stays (a node that restarted its server comes back with new func ids)."""
        while (route := self._by_node.get(node)) is not None and route.state is not NodeState.DEAD:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(route.host, route.port),
                                                        self.cfg.ping_interval_s)
            except (OSError, TimeoutError) as e:
                log.info("node %s at %s:%d: no connection yet (%s)", node[:12], route.host, route.port, e)
                await asyncio.sleep(self.cfg.ping_interval_s)
                continue
            with contextlib.suppress(OSError):
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(node, writer)
            self._links[node] = link
            self.health.add(node, self.clock())
            for model in route.models:
                self._learn_once(link, model)
            try:
                await self._read_link(link, reader)
            finally:
                self._lose(node, "its connection closed")
            await asyncio.sleep(self.cfg.ping_interval_s)

    async def _read_link(self, link: _Link, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, OSError, BadFrame):
            while True:
                h, payload = await read_frame(reader)
                assert payload is not None  # no bound below the header's own: every payload is read
                now = self.clock()
                self.health.heard(link.node, now)
                if h.req_id & _CONTROL_BIT:
                    fut = link.pending.pop(h.req_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result((h, payload))
                    continue
                error = None
                if h.kind == Kind.ERROR:
                    error = error_for_status(h.status, payload.decode(errors="replace"))
                self._outcome(self.ledger.answered(h.req_id, link.node, now, error), (h, payload))

    def _learn_once(self, link: _Link, model: str) -> None:
        """``_learn`` ``model`` on ``link`` unless a LOOKUP for it is already out there."""
        if model not in link.learning:
            link.learning.add(model)
            self._spawn(self._learn(link, model))

    async def _learn(self, link: _Link, model: str) -> None:
        """LOOKUP ``model`` on ``link``'s node: its func id there, and the reply for clients."""
        try:
            h, payload = await self._control(link, Kind.LOOKUP, model.encode())
        except (TimeoutError, ConnectionError):
            return
        finally:
            link.learning.discard(model)
        route = self._by_node.get(link.node)
        if route is None or model not in route.models:
            return  # moved off the node while the LOOKUP was out: not served there now
        if h.kind == Kind.LOOKUP_REPLY:
            link.lookups[model] = payload
            link.func_ids[model] = h.func_id
            slo_s = json.loads(payload).get("slo_s")
            if slo_s:
                self._model_slo[model] = float(slo_s)
            self._unpark()
        else:
            log.warning("node %s has no model %s: %s", link.node[:12], model, payload.decode(errors="replace"))

    async def _control(self, link: _Link, kind: Kind, body: bytes = b"") -> tuple[Header, bytes]:
        cid = _CONTROL_BIT | next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        link.pending[cid] = fut
        link.writer.writelines([Header(kind, req_id=cid, payload_len=len(body)).pack(), body])
        try:
            return await asyncio.wait_for(fut, self.health.dead_after_s)
        finally:
            link.pending.pop(cid, None)

    async def _pinger(self) -> None:
        """Every ping period (``HealthTracker.ping_period_s``): PING each link; nodes silent for
        ``ping_misses`` intervals are lost."""
        while True:
            await asyncio.sleep(self.health.ping_period_s)
            for link in list(self._links.values()):
                cid = _CONTROL_BIT | next(self._control_ids)
                with contextlib.suppress(OSError, RuntimeError):
                    link.writer.write(Header(Kind.PING, req_id=cid).pack())
            for node in self.health.check(self.clock()):
                self._lose(node, f"silent for {self.health.dead_after_s:.1f} s")
            self._unpark()

    async def until(self, check: Callable[[], bool]) -> None:
        """Return once ``check()`` holds, looked at again on every change of the routes, the
        links' lookups and health (each ping round at least); the caller bounds the wait."""
        while not check():
            await self._news.wait()

    def _unpark(self) -> None:
        """Try the waiting requests again (a node came, or their wait is over)."""
        news, self._news = self._news, asyncio.Event()
        news.set()
        parked, self._parked = self._parked, {}
        for entry, exclude in parked.values():
            self._dispatch(entry, exclude)

    def _lose(self, node: str, why: str) -> None:
        """``node`` is out of dispatch: close its link and send what it held elsewhere."""
        link = self._links.pop(node, None)
        self.health.remove(node)
        if link is not None:
            link.writer.close()
            for fut in link.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"node {node} lost"))
        outcomes = self.ledger.node_lost(node, self.clock())
        if link is not None or outcomes:
            log.warning("node %s lost (%s): %d requests sent again or answered", node[:12], why, len(outcomes))
        for out in outcomes:
            self._outcome(out)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def stats(self) -> dict[str, Any]:
        """What the gateway holds and has done (for ``cluster status``, /metrics and tests;
        ``slo``, the strict calls' SLO outcomes so far, is the controller's autoscaler's input)."""
        return {"routes": self.routes.version, "held": len(self.ledger), "held_bytes": self._held_bytes, "waiting": len(self._parked),
                "in_flight": dict(self.ledger.in_flight()), "delivered": self.ledger.delivered,
                "resent": self.ledger.resent, "dropped": self.ledger.dropped,
                "accepted": self.accepted, "answered": dict(self.answered), "refused": dict(self.refused),
                "waits": self.waits, "slo": {str(o): n for o, n in self.strict_slo.items()},
                "answers_by_node": dict(self.answers_by_node), "links": sorted(self._links),
                "held_by_model": dict(Counter(e.model for e in self.ledger)),  # each model's demand (placement)
                "models": {n: sorted(link.func_ids) for n, link in self._links.items()}}

    def health_states(self) -> dict[str, Health]:
        """Each routed node's health as the gateway's pings see it (a node without a link: DEAD)."""
        now = self.clock()
        return {node: self.health.state(node, now) if node in self._links else Health.DEAD for node in self._by_node}


def _error(h: Header, e: SplitServeError) -> list[bytes]:
    body = e.message.encode()
    return [Header(Kind.ERROR, req_id=h.req_id, func_id=h.func_id, status=int(e.status),
                   payload_len=len(body)).pack(), body]
