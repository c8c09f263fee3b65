"""What every fast-path client shares: a request header's fields, an answer's checks and
decoding, and the receive buffer's size.

A request is one gather write of the 64-byte header and the input arrays' own buffers.
Many calls may be in flight on one connection; answers are matched by ``req_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from splitserve.client.common import InferResult, ModelInfo, target_ms
from splitserve.errors import Status, error_for_status
from splitserve.protocol.header import Header, Kind, RequestClass, pack_request, unpack_header


_RX_BYTES = 64 * 1024  # a client's receive buffer; bigger payloads are read past it

# An answer's header as a solo call reads it: a Header, or on the compiled wire the same
# fields by the same names (``_fastwire.Fields``), with no Header built
_Fields = Any


_PLAIN_FIELDS = (RequestClass.DEFAULT.value, 0, 0)  # a call that names no class, deadline or SLO
# plain ints: an enum member's attribute lookup is a descriptor call, once per answer
_ERROR, _DUPLICATE = int(Kind.ERROR), int(Status.DUPLICATE_REQUEST)


def _request_fields(cls: Any, deadline_ms: float | None, slo_ms: float | None) -> tuple[int, int, int]:
    """A request header's class, ``deadline_us`` and ``slo_us``. ``deadline_ms`` is hard (still
    queued then, the call fails), ``slo_ms`` soft (a late real-time call is served and counted
    missed); None: none (``common.target_ms`` refuses 0 and less)."""
    if cls is None and deadline_ms is None and slo_ms is None:  # the usual call: no enum lookups
        return _PLAIN_FIELDS
    deadline, slo = target_ms(deadline_ms, "deadline_ms"), target_ms(slo_ms, "slo_ms")
    return (RequestClass.DEFAULT.value if cls is None else int(RequestClass.parse(cls)),
            round(deadline * 1000) if deadline else 0, round(slo * 1000) if slo else 0)


def _request_header(info: ModelInfo, req_id: int, arrays: list[np.ndarray], cls: Any, deadline_ms: float | None,
                    slo_ms: float | None, func_id: int | None = None) -> bytes:
    """The packed header of a call on a stream (one struct call, no ``Header`` built);
    ``func_id``: a cluster node's for its worker (None: the model's)."""
    return pack_request(req_id, func_id or info.func_id, *_request_fields(cls, deadline_ms, slo_ms),
                        sum(a.nbytes for a in arrays))


def _with_func_id(parts: list, func_id: int) -> list:
    """A call's frame ``parts`` with ``func_id`` in its header: a call a cluster node's worker
    did not answer, re-sent through the gateway, which knows the model by the cluster's id."""
    return [replace(unpack_header(parts[0]), func_id=func_id).pack(), *parts[1:]]


def _result(info: ModelInfo, h: "Header | _Fields", payload: bytes, count: int, batched: bool) -> InferResult:
    if h.kind == _ERROR:
        raise error_for_status(h.status, bytes(payload).decode(errors="replace"))
    return InferResult(info.codec.decode(payload, count, batched), h.queue_us, h.compute_us, h.total_us)


def _check(h: Header, payload: bytes, parse: Callable[[bytes], Any]) -> Any:
    """``parse(payload)`` of a lookup's answer, or the error the server answered instead."""
    if h.kind == Kind.ERROR:
        raise error_for_status(h.status, payload.decode(errors="replace"))
    return parse(payload)
