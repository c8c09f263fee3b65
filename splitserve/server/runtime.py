"""A served model inside the front end: its tensor queues, scheduler and worker processes.

Everything here runs on the front end's event loop. The scheduler decides; this module
does the I/O its decisions need (send batch descriptors, answer calls, restart workers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.errors import BadSize, DeadlineMissed, ModelNotReady, ShuttingDown, SplitServeError, WorkerFailed
from splitserve.placement.packrat import PackratConfig, PackratController
from splitserve.placement.profiler import load_profile
from splitserve.placement.topology import allocate
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord
from splitserve.scheduler.model_scheduler import CLASSES, ModelScheduler
from splitserve.scheduler.policy import PackratAggregate, make_policy
from splitserve.scheduler.request import Batch, QueuedRequest
from splitserve.server.monitor import Call
from splitserve.tensorqueue import SlotRing, TensorQueue, ring_slots
from splitserve.worker.messages import DoneMsg, Msg, RunMsg
from splitserve.worker.pool import WorkerHandle
from splitserve.worker.spec import QueueFds, WorkerSpec

if TYPE_CHECKING:
    from splitserve.server.app import Server

log = logging.getLogger(__name__)


@dataclass
class ModelStats:
    """Cumulative per-model counters (Open Inference Protocol statistics extension)."""

    success: int = 0
    failure: int = 0
    inference_count: int = 0  # samples
    execution_count: int = 0  # batches
    queue_ns: int = 0
    compute_ns: int = 0
    request_ns: int = 0  # successful calls, header to answer
    failure_ns: int = 0  # failed calls, header to answer
    preemptions: int = 0
    last_inference_ms: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)


class ModelRuntime:
    """One model as served: queues per class, a scheduler, one worker per instance."""

    def __init__(self, server: "Server", record: ModelRecord) -> None:
        self.server = server
        self.loop = server.loop
        self.record = record
        self.config = record.config
        self.name = record.name
        self.func_id = record.func_id
        cfg = self.config
        sizes = [t.nbytes for t in cfg.inputs + cfg.outputs]
        self.nslots = ring_slots(sizes, max(cfg.queue_slots or server.config.queue_slots, 2 * cfg.max_batch_size))
        self.rings = {c: SlotRing(self.nslots) for c in CLASSES}
        self.tqs: dict[RequestClass, tuple[list[TensorQueue], list[TensorQueue]]] = {
            c: (
                [TensorQueue(t.nbytes, self.nslots, name=f"{self.name}-{c.name}-in-{t.name}") for t in cfg.inputs],
                [TensorQueue(t.nbytes, self.nslots, name=f"{self.name}-{c.name}-out-{t.name}") for t in cfg.outputs],
            )
            for c in CLASSES
        }
        self.sched = ModelScheduler(self.name, make_policy(cfg.batching), cfg.max_batch_size, queue_limit=self.nslots,
                                    rt_policy=server.config.rt_policy)
        # Per instance id: its worker, CPUs and thread count (instances may differ: Packrat).
        self.workers: dict[int, WorkerHandle] = {}
        self.cpus: dict[int, list[int]] = {}
        self.threads: dict[int, int] = {}
        self._backoff: dict[int, float] = {}
        # One stored profile feeds Packrat's optimizer and the workers' padding budgets.
        self.profile = load_profile(server.registry, self.name)
        self.packrat = self._packrat_controller()
        if self.packrat is not None:
            self.sched.policy = PackratAggregate(self.packrat.batch, self.packrat.cfg.timeout_ms / 1000)
            for t, b, cpus in self.packrat.shapes(self.packrat.plan()):
                self._add_instance(t, cpus, max_batch=b)
        else:
            for _ in range(cfg.instances):
                self._add_instance(cfg.threads, self._fixed_cpus(cfg.threads))
        self.stats = ModelStats()
        self.state = "unloaded"  # unloaded | loading | ready | failed | stopping
        self.error: str | None = None
        # False after a user's unload: requests are refused (MODEL_NOT_READY) until a load;
        # a model that was never unloaded still starts lazily on first use.
        self.enabled = True
        self._ready_event = asyncio.Event()
        self._kick_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.default_class = RequestClass.RT if cfg.default_class == "rt" else RequestClass.BE
        self._batch_s: dict[int, float] = {}  # batch size -> EWMA of its compute time (s)
        self.reconfigurations: list[dict] = []  # what each active-passive switch cost
        self._reconfig_lock = asyncio.Lock()
        self._repack_task: asyncio.Task | None = None

    # -- instances -------------------------------------------------------------------

    def _packrat_controller(self) -> PackratController | None:
        pcfg = PackratConfig.parse(self.config.placement, self.config.max_batch_size, self.server.config.placement)
        if pcfg is None:
            return None
        if self.profile is None:
            log.warning("model %s: placement is packrat but it was never profiled on this machine "
                        "(run `splitserve profile %s`); serving with fixed placement", self.name, self.name)
            return None
        return PackratController(pcfg, self.profile.latency, self.config.max_batch_size)

    def _repack_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("model %s: reconfiguration failed: %s", self.name, task.exception())

    async def repack(self, batch: int) -> dict:
        """Packrat: serve a batch of ``batch`` with the plan the optimizer picks for it.

        Only the instance count changes: scale in place. Threads or batch per instance
        change: active-passive switch. The aggregation target follows at the switch.
        """
        pk = self.packrat
        if pk is None:
            raise ModelNotReady(f"model {self.name!r} does not use packrat placement")
        plan = pk.plan(batch)
        pk.switched(batch, time.perf_counter())
        current = {(self.threads[i], self.sched.instances[i].max_batch) for i in self.sched.serving()}
        wanted = {(sh.threads, sh.batch) for sh in plan.shapes}
        if len(current) == 1 and current == wanted:
            (t, b), = wanted
            t0 = time.perf_counter()
            async with self._reconfig_lock:
                self.sched.policy.total = batch  # type: ignore[attr-defined]
                serving = self.sched.serving()
                n = plan.shapes[0].count
                used = {c for i in serving[:n] for c in self.cpus[i]}
                free = [c for c in pk.cores if c.cpu not in used]
                added = []
                for cpus in allocate([t] * max(0, n - len(serving)), free):
                    added.append(i := self._add_instance(t, cpus, max_batch=b))
                    if self.state in ("loading", "ready"):
                        self._spawn(i)
                await self._wait_instances(added)
                t_ready = time.perf_counter()
                self.kick()
                await asyncio.gather(*(self._drain_and_stop(i) for i in serving[n:]))
            record = {"shapes": [(t, b)] * n, "in_place": True, "plan": plan.to_dict(), "batch": batch,
                      "start_s": t_ready - t0, "drain_s": time.perf_counter() - t_ready, "switched_at": t_ready}
            self.reconfigurations.append(record)
            return record
        record = await self.reconfigure(
            pk.shapes(plan), on_switch=lambda: setattr(self.sched.policy, "total", batch))
        record["plan"] = plan.to_dict()
        record["batch"] = batch
        return record

    def _add_instance(self, threads: int, cpus: list[int], max_batch: int | None = None, standby: bool = False) -> int:
        iid = self.sched.add_instance(max_batch=max_batch, standby=standby)
        self.threads[iid] = threads
        self.cpus[iid] = cpus
        self._backoff[iid] = self.server.config.worker_restart_backoff_s
        return iid

    def _fixed_cpus(self, threads: int) -> list[int]:
        """Fixed placement: the config's ``cpus`` if it names them, else the node's next
        ``threads`` CPUs round-robin, so models spread over the cores instead of piling up."""
        if self.config.cpus:
            n = len(self.sched.instances) - 1  # this instance's position among the model's
            return [self.config.cpus[(n * threads + k) % len(self.config.cpus)] for k in range(threads)]
        return self.server.next_cpus(threads)

    async def _wait_instances(self, ids: list[int]) -> None:
        """Until the instances ``ids`` are up (or the model stopped trying)."""
        deadline = time.perf_counter() + self.server.config.worker_start_timeout_s
        while self.state in ("loading", "ready") and not all(
                self.sched.instances[i].ready for i in ids if i in self.sched.instances):
            if time.perf_counter() > deadline:
                raise ModelNotReady(f"model {self.name!r}: new instances did not start in time")
            await asyncio.sleep(0.01)

    def _forget_instance(self, iid: int) -> None:
        self.sched.remove(iid)
        for d in (self.workers, self.cpus, self.threads, self._backoff):
            d.pop(iid, None)

    @property
    def instance_count(self) -> int:
        return len(self.sched.serving())

    # -- lifecycle -------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the workers if they are not running (models load on first use)."""
        if self.state in ("loading", "ready") or not self.enabled:
            return
        self.state, self.error = "loading", None
        self._ready_event.clear()
        for i in self.sched.serving():
            if i not in self.workers:
                self._spawn(i)

    async def wait_ready(self, timeout: float | None = None) -> None:
        if not self.enabled:
            raise ModelNotReady(f"model {self.name!r} was unloaded; load it again first")
        self.ensure_started()
        await asyncio.wait_for(self._ready_event.wait(), timeout or self.server.config.worker_start_timeout_s)
        if self.state == "failed":
            raise ModelNotReady(f"model {self.name!r} failed to load: {self.error}")

    def _spawn(self, i: int) -> None:
        def make_spec(ctrl_fd: int, flag_fd: int) -> WorkerSpec:
            return WorkerSpec(
                model=self.config.to_dict(),
                model_dir=str(self.record.path) if self.record.path else None,
                instance=i, cpus=self.cpus[i], threads=self.threads[i], ctrl_fd=ctrl_fd, flag_fd=flag_fd,
                queues={str(int(c)): QueueFds(self.nslots, [q.fd for q in ins], [q.fd for q in outs])
                        for c, (ins, outs) in self.tqs.items()},
                cache_dir=str(self.server.config.cache_path),
                segment_capacity=self.config.capacity,
                extra={"segment_times_ns": self.profile.segment_times_ns(self.threads[i])} if self.profile else {},
            )

        self.workers[i] = handle = WorkerHandle(self, i, make_spec, self.loop)
        log.info("model %s: starting instance %d (%d threads on cpus %s, pid %d)", self.name, i, self.threads[i],
                 self.cpus[i], handle.pid)

    def on_ready(self, instance: int, info: dict) -> None:
        if instance not in self.sched.instances:
            return
        self.sched.set_ready(instance, True)
        self._backoff[instance] = self.server.config.worker_restart_backoff_s
        if self.state == "loading" and not self.sched.instances[instance].standby:
            self.state = "ready"  # serve as soon as one instance can
        if self.state == "ready" and all(self.sched.instances[i].ready for i in self.sched.serving()):
            self._ready_event.set()  # a load returns when every instance is up
        log.info("model %s: instance %d ready (%s segments)", self.name, instance, info.get("segments"))
        self.kick()

    def on_failed(self, instance: int, batch_id: int, text: str) -> None:
        if batch_id == 0:  # this instance could not load the model: do not retry in a loop
            self.error = text
            st = self.sched.instances.get(instance)
            if st is not None:
                st.draining = True  # its process exits now; on_exit forgets it
            if any(s.ready and not s.draining for s in self.sched.instances.values()):
                log.error("model %s: a new instance failed to load (%s); the others keep serving", self.name, text)
                return
            self.state = "failed"
            self._ready_event.set()
            self._fail_waiting(ModelNotReady(f"model {self.name!r} failed to load: {text}"))
            return
        batch = self.sched.complete(instance)
        if batch is not None:
            self.server.coordinator.finished(self, instance, batch, ok=False)
            self._answer_batch(batch, WorkerFailed(f"model {self.name!r} raised: {text}"))
        self.kick()

    def on_exit(self, instance: int, handle: WorkerHandle) -> None:
        if self.workers.get(instance) is not handle:
            return
        del self.workers[instance]
        st = self.sched.instances.get(instance)
        if st is None:
            return
        for lost in self.sched.set_ready(instance, False):
            self.server.coordinator.finished(self, instance, lost, ok=False)
            self._answer_batch(lost, WorkerFailed(f"worker of {self.name!r} (pid {handle.pid}) died during the batch"))
        if st.draining:
            self._forget_instance(instance)
            return
        if self.state in ("ready", "loading") and not handle.stopping:
            delay = self._backoff[instance]
            self._backoff[instance] = min(delay * 2, 5.0)
            log.warning("model %s: instance %d exited (%s); restarting in %.1fs", self.name, instance,
                        handle.proc.returncode, delay)
            self.loop.call_later(delay, self._restart, instance)
        self.kick()

    def _restart(self, instance: int) -> None:
        st = self.sched.instances.get(instance)
        if self.state in ("ready", "loading") and st is not None and not st.draining and instance not in self.workers:
            self._spawn(instance)

    async def resize(self, instances: int) -> None:
        """Change the instance count in place (same threads), without dropping requests."""
        async with self._reconfig_lock:
            threads = self.threads[self.sched.serving()[0]] if self.sched.serving() else self.config.threads
            added, retire = self.sched.resize(instances)
            for i in added:
                self.threads[i], self.cpus[i] = threads, self._fixed_cpus(threads)
                self._backoff[i] = self.server.config.worker_restart_backoff_s
                if self.state in ("loading", "ready"):
                    self._spawn(i)
            self.kick()
            await asyncio.gather(*(self._drain_and_stop(i) for i in retire))
            await self._wait_instances(added)

    async def reconfigure(self, shapes: list[tuple[int, int, list[int]]],
                          on_switch: Callable[[], None] | None = None) -> dict:
        """Active-passive switch to instances of (threads, batch, cpus): start the new set
        beside the serving one, switch dispatch once it is ready, drain and stop the old."""
        async with self._reconfig_lock:
            t0 = time.perf_counter()
            old = self.sched.serving()
            new = [self._add_instance(t, cpus, max_batch=b, standby=True) for t, b, cpus in shapes]
            if self.state in ("loading", "ready"):
                for i in new:
                    self._spawn(i)
                try:
                    await self._wait_instances(new)
                except ModelNotReady:
                    await asyncio.gather(*(self._drain_and_stop(i) for i in new))
                    raise
                if not all(self.sched.instances[i].ready for i in new):
                    await asyncio.gather(*(self._drain_and_stop(i) for i in new))
                    raise ModelNotReady(f"model {self.name!r}: the new instance set did not start: {self.error}")
            t_ready = time.perf_counter()
            if on_switch is not None:
                on_switch()
            self.sched.activate(new, old)
            self.kick()
            await asyncio.gather(*(self._drain_and_stop(i) for i in old))
            record = {"shapes": [(t, b) for t, b, _ in shapes], "start_s": t_ready - t0,
                      "drain_s": time.perf_counter() - t_ready, "switched_at": t_ready}
            self.reconfigurations.append(record)
            log.info("model %s: reconfigured to %s (new set ready in %.2fs, old drained in %.2fs)", self.name,
                     record["shapes"], record["start_s"], record["drain_s"])
            return record

    async def _drain_and_stop(self, i: int) -> None:
        st = self.sched.instances[i]
        st.draining = True
        while st.busy:
            await asyncio.sleep(0.005)
        handle = self.workers.get(i)
        if handle is not None:
            await handle.stop()
        if i in self.sched.instances:
            self._forget_instance(i)

    async def unload(self) -> None:
        """Stop the workers; waiting calls are answered MODEL_NOT_READY, running ones finish."""
        self.state = "stopping"
        while any(s.busy for s in self.sched.instances.values()):
            await asyncio.sleep(0.005)
        self._fail_waiting(ModelNotReady(f"model {self.name!r} was unloaded"))
        handles = list(self.workers.values())
        await asyncio.gather(*(h.stop() for h in handles))
        self.workers.clear()
        for i in self.sched.instances:
            self.sched.set_ready(i, False)
        self.state = "unloaded"
        self._ready_event.clear()

    def close(self) -> None:
        """Release the shared memory (after unload)."""
        for ins, outs in self.tqs.values():
            for q in ins + outs:
                q.close()

    # -- requests --------------------------------------------------------------------

    def alloc(self, cls: RequestClass, count: int) -> int:
        if not self.enabled:
            raise ModelNotReady(f"model {self.name!r} was unloaded; load it again first")
        if self.state == "stopping":
            raise ShuttingDown(f"model {self.name!r} is being unloaded")
        if count > self.config.max_batch_size:
            raise BadSize(f"{count} samples exceed max_batch_size {self.config.max_batch_size} of {self.name!r}")
        return self.rings[cls].alloc(count)

    def input_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return [q.view(seq, count) for q in self.tqs[cls][0]]

    def output_views(self, cls: RequestClass, seq: int, count: int) -> list[memoryview]:
        return [q.view(seq, count) for q in self.tqs[cls][1]]

    def release(self, call: Call) -> None:
        self.rings[call.cls].release(call.seq, call.count)

    def submit(self, call: Call) -> None:
        """RX_COMPLETE: queue the call for a batch (answers QUEUE_FULL if bounded out)."""
        call.rx_complete()
        try:
            self.sched.enqueue(QueuedRequest(call.seq, call.count, call.cls, call.t_rx, call.deadline, call))
        except SplitServeError as e:
            self._answer(call, e)
            return
        if self.state == "failed":
            self.state = "unloaded"
        if self.packrat is not None:
            self.packrat.observe(self.sched.waiting(), call.t_rx)
        self.ensure_started()
        self.kick()

    def kick(self) -> None:
        """Run the scheduler once this loop iteration is done (batches what arrived together)."""
        if not self._kick_scheduled:
            self._kick_scheduled = True
            self.loop.call_soon(self._schedule)

    def _schedule(self) -> None:
        self._kick_scheduled = False
        now = time.perf_counter()
        for req in self.sched.expire(now):
            self._answer(req.handle, DeadlineMissed(f"deadline passed after {1e3 * (now - req.arrival):.1f} ms in queue"))
        for batch in self.server.coordinator.schedule(self, now):
            self._start(batch, now)
        if self.packrat is not None and (self._repack_task is None or self._repack_task.done()):
            batch_size = self.packrat.next_batch(now)
            if batch_size is not None:
                log.info("model %s: queue depth suggests batch %d; repacking", self.name, batch_size)
                self._repack_task = self.loop.create_task(self.repack(batch_size))
                self._repack_task.add_done_callback(self._repack_done)
        self._arm_timer(now)

    def _start(self, batch: Batch, now: float) -> None:
        if not batch.resume_segment:
            for r in batch.requests:
                r.handle.t_dispatch = now
        self.server.coordinator.started(self, batch)
        handle = self.workers[batch.instance]
        if handle is None or not handle.send_run(
            RunMsg(int(batch.cls), batch.batch_id, batch.seq, batch.count, batch.resume_segment)
        ):
            self.sched.complete(batch.instance)
            self.server.coordinator.finished(self, batch.instance, batch, ok=False)
            self._answer_batch(batch, WorkerFailed(f"instance {batch.instance} of {self.name!r} is not running"))

    def _arm_timer(self, now: float) -> None:
        wake = self.sched.next_wakeup(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake is not None:
            self._timer = self.loop.call_later(max(0.0, wake - now), self.kick)

    def on_done(self, instance: int, msg: DoneMsg) -> None:
        if msg.kind == Msg.PREEMPTED:
            self.server.coordinator.preempted(self, instance, msg)
            self.kick()
            return
        batch = self.sched.complete(instance)
        if batch is None or batch.batch_id != msg.batch_id:
            log.error("model %s: instance %d finished batch %d it was not running", self.name, instance, msg.batch_id)
            return
        self.server.coordinator.finished(self, instance, batch, ok=True)
        if msg.first_segment == 0:  # a whole, uninterrupted run: a clean sample of batch time
            old = self._batch_s.get(batch.count)
            sample = msg.compute_ns / 1e9
            self._batch_s[batch.count] = sample if old is None else 0.75 * old + 0.25 * sample
        st = self.stats
        st.execution_count += 1
        self.server.metrics.executions.labels(self.name).inc()
        st.compute_ns += msg.compute_ns
        st.batch_sizes[batch.count] = st.batch_sizes.get(batch.count, 0) + 1
        st.last_inference_ms = int(time.time() * 1000)
        for r in batch.requests:
            r.handle.compute_ns = msg.compute_ns
        self._answer_batch(batch, None)
        self.kick()

    def _answer_batch(self, batch: Batch, error: SplitServeError | None) -> None:
        for r in batch.requests:
            self._answer(r.handle, error)

    def _answer(self, call: Call, error: SplitServeError | None) -> None:
        st = self.stats
        if error is None:
            st.success += 1
            st.inference_count += call.count
            st.queue_ns += int(max(0.0, call.t_dispatch - call.t_rx) * 1e9)
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
        self.server.metrics.observe_call(self, call, error)

    def _fail_waiting(self, error: SplitServeError) -> None:
        for q in self.sched.queues.values():
            for r in q.drain():
                self._answer(r.handle, error)

    def expected_batch_s(self, count: int) -> float:
        """Expected compute time of a batch of ``count``, from batches seen so far."""
        if count in self._batch_s:
            return self._batch_s[count]
        if not self._batch_s:
            return 0.0
        # scale the nearest measured size linearly: a fair guess until this size is seen
        near = min(self._batch_s, key=lambda b: abs(b - count))
        return self._batch_s[near] * count / near

    @property
    def ready(self) -> bool:
        return self.state == "ready"
