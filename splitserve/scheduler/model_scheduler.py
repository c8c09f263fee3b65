"""Per-model scheduling: class queues, instances, batching. Pure: a clock is passed in.

Real-time requests are always considered before best-effort ones, so an RT request is
never queued behind BE requests. Within a class, requests are kept in slot order and a
batch is a run of consecutive slots, i.e. one contiguous view of the tensor queue.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.errors import QueueFull
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.policy import BatchingPolicy
from splitserve.scheduler.request import Batch, QueuedRequest

CLASSES = (RequestClass.RT, RequestClass.BE)


@dataclass(slots=True)
class InstanceState:
    """What the scheduler knows of one model instance (a worker process)."""

    ready: bool = False
    running: Batch | None = None
    # A best-effort batch preempted here; its restore point lives in this instance's worker.
    suspended: Batch | None = None
    # Set by the server while the instance is being drained by a reconfiguration.
    draining: bool = False

    @property
    def idle(self) -> bool:
        return self.ready and self.running is None and not self.draining


class ClassQueue:
    """Received requests of one class, ordered by slot sequence number (bounded by the ring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: list[QueuedRequest] = []
        self._keys: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    def push(self, req: QueuedRequest) -> None:
        if len(self._items) >= self.limit:
            raise QueueFull(f"request queue full ({self.limit} requests waiting)")
        if not self._keys or req.seq > self._keys[-1]:
            self._items.append(req)
            self._keys.append(req.seq)
        else:  # a request that finished receiving after a later one did
            i = bisect.bisect(self._keys, req.seq)
            self._items.insert(i, req)
            self._keys.insert(i, req.seq)

    def contiguous_run(self) -> list[QueuedRequest]:
        """The longest prefix whose slots follow one another without a gap."""
        run: list[QueuedRequest] = []
        nxt = None
        for r in self._items:
            if nxt is not None and r.seq != nxt:
                break
            run.append(r)
            nxt = r.seq + r.count
        return run

    def pop_front(self, n: int) -> list[QueuedRequest]:
        taken = self._items[:n]
        del self._items[:n]
        del self._keys[:n]
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

    @property
    def oldest_arrival(self) -> float | None:
        return min((r.arrival for r in self._items), default=None)


class ModelScheduler:
    """Queues and instances of one model; ``schedule`` turns them into batches."""

    def __init__(self, model: str, policy: BatchingPolicy, max_batch: int, instances: int, queue_limit: int) -> None:
        self.model = model
        self.policy = policy
        self.max_batch = max_batch
        self.queues = {c: ClassQueue(queue_limit) for c in CLASSES}
        self.instances = [InstanceState() for _ in range(instances)]
        self._next_batch_id = 1

    # -- events ---------------------------------------------------------------------

    def enqueue(self, req: QueuedRequest) -> None:
        """A request finished receiving (RX_COMPLETE). Raises QueueFull when bounded out."""
        self.queues[req.cls].push(req)

    def set_ready(self, instance: int, ready: bool) -> list[Batch]:
        """An instance came up or went down; returns the batches lost with it (running, suspended)."""
        st = self.instances[instance]
        st.ready = ready
        if ready:
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

    def complete(self, instance: int) -> Batch | None:
        """The instance finished its batch; returns it."""
        st = self.instances[instance]
        done, st.running = st.running, None
        return done

    def resize(self, instances: int) -> list[int]:
        """Change the instance count. Returns indices that must be drained and stopped."""
        cur = len(self.instances)
        if instances > cur:
            self.instances.extend(InstanceState() for _ in range(instances - cur))
            return []
        for st in self.instances[instances:]:
            st.draining = True
        return list(range(instances, cur))

    def drop_drained(self) -> None:
        """Forget trailing instances that were drained and are now idle."""
        while self.instances and self.instances[-1].draining and self.instances[-1].running is None \
                and self.instances[-1].suspended is None:
            self.instances.pop()

    # -- decisions ------------------------------------------------------------------

    def expire(self, now: float) -> list[QueuedRequest]:
        """Requests whose deadline passed while they waited: to be answered DEADLINE_MISSED."""
        return [r for c in CLASSES for r in self.queues[c].remove_expired(now)]

    def schedule(self, now: float, classes: tuple[RequestClass, ...] = CLASSES,
                 may_start: Callable[[int, RequestClass], bool] | None = None) -> list[Batch]:
        """Batches to start now, RT before BE, one per idle instance.

        ``may_start(instance, cls)`` is the node's say (priority and preemption policy);
        a best-effort slot on an instance that holds a suspended batch resumes that batch
        before any new one, so preempted work is never starved by later arrivals.
        """
        out: list[Batch] = []
        for cls in classes:
            q = self.queues[cls]
            for i, st in enumerate(self.instances):
                if not st.idle or (may_start is not None and not may_start(i, cls)):
                    continue
                if cls == RequestClass.BE and st.suspended is not None:
                    st.running, st.suspended = st.suspended, None
                    out.append(st.running)
                    continue
                if not len(q):
                    continue
                run = q.contiguous_run()
                n = self.policy.take(run, now, self.max_batch)
                if n == 0:
                    continue
                reqs = q.pop_front(n)
                batch = Batch(
                    model=self.model, instance=i, cls=cls, seq=reqs[0].seq,
                    count=sum(r.count for r in reqs), requests=reqs, created=now,
                    batch_id=self._next_batch_id,
                )
                self._next_batch_id += 1
                st.running = batch
                out.append(batch)
        return out

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
        return sum(len(q) for c, q in self.queues.items() if cls is None or c == cls)

    def has_idle(self) -> bool:
        return any(s.idle for s in self.instances)
