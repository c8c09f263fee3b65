"""The nodes' worker routes a gateway hands a direct client in its LOOKUP reply.

A node's own LOOKUP reply names its workers' TCP endpoints at the address they bind (maybe a
wildcard) and takes that node's func id; a client of the gateway gets, for each active node
that serves the model, its func id and those endpoints at the node's advertised address, and
calls the workers itself (``splitserve.client``: answers matched by request id, a lost
node's calls re-sent through the gateway). Pure: the nodes in, the list out."""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlsplit


def direct_routes(nodes: Iterable[tuple[str, str, int, bytes]]) -> list[dict]:
    """``nodes``: (node id, its advertised host, its func id for the model, its LOOKUP
    reply); the reply's ``nodes`` entry: one per node offering TCP endpoints."""
    out = []
    for node, host, func_id, reply in nodes:
        info = json.loads(reply)
        urls = info.get("direct_tcp", ())
        classes = info.get("direct_tcp_classes") or ()
        if len(classes) != len(urls):  # a node that names none (an older one): each takes any call
            classes = ["rt"] * len(urls)
        served = [(port, cls) for u, cls in zip(urls, classes) if (port := urlsplit(u).port)]
        if not served:  # the direct path off there: its calls go through the gateway
            continue
        at = f"[{host}]" if ":" in host else host
        out.append({"node": node, "func_id": func_id, "direct_tcp": [f"tcp://{at}:{p}" for p, _ in served],
                    "direct_tcp_classes": [cls for _, cls in served]})
    return out
