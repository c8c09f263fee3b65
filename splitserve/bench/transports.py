"""The transports a scenario can measure, and how to open a client for each.

Transport names are the benchmark's, not URL schemes: ``http-json`` and ``http-binary`` use
the same HTTP port with a different body encoding. The HTTP and gRPC clients live in their
own modules and are imported only when used; if one is missing, or the server did not open
that front end, opening it raises ``Unavailable`` and the scenario reports the transport as
unavailable instead of failing.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.launcher import urls_from_info

# transports served by a splitserve server, in report order
SERVER_TRANSPORTS: tuple[str, ...] = ("tcp", "unix", "direct", "direct-tcp", "direct-front", "udp", "http-json",
                                      "http-binary", "grpc")
# reference points measured without a server
BASELINES: tuple[str, ...] = ("local", "echo")

SCHEME: dict[str, str] = {
    "tcp": "tcp", "unix": "unix", "udp": "udp", "http-json": "http", "http-binary": "http", "grpc": "grpc",
    # looked up at the front end's Unix socket, then straight to the workers' Unix sockets;
    # or at its TCP port, then to the workers' TCP ports (the way a remote client goes)
    "direct": "unix", "direct-tcp": "tcp",
    # looked up at the front end's TCP port, and a connection there handed over to the worker
    # (``protocol/handoff.py``): the way a client goes that may reach only the front end's port
    "direct-front": "tcp",
}
LABEL: dict[str, str] = {
    "tcp": "fast path TCP", "unix": "fast path Unix", "direct": "fast path direct (to the worker, Unix)",
    "direct-tcp": "fast path direct (to the worker, TCP)",
    "direct-front": "fast path direct (to the worker, handed over at the front end's TCP port)",
    "udp": "fast path UDP", "http-json": "HTTP JSON",
    "http-binary": "HTTP binary", "grpc": "gRPC", "local": "in-process (ideal)", "echo": "TCP echo (floor)",
}
SHORT: dict[str, str] = {
    "tcp": "TCP", "unix": "Unix", "direct": "direct", "direct-tcp": "direct TCP", "direct-front": "direct via FE",
    "udp": "UDP", "http-json": "HTTP-J", "http-binary": "HTTP-B",
    "grpc": "gRPC", "local": "local", "echo": "echo",
}
DIRECT: tuple[str, ...] = ("direct", "direct-tcp", "direct-front")  # the transports that go straight to the workers
# A direct path's name with this suffix: the same path measured by a client that polls for its
# answers before it sleeps (``Client(poll_us=...)``)
POLLS = "+poll"


def path_label(path: str, short: bool = False) -> str:
    """A transport's label (``SHORT``'s with ``short``), ", client polls" after a polled path's."""
    base = path.removesuffix(POLLS)
    return (SHORT if short else LABEL)[base] + (", client polls" if path != base else "")


FAST_PATH: tuple[str, ...] = ("tcp", "unix", *DIRECT, "udp")
# third-party clients (bench peers), by the names in splitserve.bench.peers.clients.CLIENTS
PEER_CLIENTS: tuple[str, ...] = ("tritonclient-http", "tritonclient-grpc", "httpx-raw")


class Unavailable(Exception):
    """A transport cannot be measured here; the message says why."""


@dataclass(frozen=True)
class Target:
    """Where a server listens: one URL per scheme (tcp, unix, udp, http, grpc)."""

    urls: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, values: Sequence[str]) -> Target:
        """From ``--url`` values: URLs (the scheme says which transport), or the path of a
        running server's ``server.json`` or data directory (every transport it opened)."""
        urls: dict[str, str] = {}
        for v in values:
            p = Path(v)
            if "://" not in v and (p.is_file() or (p / "server.json").is_file()):
                info_file = p if p.is_file() else p / "server.json"
                urls.update(urls_from_info(json.loads(info_file.read_text())))
                continue
            scheme = v.split("://", 1)[0] if "://" in v else ""
            if scheme not in SCHEME.values():
                raise ValueError(f"--url {v!r}: give a tcp://, unix://, udp://, http:// or grpc:// URL, "
                                 "or the path of a server's server.json")
            urls[scheme] = v
        return cls(urls)

    def url(self, transport: str) -> str:
        scheme = SCHEME.get(transport)
        if scheme is None:
            raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(SCHEME)}")
        url = self.urls.get(scheme)
        if url is None:
            raise Unavailable(f"the server has no {scheme}:// endpoint (front end off or not built)")
        return url


