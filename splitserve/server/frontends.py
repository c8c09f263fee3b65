"""Machinery shared by the decoded front ends (HTTP in ``http``, gRPC in ``grpc_server``):
the thread pool that keeps their CPU work off the fast path's event loop, and uvicorn
embedded in a loop it does not own.

Both run on the node's own event loop. The loop only moves bytes and answers; parsing
JSON, splitting binary tensors, converting typed gRPC contents to numpy and encoding large
responses run in ``CodecPool``'s threads, so a multi-megabyte JSON body never holds up a
fast-path client. (The front ends could have their own loop and thread instead, but
inference and management touch loop-owned state, so every handler would hop back anyway;
the pool moves exactly the CPU work and nothing else.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import uvicorn

from splitserve.config import ServerConfig
from splitserve.errors import QueueFull

_T = TypeVar("_T")


class CodecPool:
    """Decoding and encoding of HTTP and gRPC bodies, off the event loop and bounded.

    ``admit`` counts a large request body from before it is received until it is decoded:
    at most ``max_pending`` at once, so buffered bodies are bounded
    by ``max_pending`` × the per-model body limit; one more is refused with QueueFull
    (HTTP 503, gRPC UNAVAILABLE) and a message, at once. ``run`` calls a function in one
    of ``threads`` threads, or inline below ``inline_bytes`` where the hop costs more than
    the work. Response encodes are not admitted (refusing then would waste an inference
    that already ran); they are bounded by the calls in flight, which the rings bound.
    """

    def __init__(self, threads: int, max_pending: int, inline_bytes: int) -> None:
        self.max_pending = max_pending
        self.inline_bytes = inline_bytes
        self.pending = 0
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="splitserve-codec")

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> "CodecPool":
        return cls(cfg.frontends.codec_threads, cfg.frontends.codec_max_pending, cfg.frontends.codec_inline_bytes)

    def small(self, size: int | None) -> bool:
        """Whether a body of ``size`` bytes (None: not known yet) is handled on the loop."""
        return size is not None and size < self.inline_bytes

    @contextlib.asynccontextmanager
    async def admit(self, size: int | None) -> AsyncIterator[None]:
        """Hold one of the ``max_pending`` places while a large body is in hand."""
        if self.small(size):
            yield
            return
        if self.pending >= self.max_pending:
            raise QueueFull(f"{self.pending} large request bodies are being decoded or encoded, the most this "
                            "server takes at once (SPLITSERVE_CODEC_MAX_PENDING); retry later")
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    async def run(self, size: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a codec thread (inline for a body below ``inline_bytes``)."""
        if self.small(size):
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a loop it does not own: it installs no signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        pass

    async def wait_started(self, task: asyncio.Task, poll_s: float) -> None:
        """Until uvicorn listens (it has no start-up event to await); raises its start-up error."""
        while not self.started:
            if task.done():
                task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(poll_s)

