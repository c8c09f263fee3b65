"""PROTEAN's Algorithm 1 (job distribution, §4.3): where each batch runs.

``tag_partitions`` marks how much of each partition, smallest first, the best-effort (BE)
memory demand will take; ``JobDistributor.choose`` sends a strict batch to the partition of
least η (Eq. 2) among those not wholly taken by BE work, and first-fits a BE batch onto the
smallest partition it fits. ``JobDistributor.place`` adds splitserve's wait-for-free (not in
the paper): a strict batch waits for a busy partition when running there once it is free is
predicted to end sooner than running now; and a BE batch keeps off partitions where strict
work runs, for a bounded time (also splitserve's: on a CPU core a co-run is time-slicing).

Pure: the clock is passed in, nothing reads profiles, sleeps or logs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from splitserve.protean.slowdown import Shape, SlowdownModel, interference


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
    running there now (``running``). A MIG device names its MIG ``profile`` (``"1g.18gb"``)
    and gives its compute slices as ``cores`` (the order of resources); its solo times and
    FBRs are then that profile's."""

    id: int
    cores: int
    mem_bytes: int
    running: tuple[Job, ...] = ()
    profile: str | None = None

    @property
    def shape(self) -> Shape:
        """What the profiles know this partition by: its MIG profile, else its core count."""
        return self.profile if self.profile is not None else self.cores

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
        solo = self.model.solo(job.model, slot.shape, job.batch)
        if solo is None:
            return None
        co = self._corunners(slot, tag, be_models, slots)
        return solo * interference([self.model.fbr_of(job.model, slot.shape), *co]) if co else solo

    def _free_at(self, slot: Slot, now: float) -> float | None:
        """When every batch running on ``slot`` is predicted to have ended (Eq. 1 for each
        among the others, solo when alone, from its start); None when one has no prediction."""
        ends = []
        for i, r in enumerate(slot.running):
            others = [o.model for o in (*slot.running[:i], *slot.running[i + 1:])]
            took = self.model.predict(r.model, r.batch, slot.shape, others)
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
        return m.rdf(job.model, job.batch, slot.shape) * interference(
            [m.fbr_of(job.model, slot.shape), *self._corunners(slot, tag, be_models, slots)])

    def _corunners(self, slot: Slot, tag: float, be_models: Sequence[str], slots: Sequence[Slot]) -> list[float]:
        """The FBRs a batch placed on ``slot`` would run beside: the running batches', and the
        tags' BE batches not running yet at the BE models' mean FBR (see ``strict_eta``)."""
        m = self.model
        fbrs = [m.fbr_of(r.model, slot.shape) for r in slot.running]
        if tag > 0 and be_models:
            per_batch = self._be_batch_mem(be_models, slots or (slot,))
            expected = tag * (slot.available_mem // per_batch if per_batch else 1)
            running_be = sum(1 for r in slot.running if not r.strict)
            extra = max(0.0, expected - running_be)
            if extra > 0:
                fbrs.append(extra * sum(m.fbr_of(b, slot.shape) for b in be_models) / len(be_models))
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
