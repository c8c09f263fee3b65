"""The rules a fast-path REQUEST frame must pass before any payload byte is read, shared by
every place that takes one: the front end's stream connections (``server/fastpath.py``)
and a worker's direct endpoint (``worker/direct.py``)."""

from __future__ import annotations

from splitserve.errors import BadSegment, BadSize, InvalidInput, Refused
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import Header, RequestClass


def stream_samples(h: Header, cfg: ModelConfig, max_batch: int | None = None) -> int:
    """The samples a stream REQUEST for ``cfg`` carries: BadSegment if it claims segments
    (a stream carries one), BadSize if its payload is not a whole number of samples or more
    than ``max_batch`` (default: the model's ``max_batch_size``)."""
    if h.seg_count != 1 or h.seq_num != 0:
        raise BadSegment(f"seq_num {h.seq_num} / seg_count {h.seg_count}: stream transports carry one segment")
    per = cfg.request_bytes
    if h.payload_len == 0 or h.payload_len % per:
        raise BadSize(
            f"payload of {h.payload_len} B for {cfg.name!r}: expected a multiple of {per} B "
            f"(inputs {', '.join(f'{t.name} {t.datatype}{list(t.shape)}' for t in cfg.inputs)})"
        )
    count = h.payload_len // per
    limit = cfg.max_batch_size if max_batch is None else max_batch
    if count > limit:
        raise BadSize(f"{count} samples exceed max_batch_size {limit} of {cfg.name!r}")
    return count


def call_class(cls: int, default: RequestClass, rt_only: bool) -> RequestClass:
    """The class a call runs in: its own, or its model's ``default``; InvalidInput for an
    unknown class, Refused for best-effort work when the node serves real-time only."""
    try:
        c = RequestClass(cls)
    except ValueError:
        raise InvalidInput(f"unknown request class {cls}; use 0 (real-time) or 1 (best-effort)") from None
    if c == RequestClass.DEFAULT:
        c = default
    if c == RequestClass.BE and rt_only:
        raise Refused("best-effort requests are refused in rt-only mode")
    return c
