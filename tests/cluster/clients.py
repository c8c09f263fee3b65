"""Fast-path clients for the cluster tiers: raw frames with a client-side ledger, so that a
duplicate answer is seen rather than hidden by a client library. Each client can run on
another "host" (``enter``: a network namespace its thread joins before it connects)."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header
from tests.framing import recv_exact

WINDOW = 4  # pipelined calls per client
IMAGE = bytes(784)


# the loads started and not yet finished, each its stop event and threads: a test that fails
# midway leaves its load running, which would spoil every later test on the same cluster
_RUNNING: dict[threading.Event, list[threading.Thread]] = {}


def running(stop: threading.Event, threads: list[threading.Thread]) -> None:
    """Note a started load (``stop`` ends it) until ``finished``."""
    _RUNNING[stop] = threads


def finished(stop: threading.Event) -> None:
    """The load ``stop`` ends was finished by its test."""
    _RUNNING.pop(stop, None)


def stop_left_running(timeout_s: float = 60.0) -> None:
    """Stop every load a test left running and wait (bounded) for its threads."""
    deadline = time.monotonic() + timeout_s
    while _RUNNING:
        stop, threads = _RUNNING.popitem()
        stop.set()
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def _stay() -> None:
    """The default ``enter``: the client stays in the caller's network namespace."""


def until(what: str, check: Callable[[], bool], timeout_s: float = 180.0,
          seen: Callable[[], object] | None = None) -> None:
    """Poll ``check`` every 0.2 s; fail the test after ``timeout_s``, with what ``seen``
    returns then (the state that kept ``check`` false)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached in {timeout_s} s: {what}" + (f"; seen: {seen()!r}" if seen else ""))
        time.sleep(0.2)


def lookup(port: int, name: str, host: str = "127.0.0.1", timeout_s: float = 30) -> int:
    """The model's cluster func id, once the routes that name it reached the gateway."""
    found: list[int] = []

    def ask() -> bool:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(Header(Kind.LOOKUP, req_id=1, payload_len=len(name)).pack() + name.encode())
            h, _ = read_frame(s)
        found.extend([h.func_id] if h.kind == Kind.LOOKUP_REPLY else [])
        return bool(found)

    until(f"the gateway knows {name}", ask, timeout_s)
    return found[0]


def read_frame(s: socket.socket) -> tuple[Header, bytes]:
    """One frame: its header and payload (``ConnectionError`` if the gateway closes first)."""
    h = unpack_header(recv_exact(s, HEADER_SIZE))
    return h, recv_exact(s, h.payload_len)


@dataclass
class Load:
    """8 clients sending pipelined lenet calls until stopped; the client-side ledger."""

    port: int
    func_id: int
    host: str = "127.0.0.1"
    enter: Callable[[], None] = _stay  # run first on each client's thread
    stop: threading.Event = field(default_factory=threading.Event)
    sent: Counter = field(default_factory=Counter)
    answers: Counter = field(default_factory=Counter)
    outputs: set = field(default_factory=set)
    errors: list = field(default_factory=list)
    threads: list = field(default_factory=list)

    def start(self, clients: int = 8) -> "Load":
        for i in range(clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)
        running(self.stop, self.threads)
        return self

    def _client(self, i: int) -> None:
        self.enter()
        with socket.create_connection((self.host, self.port)) as s:
            s.settimeout(60)
            ids = iter(range(i << 32, (i + 1) << 32))
            while not self.stop.is_set():
                batch = [next(ids) for _ in range(WINDOW)]
                for rid in batch:
                    s.sendall(Header(Kind.REQUEST, req_id=rid, func_id=self.func_id, payload_len=784).pack() + IMAGE)
                    self.sent[rid] += 1
                left = set(batch)
                while left:
                    h, payload = read_frame(s)
                    self.answers[h.req_id] += 1
                    left.discard(h.req_id)
                    if h.kind == Kind.RESPONSE:
                        self.outputs.add(payload)
                    else:
                        self.errors.append((h.status, payload.decode(errors="replace")))

    def finish(self) -> None:
        self.stop.set()
        finished(self.stop)
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a client never got all its answers"
        assert self.answers == self.sent, "some request was answered twice or never"
        assert self.errors == []
        # the same logits from every node and batch size (batched float sums differ in the last bits)
        logits = [np.frombuffer(o, np.float32) for o in self.outputs]
        assert all(np.allclose(x, logits[0], atol=1e-5) for x in logits), "nodes disagree on the model's output"
