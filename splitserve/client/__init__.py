"""Clients for every splitserve transport, with one ``infer`` API."""

from typing import Any

from splitserve.client.aio import AsyncClient
from splitserve.client.common import InferResult, ModelInfo
from splitserve.client.stream import Client, PendingCall
from splitserve.client.udp import UdpClient

__all__ = ["AsyncClient", "Client", "InferResult", "ModelInfo", "PendingCall", "UdpClient", "connect"]


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
