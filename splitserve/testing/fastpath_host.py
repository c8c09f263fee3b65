"""The smallest server a fast-path transport can run against, for fuzzing it in-process.

``FuzzServer`` is a ``FastPathHost`` (``server/ports.py``: ``loop``, ``config``, ``intake``,
``monitor``, ``model``, ``model_by_func``, ``request_class``), and ``connections`` is the set
of live connections a listener would keep; ``FuzzRuntime`` is a ``ModelPort`` (``alloc``,
``input_views``, ``output_views``, ``plan_room``, ``release``, ``submit``, ``describe``).
The runtimes keep their inputs in real ``TensorQueue`` rings allocated by real ``SlotRing``s,
and a *shadow* of what every ring byte must hold: a guard pattern until a slot is handed
out, anything while a request is being received into it, and the received bytes from
``submit`` on. Any byte that changes where the shadow does not allow it is a write outside
the slots of the request being received.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput, UnknownModel, WorkerFailed
from splitserve.modelconfig import ArtifactConfig, ModelConfig
from splitserve.protocol.header import RequestClass
from splitserve.server.intake import Intake
from splitserve.server.model.queues import ModelQueues
from splitserve.server.monitor import Call, InferenceMonitor
from splitserve.tensorqueue import SlotRing, TensorQueue, ring_slots
from splitserve.types import TensorSpec


class PropertyViolation(AssertionError):
    """A fuzzed input broke a property; the message names the property and what was seen."""


# The fuzzed models: one with two inputs of different sizes and enough bytes per sample to
# need several UDP segments, one small one (many samples per ring, cheap stream frames).
MODELS: tuple[ModelConfig, ...] = (
    ModelConfig(name="fz2", inputs=(TensorSpec("a", "UINT8", (2048,)), TensorSpec("b", "INT16", (512,))),
                outputs=(TensorSpec("y", "UINT8", (64,)), TensorSpec("z", "INT32", (16,))),
                artifact=ArtifactConfig(arch="fuzz"),
                max_batch_size=4, default_class="be"),
    ModelConfig(name="fz1", inputs=(TensorSpec("x", "FP32", (4,)),), outputs=(TensorSpec("y", "FP32", (4,)),),
                artifact=ArtifactConfig(arch="fuzz"), max_batch_size=8, default_class="rt"),
)
FUNC_IDS: dict[str, int] = {"fz2": 1, "fz1": 2}
CLASSES = (RequestClass.RT, RequestClass.BE)


class Answer:
    """How the fake model answers a submitted call (one per call, cycled from the case)."""

    SOON = "soon"  # outputs on a later loop iteration, as a worker's DONE would
    SOON_FAIL = "soon-fail"  # WORKER_FAILED on a later iteration
    NOW_FAIL = "now-fail"  # refused inside submit, as a full scheduler queue is
    AT_END = "at-end"  # held until the case has sent everything
    ALL = (SOON, SOON_FAIL, NOW_FAIL, AT_END)


def ring_start(rnd: random.Random) -> int:
    """Where a case's rings start: anywhere, or a few slots before the end so batches wrap."""
    return rnd.randrange(1 << 12) if rnd.random() < 0.5 else -rnd.randint(1, 8)


def ring_free(rnd: random.Random) -> int | None:
    """How many slots a case gets: usually all of them, sometimes only a few (QUEUE_FULL)."""
    return None if rnd.random() < 0.7 else rnd.randint(0, 12)


def expected_output(data: bytes, size: int) -> bytes:
    """What the fake model answers for input bytes ``data``: ``size`` bytes that depend on all of them."""
    return hashlib.shake_256(data).digest(size)


@dataclass
class Submitted:
    """A call the transport submitted, with the input bytes its slots held at that moment."""

    call: Call
    data: bytes
    answer: str
    output: bytes = b""
    answered_ok: bool | None = None  # None until answered


