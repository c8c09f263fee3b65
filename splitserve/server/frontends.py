"""Starts and stops the decoded front ends (HTTP, gRPC) beside the fast path."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.server.app import Server


async def start(server: "Server") -> None:
    """HTTP and gRPC are added by their own modules; the spine runs without them."""


async def stop(server: "Server") -> None:
    """Counterpart of ``start``."""
