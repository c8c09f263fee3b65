"""The synchronous UDP fast-path client (``UdpClient``): segments big requests,
retransmits on timeout."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from splitserve.client.common import Endpoint, InferResult, ModelInfo, encode_inputs
from splitserve.client.frames import _check, _request_fields, _result
from splitserve.errors import InvalidInput
from splitserve.protocol.header import HEADER_SIZE, Flags, Header, Kind, unpack_header


class UdpClient:
    """Synchronous UDP fast-path client: segments big requests, retransmits on timeout."""

    def __init__(self, url: str, timeout: float = 60.0, retry_s: float = 0.5, segment: int = 60000) -> None:
        self.endpoint = ep = Endpoint.parse(url)
        if ep.scheme != "udp":
            raise InvalidInput("UdpClient speaks udp://")
        self.addr = (ep.host, ep.port)
        self.timeout = timeout
        self.retry_s = retry_s
        self.segment = segment
        family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.connect(self.addr)
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        self._models: dict[str, ModelInfo] = {}
        self._buf = bytearray(65536)
        self._lock = threading.Lock()
        self.retransmits = 0

    def _exchange(self, datagrams: list[list], req_id: int) -> tuple[Header, bytes]:
        """Send all datagrams, gather the (possibly segmented) answer; retransmit on silence."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            parts: dict[int, bytes] = {}
            first: Header | None = None
            while True:
                for d in datagrams:
                    self.sock.sendmsg(d)
                resend_at = time.monotonic() + self.retry_s
                while time.monotonic() < resend_at:
                    self.sock.settimeout(max(1e-3, resend_at - time.monotonic()))
                    try:
                        n = self.sock.recv_into(self._buf)
                    except TimeoutError:
                        break
                    h = unpack_header(self._buf)
                    if h.req_id != req_id:
                        continue  # a late answer to an earlier, retransmitted call
                    if h.kind != Kind.RESPONSE:
                        return h, bytes(self._buf[HEADER_SIZE:n])
                    first = first or h
                    parts[h.seq_num] = bytes(self._buf[HEADER_SIZE : HEADER_SIZE + h.payload_len])
                    if len(parts) == h.seg_count:
                        return first, b"".join(parts[i] for i in range(h.seg_count))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to UDP call {req_id} after {self.timeout:.1f}s")
                self.retransmits += 1

    def lookup(self, model: str) -> ModelInfo:
        info = self._models.get(model)
        if info is None:
            rid = next(self._ids)
            body = model.encode()
            h, p = self._exchange([[Header(Kind.LOOKUP, req_id=rid, payload_len=len(body)).pack(), body]], rid)
            info = self._models[model] = _check(h, p, ModelInfo.from_json)
        return info

    def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                     slo_ms: float | None = None) -> InferResult:
        info = self.lookup(model)
        arrays, count, batched = encode_inputs(info, x)
        rid = next(self._ids)
        payload = memoryview(b"".join(memoryview(a).cast("B") for a in arrays)) if len(arrays) > 1 else memoryview(arrays[0]).cast("B")
        total = len(payload)
        segs = max(1, -(-total // self.segment))
        rcls, deadline_us, slo_us = _request_fields(cls, deadline_ms, slo_ms)
        base = Header(Kind.REQUEST, req_id=rid, func_id=info.func_id, cls=rcls, deadline_us=deadline_us, slo_us=slo_us)
        dgrams = []
        for i in range(segs):
            chunk = payload[i * self.segment : (i + 1) * self.segment]
            base.seq_num, base.seg_count, base.payload_offset = i, segs, i * self.segment
            base.payload_len, base.total_len = len(chunk), total
            base.flags = int(Flags.SEGMENTED) if segs > 1 else 0
            dgrams.append([base.pack(), chunk])
        h, p = self._exchange(dgrams, rid)
        return _result(info, h, p, count, batched)

    def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        return self.infer_result(model, x, **kw).value()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "UdpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
