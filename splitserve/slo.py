"""The one rule that decides what became of a real-time call's soft SLO, shared by the
front end (``server/monitor.py``) and a worker's direct path (``worker/direct.py``), which
counts its own calls in its page for the front end to add to the same metric."""

from __future__ import annotations

from enum import StrEnum

from splitserve.errors import SplitServeError


class SloOutcome(StrEnum):
    """What became of a real-time call's soft SLO, counted once when the call is answered."""

    MET = "met"  # answered with its result by its SLO
    MISSED = "missed"  # answered with its result, late (served anyway: the SLO is never enforced)
    DROPPED = "dropped"  # answered with an error (a hard deadline, a failure, the watchdog)


def slo_outcome(slo: float, answered: float, error: SplitServeError | None) -> SloOutcome:
    """The outcome of a call with SLO ``slo`` answered at ``answered`` (same clock and unit)."""
    if error is not None:
        return SloOutcome.DROPPED
    return SloOutcome.MET if answered <= slo else SloOutcome.MISSED
