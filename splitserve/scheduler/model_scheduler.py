"""Per-model scheduling: class queues, instances, batching. Pure: a clock is passed in.

Under ``ClassOrder.PRIORITY`` (the default) real-time requests are always considered before
best-effort ones, so an RT request is never queued behind BE requests; under ``ARRIVAL`` an
idle instance takes whichever class's oldest request came first (the class-agnostic
baselines of PROTEAN's evaluation). Within a class, requests are kept in slot order and a
batch is a run of consecutive slots, i.e. one contiguous view of the tensor queue.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from splitserve.errors import QueueFull
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.policy import BatchingPolicy
from splitserve.scheduler.request import Batch, QueuedRequest
from splitserve.types import Choice

CLASSES = (RequestClass.RT, RequestClass.BE)


class RtPolicy(Choice, what="rt_policy"):
    """Order among waiting real-time requests; ``ServerConfig.reef.rt_policy``."""

    FIFO = "fifo"  # arrival (slot) order
    EDF = "edf"  # earliest deadline first: the earlier of a request's soft SLO and hard deadline


class ClassOrder(Choice, what="class_order"):
    """Which class an idle instance serves first; ``ServerConfig.reef.class_order``."""

    PRIORITY = "priority"  # real-time before best-effort (REEF, PROTEAN)
    ARRIVAL = "arrival"  # the oldest waiting request first, whatever its class (Molecule, INFless, naive slicing)


class Residency(StrEnum):
    """Whether an instance holds the model's weights. Only a RESIDENT instance is given
    batches: one that is loading or unloading never is."""

    ABSENT = "absent"  # no weights: no process, or one bound to nothing
    LOADING = "loading"  # its process is starting or loading the weights
    RESIDENT = "resident"  # the weights are loaded: it serves batches
    UNLOADING = "unloading"  # releasing the weights once its batch (if any) has finished


@dataclass(slots=True)
class InstanceState:
    """What the scheduler knows of one model instance (a worker process)."""

    residency: Residency = Residency.ABSENT
    running: Batch | None = None
    # A best-effort batch preempted here; its restore point lives in this instance's worker.
    suspended: Batch | None = None
    # Being retired (scale-in, or the old set of an active-passive switch): no new batches.
    draining: bool = False
    # Started but not yet serving (the new set of an active-passive switch).
    standby: bool = False
    # Packrat's b for this instance (None: the model's max batch).
    max_batch: int | None = None
    # Kept for best-effort batches (the model's ``be_instances``; its worker under SCHED_IDLE under idle).
    best_effort: bool = False

    @property
    def ready(self) -> bool:
        """The weights are resident: the instance can run a batch."""
        return self.residency is Residency.RESIDENT

    @property
    def idle(self) -> bool:
        return self.ready and self.running is None and not self.draining and not self.standby

    @property
    def can_resume(self) -> bool:
        """Free to resume its suspended batch: a draining instance must too, or its drain never ends."""
        return self.ready and self.running is None and self.suspended is not None and not self.standby

    @property
    def busy(self) -> bool:
        return self.running is not None or self.suspended is not None


def _urgency(req: QueuedRequest) -> float:
    return min(t for t in (req.slo, req.deadline, math.inf) if t is not None)


class ClassQueue:
    """Received requests of one class, ordered by slot sequence number (bounded by the ring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: list[QueuedRequest] = []
        self._keys: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    def push(self, req: QueuedRequest, bounded: bool = True) -> None:
        """Queue ``req`` in slot order; QueueFull past the limit unless ``bounded`` is off
        (requests handed back from a batch were admitted once already)."""
        if bounded and len(self._items) >= self.limit:
            raise QueueFull(f"request queue full ({self.limit} requests waiting)")
        if not self._keys or req.seq > self._keys[-1]:
            self._items.append(req)
            self._keys.append(req.seq)
        else:  # a request that finished receiving after a later one did
            i = bisect.bisect(self._keys, req.seq)
            self._items.insert(i, req)
            self._keys.insert(i, req.seq)

    def earliest_deadline(self) -> int:
        """Index of the most urgent request: the earliest of its SLO and its deadline (neither
        sorts last; ties: oldest)."""
        return min(range(len(self._items)), key=lambda i: (_urgency(self._items[i]), i))

    def head(self, index: int = 0) -> QueuedRequest:
        """The request at ``index`` in slot order."""
        return self._items[index]

    def head_arrival(self) -> float | None:
        """Arrival of the request first in slot order (slots are handed out as headers arrive),
        None when empty."""
        return self._items[0].arrival if self._items else None

    def contiguous_run(self, start: int = 0) -> list[QueuedRequest]:
        """The longest run from ``start`` whose slots follow one another without a gap."""
        run: list[QueuedRequest] = []
        nxt = None
        for r in self._items[start:]:
            if nxt is not None and r.seq != nxt:
                break
            run.append(r)
            nxt = r.seq + r.count
        return run

    def pop(self, start: int, n: int) -> list[QueuedRequest]:
        taken = self._items[start : start + n]
        del self._items[start : start + n]
        del self._keys[start : start + n]
        return taken

    def remove_expired(self, now: float) -> list[QueuedRequest]:
        expired = [r for r in self._items if r.deadline is not None and r.deadline < now]
        if expired:
            keep = [r for r in self._items if r.deadline is None or r.deadline >= now]
            self._items = keep
            self._keys = [r.seq for r in keep]
        return expired

    def drain(self) -> list[QueuedRequest]:
        items, self._items, self._keys = self._items, [], []
        return items


class ModelScheduler:
    """Queues and instances of one model; ``schedule`` turns them into batches.

    Instances have stable ids (never reused), so a set of instances can be added beside
    the serving set and the old set drained and dropped without renumbering anything.
    """

    def __init__(self, model: str, policy: BatchingPolicy, max_batch: int, queue_limit: int,
                 rt_policy: RtPolicy | str = RtPolicy.FIFO,
                 class_order: ClassOrder | str = ClassOrder.PRIORITY) -> None:
        self.model = model
        self.rt_policy = RtPolicy.parse(rt_policy)
        self.class_order = ClassOrder.parse(class_order)
        self.policy = policy
        self.max_batch = max_batch
        self.queues = {c: ClassQueue(queue_limit) for c in CLASSES}
        self.instances: dict[int, InstanceState] = {}
        self._next_instance = 0
        self._next_batch_id = 1

    # -- events ---------------------------------------------------------------------

    def enqueue(self, req: QueuedRequest) -> None:
        """A request finished receiving (RX_COMPLETE). Raises QueueFull when bounded out."""
        self.queues[req.cls].push(req)
        self.policy.arrived(req.cls, req.count, req.arrival)

    def batch_done(self, compute_s: float) -> None:
        """A whole batch (not a resumed part) computed in ``compute_s``: the batching policy
        may follow the model's speed."""
        self.policy.batch_time(compute_s)

    def add_instance(self, max_batch: int | None = None, standby: bool = False, best_effort: bool = False) -> int:
        """A new instance (ABSENT until its worker has loaded the weights); returns its id."""
        iid = self._next_instance
        self._next_instance += 1
        self.instances[iid] = InstanceState(max_batch=max_batch, standby=standby, best_effort=best_effort)
        return iid

    def serving(self) -> list[int]:
        """Ids of the instances that take new batches (not draining, not standby)."""
        return [i for i, s in self.instances.items() if not s.draining and not s.standby]

    def activate(self, new: list[int], old: list[int]) -> None:
        """Active-passive switch: ``new`` starts taking batches, ``old`` drains."""
        for i in new:
            self.instances[i].standby = False
        for i in old:
            self.instances[i].draining = True

    def set_residency(self, instance: int, residency: Residency) -> list[Batch]:
        """The instance's weights came, are going or went; returns the batches lost with
        them (running, suspended) when they are gone (ABSENT, or LOADING again). While
        UNLOADING its batches are kept: the runtime lets them end first."""
        st = self.instances[instance]
        st.residency = residency
        if residency in (Residency.RESIDENT, Residency.UNLOADING):
            return []
        lost = [b for b in (st.running, st.suspended) if b is not None]
        st.running = st.suspended = None
        return lost

    def preempted(self, instance: int, restore_segment: int) -> Batch | None:
        """The instance stopped its batch at ``restore_segment``; it waits to be resumed there."""
        st = self.instances[instance]
        batch, st.running = st.running, None
        if batch is not None:
            batch.resume_segment = restore_segment
            st.suspended = batch
        return batch

    def running(self, instance: int, batch_id: int | None = None) -> Batch | None:
        """The batch running on ``instance`` if it is ``batch_id`` (None: whichever runs)."""
        st = self.instances.get(instance)
        if st is None or st.running is None or batch_id not in (None, st.running.batch_id):
            return None
        return st.running

    def complete(self, instance: int, batch_id: int | None = None) -> Batch | None:
        """The instance finished batch ``batch_id`` (None: whichever runs); returns it. A
        report for any other batch changes nothing (None): the running one is still owed
        its answer."""
        batch = self.running(instance, batch_id)
        if batch is not None:
            self.instances[instance].running = None
        return batch

    def take_suspended(self, instance: int) -> Batch | None:
        """Take the batch suspended on ``instance`` off it (to hand back or to answer)."""
        st = self.instances.get(instance)
        if st is None:
            return None
        batch, st.suspended = st.suspended, None
        return batch

    def requeue(self, batch: Batch) -> None:
        """Put a batch's requests back in their queue: it reruns from segment 0 on whichever
        instance takes it next (segments are idempotent; the requests keep their slots)."""
        q = self.queues[batch.cls]
        for r in batch.requests:
            q.push(r, bounded=False)

    def resize(self, instances: int) -> tuple[list[int], list[int]]:
        """Scale in place to ``instances`` serving instances: (added ids, ids to drain)."""
        serving = self.serving()
        if instances >= len(serving):
            return [self.add_instance() for _ in range(instances - len(serving))], []
        retire = serving[instances:]
        for i in retire:
            self.instances[i].draining = True
        return [], retire

    def remove(self, instance: int) -> None:
        """Forget a drained instance whose worker has stopped."""
        st = self.instances.pop(instance, None)
        if st is not None and st.busy:
            raise RuntimeError(f"instance {instance} of {self.model} removed while busy")

    # -- decisions ------------------------------------------------------------------

    def expire(self, now: float) -> list[QueuedRequest]:
        """Requests whose deadline passed while they waited: to be answered DEADLINE_MISSED."""
        return [r for c in CLASSES for r in self.queues[c].remove_expired(now)]

    def schedule(self, now: float, classes: tuple[RequestClass, ...] = CLASSES,
                 may_start: Callable[[int, RequestClass], bool] | None = None,
                 pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None = None) -> list[Batch]:
        """Batches to start now, one per idle instance: RT before BE, or under
        ``ClassOrder.ARRIVAL`` the class whose oldest request came first (on each instance).

        ``may_start(instance, cls)`` is the node's say (priority and preemption policy);
        ``pick(cls, batch_size, idle_ids)`` is the node's choice of the instance (its
        partition) for each batch, None to hold the batch back (default: the first idle);
        a best-effort slot on an instance that holds a suspended batch resumes that batch
        before any new one, so preempted work is never starved by later arrivals; a
        draining instance still resumes its own (it takes nothing new).
        """
        out: list[Batch] = []
        if self.class_order is ClassOrder.ARRIVAL:
            for i, st in sorted(self.instances.items()):
                # A class that cannot start a batch here (its batching policy waits, the node
                # says no) leaves the instance to the next oldest.
                for cls in sorted(classes, key=lambda c: self._head_arrival(c, st)):
                    batch = self._start_on(i, st, cls, now, may_start, pick)
                    if batch is not None:
                        out.append(batch)
                        break
            return out
        for cls in classes:
            for i, st in sorted(self.instances.items()):
                batch = self._start_on(i, st, cls, now, may_start, pick)
                if batch is not None:
                    out.append(batch)
        return out

    def _head_arrival(self, cls: RequestClass, st: InstanceState) -> float:
        """When the request that ``cls`` would serve next on this instance arrived (inf: none)."""
        if cls == RequestClass.BE and st.can_resume and st.suspended is not None:
            return min(r.arrival for r in st.suspended.requests)
        head = self.queues[cls].head_arrival()
        return math.inf if head is None else head

    def _start_on(self, i: int, st: InstanceState, cls: RequestClass, now: float,
                  may_start: Callable[[int, RequestClass], bool] | None,
                  pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None) -> Batch | None:
        """The batch of ``cls`` instance ``i`` starts now (a resumed one first), or None;
        with ``pick``, a new batch goes to the idle instance it chooses instead."""
        resume = cls == RequestClass.BE and st.can_resume
        if not (st.idle or resume) or (may_start is not None and not may_start(i, cls)):
            return None
        if resume:
            st.running, st.suspended = st.suspended, None
            return st.running
        q = self.queues[cls]
        if not len(q):
            return None
        # RT under EDF: the most urgent request heads the batch, which continues
        # over the slots after it, so the batch is still one contiguous view
        start = q.earliest_deadline() if cls == RequestClass.RT and self.rt_policy is RtPolicy.EDF else 0
        run = q.contiguous_run(start)
        if pick is not None:
            chosen = self._pick(pick, cls, run, may_start)
            if chosen is None:
                return None
            i, st = chosen, self.instances[chosen]
        n = self.policy.take(run, now, st.max_batch or self.max_batch)
        if n == 0:
            return None
        reqs = q.pop(start, n)
        batch = Batch(
            model=self.model, instance=i, cls=cls, seq=reqs[0].seq,
            count=sum(r.count for r in reqs), requests=reqs, created=now,
            batch_id=self._next_batch_id,
        )
        self._next_batch_id += 1
        st.running = batch
        return batch

    def next_rt_due(self) -> float | None:
        """The soft SLO due of the real-time request the next RT batch starts with (None:
        none waits, or it has no SLO)."""
        q = self.queues[RequestClass.RT]
        if not len(q):
            return None
        return q.head(q.earliest_deadline() if self.rt_policy is RtPolicy.EDF else 0).slo

    def oldest_waiting(self) -> float | None:
        """Arrival of the oldest request waiting in any class (None: none waits)."""
        heads = [t for q in self.queues.values() if (t := q.head_arrival()) is not None]
        return min(heads, default=None)

    def _pick(self, pick: Callable[[RequestClass, int, Sequence[int]], int | None], cls: RequestClass,
              run: list[QueuedRequest], may_start: Callable[[int, RequestClass], bool] | None) -> int | None:
        """The idle instance ``pick`` chooses for a batch of ``run``'s head (None: none of them)."""
        idle = [i for i, st in sorted(self.instances.items())
                if st.idle and (may_start is None or may_start(i, cls))]
        chosen = pick(cls, min(sum(r.count for r in run), self.max_batch), idle)
        return chosen if chosen in idle else None

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time a waiting request could become dispatchable without a new event."""
        times = []
        for q in self.queues.values():
            if len(q):
                t = self.policy.wakeup(q.contiguous_run(), now)
                if t is not None:
                    times.append(t)
                times.extend(r.deadline for r in q._items if r.deadline is not None)
        return min(times, default=None)

    def waiting(self, cls: RequestClass | None = None) -> int:
        """Requests queued in ``cls`` (None: in every class); asked several times a call."""
        if cls is not None:
            return len(self.queues[cls])
        return sum(map(len, self.queues.values()))