class _Shadow:
    """What one ring's bytes must hold; ``loose`` marks bytes being received (anything goes)."""

    def __init__(self, queue: TensorQueue) -> None:
        self.queue = queue
        n = queue.size
        self.actual = np.frombuffer(queue.view(0, queue.nslots), dtype=np.uint8)
        self.expect = ((np.arange(n, dtype=np.uint32) * 131 + 7) % 251).astype(np.uint8)
        self.loose = np.zeros(n, dtype=bool)

    def reset(self) -> None:
        self.actual[:] = self.expect
        self.loose[:] = False

    def _span(self, seq: int, count: int) -> list[slice]:
        sb, n = self.queue.slot_bytes, self.queue.nslots
        first = (seq % n) * sb
        end = first + count * sb
        if end <= self.queue.size:
            return [slice(first, end)]
        return [slice(first, self.queue.size), slice(0, end - self.queue.size)]

    def check(self, where: str, seq: int | None = None, count: int = 0) -> None:
        spans = [slice(0, self.queue.size)] if seq is None else self._span(seq, count)
        for s in spans:
            bad = (self.actual[s] != self.expect[s]) & ~self.loose[s]
            if bad.any():
                at = int(np.flatnonzero(bad)[0]) + s.start
                raise PropertyViolation(
                    f"{where}: ring {self.queue.slot_bytes} B x {self.queue.nslots} changed at byte {at} "
                    f"(slot {at // self.queue.slot_bytes}), outside the slots of the request being received")

    def mark_loose(self, seq: int, count: int) -> None:
        for s in self._span(seq, count):
            self.loose[s] = True

    def settle(self, seq: int, count: int) -> None:
        """From now on these slots must keep what they hold."""
        for s in self._span(seq, count):
            self.expect[s] = self.actual[s]
            self.loose[s] = False


class FuzzRuntime:
    """A model runtime with real rings and no workers: it records what is submitted."""

    def __init__(self, server: "FuzzServer", config: ModelConfig, func_id: int) -> None:
        self.server = server
        self.config = config
        self.name = config.name
        self.func_id = func_id
        self.default_class = RequestClass.RT if config.default_class == "rt" else RequestClass.BE
        sizes = [t.nbytes for t in config.inputs + config.outputs]
        self.nslots = ring_slots(sizes, 4 * config.max_batch_size)
        self.queues = ModelQueues(config, self.nslots, f"fuzz-{self.name}")  # the server's own rings and queues
        self.shadows = {c: [_Shadow(q) for q in self.queues.tqs[c][0]] for c in CLASSES}
        self.held: dict[RequestClass, tuple[int, int]] = {}

    def reset(self, start: int, free: int | None) -> None:
        """A fresh case: rings start at ``start``; all but ``free`` slots are taken by someone
        else (None: none are)."""
        for c in CLASSES:
            ring = self.queues.rings[c] = SlotRing(self.nslots)
            ring.head = ring.tail = start % self.nslots
            hold = 0 if free is None else max(0, self.nslots - free)
            self.held[c] = (ring.alloc(hold) if hold else ring.head, hold)
            for sh in self.shadows[c]:
                sh.reset()

    def release_held(self) -> None:
        """Give back the slots ``reset`` took for someone else (the ring's tail waits on them)."""
        for c, (seq, n) in self.held.items():
            if n:
                self.queues.release(c, seq, n)
        self.held = {c: (0, 0) for c in CLASSES}

    def check_memory(self, where: str) -> None:
        for c in CLASSES:
            for sh in self.shadows[c]:
                sh.check(where)

    # -- what the transports call -------------------------------------------------

    def alloc(self, cls: RequestClass, count: int) -> int:
        seq = self.queues.alloc(cls, count)
        for sh in self.shadows[cls]:
            sh.check("before a request was received into its slots", seq, count)
            sh.mark_loose(seq, count)
        return seq

    def input_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return self.queues.input_views(cls, seq, count)

    def output_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return self.queues.output_views(cls, seq, count)

    def plan_room(self, cls: RequestClass, count: int, movable: dict[int, int]) -> list[int] | None:
        return self.queues.plan_room(cls, count, movable)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "func_id": self.func_id}

    def release(self, call: Call) -> None:
        for sh in self.shadows[call.cls]:
            sh.settle(call.seq, call.count)  # an abandoned call's partial bytes stay put too
        self.queues.release(call.cls, call.seq, call.count)

    def submit(self, call: Call) -> None:
        call.rx_complete()
        data = b"".join(bytes(v) for v in self.input_views(call.cls, call.seq, call.count))
        for sh in self.shadows[call.cls]:
            sh.settle(call.seq, call.count)
        self.server.on_submit(self, call, data)


