"""The small HTTP adapter that lets splitserve's load generator drive peer servers.

``RawHttpClient`` posts a model's raw input bytes and reads raw output bytes (the Ray Serve
peer); ``V2HttpClient`` is splitserve's own Open Inference Protocol v2 HTTP client with the
binary tensor extension (PyTriton / Triton). Both have the ``infer_result(model, x)`` coroutine
the load generator's senders call, and ``close()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from splitserve.client.common import InferResult
from splitserve.types import TensorSpec


class RawHttpClient:
    """POST the inputs' bytes (declared order, no batch dimension) to ``url``; the answer is
    the outputs' bytes back to back."""

    def __init__(self, url: str, outputs: Sequence[TensorSpec], connections: int = 64, timeout: float = 60.0) -> None:
        self.url = url
        self.outputs = tuple(outputs)
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=connections,
                                                                             max_keepalive_connections=connections))

    async def infer_result(self, model: str, x: Any) -> InferResult:
        arrays = list(x) if isinstance(x, (tuple, list)) else [x]
        body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        r = await self.http.post(self.url, content=body, headers={"content-type": "application/octet-stream"})
        r.raise_for_status()
        outs, off = {}, 0
        for spec in self.outputs:
            outs[spec.name] = np.frombuffer(r.content, dtype=spec.dtype, count=spec.numel, offset=off).reshape(spec.shape)
            off += spec.nbytes
        if off != len(r.content):
            raise ValueError(f"answer of {len(r.content)} B, expected {off} B")
        return InferResult(outs)

    async def close(self) -> None:
        await self.http.aclose()


class V2HttpClient:
    """splitserve's OIP v2 HTTP client, binary tensor extension on every call."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        from splitserve.client.http import AsyncHttpClient

        self.client = AsyncHttpClient(url, timeout=timeout)

    async def infer_result(self, model: str, x: Any) -> InferResult:
        return await self.client.infer_result(model, x, binary=True)

    async def close(self) -> None:
        await self.client.close()
