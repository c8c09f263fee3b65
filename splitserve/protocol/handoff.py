"""A connection handed to a worker through the front end's port (a HANDOFF frame).

A client that cannot reach a worker's own direct endpoint (a firewall that lets only the
front end's port through, a Unix socket in a directory its user may not enter) still gets
the direct path: it opens a connection to the front end and sends, before anything else,
a HANDOFF frame naming the model and the endpoint it could not reach. The front end passes
the connection's descriptor to that worker (SCM_RIGHTS over the worker's control socket)
and forgets it; the worker acknowledges with an empty HANDOFF frame of the same ``req_id``
before anything else on it and serves it as a connection it accepted itself. The front end
is then on none of its calls' ways, and the only port the client needs is the front end's.

The front end says why where it cannot (an ERROR frame: a model or endpoint it does not
serve now, a connection with calls in flight) and keeps serving the connection; the worker
says why where it cannot (its connection limit, no endpoint open now) and closes it.
Either way the client's calls go through the front end, as for any direct endpoint it
cannot use.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from splitserve.errors import BadFrame
from splitserve.protocol.header import Header, Kind


def handoff_frame(req_id: int, model: str, endpoint: str) -> bytes:
    """The HANDOFF frame (header and JSON payload) asking for ``model``'s worker whose
    direct endpoint is ``endpoint`` (a LOOKUP's ``tcp://`` or ``unix://`` URL)."""
    body = json.dumps({"model": model, "endpoint": endpoint}).encode()
    return Header(Kind.HANDOFF, req_id=req_id, payload_len=len(body)).pack() + body


def endpoint_key(url: str) -> tuple[str, int | str]:
    """What names a worker's endpoint whatever host the client reached it at: a TCP
    endpoint's port (``("tcp", port)``), a Unix one's path (``("unix", path)``); raises
    BadFrame for anything else."""
    try:
        parts = urlsplit(url)
        if parts.scheme == "tcp" and parts.port is not None:
            return "tcp", parts.port
    except ValueError:  # a port out of range, a malformed netloc
        pass
    else:
        if parts.scheme == "unix" and parts.path:
            return "unix", parts.path
    raise BadFrame(f"a HANDOFF endpoint is a worker's tcp://host:port or unix:///path URL, not {url!r}")


def parse_handoff(body: bytes) -> tuple[str, tuple[str, int | str]]:
    """A HANDOFF payload's model name and endpoint (``endpoint_key``); raises BadFrame
    naming what is wrong with it."""
    try:
        fields = json.loads(body)
        model, endpoint = fields["model"], fields["endpoint"]
    except (ValueError, TypeError, KeyError):
        raise BadFrame('a HANDOFF payload is JSON {"model": name, "endpoint": url}') from None
    if not isinstance(model, str) or not isinstance(endpoint, str):
        raise BadFrame("a HANDOFF's model and endpoint are strings")
    return model, endpoint_key(endpoint)