def _import_client(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(f"{what} client ({module}) is not available: {e}") from None


def _classes(transport: str) -> tuple[type | None, type | None, dict[str, Any]]:
    """(sync class, async class, keywords every ``infer_result`` call passes) for ``transport``."""
    if transport in ("tcp", "unix"):  # the front end: the clients' opt-out of the direct path
        from splitserve.client import AsyncClient, Client

        return functools.partial(Client, direct=False), functools.partial(AsyncClient, direct=False), {}
    if transport == "direct-front":  # the workers' own ports never tried
        from splitserve.client import AsyncClient, Client

        return (functools.partial(Client, direct="via-front"), functools.partial(AsyncClient, direct="via-front"), {})
    if transport in DIRECT:  # the clients' default
        from splitserve.client import AsyncClient, Client

        return Client, AsyncClient, {}
    if transport == "udp":
        from splitserve.client import UdpClient

        return UdpClient, None, {}
    if transport in ("http-json", "http-binary"):
        mod = _import_client("splitserve.client.http", "the HTTP")
        return (getattr(mod, "HttpClient", None), getattr(mod, "AsyncHttpClient", None),
                {"binary": transport == "http-binary"})  # per call, see _Encoding
    if transport == "grpc":
        mod = _import_client("splitserve.client.grpc", "the gRPC")
        return getattr(mod, "GrpcClient", None), getattr(mod, "AsyncGrpcClient", None), {}
    if transport in PEER_CLIENTS:
        mod = _import_client("splitserve.bench.peers.clients", "a third-party")
        return (*mod.classes(transport), {})
    raise ValueError(f"unknown transport {transport!r}; use one of {', '.join((*SCHEME, *PEER_CLIENTS))}")


class _Encoding:
    """An HTTP client that sends every call with one body encoding (``binary=`` per call)."""

    def __init__(self, client: Any, call_kw: dict[str, Any]) -> None:
        self.client = client
        self.call_kw = call_kw

    def infer_result(self, model: str, x: Any, **kw: Any) -> Any:
        return self.client.infer_result(model, x, **self.call_kw, **kw)

    def close(self) -> None:
        close_sync(self.client)


class _AsyncEncoding(_Encoding):
    async def infer_result(self, model: str, x: Any, **kw: Any) -> Any:  # type: ignore[override]
        return await self.client.infer_result(model, x, **self.call_kw, **kw)

    async def close(self) -> None:  # type: ignore[override]
        await close_async(self.client)


def _construct(cls: type, url: str, timeout: float, **options: Any) -> Any:
    # Every splitserve client takes the URL first; ``timeout`` is passed where accepted.
    try:
        accepts_timeout = "timeout" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        accepts_timeout = False
    return cls(url, **({"timeout": timeout} if accepts_timeout else {}), **options)


def open_sync(transport: str, url: str, timeout: float = 60.0, **options: Any) -> Any:
    """A connected blocking client with ``infer_result(model, x)`` and ``close()``;
    ``options``: the client class's own keywords (e.g. the fast-path client's ``poll_us``)."""
    sync_cls, _, kw = _classes(transport)
    if sync_cls is None:
        raise Unavailable(f"no blocking client for {transport}")
    try:
        client = _construct(sync_cls, url, timeout, **options)
    except (ConnectionError, OSError) as e:
        raise Unavailable(f"cannot connect to {url}: {e}") from None
    return _Encoding(client, kw) if kw else client


def close_sync(client: Any) -> None:
    close = getattr(client, "close", None)
    if close is not None:
        close()


class _ThreadedAsync:
    """An asyncio face on a blocking client, for transports without an asyncio client."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def infer_result(self, model: str, x: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(self.client.infer_result, model, x, **kw)

    async def close(self) -> None:
        close_sync(self.client)


async def open_async(transport: str, url: str, timeout: float = 60.0) -> Any:
    """A connected asyncio client with ``await infer_result(model, x)``; close with ``close_async``."""
    _, async_cls, kw = _classes(transport)
    if async_cls is None:
        return _ThreadedAsync(open_sync(transport, url, timeout))
    try:
        client = _construct(async_cls, url, timeout)
        if hasattr(client, "__aenter__"):
            entered = await client.__aenter__()
            client = entered if entered is not None else client
        elif hasattr(client, "connect"):
            res = client.connect()
            if inspect.isawaitable(res):
                res = await res
    except (ConnectionError, OSError) as e:
        raise Unavailable(f"cannot connect to {url}: {e}") from None
    return _AsyncEncoding(client, kw) if kw else client


async def close_async(client: Any) -> None:
    for name in ("aclose", "close"):
        fn = getattr(client, name, None)
        if fn is not None:
            res = fn()
            if inspect.isawaitable(res):
                await res
            return
    if hasattr(client, "__aexit__"):
        await client.__aexit__(None, None, None)
