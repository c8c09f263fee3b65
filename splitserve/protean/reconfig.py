"""PROTEAN's Algorithm 2 (the GPU reconfigurator, §4.4) and its settings.

``GeometryController.tick`` forecasts BE demand with an EWMA (``BEPredictor``), picks the
smallest set of small partitions that holds it, falls back to (4g, 3g), and reconfigures a
partition group only on its (wait_limit+1)-th consecutive mismatching interval, never more
than ~30 % of the groups at once. The paper leaves many values open; each such place says
"not given: splitserve's choice" and every such value is a named setting
(``ProteanSettings``) that the node reports.

Pure: the clock is passed in, nothing reads profiles, sleeps or logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.protean.distributor import Job, JobDistributor, tag_partitions
from splitserve.protean.geometry import (
    FALLBACK_GEOMETRY,
    INITIAL_GEOMETRY,
    LARGE_UNITS,
    SMALL_SETS,
    Geometry,
    geometry_slots,
)
from splitserve.protean.slowdown import SlowdownModel


@dataclass(frozen=True)
class ProteanSettings:
    """PROTEAN's parameters, each with its source ("paper" or "not given: splitserve's
    choice"). A node takes them from its ``protean_*`` config fields; ``to_dict`` goes into
    every benchmark record."""

    # not given: splitserve's choice. Alg. 2 line 1's Monitor_Interval W; 2 s is the MIG
    # reconfiguration time the forecast looks past (§4.4 L264).
    monitor_interval_s: float = 2.0
    # not given: splitserve's choice. Weight of the newest sample in the BE forecast
    # ("light-weight EWMA model", Atoll [95]; §4.4 ⑨).
    ewma_weight: float = 0.5
    # paper: "3 times at least" (§4.4 L266, Alg. 2 ⑮): reconfigure on the 4th mismatch.
    wait_limit: int = 3
    # paper: "only ~30% of GPUs (on average)" change at once (§4.4 L266); at least one.
    reconfig_fraction: float = 0.3
    # not given: splitserve's choice. "Similar mismatches" (L266) may mean the same target each
    # time; False follows the pseudo-code, where any mismatch counts.
    require_same_target: bool = False
    # not given (calc_Lthresh, Alg. 2 ⑫): None derives T_low from the η model
    # (derive_thresholds); a number overrides it, in BE requests.
    t_low: float | None = None
    # not given (calc_Hthresh, Alg. 2 ⑬): None derives T_high like T_low; a number overrides it.
    t_high: float | None = None
    # paper: "~10 min" keep-alive of surplus instances (§4.2).
    keep_alive_s: float = 600.0
    # not given: splitserve's choice. FBR of a model with no fitted FBR: the whole bandwidth.
    unknown_fbr: float = 1.0
    # splitserve's addition to Algorithm 1 (not the paper's): a strict batch may wait for a
    # busy partition predicted to free sooner than a co-run would end (JobDistributor.place).
    wait_for_free: bool = True
    # splitserve's addition to Algorithm 1 (not the paper's): a BE batch keeps off partitions
    # where strict work runs until its oldest request has waited this long (0: never waits).
    be_max_wait_s: float = 0.5

    def __post_init__(self) -> None:
        if self.monitor_interval_s <= 0:
            raise InvalidInput(f"monitor_interval_s={self.monitor_interval_s}: use a positive interval")
        if not 0.0 < self.ewma_weight <= 1.0:
            raise InvalidInput(f"ewma_weight={self.ewma_weight}: use a weight in (0, 1]")
        if self.wait_limit < 0:
            raise InvalidInput(f"wait_limit={self.wait_limit}: use 0 or more intervals")
        if not 0.0 < self.reconfig_fraction <= 1.0:
            raise InvalidInput(f"reconfig_fraction={self.reconfig_fraction}: use a fraction in (0, 1]")
        if self.t_low is not None and self.t_high is not None and self.t_low > self.t_high:
            raise InvalidInput(f"t_low={self.t_low} is above t_high={self.t_high}")
        if self.keep_alive_s < 0:
            raise InvalidInput(f"keep_alive_s={self.keep_alive_s}: use 0 (no keep-alive) or more")
        if self.unknown_fbr < 0:
            raise InvalidInput(f"unknown_fbr={self.unknown_fbr}: an FBR is >= 0")
        if self.be_max_wait_s < 0:
            raise InvalidInput(f"be_max_wait_s={self.be_max_wait_s}: use 0 (BE never waits for strict work) or more")

    def to_dict(self) -> dict[str, Any]:
        """Every value, for benchmark records and logs."""
        return asdict(self)


class BEPredictor:
    """Alg. 2 ⑨: an EWMA forecast of the BE requests waiting, one sample per interval. The
    first sample seeds the average (starting from 0 would read as an idle node)."""

    def __init__(self, weight: float) -> None:
        if not 0.0 < weight <= 1.0:
            raise InvalidInput(f"EWMA weight {weight}: use a weight in (0, 1]")
        self.weight = weight
        self.forecast: float | None = None

    def observe(self, be_requests: float) -> float:
        """Fold in this interval's count and return the forecast for the next."""
        x = max(0.0, float(be_requests))
        self.forecast = x if self.forecast is None else self.weight * x + (1.0 - self.weight) * self.forecast
        return self.forecast


