"""Running fuzz targets for a budget of inputs (what ``splitserve bench fuzz`` does).

Plain random generation and mutation loops: the same generators and properties as the
hypothesis tests, many more inputs. The header target draws from one random stream per run
and records each failing input whole (64 bytes); the stream and UDP targets draw each case
from its own seed (``case_seed``), so a failing case is replayed with
``replay(target, seed)`` however large it is.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from splitserve.testing.fastpath_host import PropertyViolation

TARGETS: tuple[str, ...] = ("header", "stream", "udp")


class Target(Protocol):
    """One fuzz target: draws an input, checks the property on it (raising PropertyViolation)."""

    name: str

    def generate(self, rnd: random.Random) -> Any: ...

    def check(self, case: Any) -> None: ...

    def close(self) -> None: ...


def open_target(name: str) -> Target:
    """A fresh target by name; its sockets and loop are released by ``close()``."""
    if name == "header":
        from splitserve.bench.fuzz.header import HeaderTarget

        return HeaderTarget()
    if name == "stream":
        from splitserve.bench.fuzz.stream import StreamHarness

        return StreamHarness()
    if name == "udp":
        from splitserve.bench.fuzz.udp import UdpHarness

        return UdpHarness(overlap=True)
    raise ValueError(f"unknown fuzz target {name!r}; choose from {', '.join(TARGETS)}")


def case_seed(seed: int, index: int) -> int:
    """The seed of case ``index`` of a run with ``seed`` (stream and UDP targets)."""
    return seed * 1_000_003 + index


def replay(name: str, seed: int) -> None:
    """Run the case a recorded ``case_seed`` names again; raises PropertyViolation if it still fails."""
    target = open_target(name)
    try:
        target.check(target.generate(random.Random(seed)))
    finally:
        target.close()


@dataclass
class TargetResult:
    """What fuzzing one target found."""

    name: str
    inputs: int = 0
    failures: int = 0
    seconds: float = 0.0
    stopped_early: bool = False  # the time limit ended it before its budget of inputs
    kinds: Counter[str] = field(default_factory=Counter)  # failure messages, numbers masked -> count
    examples: list[dict[str, Any]] = field(default_factory=list)  # the first failing inputs

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "failures": self.failures, "seconds": round(self.seconds, 3),
                "inputs_per_s": round(self.inputs_per_s, 1), "stopped_early": self.stopped_early,
                "failure_kinds": dict(self.kinds.most_common()), "first_failures": self.examples}


def _kind(message: str) -> str:
    return re.sub(r"\d+", "N", message.split("\n", 1)[0])[:120]


def _record(case: Any) -> dict[str, Any]:
    if isinstance(case, (bytes, bytearray)):
        return {"hex": bytes(case).hex(), "len": len(case)}
    return case.record()


def fuzz(name: str, inputs: int, seed: int = 0, time_limit_s: float | None = None, keep: int = 3,
         advance: Callable[[int], None] | None = None) -> TargetResult:
    """Check ``inputs`` inputs of target ``name`` (fewer if ``time_limit_s`` runs out)."""
    res = TargetResult(name)
    target = open_target(name)
    shared = random.Random(seed) if name == "header" else None
    step, advanced = (1000 if name == "header" else 50), 0
    t0 = time.perf_counter()
    try:
        for i in range(inputs):
            if i % step == 0 and i:
                if advance is not None:
                    advance(step)
                    advanced += step
                if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                    res.stopped_early = True
                    break
            rnd = shared if shared is not None else random.Random(case_seed(seed, i))
            case = target.generate(rnd)
            res.inputs += 1
            try:
                target.check(case)
                continue
            except PropertyViolation as e:
                message = str(e)
            except Exception as e:  # a crash of the harness itself: start it afresh
                message = f"harness error {type(e).__name__}: {e}"
                target.close()
                target = open_target(name)
            res.failures += 1
            res.kinds[_kind(message)] += 1
            if len(res.examples) < keep:
                example = {"message": message, "input": _record(case)}
                if shared is None:
                    example["case_seed"] = case_seed(seed, i)
                res.examples.append(example)
    finally:
        res.seconds = time.perf_counter() - t0
        target.close()
    if advance is not None:
        advance(res.inputs - advanced)
    return res


__all__ = ["TARGETS", "Target", "TargetResult", "case_seed", "fuzz", "open_target", "replay"]