class FuzzServer:
    """What a fast-path transport uses of ``Server``, on a loop the harness drives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, config: ServerConfig | None = None) -> None:
        self.loop = loop
        self.config = config or ServerConfig()
        self.connections: set[Any] = set()
        self.monitor = InferenceMonitor()
        self.intake = Intake(self.config.transports)
        self.runtimes = {m.name: FuzzRuntime(self, m, FUNC_IDS[m.name]) for m in MODELS}
        self.by_func = {rt.func_id: rt for rt in self.runtimes.values()}
        self.submitted: list[Submitted] = []
        self.later: list[Submitted] = []
        self.answers: list[str] = [Answer.SOON]
        self.soon = 0  # answers scheduled for a later loop iteration, not given yet
        self.violations: list[str] = []  # seen inside the transport's callbacks, reported after

    def reset(self, answers: list[str], start: int, free: int | None) -> None:
        self.monitor = InferenceMonitor()
        self.intake.close()
        self.intake = Intake(self.config.transports)
        self.connections.clear()
        self.submitted = []
        self.later = []
        self.soon = 0
        self.violations = []
        self.answers = answers or [Answer.SOON]
        for rt in self.runtimes.values():
            rt.reset(start, free)

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.queues.close()

    # -- FastPathHost ------------------------------------------------------------------

    def model(self, name: str) -> FuzzRuntime:
        rt = self.runtimes.get(name)
        if rt is None:
            raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(sorted(self.runtimes))}")
        return rt

    def model_by_func(self, func_id: int) -> FuzzRuntime:
        rt = self.by_func.get(func_id)
        if rt is None:
            raise UnknownModel(f"unknown func_id {func_id}; look the model up by name first")
        return rt

    def request_class(self, port: FuzzRuntime, cls: int) -> RequestClass:
        try:
            c = RequestClass(cls)
        except ValueError:
            raise InvalidInput(f"unknown request class {cls}; use 0 (real-time) or 1 (best-effort)") from None
        return port.default_class if c == RequestClass.DEFAULT else c

    # -- the fake model ---------------------------------------------------------------

    def on_submit(self, rt: FuzzRuntime, call: Call, data: bytes) -> None:
        sub = Submitted(call, data, self.answers[len(self.submitted) % len(self.answers)])
        if any(s.answered_ok is None and s.call.req_id == call.req_id and s.call.sink is call.sink
               and s.call.peer == call.peer for s in self.submitted):
            self.violations.append(f"req_id {call.req_id} of {call.peer!r} was submitted while the same "
                                   "request was still running")
        self.submitted.append(sub)
        if sub.answer == Answer.NOW_FAIL:
            self.answer(sub)
        elif sub.answer == Answer.AT_END:
            self.later.append(sub)
        else:
            self.soon += 1
            self.loop.call_soon(self._answer_soon, sub)

    def _answer_soon(self, sub: Submitted) -> None:
        self.soon -= 1
        self.answer(sub)

    def answer(self, sub: Submitted) -> None:
        """Answer ``sub`` the way its policy says (outputs, or an error)."""
        call = sub.call
        if sub.answer in (Answer.SOON_FAIL, Answer.NOW_FAIL):
            sub.answered_ok = False
            call.answer(WorkerFailed(f"fuzz: call {call.req_id} fails on purpose"))
            return
        size = call.count * call.runtime.config.response_bytes
        sub.output = expected_output(sub.data, size)
        pos = 0
        for v in call.runtime.output_views(call.cls, call.seq, call.count):
            v[:] = sub.output[pos : pos + len(v)]
            pos += len(v)
        sub.answered_ok = True
        call.answer(None)

    def answer_later(self) -> None:
        later, self.later = self.later, []
        for sub in later:
            self.answer(sub)

    def in_use(self) -> dict[str, int]:
        """Slots still allocated per model and class, once the ones held on purpose are given back."""
        for rt in self.runtimes.values():
            rt.release_held()
        return {f"{rt.name}/{c.name}": rt.queues.rings[c].in_use for rt in self.runtimes.values() for c in CLASSES
                if rt.queues.rings[c].in_use}


class LoopHarness:
    """A fuzz target's event loop, turned by hand, and the fake server on it.

    Exceptions that escape a transport's callbacks land in ``loop_errors`` (the loop's
    exception handler) instead of a log, so a case can fail on them.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._on_loop_error)
        self.server = FuzzServer(self.loop)
        self.loop_errors: list[str] = []

    def __enter__(self) -> "LoopHarness":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.server.close()
        self.loop.close()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.loop_errors.append(f"{type(exc).__name__}: {exc}" if exc else str(context.get("message")))

    def turn(self) -> None:
        """One iteration of the loop: ready sockets are served, due callbacks run."""
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()

    def raise_seen(self) -> None:
        """Fail the case on what went wrong inside the transport's callbacks."""
        if self.loop_errors:
            raise PropertyViolation(f"an exception escaped the transport: {self.loop_errors[0]}")
        if self.server.violations:
            raise PropertyViolation(self.server.violations[0])


__all__ = ["Answer", "FUNC_IDS", "FuzzRuntime", "LoopHarness", "FuzzServer", "MODELS", "PropertyViolation", "Submitted",
           "expected_output", "ring_free", "ring_start"]