def reconfig_budget(groups: int, fraction: float) -> int:
    """Partition groups that may change at once: max(1, ⌊fraction × groups⌋). The paper's
    "~30% of GPUs (on average)" (§4.4 L266); its demo changed 2 of 8 (§6.1.1)."""
    return max(1, math.floor(fraction * groups))


Thresholds = Callable[[Geometry, float], tuple[float, float]]


def _reportable(bound: float | None) -> float | str | None:
    """A threshold as JSON can carry it: "inf" (a candidate that never wins) as a string,
    since strict JSON has no infinity; None for an open bound."""
    return str(bound) if bound is not None and math.isinf(bound) else bound


class GeometryController:
    """Algorithm 2 for one node (PROTEAN §4.4). A "group" is what is reconfigured as a whole
    (a GPU; a CPU node is one group). Every group starts at (4g, 2g, 1g).

    The node calls ``tick`` every ``settings.monitor_interval_s`` with the BE requests waiting,
    carries out what it returns through its one applier, and calls ``applied`` when a change
    is done. ``be_mem(n)`` gives the bytes ``n`` BE requests need (Alg. 2 ⑩'s mem(); not
    given: the node computes ⌈n / batch⌉ × footprint per batch); ``unit_mem`` is the memory of
    one memory unit and ``mem_units`` the units of each profile (None: one per compute unit,
    a CPU node's proportional budget; ``MIG_A100_MEM_UNITS`` on an A100). ``thresholds(g, n)``
    gives (T_low, T_high) in BE requests for candidate geometry ``g`` (``derive_thresholds``);
    ``settings.t_low``/``t_high`` override it, and without either a bound is open.
    """

    def __init__(
        self,
        settings: ProteanSettings,
        groups: int,
        unit_mem: int,
        be_mem: Callable[[float], int],
        thresholds: Thresholds | None = None,
        mem_units: Mapping[int, int] | None = None,
    ) -> None:
        if groups < 1:
            raise InvalidInput(f"groups={groups}: a node has at least one partition group")
        self.settings = settings
        self.groups = groups
        self.unit_mem = unit_mem
        self.mem_units = dict(mem_units) if mem_units else None
        self.budget = reconfig_budget(groups, settings.reconfig_fraction)
        self.predictor = BEPredictor(settings.ewma_weight)
        self.current: list[Geometry] = [INITIAL_GEOMETRY] * groups
        self.wait: list[int] = [0] * groups  # Alg. 2's wait_ctr, one per group
        self.last: dict[str, Any] = {}
        self._be_mem = be_mem
        self._thresholds = thresholds
        self._pending: list[Geometry | None] = [None] * groups  # the target being waited for
        self._in_flight: dict[int, Geometry] = {}  # issued, not yet applied
        self._ready_since: dict[int, int] = {}  # group -> tick it first could change (fairness)
        self._ticks = 0

    def set_mem(self, units: Sequence[int]) -> int:
        """Alg. 2 ⑪'s sum_max_mem: bytes the partitions of ``units`` hold together."""
        return sum((self.mem_units[u] if self.mem_units else u) * self.unit_mem for u in units)

    def _bounds(self, candidate: Geometry, pred: float) -> tuple[float | None, float | None, str]:
        """(T_low, T_high) for ``candidate`` and where they came from: each from the settings
        where given, else from ``thresholds``, else open (None)."""
        s = self.settings
        if (s.t_low is None or s.t_high is None) and self._thresholds is not None:
            lo, hi = self._thresholds(candidate, pred)
            return (lo if s.t_low is None else s.t_low), (hi if s.t_high is None else s.t_high), "derived"
        return s.t_low, s.t_high, "settings" if s.t_low is not None or s.t_high is not None else "open"

    def target(self, pred: float) -> tuple[Geometry, dict[str, Any]]:
        """Alg. 2 lines 9-23 for a forecast of ``pred`` BE requests: the geometry every group
        should have, and the numbers that decided it."""
        need = self._be_mem(pred)
        chosen = next((ss for ss in SMALL_SETS if self.set_mem(ss) >= need), None)  # lines 10-11
        lo = hi = None
        source = "none"
        if chosen is not None:
            candidate = Geometry((LARGE_UNITS, *chosen))  # line 23
            lo, hi, source = self._bounds(candidate, pred)  # ⑫ ⑬
        # line 19: "pot", the chosen set's potential occupancy, is read as the forecast BE
        # requests, the unit the thresholds are in (not given: splitserve's choice).
        if chosen is None or (lo is not None and pred < lo) or (hi is not None and pred > hi):
            goal = FALLBACK_GEOMETRY  # line 20 ⑭
        else:
            goal = candidate
        return goal, {
            "be_mem": need,
            "small_set": list(chosen) if chosen is not None else None,
            "t_low": _reportable(lo),
            "t_high": _reportable(hi),
            "threshold_source": source,
            "target": str(goal),
        }

    def tick(self, now: float, be_waiting: float) -> list[tuple[int, Geometry]]:
        """One monitor interval (Alg. 2 lines 1-30): the (group, geometry) changes to start
        now, at most ``budget`` groups in flight at once, each on its (wait_limit+1)-th
        consecutive mismatching interval.

        A group held back by the budget keeps its count and goes first when room frees (the
        paper leaves this open: not given: splitserve's choice). A group whose change is
        issued restarts its count, so flapping BE demand needs wait_limit+1 fresh mismatches
        before the next change (not given: splitserve's choice; the pseudo-code only resets on
        a matching interval). A group with a change in flight is left alone until ``applied``.
        """
        self._ticks += 1
        pred = self.predictor.observe(be_waiting)
        goal, numbers = self.target(pred)
        limit = self.settings.wait_limit
        for g in range(self.groups):
            if g in self._in_flight:
                continue
            if self.current[g] == goal:  # line 29
                self.wait[g] = 0
                self._pending[g] = None
                self._ready_since.pop(g, None)
                continue
            if self.settings.require_same_target and self._pending[g] != goal:
                self.wait[g] = 0
                self._ready_since.pop(g, None)
            self._pending[g] = goal
            if self.wait[g] >= limit:  # line 25 ⑮
                self._ready_since.setdefault(g, self._ticks)
            else:
                self.wait[g] += 1  # line 28
        ready = sorted(self._ready_since, key=lambda g: (self._ready_since[g], g))
        room = max(0, self.budget - len(self._in_flight))
        issued = [(g, goal) for g in ready[:room]]
        for g, geometry in issued:
            self._in_flight[g] = geometry
            self.wait[g] = 0
            self._pending[g] = None
            del self._ready_since[g]
        self.last = {
            "t": now,
            "be_waiting": be_waiting,
            "prediction": pred,
            **numbers,
            "wait": list(self.wait),
            "wait_limit": limit,
            "budget": self.budget,
            "issued": [g for g, _ in issued],
            "in_flight": {g: str(geo) for g, geo in self._in_flight.items()},
            "current": [str(geo) for geo in self.current],
        }
        return issued

    def applied(self, group: int, geometry: Geometry) -> None:
        """The applier finished a change of ``group``; ``geometry`` is what is in force now
        (the old one if the change failed)."""
        if not 0 <= group < self.groups:
            raise InvalidInput(f"group {group} does not exist; this node has groups 0..{self.groups - 1}")
        self.current[group] = geometry
        self._in_flight.pop(group, None)


