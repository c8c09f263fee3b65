"""Applies the node-wide RT/BE policy (``scheduler.priority``) to the running models.

Every model runtime asks the coordinator for its batches. The coordinator looks at the
whole node (all models' instances, their CPUs and what they run), lets RT batches start
first, raises preemption flags on BE batches that sit on CPUs the RT work needs, then lets
BE batches start where policy allows, and sets padding deadlines for BE work running
beside RT work. It also keeps a bounded event log (start, preempt, resume, done) that
tests and the DISB benchmark read to check the order of events rather than wall-clock
thresholds. On a partitioned node it asks the node's ``BatchPlacement`` which instance (so
which partition) takes each batch, and every event names the partition and, under PROTEAN's
η placement, the partition's tag when the batch was placed (so a reader can check from the
log alone that strict batches went only where best-effort work had not taken the partition).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.protocol.header import RequestClass
from splitserve.scheduler import padding
from splitserve.scheduler.model_scheduler import ClassOrder
from splitserve.scheduler.priority import Decision, InstanceView, PriorityMode, decide
from splitserve.scheduler.request import Batch
from splitserve.worker.messages import DIRECT_BATCH

RT, BE = RequestClass.RT, RequestClass.BE


@dataclass(slots=True)
class Event:
    """One step in the life of a batch, on the server's perf_counter clock. Never changed once
    logged; not frozen, because a frozen dataclass takes six times as long to build (≈ 1.7 µs
    against 0.3), and the front end's path logs two a call (start and done)."""

    t: float  # start and resume: the scheduling pass that let it start (its RUN follows at once)
    kind: str  # start | resume | preempt | preempted | done | failed; load_start | load_done | evict_start | evict_done
    model: str
    instance: int
    batch: int
    cls: str
    segment: int = 0  # preempted: the restore point; resume: where it resumes
    latency_ns: int = 0  # preempted: flag raised -> worker stopped
    partition: int = -1  # the node partition the instance sits on (-1: none, or not an instance's event)
    tag: float | None = None  # the batch's ``Batch.tag``: its partition's tag when placed (None: not by tags)
    # done, for a batch run whole: when its worker began computing it (server clock), and each of
    # its requests' arrival -> that moment in µs (the preemption latency, queueing and wake-up included)
    compute_start: float | None = None
    waits_us: tuple[int, ...] = ()


class ScheduledModel(Protocol):
    """One model as the coordinator sees it: a model's ``dispatch``
    (``server.model.dispatch.Dispatch``), which calls the coordinator (``NodeScheduler``)
    from its scheduling pass; the coordinator answers with these calls."""

    name: str

    def instance_views(self, preempt_raised: Callable[[int, int], bool]) -> list[InstanceView]:
        """Each instance: CPUs, what it runs, when that should end. ``preempt_raised(instance,
        batch_id)`` says whether the coordinator has already asked that batch to stop."""

    def rt_waiting(self) -> int:
        """Real-time requests waiting for a batch."""

    def start_batches(self, now: float, classes: Sequence[RequestClass],
                      may_start: Callable[[int, RequestClass], bool] | None,
                      pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None = None) -> list[Batch]:
        """Take the batches that may start now (only ``classes``, only where ``may_start``);
        ``pick(cls, batch_size, idle_ids)`` chooses the instance of each batch (None: it waits)."""

    def preempt(self, instance: int, batch_id: int) -> Batch | None:
        """Ask ``batch_id`` on ``instance`` to stop at its next segment boundary; the batch,
        or None if that instance runs no worker."""

    def clear_preempt(self, instance: int, batch_id: int) -> None:
        """Lower the instance's preemption flag for ``batch_id`` (it finished first), or for
        ``DIRECT_BATCH`` let its worker's direct best-effort batches go; either leaves the other."""

    def pad(self, deadlines: Mapping[int, float]) -> None:
        """Padding deadlines (perf_counter seconds) per instance; an instance left out, or
        0.0, runs without one."""

    def kick(self) -> None:
        """Run a scheduling pass soon (something elsewhere on the node changed)."""

    def direct_activity(self) -> tuple[bool, bool, bool]:
        """(real-time work, best-effort work, a direct real-time batch running) of the model
        now, through the front end or on its workers' direct paths (``fast_direct``)."""

    def direct_use(self, now: float) -> bool:
        """Count the direct calls its workers took since the last look as its use (the
        memory manager's LRU, Packrat's estimator); True where direct calls arrived or are held."""

    def set_direct_bell(self, on: bool) -> None:
        """Ask its workers to ring the coordinator when a direct real-time batch begins or ends."""


