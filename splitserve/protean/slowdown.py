"""PROTEAN's slowdown model (PROTEAN §3, Eq. 1 and Eq. 2) and the fit of its FBRs.

Eq. 1 (re-purposed from Prophet): a job J_k co-located with J_1..J_n on one partition runs

    T_k = Solo_k × max{ FBR_k + Σ_i FBR_i , 1 }

where the FBR (fractional bandwidth requirement, bw·sm in the paper) is the share of the
partition's memory bandwidth a job needs alone. Every co-located job is slowed by the same
factor, the partition's total demand, never below 1. Eq. 2 scales it by the RDF (resource
deficiency factor, Solo on the partition / Solo on the whole device) to rank candidate
partitions for a strict batch: η = RDF × max{ΣFBR, 1}.

On a CPU node a partition is a set of cores, Solo on ``c`` cores is the stored latency
profile L[c, b], and an FBR is a fitted contention coefficient (cores, cache and memory
bandwidth together): Eq. 1 is kept as it is and its accuracy measured, not assumed. On a MIG
device the partition is its MIG profile (``"1g.18gb"``): Solo there and the FBRs are
measured per profile (``placement.mig_profiler``), as the paper's are "on all viable slices".
A partition's ``Shape`` says which: an int is a core count, a str a MIG profile name.

Everything here is pure: numbers in, numbers out; nothing reads a profile, a clock or a file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitserve.errors import InvalidInput

# A component of a null-space basis vector below this counts as zero: the key it belongs to is
# pinned by the equations (SVD noise on a well-posed system is ~1e-15).
_IDENTIFIED_TOL = 1e-9
# What a partition is to the profiles: its core count (a CPU set) or its MIG profile name.
Shape = int | str

# Slowdowns up to 1 + this are read as "at the floor": within the run-to-run noise of a
# latency measurement (~5 %), so they carry no equation (see fit_fbr).
FLOOR_MARGIN = 0.05


def interference(fbrs: Iterable[float]) -> float:
    """Eq. 1's factor, max{ΣFBR, 1}: the slowdown every job on a partition suffers when the
    jobs there together demand ``Σ fbrs`` of its bandwidth (PROTEAN §3, Eq. 1)."""
    return max(float(sum(fbrs)), 1.0)


def eta(rdf: float, own_fbr: float, corunner_fbrs: Iterable[float]) -> float:
    """Eq. 2: the slowdown of a job on a candidate partition relative to running alone on the
    whole device, RDF × max{FBR_own + Σ FBR_corunners, 1} (PROTEAN §3, Eq. 2, L199)."""
    return rdf * interference([own_fbr, *corunner_fbrs])


@dataclass(frozen=True)
class Colocation:
    """One co-location run: ``members`` ran together on one partition (closed loop, full
    overlap) and ``slowdowns[i]`` is member i's measured T/Solo there.

    A member key is any string; the profiler uses ``"model@batch"``. A key may appear more
    than once (two copies of one job: the self-pair, whose equation reads 2·FBR = s).
    """

    members: tuple[str, ...]
    slowdowns: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise InvalidInput("a co-location run needs at least one member")
        if len(self.members) != len(self.slowdowns):
            raise InvalidInput(
                f"a co-location run has {len(self.members)} members but {len(self.slowdowns)} slowdowns; "
                "give one measured slowdown per member"
            )
        for m, s in zip(self.members, self.slowdowns, strict=True):
            if not np.isfinite(s) or s <= 0:
                raise InvalidInput(f"member {m!r} has slowdown {s!r}; a slowdown is T/Solo > 0")


@dataclass(frozen=True)
class FbrFit:
    """What ``fit_fbr`` found.

    ``fbr``: the fitted FBR of every key the equations identify. ``unidentified``: keys that
    appear in the runs but that no combination of usable equations pins down (every slowdown
    of theirs at or below 1, or always co-located with the same unknown partner); they get no
    number. ``residuals``: per key, the root mean square of (predicted − measured) slowdown
    over the equations where that key was the measured member. ``equations``: how many
    equations (member measurements above the floor) the fit used.
    """

    fbr: dict[str, float]
    unidentified: tuple[str, ...] = ()
    residuals: dict[str, float] = field(default_factory=dict)
    equations: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as the registry stores it (profile kind ``"fbr"``)."""
        return {
            "fbr": dict(self.fbr),
            "unidentified": list(self.unidentified),
            "residuals": dict(self.residuals),
            "equations": self.equations,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FbrFit:
        """The inverse of ``to_dict``."""
        return cls(
            fbr={str(k): float(v) for k, v in d.get("fbr", {}).items()},
            unidentified=tuple(str(k) for k in d.get("unidentified", ())),
            residuals={str(k): float(v) for k, v in d.get("residuals", {}).items()},
            equations=int(d.get("equations", 0)),
        )


def fit_fbr(runs: Sequence[Colocation], floor_margin: float = FLOOR_MARGIN) -> FbrFit:
    """FBRs from co-location runs, by solving Eq. 1 over all of them (PROTEAN §3 L206).

    Each member k of a run C with measured slowdown s_k > 1 gives one equation
    Σ_{j∈C} FBR_j = s_k. A slowdown at or below 1 says only Σ FBR ≤ 1 (the max{·,1} floor), so
    such measurements are left out. So are those within ``floor_margin`` above 1 (not given:
    splitserve's choice): a pair whose true Σ FBR is below 1 runs at slowdown 1 ± noise, and
    keeping the draws that land just above 1 would read noise as bandwidth demand and bias
    the fit upwards. The paper averages the FBRs it gets from solving the equations of several
    co-locations; with more equations than unknowns and noisy measurements, non-negative least
    squares is that average done once over every equation (not given: splitserve's choice),
    and its residuals say how well Eq. 1 fits.

    A key is identified when the usable equations pin its value (its unit vector lies in the
    row space of the system); any other key is reported in ``unidentified`` and gets no number.
    """
    if floor_margin < 0:
        raise InvalidInput(f"floor_margin={floor_margin}: use 0 or a small positive share of solo time")
    keys = sorted({m for r in runs for m in r.members})
    index = {k: i for i, k in enumerate(keys)}
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    measured: list[str] = []
    for run in runs:
        row = np.zeros(len(keys))
        for m in run.members:
            row[index[m]] += 1.0
        for m, s in zip(run.members, run.slowdowns, strict=True):
            if s > 1.0 + floor_margin:
                rows.append(row)
                rhs.append(float(s))
                measured.append(m)
    if not rows:
        return FbrFit(fbr={}, unidentified=tuple(keys), residuals={}, equations=0)
    # scipy here, not at the top: every node imports this module for η, and loading scipy's
    # solvers costs about half a second at each server start; only fitting needs them
    from scipy.linalg import null_space
    from scipy.optimize import nnls

    a = np.vstack(rows)
    b = np.asarray(rhs)
    x, _ = nnls(a, b)
    free = null_space(a)  # directions the equations cannot see
    pinned = np.all(np.abs(free) < _IDENTIFIED_TOL, axis=1)  # True for every key when nothing is free
    errors = a @ x - b
    per_key: dict[str, list[float]] = {}
    for m, e in zip(measured, errors, strict=True):
        per_key.setdefault(m, []).append(float(e))
    return FbrFit(
        fbr={k: float(x[i]) for k, i in index.items() if pinned[i]},
        unidentified=tuple(k for k, i in index.items() if not pinned[i]),
        residuals={k: float(np.sqrt(np.mean(np.square(v)))) for k, v in per_key.items()},
        equations=len(rows),
    )


class SlowdownModel:
    """Eq. 1 and Eq. 2 over a node's profiles.

    ``solo(model, shape, batch)`` is the seconds one batch of ``model`` takes alone on a
    partition of that ``Shape`` (None where it was not profiled); ``fbr`` maps a model name to
    its fitted FBR on the node's core sets, ``mig_fbr`` a (model, MIG profile) pair to its FBR
    fitted on that profile; ``whole_cores`` is the whole CPU device (PROTEAN's 7g: every
    worker core) and ``mig_profiles`` the MIG profiles of the node's MIG devices.

    A model without a fitted FBR gets ``unknown_fbr``: with the default 1.0 an unprofiled job
    is assumed to need the whole partition's bandwidth, so it never looks harmless (not
    given: splitserve's choice). On a MIG profile only that profile's FBR counts: a core
    set's contention coefficient says nothing of a slice's memory bandwidth.
    """

    def __init__(
        self,
        solo: Callable[[str, Shape, int], float | None],
        fbr: Mapping[str, float],
        whole_cores: int,
        unknown_fbr: float = 1.0,
        mig_fbr: Mapping[tuple[str, str], float] | None = None,
        mig_profiles: Sequence[str] = (),
    ) -> None:
        if whole_cores < 1:
            raise InvalidInput(f"whole_cores={whole_cores}: the whole device has at least one core")
        if unknown_fbr < 0:
            raise InvalidInput(f"unknown_fbr={unknown_fbr}: an FBR is a share of bandwidth, >= 0")
        self._solo = solo
        self._fbr = dict(fbr)
        self._mig_fbr = dict(mig_fbr or {})
        self.whole_cores = whole_cores
        self.mig_profiles = tuple(dict.fromkeys(mig_profiles))
        self.unknown_fbr = unknown_fbr

    def solo(self, model: str, shape: Shape, batch: int) -> float | None:
        """Seconds one batch of ``batch`` of ``model`` takes alone on a partition of
        ``shape``; None where it was not profiled."""
        return self._solo(model, shape, batch)

    def _whole(self, model: str, batch: int, shape: Shape) -> float | None:
        """Solo on the whole device: every worker core for a core set; for a MIG profile the
        fastest of the node's MIG profiles measured (its 7g when it has one). A GPU split
        into slices has no 7g to measure without a geometry change, and the partition η picks
        is the same whichever reference divides a model's solo times (not given:
        splitserve's choice)."""
        if not isinstance(shape, str):
            return self._solo(model, self.whole_cores, batch)
        times = [t for p in self.mig_profiles if (t := self._solo(model, p, batch)) is not None and t > 0]
        return min(times, default=None)

    def rdf(self, model: str, batch: int, shape: Shape) -> float:
        """Solo on ``shape`` / Solo on the whole device (PROTEAN §3 L197); 1.0 when either
        is not profiled, so a missing profile ranks partitions by interference alone."""
        part = self._solo(model, shape, batch)
        whole = self._whole(model, batch, shape)
        if part is None or whole is None or part <= 0 or whole <= 0:
            return 1.0
        return part / whole

    def fbr_of(self, model: str, shape: Shape | None = None) -> float:
        """The fitted FBR of ``model`` (on the MIG profile ``shape`` names, when it names
        one), else ``unknown_fbr``."""
        if isinstance(shape, str):
            return self._mig_fbr.get((model, shape), self.unknown_fbr)
        return self._fbr.get(model, self.unknown_fbr)

    def eta(self, model: str, batch: int, shape: Shape, corunners: Sequence[str]) -> float:
        """Eq. 2 for one batch of ``model`` on a partition of ``shape`` shared with batches
        of ``corunners`` (one entry per co-running batch)."""
        return eta(self.rdf(model, batch, shape), self.fbr_of(model, shape),
                   (self.fbr_of(c, shape) for c in corunners))

    def predict(self, model: str, batch: int, shape: Shape, corunners: Sequence[str]) -> float | None:
        """Eq. 1's predicted seconds for the batch there: Solo on ``shape`` × max{ΣFBR, 1};
        Solo itself when it runs alone (Eq. 1 is about co-location: with a fitted FBR above 1,
        as a CPU core's time-slicing gives, max{FBR, 1} would make a job slower than its own
        solo time); None when its solo time on ``shape`` is not profiled."""
        solo = self.solo(model, shape, batch)
        if solo is None or not corunners:
            return solo
        return solo * interference([self.fbr_of(model, shape), *(self.fbr_of(c, shape) for c in corunners)])