def derive_thresholds(
    candidate: Geometry,
    model: SlowdownModel,
    strict: Job,
    be: Job,
    *,
    unit_cores: int,
    unit_mem: int,
    mem_units: Mapping[int, int] | None = None,
    strict_batches: int = 1,
    fallback: Geometry = FALLBACK_GEOMETRY,
) -> tuple[float, float]:
    """T_low and T_high (Alg. 2 ⑫ ⑬, formulas not given) as crossover points of the η model:
    the fewest and the most BE requests at which ``candidate`` still serves strict work at
    least as well as ``fallback``.

    For n = 0, 1, ... BE batches (``be``), up to what the larger of the two geometries holds,
    both geometries are filled by Algorithm 1 itself: the n BE batches first fit, the tags
    from their memory, then ``strict_batches`` batches of ``strict`` each to its least-η slot.
    ``candidate`` wins at n when its mean strict η is at most ``fallback``'s; T_low and T_high
    bound the first run of consecutive wins. (Past what the candidate's memory holds, BE
    batches wait there and stop crowding strict work, so a second run of "wins" can appear
    at the far end; it is an artefact of unserved BE work and is not counted.) The result is
    in BE requests (n × ``be.batch``); when the candidate never wins, both are infinite, so
    every forecast falls below T_low and the fallback is taken. The paper's reading (L266): below
    T_low a 3g shared by strict and BE beats the small partitions; above T_high the BE on
    (2g, 1g) crowds strict work.
    """
    if be.mem_bytes <= 0 or strict_batches < 1:
        raise InvalidInput("derive_thresholds needs a BE batch with a footprint and at least one strict batch")
    geoms = (candidate, fallback)
    most = max(sum(s.mem_bytes for s in geometry_slots(g, unit_cores, unit_mem, mem_units)) for g in geoms)
    dist = JobDistributor(model, batch_mem=lambda m: be.mem_bytes if m == be.model else None)
    wins = [
        _mean_strict_eta(dist, candidate, n, strict, be, strict_batches, unit_cores, unit_mem, mem_units)
        <= _mean_strict_eta(dist, fallback, n, strict, be, strict_batches, unit_cores, unit_mem, mem_units)
        for n in range(most // be.mem_bytes + 1)
    ]
    if not any(wins):
        return math.inf, math.inf
    low = wins.index(True)
    high = low
    while high + 1 < len(wins) and wins[high + 1]:
        high += 1
    return float(low * be.batch), float(high * be.batch)


def _mean_strict_eta(
    dist: JobDistributor,
    geometry: Geometry,
    n_be: int,
    strict: Job,
    be: Job,
    strict_batches: int,
    unit_cores: int,
    unit_mem: int,
    mem_units: Mapping[int, int] | None,
) -> float:
    """Mean η of ``strict_batches`` strict batches placed by Algorithm 1 on ``geometry`` after
    ``n_be`` BE batches (those that fit; the rest wait)."""
    slots = geometry_slots(geometry, unit_cores, unit_mem, mem_units)
    ids = [s.id for s in slots]
    for _ in range(n_be):
        sid = dist.choose(be, slots, {}, ids)
        if sid is None:
            break
        slots[sid] = replace(slots[sid], running=(*slots[sid].running, be))
    tags = tag_partitions(slots, n_be * be.mem_bytes)
    total = 0.0
    for _ in range(strict_batches):
        sid = dist.choose(strict, slots, tags, ids, be_models=(be.model,))
        assert sid is not None  # every slot is eligible and a strict choice never waits
        total += dist.strict_eta(strict, slots[sid], tags[sid], (be.model,), slots)
        slots[sid] = replace(slots[sid], running=(*slots[sid].running, strict))
    return total / strict_batches