@dataclass(frozen=True, slots=True)
class Chosen:
    """``BatchPlacement.choose``'s answer: the instance that takes the batch, and its
    partition's tag at that decision (None: the placement policy does not use tags)."""

    instance: int
    tag: float | None = None


class BatchPlacement(Protocol):
    """The node's per-batch choice of a partition (``partitions.PartitionManager``), called by
    the coordinator for every batch a model could start."""

    def choose(self, model: str, cls: RequestClass, batch_size: int, idle: Sequence[int],
               node: Sequence[InstanceView]) -> Chosen | None:
        """Which of ``model``'s ``idle`` instances takes a batch of ``batch_size`` of ``cls``
        (its partition chosen under ``strict_placement``), given the whole node; None: the
        batch waits (best effort that fits no partition, or rt whose partition is busy)."""


class NodeScheduler(Protocol):
    """Node-wide scheduling (``coordinator.Coordinator``), called by every runtime."""

    def schedule(self, model: ScheduledModel, now: float) -> list[Batch]:
        """The batches ``model`` may start now; may preempt or pad other models' work."""

    def started(self, model: ScheduledModel, batch: Batch) -> None:
        """``batch`` (new, or resuming) was sent to its worker."""

    def finished(self, model: ScheduledModel, instance: int, batch: Batch, ok: bool) -> None:
        """``batch`` ended: done, failed, or handed back to the queue."""

    def preempted(self, model: ScheduledModel, instance: int, batch: Batch, restore: int, latency_ns: int) -> None:
        """``batch`` stopped at segment ``restore`` and waits, suspended, on ``instance``."""

    def direct_changed(self) -> None:
        """A worker's direct real-time work began or ended (its doorbell): look at the node again."""

    def plain(self) -> bool:
        """A scheduling pass now only starts the model's own batches (no class priority in
        play, no padding to lift): a model with nothing waiting needs none."""


def _never(instance: int, batch_id: int) -> bool:
    return False


