"""Direct-endpoint routing shared by ``Client`` and ``AsyncClient``: which worker endpoints
a client connects to, and when it looks a model up again."""

from __future__ import annotations

import itertools
from typing import Any

from splitserve.client.common import Endpoint, ModelInfo
from splitserve.client.frames import _PLAIN_FIELDS
from splitserve.protocol.header import RequestPacker


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


def _direct_targets(front: Endpoint, info: ModelInfo) -> list[tuple[str, int]]:
    """The direct endpoints a client connects to for ``info``, each with the func id its
    calls carry there: a cluster's gateway names each node's workers with that node's func
    id (``nodes``), a node its own workers (``_direct_urls``), which take the model's."""
    nodes = info.extra.get("nodes")
    if nodes is not None:
        return [(url, int(n["func_id"])) for n in nodes for url in n.get("direct_tcp", ())]
    return [(url, info.func_id) for url in _direct_urls(front, info)]


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

    def __init__(self, info: ModelInfo, streams: list[Any], due_at: float) -> None:
        # ``streams``: the client's own connections to the workers (``stream._Stream`` or
        # ``aio._AsyncConn``), typed loosely so that routing imports neither client
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
