"""The chaos injector's schedule: every fault kind fires, however late the loop wakes up."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.bench.chaos_faults import FAULT_KINDS, FaultInjector
from splitserve.bench.scenarios.chaos import Params


def _fired(monkeypatch: pytest.MonkeyPatch, duration_s: float, interval_s: float, lateness_s: float) -> list[str]:
    """The kinds fired on a fake clock that sleeping moves on, and every read moves ``lateness_s`` further."""
    now = [0.0]
    real_sleep = asyncio.sleep

    def clock() -> float:
        now[0] += lateness_s
        return now[0]

    async def sleep(delay: float) -> None:
        now[0] += delay
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)

    inj = FaultInjector({}, 0, None, ("m",), clock, hold_s=1, call_timeout_s=1, nonreader_mib=1)
    fired: list[str] = []

    async def one(kind: str) -> None:
        fired.append(kind)

    async def close() -> None:
        pass

    inj._one, inj.close = one, close  # type: ignore[method-assign]
    asyncio.run(inj.run(duration_s, interval_s))
    return fired


def test_a_round_that_fits_fires_each_kind_once_in_order(monkeypatch):
    assert _fired(monkeypatch, len(FAULT_KINDS) + 0.5, 1.0, lateness_s=0.0) == list(FAULT_KINDS)


def test_a_loop_that_falls_behind_still_fires_every_kind(monkeypatch):
    # each clock read costs 0.7 s: the phase is over long before the round is
    fired = _fired(monkeypatch, len(FAULT_KINDS) + 0.5, 1.0, lateness_s=0.7)
    assert fired[:len(FAULT_KINDS)] == list(FAULT_KINDS)


def test_a_phase_too_short_for_one_round_is_refused():
    with pytest.raises(ValueError, match="one round"):
        Params(models=("m",), duration_s=len(FAULT_KINDS) - 1.0, fault_interval_s=1.0).check()