class Coordinator:
    """Node-wide scheduling across models under one ``PriorityMode`` (the node's
    ``NodeScheduler``). ``models`` gives the node's models as they are now; ``clock``
    stamps the event log (perf_counter seconds); ``class_order`` says whether ``seq`` hands
    the node to real-time work first or to the oldest waiting request. ``placement`` chooses
    each batch's instance on a partitioned node (None: the first idle one);
    ``partition_of(model, instance)`` names an instance's partition in the log (-1: none)."""

    def __init__(self, models: Callable[[], Iterable[ScheduledModel]], mode: PriorityMode,
                 max_events: int = 200_000, clock: Callable[[], float] = time.perf_counter,
                 class_order: ClassOrder = ClassOrder.PRIORITY, placement: BatchPlacement | None = None,
                 partition_of: Callable[[str, int], int] | None = None,
                 fbr: Callable[[str], float | None] | None = None) -> None:
        self.models = models
        # under idle: each model's fitted FBR (None: not measured), for padding by interference
        self.fbr = fbr
        self.mode = mode
        self.class_order = class_order
        self.clock = clock
        self.placement = placement
        self.partition_of = partition_of
        self.events: deque[Event] = deque(maxlen=max_events)
        self._raised: set[tuple[str, int, int]] = set()
        # Cheap node-wide state, so normal mode (no RT work anywhere) skips the full view.
        self._rt_running: set[tuple[str, int]] = set()  # (model, batch id)
        self._suspended: set[tuple[str, int]] = set()
        self._padding = False  # some worker has a padding deadline set
        # The direct path (fast_direct): a worker runs a real-time batch the front end never
        # dispatched (its page says so); workers ring on such batches while ``_bell`` is on.
        self._direct_rt = False
        self._bell = False
        # under REEF, called at each scheduling pass: the node's next look at the workers'
        # pages comes soon (``server/direct_watch.py``); set by the composition root
        self.hurry: Callable[[], None] = lambda: None
        # (model, instance) -> its partition's tag when ``placement`` chose it, during one
        # scheduling pass: the batches that pass starts carry it (``Batch.tag``)
        self._placed: dict[tuple[str, int], float | None] = {}

    # -- the node as the pure policy sees it ----------------------------------------------

    def view(self) -> list[InstanceView]:
        out: list[InstanceView] = []
        for m in self.models():
            out.extend(m.instance_views(lambda i, b, name=m.name: (name, i, b) in self._raised))
        return out

    @staticmethod
    def _allowed(d: Decision, model: ScheduledModel) -> Callable[[int, RequestClass], bool]:
        return lambda i, cls: cls in d.may_start.get((model.name, i), ())

    @classmethod
    def _one_batch(cls, d: Decision, model: ScheduledModel) -> Callable[[int, RequestClass], bool]:
        """seq's say: ``d`` lets the node's one batch start, but names every instance of the
        model it goes to (the node was idle when it was taken), so once this pass has
        started a batch on one of them (an instance of the model runs) no other may."""
        allowed = cls._allowed(d, model)
        return lambda i, c: allowed(i, c) and all(v.running_cls is None for v in model.instance_views(_never))

    def _pick(self, model: ScheduledModel) -> Callable[[RequestClass, int, Sequence[int]], int | None] | None:
        """The per-batch choice of instance for ``model`` (None: the node has no partitions)."""
        placement = self.placement
        if placement is None:
            return None

        def pick(cls: RequestClass, size: int, idle: Sequence[int]) -> int | None:
            chosen: Chosen | None = placement.choose(model.name, cls, size, idle, self.view())
            if chosen is None:
                return None
            self._placed[(model.name, chosen.instance)] = chosen.tag
            return chosen.instance
        return pick

    # -- called by runtimes ---------------------------------------------------------------

    def _normal_mode(self) -> bool:
        """No RT work running or waiting anywhere, and no BE work preempted or being preempted."""
        if self._rt_running or self._suspended or self._raised or self._direct_rt:
            return False
        return not any(m.rt_waiting() for m in self.models())

    def plain(self) -> bool:
        """Under ``concurrent`` and ``rt-only``, or ``reef`` with no real-time work anywhere,
        ``schedule`` starts the model's own batches and nothing else (once no padding is
        left to lift)."""
        if self._padding:
            return False
        return self.mode in (PriorityMode.CONCURRENT, PriorityMode.RT_ONLY) or (
            self.mode is PriorityMode.REEF and self._normal_mode())

    def schedule(self, model: ScheduledModel, now: float) -> list[Batch]:
        """Batches ``model`` may start now; preempts and pads other models' BE work as needed."""
        if self.mode is PriorityMode.REEF:  # front-end work: direct real-time batches are watched closely
            self.hurry()
        if self.mode in (PriorityMode.CONCURRENT, PriorityMode.RT_ONLY) or (
                self.mode is PriorityMode.REEF and self._normal_mode()):
            if self._padding:  # RT mode just ended: lift the padding limits once
                self._pad(Decision())
            return self._stamp(self._start(model, now, (RT, BE), None), now)
        if self.mode is PriorityMode.SEQ and self.class_order is ClassOrder.ARRIVAL:
            d = decide(self.mode, self.view(), self.class_order)
            return self._stamp(self._start(model, now, (RT, BE), self._one_batch(d, model)), now)
        first = self._decide(now)
        allowed = self._one_batch(first, model) if self.mode is PriorityMode.SEQ else self._allowed(first, model)
        batches = self._stamp(self._start(model, now, (RT,), allowed), now)
        d = self._decide(now)
        self._preempt(d)
        be = self._stamp(self._start(model, now, (BE,), self._allowed(d, model)), now)
        if self.mode is PriorityMode.REEF:
            self._pad(decide(self.mode, self.view()))
        return batches + be

    def _decide(self, now: float) -> Decision:
        """The policy's decision; under idle with FBRs known, padded by measured interference."""
        view = self.view()
        d = decide(self.mode, view)
        if self.mode is PriorityMode.IDLE and self.fbr is not None:
            d = padding.apply(d, padding.pad(view, self.fbr, now))
        return d

    def _start(self, model: ScheduledModel, now: float, classes: tuple[RequestClass, ...],
               may_start: Callable[[int, RequestClass], bool] | None) -> list[Batch]:
        """``model``'s batches that may start, each new one with its partition's tag when
        placed (a resumed batch keeps the tag it was first placed with)."""
        self._placed.clear()
        batches = model.start_batches(now, classes, may_start, self._pick(model))
        for b in batches:
            key = (model.name, b.instance)
            if key in self._placed:
                b.tag = self._placed.pop(key)
        self._placed.clear()
        return batches

    @staticmethod
    def _stamp(batches: list[Batch], now: float) -> list[Batch]:
        for b in batches:
            b.started = now
        return batches

    def started(self, model: ScheduledModel, batch: Batch) -> None:
        if batch.cls == RT:
            self._rt_running.add((model.name, batch.batch_id))
        self._suspended.discard((model.name, batch.batch_id))
        # stamped when the node let it start (its scheduling pass), which its RUN follows at once:
        # the runtime logs it after sending, and the worker may have begun by now
        self._log("resume" if batch.resume_segment else "start", model, batch.instance, batch, batch.resume_segment,
                  t=batch.started)

    def preempted(self, model: ScheduledModel, instance: int, batch: Batch, restore: int, latency_ns: int) -> None:
        self._raised.discard((model.name, instance, batch.batch_id))
        self._suspended.add((model.name, batch.batch_id))
        self._log("preempted", model, instance, batch, restore, latency_ns)
        self._kick_all()

    def finished(self, model: ScheduledModel, instance: int, batch: Batch, ok: bool) -> None:
        self._rt_running.discard((model.name, batch.batch_id))
        self._suspended.discard((model.name, batch.batch_id))
        key = (model.name, instance, batch.batch_id)
        if key in self._raised:  # it finished before it reached a segment boundary
            self._raised.discard(key)
            model.clear_preempt(instance, batch.batch_id)
        self._log("done" if ok else "failed", model, instance, batch, 0,
                  compute_start=batch.compute_start if ok else None)
        # An RT batch ending can end RT mode; in seq mode any end frees the node; on a
        # partitioned node any end may free the partition a waiting RT batch waits for.
        if batch.cls == RT:
            self._release_direct()
        if batch.cls == RT or self.mode is PriorityMode.SEQ or (
                self.placement is not None and any(m.rt_waiting() for m in self.models())):
            self._kick_all()

    # -- the direct path ---------------------------------------------------------------------

    def direct_changed(self) -> None:
        """A worker's direct real-time batch began or ended: best-effort work on its CPUs
        is preempted (front-end batches by their id, a worker's own direct batch by
        ``DIRECT_BATCH``) on the scheduling pass this starts, and let go once no
        real-time work runs."""
        self._direct_rt = any(v.running_cls == RT and v.running_batch == DIRECT_BATCH for v in self.view())
        self._release_direct()
        self._kick_all()

    def watch_direct(self) -> bool:
        """The node's look at its workers' pages (``server/direct_watch.py``): the direct calls
        since the last look are their models' use; under REEF, ring on direct real-time
        batches while both classes are about, and notice a direct real-time batch that began
        or ended without ringing (before the bell was on). True where it found something to
        follow closely: direct calls arriving or held, or under REEF work of either class."""
        now = self.clock()
        found = False
        for m in self.models():
            found = m.direct_use(now) or found
        if self.mode is not PriorityMode.REEF:
            return found
        rt = be = running = False
        for m in self.models():
            r, b, x = m.direct_activity()
            rt, be, running = rt or r, be or b, running or x
        if (rt and be) != self._bell:
            self._bell = rt and be
            for m in self.models():
                m.set_direct_bell(self._bell)
        if running != self._direct_rt:
            self.direct_changed()
        return found or rt or be or running

    def _release_direct(self) -> None:
        """No real-time work runs any more: direct best-effort batches held for it resume."""
        if self._direct_rt or self._rt_running:
            return
        held = [k for k in self._raised if k[2] == DIRECT_BATCH]
        if not held:
            return
        by_name = {m.name: m for m in self.models()}
        for name, i, batch_id in held:
            self._raised.discard((name, i, batch_id))
            if (model := by_name.get(name)) is not None:
                model.clear_preempt(i, batch_id)

    # -- effects ---------------------------------------------------------------------------

    def _preempt(self, d: Decision) -> None:
        if not d.preempt:
            return
        by_name = {m.name: m for m in self.models()}
        for name, i, batch_id in d.preempt:
            model = by_name.get(name)
            if model is None or batch_id == 0:
                continue
            batch = model.preempt(i, batch_id)
            if batch is None:
                continue
            self._raised.add((name, i, batch_id))
            self._log("preempt", model, i, batch, 0)

    def _pad(self, d: Decision) -> None:
        self._padding = any(d.padding_deadline.values())
        for m in self.models():
            m.pad({i: end for (name, i), end in d.padding_deadline.items() if name == m.name})

    def _kick_all(self) -> None:
        for m in self.models():
            m.kick()

    def note(self, kind: str, model: str) -> None:
        """A model's residency changed (the memory manager's load_start, load_done,
        evict_start, evict_done): logged beside the batches (instance -1, batch 0)."""
        self.events.append(Event(self.clock(), kind, model, -1, 0, ""))

    def _log(self, kind: str, model: ScheduledModel, instance: int, batch: Batch, segment: int,
             latency_ns: int = 0, compute_start: float | None = None, t: float | None = None) -> None:
        """Log a step of ``batch`` at ``t`` (None: now)."""
        partition = self.partition_of(model.name, instance) if self.partition_of is not None else -1
        waits = () if compute_start is None else tuple(round((compute_start - r.arrival) * 1e6) for r in batch.requests)
        self.events.append(Event(self.clock() if t is None else t, kind, model.name, instance, batch.batch_id,
                                 "rt" if batch.cls == RT else "be", segment, latency_ns, partition, batch.tag,
                                 compute_start, waits))
