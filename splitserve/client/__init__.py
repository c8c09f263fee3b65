"""Clients for every splitserve transport, with one ``infer`` API."""

from splitserve.client.common import InferResult, ModelInfo
from splitserve.client.fastpath import AsyncClient, Client, PendingCall, UdpClient, connect

__all__ = ["AsyncClient", "Client", "InferResult", "ModelInfo", "PendingCall", "UdpClient", "connect"]
