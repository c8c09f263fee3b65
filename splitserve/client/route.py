"""Direct-endpoint routing shared by ``Client`` and ``AsyncClient``: which worker endpoints
a client connects to, and when it looks a model up again."""

from __future__ import annotations

import itertools
from typing import Any

from splitserve.client.common import Endpoint, ModelInfo
from splitserve.client.frames import _PLAIN_FIELDS
from splitserve.errors import InvalidInput
from splitserve.protocol.header import RequestClass, RequestPacker

_BE, _DEFAULT = int(RequestClass.BE), int(RequestClass.DEFAULT)  # plain ints: compared per call


VIA_FRONT = "via-front"  # ``direct``: reach the workers through the front end's port only


def direct_mode(direct: "bool | str") -> tuple[bool, bool]:
    """A client's ``direct`` argument as (go direct, reach the workers through the front
    end's port from the start): True, False or ``"via-front"``."""
    if direct is True or direct is False:
        return direct, False
    if direct == VIA_FRONT:
        return True, True
    raise InvalidInput(f'direct is True, False or "{VIA_FRONT}", not {direct!r}')


def _direct_urls(front: Endpoint, info: ModelInfo) -> tuple[list[str], str]:
    """The direct endpoints of ``info``'s workers for a client that reached the front end at
    ``front``, and the LOOKUP key of their classes: from a ``unix://`` front end their Unix
    sockets (LOOKUP's ``direct``), from a ``tcp://`` one their TCP ports (``direct_tcp``) at
    the host the client reached the front end at, since the workers bind the front end's own
    address (which may be a wildcard, or have another name here). From a ``tcp://`` front end
    whose server offers no TCP endpoints (``direct_tcp`` off) their Unix sockets, which such a
    client never connects to (they may name another server's sockets on its own machine) but
    names in a HANDOFF to the front end, which hands its connection over to that worker
    (``protocol/handoff.py``); a server that knows no HANDOFF (an older one) answers that
    with an error, and the client's calls go through the front end."""
    if front.scheme == "unix" or not info.extra.get("direct_tcp"):
        return list(info.extra.get("direct", ())), "direct_classes"
    host = f"[{front.host}]" if ":" in front.host else front.host
    return [f"tcp://{host}:{Endpoint.parse(url).port}" for url in info.extra["direct_tcp"]], "direct_tcp_classes"


def handed_over_only(front: Endpoint, url: str) -> bool:
    """Whether a client that reached the front end at ``front`` reaches the worker at ``url``
    only through a connection the front end hands over to it (``_direct_urls``: a Unix
    socket named to a TCP client)."""
    return front.scheme == "tcp" and url.startswith("unix:")


def _best_effort(urls: list, classes: list | None) -> list[bool]:
    """Whether each of ``urls`` serves best-effort calls only (its LOOKUP's classes, in order;
    a server that names none has every worker take any call)."""
    if not classes or len(classes) != len(urls):
        return [False] * len(urls)
    return [c == "be" for c in classes]


def _direct_targets(front: Endpoint, info: ModelInfo) -> list[tuple[str, int, bool]]:
    """The direct endpoints a client connects to for ``info``, each with the func id its
    calls carry there and whether it serves best-effort calls only (an instance kept for
    them: ``_Route.pick``): a cluster's gateway names each node's workers with that node's
    func id (``nodes``), a node its own workers (``_direct_urls``), which take the model's."""
    nodes = info.extra.get("nodes")
    if nodes is not None:
        return [(url, int(n["func_id"]), be) for n in nodes
                for url, be in zip(n.get("direct_tcp", ()), _best_effort(n.get("direct_tcp", []),
                                                                         n.get("direct_tcp_classes")))]
    urls, key = _direct_urls(front, info)
    return [(url, info.func_id, be) for url, be in zip(urls, _best_effort(urls, info.extra.get(key)))]


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

    __slots__ = ("info", "plain", "streams", "by_class", "default_be", "turns", "due_at", "stale")

    def __init__(self, info: ModelInfo, streams: list[Any], due_at: float) -> None:
        self.info = info
        self.plain = RequestPacker(info.func_id, *_PLAIN_FIELDS)  # the header of a call that names no class
        self.default_be = info.extra.get("default_class") == "be"  # what a call that names no class is
        self.set_streams(streams)
        self.turns = itertools.count()
        # when a direct client looks the model up again (its streams shrink only when one
        # closes, which sets ``stale``, so the interval is known at the lookup)
        self.due_at = due_at
        self.stale = False  # a direct connection closed: look the model up again

    def set_streams(self, streams: list[Any]) -> None:
        """The client's own connections to the workers (``stream._Stream`` or
        ``aio._AsyncConn``, typed loosely so that routing imports neither client), each with
        ``best_effort`` set from its target. Replaced, never changed in place, so a caller
        picks from them without the client's lock."""
        self.streams = streams
        self.by_class = ([s for s in streams if not s.best_effort], [s for s in streams if s.best_effort])

    def pick(self, cls: int) -> Any | None:
        """The connection a call of class ``cls`` (a header's class byte) goes on: the next of
        those whose workers serve its class, or of them all where none does (a model with no
        instance kept for best-effort work); None with no direct connection."""
        be = cls == _BE or (cls == _DEFAULT and self.default_be)
        streams = self.by_class[be] or self.streams
        return streams[next(self.turns) % len(streams)] if streams else None

    def lookup_due(self, now: float) -> bool:
        """Whether a direct client looks the model up again before its next call: a direct
        connection of it closed, or ``_lookup_interval`` has passed since the last lookup."""
        return self.stale or now > self.due_at
