"""Applies the node-wide RT/BE policy (``scheduler.priority``) to the running models.

Every model runtime asks the coordinator for its batches. The coordinator looks at the
whole node (all models' instances, their CPUs and what they run), lets RT batches start
first, raises preemption flags on BE batches that sit on CPUs the RT work needs, then lets
BE batches start where policy allows, and sets padding deadlines for BE work running
beside RT work. It also keeps a bounded event log (start, preempt, resume, done) that
tests and the DISB benchmark read to check the order of events rather than wall-clock
thresholds.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import Decision, InstanceView, PriorityMode, decide
from splitserve.scheduler.request import Batch
from splitserve.worker.messages import DoneMsg

if TYPE_CHECKING:
    from splitserve.server.app import Server
    from splitserve.server.runtime import ModelRuntime

RT, BE = RequestClass.RT, RequestClass.BE


@dataclass(frozen=True, slots=True)
class Event:
    """One step in the life of a batch, on the server's perf_counter clock."""

    t: float
    kind: str  # start | resume | preempt | preempted | done | failed
    model: str
    instance: int
    batch: int
    cls: str
    segment: int = 0  # preempted: the restore point; resume: where it resumes
    latency_ns: int = 0  # preempted: flag raised -> worker stopped


class Coordinator:
    """Node-wide scheduling across models under one ``PriorityMode``."""

    def __init__(self, server: "Server", mode: PriorityMode, max_events: int) -> None:
        self.server = server
        self.mode = mode
        self.events: deque[Event] = deque(maxlen=max_events)
        self._raised: set[tuple[str, int, int]] = set()
        # Cheap node-wide state, so normal mode (no RT work anywhere) skips the full view.
        self._rt_running: set[tuple[str, int]] = set()  # (model, batch id)
        self._suspended: set[tuple[str, int]] = set()
        self._padding = False  # some worker has a padding deadline set

    # -- the node as the pure policy sees it ----------------------------------------------

    def view(self) -> list[InstanceView]:
        out = []
        for rt in self.server.runtimes.values():
            rt_waiting = rt.sched.waiting(RT)
            for i, st in rt.sched.instances.items():
                b = st.running
                out.append(InstanceView(
                    model=rt.name, instance=i, cpus=frozenset(rt.cpus.get(i, ())),
                    ready=st.ready, running_cls=b.cls if b else None, running_batch=b.batch_id if b else 0,
                    preempt_raised=bool(b) and (rt.name, i, b.batch_id) in self._raised,
                    expected_end=((b.created if b.started is None else b.started)
                                  + rt.expected_batch_s(b.count)) if b else None,
                    suspended=st.suspended is not None, rt_waiting=rt_waiting,
                ))
        return out

    def _allowed(self, d: Decision, rt: "ModelRuntime"):
        return lambda i, cls: cls in d.may_start.get((rt.name, i), ())

    # -- called by runtimes ---------------------------------------------------------------

    def _normal_mode(self) -> bool:
        """No RT work running or waiting anywhere, and no BE work preempted or being preempted."""
        if self._rt_running or self._suspended or self._raised:
            return False
        return not any(len(r.sched.queues[RT]) for r in self.server.runtimes.values())

    def schedule(self, rt: "ModelRuntime", now: float) -> list[Batch]:
        """Batches ``rt`` may start now; preempts and pads other models' BE work as needed."""
        if self.mode in (PriorityMode.CONCURRENT, PriorityMode.RT_ONLY) or (
                self.mode is PriorityMode.REEF and self._normal_mode()):
            if self._padding:  # RT mode just ended: lift the padding limits once
                self._pad(Decision())
            return self._stamp(rt.sched.schedule(now), now)
        batches = self._stamp(rt.sched.schedule(now, (RT,), self._allowed(decide(self.mode, self.view()), rt)), now)
        d = decide(self.mode, self.view())
        self._preempt(d)
        be = self._stamp(rt.sched.schedule(now, (BE,), self._allowed(d, rt)), now)
        if self.mode is PriorityMode.REEF:
            self._pad(decide(self.mode, self.view()))
        return batches + be

    @staticmethod
    def _stamp(batches: list[Batch], now: float) -> list[Batch]:
        for b in batches:
            b.started = now
        return batches

    def started(self, rt: "ModelRuntime", batch: Batch) -> None:
        if batch.cls == RT:
            self._rt_running.add((rt.name, batch.batch_id))
        self._suspended.discard((rt.name, batch.batch_id))
        self._log("resume" if batch.resume_segment else "start", rt, batch.instance, batch, batch.resume_segment)

    def preempted(self, rt: "ModelRuntime", instance: int, msg: DoneMsg) -> None:
        restore = msg.first_segment + msg.segments_run
        batch = rt.sched.preempted(instance, restore)
        self._raised.discard((rt.name, instance, msg.batch_id))
        handle = rt.workers.get(instance)
        if handle is not None:
            handle.flag.clear()
        if batch is not None:
            self._suspended.add((rt.name, batch.batch_id))
            rt.stats.preemptions += 1
            self.server.metrics.preemptions.labels(rt.name).inc()
            self.server.metrics.preemption_latency.labels(rt.name).observe(msg.preempt_ns / 1e9)
            self._log("preempted", rt, instance, batch, restore, msg.preempt_ns)
        self._kick_all()

    def finished(self, rt: "ModelRuntime", instance: int, batch: Batch, ok: bool) -> None:
        self._rt_running.discard((rt.name, batch.batch_id))
        self._suspended.discard((rt.name, batch.batch_id))
        key = (rt.name, instance, batch.batch_id)
        if key in self._raised:  # it finished before it reached a segment boundary
            self._raised.discard(key)
            handle = rt.workers.get(instance)
            if handle is not None:
                handle.flag.clear()
        self._log("done" if ok else "failed", rt, instance, batch, 0)
        # An RT batch ending can end RT mode; in seq mode any end frees the node.
        if batch.cls == RT or self.mode is PriorityMode.SEQ:
            self._kick_all()

    # -- effects ---------------------------------------------------------------------------

    def _preempt(self, d: Decision) -> None:
        for model, i, batch_id in d.preempt:
            rt = self.server.runtimes[model]
            handle = rt.workers.get(i)
            if handle is None or batch_id == 0:
                continue
            handle.flag.raise_for(batch_id)
            self._raised.add((model, i, batch_id))
            st = rt.sched.instances.get(i)
            if st is not None and st.running is not None:
                self._log("preempt", rt, i, st.running, 0)

    def _pad(self, d: Decision) -> None:
        now_pc, now_ns = time.perf_counter(), time.monotonic_ns()
        self._padding = any(d.padding_deadline.values())
        for rt in self.server.runtimes.values():
            for i, handle in rt.workers.items():
                end = d.padding_deadline.get((rt.name, i), 0.0)
                handle.flag.set_padding_deadline(now_ns + int((end - now_pc) * 1e9) if end else 0)

    def _kick_all(self) -> None:
        for other in self.server.runtimes.values():
            other.kick()

    def _log(self, kind: str, rt: "ModelRuntime", instance: int, batch: Batch, segment: int, latency_ns: int = 0) -> None:
        self.events.append(Event(time.perf_counter(), kind, rt.name, instance, batch.batch_id,
                                 "rt" if batch.cls == RT else "be", segment, latency_ns))
