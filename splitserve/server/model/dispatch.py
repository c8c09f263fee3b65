"""A model's dispatch: submit -> schedule -> answer, and REEF's preempt and pad.

This is the piece of a model the node's coordinator drives (``ScheduledModel``, declared in
``server/coordinator.py``); the dispatch asks the coordinator for its batches from its
scheduling pass. Every batch that ends (done, failed, lost with its worker, handed back to
the queue) ends through ``batch_ended``, the one place that tells the coordinator and,
once the loop's iteration is done, the memory manager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from splitserve.errors import DeadlineMissed, ModelNotReady, ShuttingDown, SplitServeError, WorkerFailed
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import InstanceView
from splitserve.scheduler.request import Batch, QueuedRequest
from splitserve.server.model.core import ModelCore
from splitserve.server.monitor import Call
from splitserve.server.ports import BatchTimes, ModelState
from splitserve.worker.messages import DIRECT_BATCH, DoneMsg, Msg, RunMsg

log = logging.getLogger(__name__)

# Estimator observations one look at the workers' pages makes at most (one per direct
# arrival since the last look): bounds the look's cost under a flood of small calls
_DIRECT_OBSERVATIONS = 64


class Dispatch:
    """The model's calls from submit to answer (the coordinator's ``ScheduledModel``).

    The facade hands it, as callables, what it tells the model's other parts:
    ``ensure_started()`` (a call arrived: residency), ``unload_when_idle(instance)`` (a
    batch left an instance that may be releasing its weights) and ``repack(now)`` (a
    ready model's placement decider may propose a new placement: placement)."""

    def __init__(self, core: ModelCore, ensure_started: Callable[[], None], unload_when_idle: Callable[[int], None],
                 repack: Callable[[float], None]) -> None:
        self.core = core
        self.name = core.name
        self.sched = core.sched
        self._ensure_started = ensure_started
        self._unload_when_idle = unload_when_idle
        self._repack = repack
        self._batch_s: dict[int, float] = {}  # batch size -> EWMA of its compute time (s)
        self._kick_scheduled = False
        self._ended = False  # a batch ended since the last scheduling pass: the memory manager hears of it there
        self._timer = None
        # Loaded for calls that wait and has not dispatched any of them yet: evicting it now
        # would undo the load before it served anyone (a livelock when models swap fast).
        self.unserved = False
        # Per instance: its worker handle and its page's RECEIVED count at the node's last
        # look (``direct_use``), to tell the direct calls that arrived since
        self._direct_seen: dict[int, tuple[object, int]] = {}
        self._direct_held = 0  # calls its workers held at that look

    # -- calls in ---------------------------------------------------------------------------

    def refusal(self, now: float) -> SplitServeError | None:
        """Why a call for this model is refused now, or None. A FAILED model whose retry
        time has come is not refused: the call's arrival retries the load."""
        core = self.core
        if not core.enabled:
            return ModelNotReady(f"model {self.name!r} was unloaded; load it again first")
        if core.env.stopping():
            return ShuttingDown("the server is shutting down")
        if core.state is ModelState.STOPPING:
            return ShuttingDown(f"model {self.name!r} is being unloaded")
        if core.state is ModelState.FAILED and now < core.retry_at:
            return ModelNotReady(f"model {self.name!r} failed to load: {core.error} (a request retries the load "
                                 f"in {core.retry_at - now:.0f} s, an explicit load at once)")
        return None

    def submit(self, call: Call) -> None:
        """RX_COMPLETE: queue the call for a batch. Answers at once instead if it cannot run
        (the model failed, was unloaded or is stopping meanwhile) or is bounded out."""
        core = self.core
        call.rx_complete()
        if call.cls == RequestClass.RT and call.slo is None and core.slo_s is not None:
            call.slo = call.t_ready + core.slo_s  # admitted: a refusal below counts as dropped too
        self._ensure_started()
        refused = self.refusal(call.t_rx)
        if refused is None and core.state is ModelState.FAILED:  # its retry did not start: still failed
            refused = ModelNotReady(f"model {self.name!r} failed to load: {core.error}")
        if refused is not None:
            self.answer(call, refused)
            return
        try:
            self.sched.enqueue(QueuedRequest(call.seq, call.count, call.cls, call.t_rx, call.deadline, call,
                                             slo=call.slo))
        except SplitServeError as e:
            self.answer(call, e)
            return
        core.placer.observe(self.sched.waiting(), call.t_rx)
        self.kick()

    def kick(self) -> None:
        """Run the scheduler once this loop iteration is done (batches what arrived together)."""
        self.core.changed.set()
        if not self._kick_scheduled:
            self._kick_scheduled = True
            self.core.loop.call_soon(self._schedule)

    def _schedule(self) -> None:
        self._kick_scheduled = False
        core = self.core
        self._tell_memory()
        now = time.perf_counter()
        for req in self.sched.expire(now):
            waited = 1e3 * (now - req.arrival)
            self.answer(req.handle, DeadlineMissed(f"deadline passed after {waited:.1f} ms in queue"))
        if core.running:  # stopping: nothing new starts
            for batch in core.env.node.schedule(self, now):
                self._start(batch, now)
        if core.state is ModelState.READY:
            self._repack(now)
        self._arm_timer(now)

    def _start(self, batch: Batch, now: float) -> None:
        core = self.core
        if not batch.resume_segment:
            for r in batch.requests:
                r.handle.t_dispatch = now
        self.unserved = False
        # The RUN goes first: the worker starts while the node's bookkeeping runs here (one
        # callback: nothing can look at the node between the two).
        handle = core.workers.get(batch.instance)
        sent = handle is not None and handle.ready and handle.send_run(
            RunMsg(int(batch.cls), batch.batch_id, batch.seq, batch.count, batch.resume_segment))
        core.env.memory.touch(self.name, now)
        core.env.node.started(self, batch)
        if not sent:
            self.sched.complete(batch.instance, batch.batch_id)
            self.batch_ended(batch.instance, batch, ok=False)
            self.answer_batch(batch, WorkerFailed(f"instance {batch.instance} of {self.name!r} is not running"))

    def _arm_timer(self, now: float) -> None:
        wake = self.sched.next_wakeup(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake is not None:
            self._timer = self.core.loop.call_later(max(0.0, wake - now), self.kick)

    # -- batches out ------------------------------------------------------------------------

    def batch_ended(self, instance: int, batch: Batch, ok: bool) -> None:
        """``batch`` ended on ``instance``: done (``ok``), failed, lost, or handed back to its
        queue. The one place that tells the coordinator; the memory manager hears of it once
        this loop iteration is done (a victim that was busy may be free now), off the answer's
        way. A scheduling pass follows where it could start something: work waits here (queued,
        or suspended on an instance), or the node's pass does more than start this model's own
        batches (``NodeScheduler.plain``). Otherwise a front-end call, which ends a batch on an
        idle model every time, would pay a second pass that finds nothing to do."""
        core = self.core
        node = core.env.node
        node.finished(self, instance, batch, ok)
        self._ended = True
        if self.sched.waiting() or not node.plain() or any(
                st.suspended is not None for st in self.sched.instances.values()):
            self.kick()
            return
        core.changed.set()  # what waits for an instance to go idle (a drain) looks again
        if not self._kick_scheduled:
            core.loop.call_soon(self._tell_memory)

    def _tell_memory(self) -> None:
        """The memory manager hears that batches ended since it last did (a load may wait
        for a victim that was busy)."""
        if self._ended:
            self._ended = False
            self.core.env.memory.batch_done(self.name)

    def done(self, instance: int, msg: DoneMsg) -> None:
        """The worker of ``instance`` reported DONE or PREEMPTED for a batch."""
        # Checked before anything is taken off the instance: a report for another batch
        # must not cost the running batch its answer.
        core = self.core
        batch = self.sched.running(instance, msg.batch_id)
        if batch is None:
            log.error("model %s: instance %d reported batch %d %s, which it was not running", self.name, instance,
                      msg.batch_id, "preempted" if msg.kind == Msg.PREEMPTED else "done")
            return
        if msg.kind == Msg.PREEMPTED:
            self._preempted(instance, msg)
            self._unload_when_idle(instance)
            self.kick()
            return
        self.sched.complete(instance, msg.batch_id)
        t_done, t_start_w = time.perf_counter(), msg.start_ns / 1e9
        for r in batch.requests:
            call = r.handle
            call.compute_ns, call.t_done, call.t_start_w = msg.compute_ns, t_done, t_start_w
            call.input_ns, call.output_ns = msg.input_ns, msg.output_ns
        # The answers go first: their callers wait, and nothing on the loop can look at the
        # node between them and the bookkeeping below (one callback), so no reader sees the
        # statistics or the event log without this batch.
        self.answer_batch(batch, None)
        if msg.first_segment == 0:  # run whole: its stamp is when its compute began (for the event log)
            batch.compute_start = msg.start_ns / 1e9
        self.batch_ended(instance, batch, ok=True)
        if msg.first_segment == 0:  # a whole, uninterrupted run: a clean sample of batch time
            old = self._batch_s.get(batch.count)
            sample = msg.compute_ns / 1e9
            weight = core.settings.reef.batch_time_weight
            self._batch_s[batch.count] = sample if old is None else old + weight * (sample - old)
            self.sched.batch_done(sample)
        st = core.stats
        st.execution_count += 1
        core.env.metrics.executed(self.name)
        times = st.batches.get(batch.count)
        if times is None:
            times = st.batches[batch.count] = BatchTimes()
        times.add(msg.input_ns, msg.infer_ns, msg.output_ns)
        st.last_inference_ms = int(time.time() * 1000)
        self._unload_when_idle(instance)

    def failed(self, instance: int, batch_id: int, text: str) -> None:
        """The model raised in batch ``batch_id`` on ``instance``: answer it WORKER_FAILED."""
        batch = self.sched.complete(instance, batch_id)
        if batch is None:
            log.error("model %s: instance %d reported batch %d failed, which it was not running",
                      self.name, instance, batch_id)
        else:
            self.batch_ended(instance, batch, ok=False)
            self.answer_batch(batch, WorkerFailed(f"model {self.name!r} raised: {text}"))
        self._unload_when_idle(instance)
        self.kick()

    def lose(self, instance: int, lost: Sequence[Batch], error: SplitServeError) -> None:
        """Batches that ``instance`` will never finish (its worker is gone): answer them ``error``."""
        for batch in lost:
            self.batch_ended(instance, batch, ok=False)
            self.answer_batch(batch, error)

    def requeue(self, instance: int, batch: Batch) -> None:
        """A suspended batch goes back to its queue (it reruns from segment 0 elsewhere)."""
        self.batch_ended(instance, batch, ok=False)
        self.sched.requeue(batch)

    def _preempted(self, instance: int, msg: DoneMsg) -> None:
        """The worker stopped its batch at a segment boundary: suspend it here (its restore
        point stays in the worker), lower the flag, and tell the node."""
        core = self.core
        restore = msg.first_segment + msg.segments_run
        batch = self.sched.preempted(instance, restore)
        handle = core.workers.get(instance)
        if handle is not None:
            handle.flag.clear()
        if batch is None:
            return
        core.stats.preemptions += 1
        core.env.metrics.preemptions.labels(self.name).inc()
        core.env.metrics.preemption_latency.labels(self.name).observe(msg.preempt_ns / 1e9)
        core.env.node.preempted(self, instance, batch, restore, msg.preempt_ns)

    def answer_batch(self, batch: Batch, error: SplitServeError | None) -> None:
        for r in batch.requests:
            self.answer(r.handle, error)

    def answer(self, call: Call, error: SplitServeError | None) -> None:
        """Answer ``call`` (once) and count it in the model's statistics and metrics."""
        if call.replied:  # the watchdog answered it: only its slots are still to come back
            call.answer(error)
            return
        st = self.core.stats
        if error is None:
            st.success += 1
            st.inference_count += call.count
            st.queue_ns += int(max(0.0, call.t_dispatch - call.t_rx) * 1e9)
            st.compute_input_ns += call.input_ns
            st.compute_infer_ns += max(0, call.compute_ns - call.input_ns - call.output_ns)
            st.compute_output_ns += call.output_ns
        else:
            st.failure += 1
        try:
            call.answer(error)
        except Exception:  # a broken sink must not take the loop or other calls with it
            log.exception("model %s: answering call %d failed", self.name, call.req_id)
        if error is None:
            st.request_ns += int((call.t_work - call.t_ready) * 1e9)
        else:
            st.failure_ns += int((call.t_work - call.t_ready) * 1e9)
        self.core.env.metrics.observe_call(self.name, call, error)

    def fail_waiting(self, error: SplitServeError) -> None:
        """Answer every queued call ``error``."""
        for q in self.sched.queues.values():
            for r in q.drain():
                self.answer(r.handle, error)

    def expected_batch_s(self, count: int) -> float:
        """Expected compute time of a batch of ``count``, from batches seen so far."""
        if count in self._batch_s:
            return self._batch_s[count]
        if not self._batch_s:
            return 0.0
        # scale the nearest measured size linearly: a fair guess until this size is seen
        near = min(self._batch_s, key=lambda b: abs(b - count))
        return self._batch_s[near] * count / near

    # -- ScheduledModel (the coordinator) ----------------------------------------------------

    def instance_views(self, preempt_raised: Callable[[int, int], bool]) -> list[InstanceView]:
        core = self.core
        rt_waiting = self.sched.waiting(RequestClass.RT)
        be_waiting = self.sched.waiting(RequestClass.BE)
        oldest = self.sched.oldest_waiting()
        rt_due = self.sched.next_rt_due()
        out = []
        for i, st in self.sched.instances.items():
            b = st.running
            began = None if b is None else b.created if b.started is None else b.started
            placed = core.resources.placed(self.name, i)
            running_cls, running_batch = (b.cls, b.batch_id) if b else (None, 0)
            if b is None and core.settings.transports.fast_direct and (h := core.workers.get(i)) is not None:
                d = h.counters.snapshot()  # what its direct path runs, from its page
                if d.rt_running or d.in_flight_be:
                    running_cls = RequestClass.RT if d.rt_running else RequestClass.BE
                    running_batch = DIRECT_BATCH
            out.append(InstanceView(
                model=self.name, instance=i, cpus=core.resources.instance_cpus(self.name, i) | self._gpu_claim(i),
                ready=st.ready, running_cls=running_cls, running_batch=running_batch,
                preempt_raised=bool(running_batch) and preempt_raised(i, running_batch),
                expected_end=began + self.expected_batch_s(b.count) if b is not None and began is not None else None,
                suspended=st.suspended is not None, rt_waiting=rt_waiting, be_waiting=be_waiting, oldest_waiting=oldest,
                partition=placed.partition if placed is not None else -1, running_count=b.count if b else 0,
                started=began, rt_due=rt_due, best_effort=st.best_effort,
            ))
        return out

    def _gpu_claim(self, i: int) -> frozenset[int]:
        """Instance ``i``'s GPU partition in the REEF view (``DeviceAssigner.claim``): shared
        with another instance, real-time work on one preempts best-effort work on the other."""
        devices = self.core.env.devices
        return devices.claim(self.name, i) if devices is not None else frozenset()

    def rt_waiting(self) -> int:
        return self.sched.waiting(RequestClass.RT)

    def start_batches(self, now: float, classes: Sequence[RequestClass],
                      may_start: Callable[[int, RequestClass], bool] | None,
                      pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None = None) -> list[Batch]:
        return self.sched.schedule(now, tuple(classes), may_start, pick)

    def preempt(self, instance: int, batch_id: int) -> Batch | None:
        handle = self.core.workers.get(instance)
        if batch_id == DIRECT_BATCH:  # the worker's own best-effort batches: held at their next boundary
            if handle is None:
                return None
            handle.flag.hold_direct(True)
            return Batch(self.name, instance, RequestClass.BE, 0, 0, [], time.perf_counter(), DIRECT_BATCH)
        st = self.sched.instances.get(instance)
        if handle is None or st is None or st.running is None:
            return None
        handle.flag.raise_for(batch_id)
        return st.running

    def clear_preempt(self, instance: int, batch_id: int) -> None:
        handle = self.core.workers.get(instance)
        if handle is None:
            return
        if batch_id == DIRECT_BATCH:
            handle.flag.hold_direct(False)
        else:
            handle.flag.clear()

    def direct_activity(self) -> tuple[bool, bool, bool]:
        """(real-time work, best-effort work, a direct real-time batch running) now: queued
        or running here, or held by the workers' direct paths (``ScheduledModel``)."""
        rt = bool(self.sched.waiting(RequestClass.RT))
        be = bool(self.sched.waiting(RequestClass.BE))
        running = False
        for i, st in self.sched.instances.items():
            if st.running is not None:
                rt, be = rt or st.running.cls == RequestClass.RT, be or st.running.cls == RequestClass.BE
            be = be or st.suspended is not None
            if (h := self.core.workers.get(i)) is not None:
                d = h.counters.snapshot()
                running = running or bool(d.rt_running)
                rt, be = rt or bool(d.in_flight_rt), be or bool(d.in_flight_be)
        return rt, be, running

    def direct_use(self, now: float) -> bool:
        """The node's look at the workers' pages (``server/direct_watch.py``): direct calls that
        arrived since the last look are the model's use as front-end calls are at their
        submit and batch start. The memory manager's LRU clock is touched; Packrat's
        estimator observes the depth they found (calls the workers hold plus those queued
        here), once per arrival up to ``_DIRECT_OBSERVATIONS``; a ready model's placement
        decider may propose a repack. Once the workers hold no direct call any more, the
        memory manager hears that its batches ended (a load may wait for it as a victim).
        A page counts per binding: a new handle, or a count below the last, counts from zero.
        True where direct calls arrived or are held: the next look should come soon."""
        core = self.core
        arrived = held = 0
        seen: dict[int, tuple[object, int]] = {}
        for i, h in core.workers.items():
            d = h.counters.snapshot()
            last_h, last = self._direct_seen.get(i, (None, 0))
            arrived += d.received - last if last_h is h and d.received >= last else d.received
            seen[i] = (h, d.received)
            held += d.in_flight_rt + d.in_flight_be
        self._direct_seen = seen
        if self._direct_held and not held:
            core.env.memory.batch_done(self.name)  # no longer pinned by direct calls
        self._direct_held = held
        if not arrived:
            return bool(held)
        core.env.memory.touch(self.name, now)
        depth = self.sched.waiting() + held
        for _ in range(min(arrived, _DIRECT_OBSERVATIONS)):
            core.placer.observe(depth, now)
        if core.state is ModelState.READY:
            self._repack(now)
        return True

    def direct_held(self) -> int:
        """Calls its workers hold from direct connections now (accepted, not yet answered;
        0 with the direct path off)."""
        total = 0
        if not self.core.settings.transports.fast_direct:
            return total
        for h in self.core.workers.values():
            d = h.counters.snapshot()
            total += d.in_flight_rt + d.in_flight_be
        return total

    def set_direct_bell(self, on: bool) -> None:
        for handle in self.core.workers.values():
            handle.counters.set_bell(on)

    def pad(self, deadlines: Mapping[int, float]) -> None:
        # The worker reads its deadline on CLOCK_MONOTONIC; the node decides on perf_counter.
        now_pc, now_ns = time.perf_counter(), time.monotonic_ns()
        for i, handle in self.core.workers.items():
            end = deadlines.get(i, 0.0)
            handle.flag.set_padding_deadline(now_ns + int((end - now_pc) * 1e9) if end else 0)
