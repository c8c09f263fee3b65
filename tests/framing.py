"""Raw fast-path frames for tests that play a client byte by byte (TCP and UDP)."""

from __future__ import annotations

import json
import socket
from typing import Any

from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header

TIMEOUT_S = 30.0  # a test that waits this long for a frame has failed anyway


def raw(server: Any) -> socket.socket:
    """A TCP connection to ``server``'s fast path."""
    s = socket.create_connection(("127.0.0.1", server.info["fast_port"]))
    s.settimeout(TIMEOUT_S)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s``; ``ConnectionError`` if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(s: socket.socket) -> tuple[Header | None, bytes]:
    """The next frame; ``(None, b"")`` once the server closed the connection between frames
    (``ConnectionError`` if it closed inside one)."""
    first = s.recv(HEADER_SIZE)
    if not first:
        return None, b""
    h = unpack_header(first + recv_exact(s, HEADER_SIZE - len(first)))
    return h, recv_exact(s, h.payload_len)


def lookup(s: socket.socket, name: str) -> int:
    """LOOKUP ``name`` on a stream; its func_id."""
    return describe(s, name)["func_id"]


def describe(s: socket.socket, name: str) -> dict:
    """LOOKUP ``name`` on a stream; the reply's JSON."""
    s.sendall(Header(Kind.LOOKUP, req_id=1, payload_len=len(name)).pack() + name.encode())
    h, body = read_frame(s)
    assert h is not None and h.kind == Kind.LOOKUP_REPLY, body
    return json.loads(body)


def udp(server: Any) -> socket.socket:
    """A UDP socket connected to ``server``'s fast path."""
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(TIMEOUT_S)
    u.connect(("127.0.0.1", server.info["udp_port"]))
    return u


def udp_read(u: socket.socket) -> tuple[Header, bytes]:
    """The next datagram: its header and payload."""
    data = u.recv(65536)
    h = unpack_header(data)
    return h, data[HEADER_SIZE : HEADER_SIZE + h.payload_len]


def udp_describe(u: socket.socket, name: str) -> dict:
    u.send(Header(Kind.LOOKUP, req_id=1, payload_len=len(name)).pack() + name.encode())
    h, body = udp_read(u)
    assert h.kind == Kind.LOOKUP_REPLY, body
    return json.loads(body)


# The stream data paths a call can take: through the front end, or straight to the worker
# that runs the model (ServerConfig.transports.fast_direct, endpoints named by LOOKUP) over its Unix
# socket. ``DIRECT_TCP``, the same over the worker's TCP endpoint (the way a client on
# another machine goes), is added only where it proves that endpoint cheaply.
PATHS = ("front", "direct")
DIRECT_TCP = "direct-tcp"


def direct_env(compiled: bool = True) -> dict[str, str]:
    """The environment of a server whose workers also serve the direct path (``compiled``
    False: their frame state machine takes every read, without the compiled intake)."""
    import os

    return {**os.environ, "SPLITSERVE_FAST_DIRECT": "1", "SPLITSERVE_DIRECT_COMPILED": "1" if compiled else "0"}


def stream(server: Any, path: str, model: str) -> tuple[socket.socket, int]:
    """A raw connection that carries ``model``'s requests over ``path`` (the front end's TCP
    port, or the first direct endpoint of that kind its LOOKUP names), and the model's func_id."""
    s = raw(server)
    info = describe(s, model)
    if path == "front":
        return s, info["func_id"]
    s.close()
    key = "direct_tcp" if path == DIRECT_TCP else "direct"
    assert info.get(key), f"{model} offers no {key} endpoint: {info}"
    url = info[key][0]
    if path == DIRECT_TCP:
        d = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    else:
        d = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        d.connect(url.removeprefix("unix://"))
    d.settimeout(TIMEOUT_S)
    return d, info["func_id"]


def client(server: Any, path: str, **kw: Any) -> Any:
    """A sync ``Client`` whose calls take ``path`` (a direct client follows the endpoints of
    its front end's kind: Unix from ``unix://``, TCP from ``tcp://``)."""
    from splitserve import Client

    url = server.unix if path == "direct" else server.tcp
    return Client(url, direct=path != "front", **kw)
