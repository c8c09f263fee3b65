"""PROTEAN's deciders (PROTEAN §4.3-§4.4): where each batch runs and which geometry a node's
partitions take.

- Algorithm 1 (job distribution, §4.3): ``tag_partitions`` marks how much of each partition,
  smallest first, the best-effort (BE) memory demand will take; ``JobDistributor.choose``
  sends a strict batch to the partition of least η (Eq. 2) among those not wholly taken by BE
  work, and first-fits a BE batch onto the smallest partition it fits. ``JobDistributor.place``
  adds splitserve's wait-for-free (not in the paper): a strict batch waits for a busy
  partition when running there once it is free is predicted to end sooner than running now;
  and a BE batch keeps off partitions where strict work runs, for a bounded time (also
  splitserve's: on a CPU core a co-run is time-slicing).
- Algorithm 2 (GPU reconfigurator, §4.4): ``GeometryController.tick`` forecasts BE demand
  with an EWMA (``BEPredictor``), picks the smallest set of small partitions that holds it,
  falls back to (4g, 3g), and reconfigures a partition group only on its (wait_limit+1)-th
  consecutive mismatching interval, never more than ~30 % of the groups at once.
- The geometry family: ``Geometry`` (partition sizes in MIG "g" units), and on a CPU node
  ``cpu_unit``/``carve``, which turn a geometry into disjoint CPU sets (one "1g" is
  ⌊worker cores / 7⌋ cores).

Pure: the clock is passed in, nothing reads profiles, sleeps or logs. The paper leaves many
values open; each such place says "not given: splitserve's choice" and every such value is a
named setting (``ProteanSettings``) that the node reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.placement.slowdown import SlowdownModel, interference
from splitserve.placement.topology import Core, allocate

# --------------------------------------------------------------------------- Algorithm 1


@dataclass(frozen=True)
class Job:
    """One batch as Algorithm 1 sees it: its model, size, class and memory footprint.

    ``started``: when a running batch started (the decider's clock; None: not running, or
    not known), from which wait-for-free predicts its end. ``due``: the soft SLO deadline of
    a strict batch being placed (its head request's), which bounds how long it may wait.
    ``arrived``: when the oldest request of a BE batch being placed arrived, which bounds how
    long it keeps off partitions where strict work runs.
    """

    model: str
    batch: int
    strict: bool
    mem_bytes: int
    started: float | None = None
    due: float | None = None
    arrived: float | None = None


@dataclass(frozen=True)
class Placement:
    """``JobDistributor.place``'s answer: the slot the batch runs on now (``slot``), or None
    when it waits. A batch that waits by choice gives the time it must be decided again by
    even if nothing ends (``until``); a strict one names the busy slot it waits for
    (``wait_for``), a BE one waits for any slot without strict work. ``run_now_s`` and
    ``wait_s`` are the predicted completions (seconds from now) that decided a strict wait,
    None where there was no prediction. ``tag`` is ``slot``'s tag in the decision (set by
    ``node_partitions.BatchChooser``; None: no slot, or a policy without tags)."""

    slot: int | None
    wait_for: int | None = None
    until: float | None = None
    run_now_s: float | None = None
    wait_s: float | None = None
    tag: float | None = None


@dataclass(frozen=True)
class _Hold:
    """A strict batch of one model waiting for ``slot`` to free, until ``until`` at the latest."""

    slot: int
    until: float


@dataclass(frozen=True)
class Slot:
    """A partition as Algorithm 1 sees it: ``cores`` and a memory budget, and the batches
    running there now (``running``)."""

    id: int
    cores: int
    mem_bytes: int
    running: tuple[Job, ...] = ()

    @property
    def free_mem(self) -> int:
        """Memory not held by any running batch: what a BE batch must fit in (first fit)."""
        return self.mem_bytes - sum(j.mem_bytes for j in self.running)

    @property
    def available_mem(self) -> int:
        """The partition's ``available_mem`` in Alg. 1 line 4: its budget less what strict
        batches running there hold. BE batches are left in, since the BE demand being tagged
        counts the running BE batches too (not given: splitserve's choice)."""
        return self.mem_bytes - sum(j.mem_bytes for j in self.running if j.strict)


def _ascending(slot: Slot) -> tuple[int, int, int]:
    """"Ascending order of resources" (Alg. 1 line 2): cores first, then memory, so a 3g.20gb
    sorts before a 4g.20gb; the id makes the order total (not given: splitserve's choice)."""
    return (slot.cores, slot.mem_bytes, slot.id)


def tag_partitions(slots: Sequence[Slot], be_mem: int) -> dict[int, float]:
    """Alg. 1 lines 1-8: the share of each partition the BE demand ``be_mem`` (bytes of queued
    and running BE batches) is expected to take, filling the smallest partitions first.

    A partition with nothing left for the demand tags 0.0 (line 8 stops the loop there); one
    whose available memory is already gone while demand remains tags 1.0 (not given:
    splitserve's choice; the paper's division would be by zero).
    """
    tags = {s.id: 0.0 for s in slots}
    left = max(0, be_mem)
    for s in sorted(slots, key=_ascending):
        if left <= 0:
            break  # line 8
        avail = s.available_mem
        if avail <= 0:
            tags[s.id] = 1.0
            continue
        tags[s.id] = min(1.0, left / avail)  # line 4
        left = max(0, left - avail)  # line 5
    return tags


class JobDistributor:
    """Algorithm 1's per-batch choice (PROTEAN §4.3, ⑦ and ⑧).

    ``batch_mem(model)``: bytes one batch of a BE model holds (its footprint at its batch
    size), to count the BE batches the tags predict on a partition; None or unknown falls back
    to a running BE batch of that model, else a wholly tagged partition counts as one batch.
    ``wait_for_free`` turns on ``place``'s waiting of strict batches and ``be_max_wait_s``
    (seconds after its oldest request arrived; 0: never) bounds how long a BE batch keeps off
    partitions where strict work runs (both splitserve's additions, see ``place``).

    ``place`` remembers, per model, the slot a waiting strict batch of it waits for, so that
    BE batches keep off that slot until the strict batch runs or its wait ends; ``model`` may
    be replaced (new FBRs) without losing that.
    """

    def __init__(self, model: SlowdownModel, batch_mem: Callable[[str], int | None] | None = None,
                 wait_for_free: bool = False, be_max_wait_s: float = 0.0) -> None:
        self.model = model
        self._batch_mem = batch_mem
        self.wait_for_free = wait_for_free
        self.be_max_wait_s = be_max_wait_s
        self._holds: dict[str, _Hold] = {}  # model -> the slot its waiting strict batch waits for

    def choose(
        self,
        job: Job,
        slots: Sequence[Slot],
        tags: Mapping[int, float],
        eligible: Collection[int],
        be_models: Sequence[str] = (),
    ) -> int | None:
        """The slot id ``job`` should run on, among ``eligible`` ids, or None (wait).

        Strict (⑦): argmin η over eligible slots with tag < 1, η counting the BE batches the
        tags predict there (``strict_eta``). While no eligible slot has tag < 1 but one with
        tag < 1 runs a strict batch of the same model (its instance there is busy with short,
        strict work, whose end decides again), the batch waits for it rather than go where
        BE work has taken the partition: eligible means an idle instance, which on MIG the
        autoscaler would make, and the paper's set is the partitions, not the idle
        instances. Otherwise, when every eligible slot is wholly tagged, argmin η over all
        of them (not given: splitserve's choice, the paper leaves the set empty). Ties go to
        the larger slot, which has more headroom if the prediction is off (not given:
        splitserve's choice).

        Best effort (⑧): first fit over the eligible slots, smallest first, by free memory;
        a batch that fits nowhere waits (not given: splitserve's choice). First fit over the
        ascending list is what spills BE into the largest partition once the small ones are
        full (PROTEAN Fig. 7 ①).
        """
        cands = [s for s in slots if s.id in eligible]
        if not cands:
            return None
        if not job.strict:
            fit = next((s for s in sorted(cands, key=_ascending) if s.free_mem >= job.mem_bytes), None)
            return None if fit is None else fit.id
        pool = [s for s in cands if tags.get(s.id, 0.0) < 1.0]
        if not pool and any(tags.get(s.id, 0.0) < 1.0 and any(j.strict and j.model == job.model for j in s.running)
                            for s in slots):
            return None
        pool = pool or cands

        def rank(s: Slot) -> tuple[float, ...]:
            return (self.strict_eta(job, s, tags.get(s.id, 0.0), be_models, slots), *(-v for v in _ascending(s)))

        return min(pool, key=rank).id

    def held(self, now: float) -> dict[str, int]:
        """The slots waiting strict batches wait for now, by model (expired waits dropped)."""
        self._holds = {m: h for m, h in self._holds.items() if h.until > now}
        return {m: h.slot for m, h in self._holds.items()}

    def place(
        self,
        job: Job,
        slots: Sequence[Slot],
        tags: Mapping[int, float],
        eligible: Collection[int],
        now: float,
        be_models: Sequence[str] = (),
        placed: Collection[int] | None = None,
    ) -> Placement:
        """``choose`` at time ``now``, with wait-for-free (splitserve's addition, not the
        paper's: on MIG, co-located batches run in parallel on their own slices, so a short
        wait rarely beats a co-run; on a CPU core a co-run is time-slicing).

        Best effort: ``choose`` over the eligible slots no waiting strict batch waits for, so
        a strict batch that waits keeps its place ahead of BE work; see ``_place_be`` for
        how it keeps off slots where strict work runs.

        Strict: the predicted completion of running now on ``choose``'s slot (Eq. 1: solo on
        its cores × max{ΣFBR, 1}, the tags' BE batches counted as in ``strict_eta``) against
        waiting for a busy slot among ``placed`` (the slots the model has instances on; None:
        all) to free and then running there alone: its running batches' predicted ends (from
        their ``started`` and the same model) plus the solo run there. It waits for the
        soonest such slot when that completes first and, if the job has a ``due``, by it;
        ``until``, when it must be decided again, is the latest start at which waiting still
        beats running now and meets ``due``. A running batch already past its predicted end
        is expected to run as long again as it has overrun (not given: splitserve's choice),
        so a wait on a late batch ends by itself. Without a prediction (no solo profile of
        the job, or of a batch running on the slot), or with ``wait_for_free`` off, it is
        ``choose``'s answer.
        """
        held = self.held(now)
        if not job.strict:
            busy = set(held.values())
            return self._place_be(job, slots, tags, [i for i in eligible if i not in busy], now, be_models)
        base = self.choose(job, slots, tags, eligible, be_models)
        if base is None:  # no idle instance it may take: it waits as it did, on what it waited for
            return Placement(None)
        self._holds.pop(job.model, None)
        by_id = {s.id: s for s in slots}
        if not self.wait_for_free:
            return Placement(base)
        run_now = self._run_s(job, by_id[base], tags.get(base, 0.0), be_models, slots)
        if run_now is None:
            return Placement(base)
        pool = [s for s in slots if tags.get(s.id, 0.0) < 1.0] or list(slots)
        best: tuple[float, float, Slot] | None = None  # (completion, solo run, slot)
        for s in pool:
            if not s.running or (placed is not None and s.id not in placed):
                continue
            free_at = self._free_at(s, now)
            run = self._run_s(job, replace(s, running=()), tags.get(s.id, 0.0), be_models, slots)
            if free_at is None or run is None:
                continue
            if best is None or free_at + run < best[0]:
                best = (free_at + run, run, s)
        if best is None:
            return Placement(base, run_now_s=run_now)
        done, run, s = best
        latest = now + run_now - run  # past this, having run now would have finished first
        if job.due is not None:
            latest = min(latest, job.due - run)
        if done - run >= latest:
            return Placement(base, run_now_s=run_now, wait_s=done - now)
        self._holds[job.model] = _Hold(s.id, latest)
        return Placement(None, wait_for=s.id, until=latest, run_now_s=run_now, wait_s=done - now)

    def _place_be(self, job: Job, slots: Sequence[Slot], tags: Mapping[int, float], eligible: Collection[int],
                  now: float, be_models: Sequence[str]) -> Placement:
        """Where a BE batch runs (splitserve's addition to ⑧, not the paper's): first fit
        over the eligible slots where no strict batch runs; when that finds none, it waits
        rather than start beside a running strict batch, until its oldest request has waited
        ``be_max_wait_s`` (``until``), then takes first fit over them all (Algorithm 1's
        answer). The paper isolates BE from strict work "whenever possible" (§4.3 L234)
        through first fit by memory, since on MIG a slice's co-runners run in parallel; on a
        CPU node the first-fit slot is often out of reach only because its instance of the
        model is busy, and the next slot's core time-slices with the strict batch there. BE
        has no latency target, so it may queue. A slot's strict work ending (or the BE
        batch's own instance freeing) makes the node decide again; without an arrival time,
        or with ``be_max_wait_s`` 0, it is Algorithm 1's answer."""
        fit = self.choose(job, slots, tags, eligible, be_models)
        if fit is None or job.arrived is None or self.be_max_wait_s <= 0:
            return Placement(fit)
        by_id = {s.id: s for s in slots}
        apart = [i for i in eligible if not any(r.strict for r in by_id[i].running)]
        if fit in apart:
            return Placement(fit)
        elsewhere = self.choose(job, slots, tags, apart, be_models)
        if elsewhere is not None:
            return Placement(elsewhere)
        until = job.arrived + self.be_max_wait_s
        return Placement(fit) if now >= until else Placement(None, until=until)

    def _run_s(self, job: Job, slot: Slot, tag: float, be_models: Sequence[str], slots: Sequence[Slot]) -> float | None:
        """Seconds for ``job`` on ``slot`` as it is: Eq. 1 (solo there × max{ΣFBR, 1}) beside
        the running batches and the tags' BE batches, its solo time when alone; None without
        a solo profile there."""
        solo = self.model.solo(job.model, slot.cores, job.batch)
        if solo is None:
            return None
        co = self._corunners(slot, tag, be_models, slots)
        return solo * interference([self.model.fbr_of(job.model), *co]) if co else solo

    def _free_at(self, slot: Slot, now: float) -> float | None:
        """When every batch running on ``slot`` is predicted to have ended (Eq. 1 for each
        among the others, solo when alone, from its start); None when one has no prediction."""
        ends = []
        for i, r in enumerate(slot.running):
            others = [o.model for o in (*slot.running[:i], *slot.running[i + 1:])]
            took = self.model.predict(r.model, r.batch, slot.cores, others)
            if took is None or r.started is None:
                return None
            end = r.started + took
            ends.append(end if end >= now else now + (now - end))
        return max(ends)

    def strict_eta(
        self, job: Job, slot: Slot, tag: float, be_models: Sequence[str] = (), slots: Sequence[Slot] = ()
    ) -> float:
        """Eq. 2 for ``job`` on ``slot``: RDF there × max{its FBR + the running batches' FBRs +
        the FBRs of the BE batches the tag predicts, 1}.

        The paper says η "also considers potential slowdown due to occupancy by BE requests
        using tag_values" (§4.3 L260) without a formula (not given: splitserve's choice):
        the tag predicts tag × ⌊available memory / memory of one BE batch⌋ BE batches on the
        slot; the BE batches already running there are part of that number, so only the rest
        are added, each with the mean FBR of ``be_models``. ``slots`` (all of them) lets a BE
        batch running elsewhere give the batch size when ``batch_mem`` does not know it.
        """
        m = self.model
        return m.rdf(job.model, job.batch, slot.cores) * interference(
            [m.fbr_of(job.model), *self._corunners(slot, tag, be_models, slots)])

    def _corunners(self, slot: Slot, tag: float, be_models: Sequence[str], slots: Sequence[Slot]) -> list[float]:
        """The FBRs a batch placed on ``slot`` would run beside: the running batches', and the
        tags' BE batches not running yet at the BE models' mean FBR (see ``strict_eta``)."""
        m = self.model
        fbrs = [m.fbr_of(r.model) for r in slot.running]
        if tag > 0 and be_models:
            per_batch = self._be_batch_mem(be_models, slots or (slot,))
            expected = tag * (slot.available_mem // per_batch if per_batch else 1)
            running_be = sum(1 for r in slot.running if not r.strict)
            extra = max(0.0, expected - running_be)
            if extra > 0:
                fbrs.append(extra * sum(m.fbr_of(b) for b in be_models) / len(be_models))
        return fbrs

    def _be_batch_mem(self, be_models: Sequence[str], slots: Sequence[Slot]) -> float:
        """Mean bytes of one batch of the BE models, from ``batch_mem`` or a running batch;
        0.0 when none is known."""
        known: list[int] = []
        for b in be_models:
            mem = self._batch_mem(b) if self._batch_mem is not None else None
            if mem is None:
                mem = next((r.mem_bytes for s in slots for r in s.running if r.model == b and not r.strict), None)
            if mem:
                known.append(mem)
        return sum(known) / len(known) if known else 0.0


# --------------------------------------------------------------------------- geometries

# Table 2 (A100): how many of each profile one GPU can hold, by compute units ("g").
MIG_MAX_COUNT: dict[int, int] = {1: 7, 2: 3, 3: 2, 4: 1, 7: 1}
# Table 2 (A100 40GB): memory slices (of 8, 5 GB each) per profile. A 3g gets as much memory as
# a 4g, which is what lets Algorithm 2's second small set [3g] hold more than [1g, 2g].
MIG_A100_MEM_UNITS: dict[int, int] = {1: 1, 2: 2, 3: 4, 4: 4, 7: 8}
COMPUTE_UNITS = 7  # MIG: at most 7 compute slices per GPU (§2.2)


@dataclass(frozen=True)
class Geometry:
    """Partition sizes in "g" units (PROTEAN's MIG profiles), largest first: (4, 2, 1) is
    (4g, 2g, 1g). Built in normal order whatever order ``units`` come in, and valid by
    construction (``validate``)."""

    units: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(sorted((int(u) for u in self.units), reverse=True)))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidInput unless this is a geometry a MIG GPU allows (Table 2): profiles
        1g/2g/3g/4g/7g within their counts (so at most one 4g) and at most 7 compute units."""
        if not self.units:
            raise InvalidInput("a geometry needs at least one partition")
        for u in set(self.units):
            if u not in MIG_MAX_COUNT:
                raise InvalidInput(f"{u}g is not a MIG profile; use sizes of {sorted(MIG_MAX_COUNT)} units")
            if self.units.count(u) > MIG_MAX_COUNT[u]:
                raise InvalidInput(f"geometry {self} has {self.units.count(u)}× {u}g; a GPU holds at most "
                                   f"{MIG_MAX_COUNT[u]}")
        if sum(self.units) > COMPUTE_UNITS:
            raise InvalidInput(f"geometry {self} needs {sum(self.units)} compute units; a GPU has {COMPUTE_UNITS}")

    def __str__(self) -> str:
        return "(" + ",".join(f"{u}g" for u in self.units) + ")"


INITIAL_GEOMETRY = Geometry((4, 2, 1))  # every group starts here (§6.1.1 Demonstration)
FALLBACK_GEOMETRY = Geometry((4, 3))  # Alg. 2 line 20 ⑭
SMALL_SETS: tuple[tuple[int, ...], ...] = ((1, 2), (3,))  # Alg. 2 line 10, tried in this order
LARGE_UNITS = 4  # Alg. 2 line 23: the 4g added to a chosen small set


def cpu_unit(worker_cores: int) -> int | None:
    """Cores of one "1g" on a CPU node: ⌊worker_cores / 7⌋, so the paper's geometries carry
    over unchanged; None below 7 cores, where only static geometries exist."""
    unit = worker_cores // COMPUTE_UNITS
    return unit if unit >= 1 else None


def carve(geometry: Geometry, cpus: Sequence[int] | Sequence[Core], unit: int) -> list[tuple[int, ...]]:
    """Disjoint CPU sets, one per partition in geometry order: a ``u``g partition gets
    ``u × unit`` CPUs, through the node's allocator (``topology.allocate``: one socket per
    partition where it fits, neighbouring cores). ``cpus`` are plain ids (taken as one socket,
    in id order) or ``Core`` records with their topology.

    CPUs beyond 7 units (worker cores not divisible by 7) go to the largest partition, so no
    worker core idles and the strict partition gets the most (not given: splitserve's choice).
    Raises InvalidInput when ``unit`` is below 1 or the geometry needs more CPUs than given.
    """
    if unit < 1:
        raise InvalidInput(f"unit={unit}: a 1g partition needs at least one CPU")
    cores = [c if isinstance(c, Core) else Core(cpu=c, core=c, socket=0) for c in cpus]
    if len({c.cpu for c in cores}) != len(cores):
        raise InvalidInput(f"carve was given duplicate CPUs: {sorted(c.cpu for c in cores)}")
    counts = [u * unit for u in geometry.units]
    if sum(counts) > len(cores):
        raise InvalidInput(f"geometry {geometry} at {unit} CPUs per unit needs {sum(counts)} CPUs; "
                           f"only {len(cores)} are given")
    counts[0] += len(cores) - sum(counts)
    return [tuple(p) for p in allocate(counts, cores)]


def geometry_slots(
    geometry: Geometry, unit_cores: int, unit_mem: int, mem_units: Mapping[int, int] | None = None
) -> list[Slot]:
    """Empty slots for ``geometry``, ids in geometry order: ``u × unit_cores`` cores and
    ``mem_units[u] × unit_mem`` bytes each (``mem_units`` None: memory in proportion to
    compute, the CPU node's budget)."""
    return [
        Slot(id=i, cores=u * unit_cores, mem_bytes=(mem_units[u] if mem_units else u) * unit_mem)
        for i, u in enumerate(geometry.units)
    ]


# --------------------------------------------------------------------------- Algorithm 2


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
