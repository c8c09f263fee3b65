"""A ``ModelRuntime`` driven through its seams (``server/ports.py``) with fakes: no
processes, no sockets, no event loop. The node is a ``RuntimeEnv`` whose scheduler
records what the runtime tells it, whose workers are fake ``InstanceWorker`` handles that
record the batch descriptors they are sent, and whose loop is a queue of callbacks the
test runs by hand; the runtime's shared-memory queues are real.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from splitserve.config import ServerConfig
from splitserve.errors import SplitServeError
from splitserve.modelconfig import ModelConfig
from splitserve.placement.devices import DeviceAssigner
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import ModelProfile
from splitserve.placement.resources import ResourceManager
from splitserve.placement.topology import Core
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord
from splitserve.scheduler.request import Batch
from splitserve.server.applier import PlacementApplier
from splitserve.server.metrics import Metrics
from splitserve.memory.manager import MemoryManager
from splitserve.server.monitor import Call, InferenceMonitor
from splitserve.memory.footprints import MemoryFootprint
from splitserve.server.coordinator import ScheduledModel
from splitserve.server.model.env import RuntimeEnv
from splitserve.server.ports import ModelState
from splitserve.server.model.runtime import ModelRuntime
from splitserve.worker.gpu_counters import GpuCopies
from splitserve.worker.messages import DoneMsg, LoadedMsg, Msg, RunMsg, UnloadedMsg
from splitserve.worker.pool import Residency
from splitserve.worker.spares import SparePool
from splitserve.worker.spec import BindSpec

BE = RequestClass.BE


class FakeLoop:
    """The loop as the runtime uses it: callbacks wait here until ``run`` runs them."""

    def __init__(self) -> None:
        self.ready: list[tuple[Callable[..., Any], tuple]] = []
        self.later: list[tuple[float, Callable[..., Any], tuple]] = []

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.ready.append((fn, args))

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> "FakeLoop":
        self.later.append((delay, fn, args))
        return self

    def cancel(self) -> None:  # the timer handle call_later returns
        pass

    def run(self) -> None:
        while self.ready:
            fn, args = self.ready.pop(0)
            fn(*args)


class FakeFlag:
    def __init__(self) -> None:
        self.raised_for = 0
        self.padding_ns = 0

    def raise_for(self, batch_id: int) -> None:
        self.raised_for = batch_id

    def clear(self) -> None:
        self.raised_for = 0

    def set_padding_deadline(self, deadline_ns: int) -> None:
        self.padding_ns = deadline_ns


_pids = itertools.count(4000)


class FakeWorker:
    """An ``InstanceWorker`` that records what it is sent (batches, LOADs, UNLOADs); the
    test answers for it (``start``, ``loaded``, ``load_failed``, ``unloaded``, ``die``)."""

    def __init__(self, owner: Any, instance: int, make_spec: Callable[[int, int], Any], loop: Any) -> None:
        self.owner, self.instance = owner, instance
        self.spec = make_spec(-1, -1)
        self.pid = next(_pids)
        self.alive, self.started, self.stopping = True, False, False
        self.start_error: str | None = None
        self.killed_for: str | None = None
        self.flag = FakeFlag()
        self.residency = Residency.STARTING
        self.binding: int | None = None
        self.rss_anon_at_start: int | None = None
        self.sent: list[RunMsg] = []
        self.loads: list[BindSpec] = []
        self.unloads = 0
        self.parks = 0
        self.reloads = 0
        self.reloading = False

    @property
    def ready(self) -> bool:
        return self.alive and self.residency is Residency.BOUND

    def send_run(self, msg: RunMsg) -> bool:
        self.sent.append(msg)
        return self.alive

    def send_load(self, bind: BindSpec) -> bool:
        assert self.residency is Residency.UNBOUND, f"LOAD sent to a {self.residency} worker"
        self.loads.append(bind)
        self.residency, self.binding, self.reloading = Residency.LOADING, len(self.loads), False
        return self.alive

    def send_unload(self, park: bool = False) -> bool:
        assert self.residency is Residency.BOUND or (self.residency is Residency.PARKED and not park), \
            f"UNLOAD sent to a {self.residency} worker"
        self.unloads += 1
        self.parks += park
        self.residency = Residency.UNLOADING
        return self.alive

    def send_reload(self) -> bool:
        assert self.residency is Residency.PARKED, f"RELOAD sent to a {self.residency} worker"
        self.reloads += 1
        self.residency, self.reloading = Residency.LOADING, True
        return self.alive

    def adopt(self, owner: Any, instance: int) -> None:
        self.owner, self.instance = owner, instance

    def gpu_copies(self) -> tuple[GpuCopies, int, int]:
        return GpuCopies(), 0, 0  # its GPU path copied nothing: the test runs no batch on a device

    def start(self) -> None:
        self.started, self.residency = True, Residency.UNBOUND
        self.rss_anon_at_start = 100 << 20
        self.owner.on_ready(self.instance, {"pid": self.pid, "rss_anon": self.rss_anon_at_start})

    def loaded(self, nbytes: int = 4096) -> None:
        self.residency, self.reloading = Residency.BOUND, False
        self.owner.on_loaded(self.instance, LoadedMsg(self.binding or 0, "double", nbytes, 2_000_000, 3, "cpu"))

    def load_failed(self, text: str) -> None:
        binding, self.binding, self.residency = self.binding or 0, None, Residency.UNBOUND
        self.owner.on_load_failed(self.instance, binding, text)
        self.reloading = False

    def unloaded(self) -> None:
        binding, self.binding, self.residency = self.binding, None, Residency.UNBOUND
        self.owner.on_unloaded(self.instance, UnloadedMsg(binding, self.rss_anon_at_start or 0))

    def parked(self, nbytes: int = 4096) -> None:
        """The answer to a PARK: the binding stays, its weights in page-locked host memory."""
        self.residency = Residency.PARKED
        self.owner.on_unloaded(self.instance, UnloadedMsg(self.binding, self.rss_anon_at_start or 0, nbytes))

    def up(self) -> None:
        """Start, then load what the runtime's LOAD named."""
        self.start()
        self.loaded()

    def kill(self, reason: str) -> None:
        self.killed_for = self.killed_for or reason
        self.die()

    def die(self) -> None:
        if self.alive:
            self.alive = False
            self.owner.on_exit(self.instance, self)

    async def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        self.die()


def inline(fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
    """``RuntimeEnv.off_loop`` in a test: the sync work runs at once, on the caller's thread."""
    done(fn())


class NoFootprints:
    """A ``FootprintStore`` that knows nothing and keeps what it is told."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, MemoryFootprint, float]] = []

    def footprint(self, record: ModelRecord) -> MemoryFootprint:
        return MemoryFootprint()

    def save(self, record: ModelRecord, footprint: MemoryFootprint, load_ms: float) -> None:
        self.saved.append((record.name, footprint, load_ms))


class RecordingNode:
    """A ``NodeScheduler`` that lets every batch start and records what it hears."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.passes = 0  # scheduling passes asked for
        self.only_own = True  # ``plain``: a pass starts only the model's own batches

    def schedule(self, model: ScheduledModel, now: float) -> list[Batch]:
        self.passes += 1
        return model.start_batches(now, (RequestClass.RT, BE), None)

    def plain(self) -> bool:
        return self.only_own

    def started(self, model: ScheduledModel, batch: Batch) -> None:
        self.calls.append(("started", model.name, batch.batch_id))

    def finished(self, model: ScheduledModel, instance: int, batch: Batch, ok: bool) -> None:
        self.calls.append(("finished", model.name, batch.batch_id, ok))

    def preempted(self, model: ScheduledModel, instance: int, batch: Batch, restore: int, latency_ns: int) -> None:
        self.calls.append(("preempted", model.name, batch.batch_id, restore, latency_ns))


class Sink:
    def __init__(self) -> None:
        self.answers: list[tuple[int, Any]] = []

    def deliver(self, call: Call) -> None:
        data = b"".join(bytes(v) for v in call.runtime.output_views(call.cls, call.seq, call.count))
        self.answers.append((call.req_id, data))

    def fail(self, call: Call, error: SplitServeError) -> None:
        self.answers.append((call.req_id, error))


MODEL = ModelConfig.from_dict({
    "name": "double", "max_batch_size": 4, "instances": 1, "threads": 1,
    "artifact": {"kind": "zoo", "arch": "vecadd1k"},
    "inputs": [{"name": "x", "datatype": "UINT8", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "UINT8", "shape": [4]}],
})


class Harness:
    def __init__(self, tmp_path: Path, config: ModelConfig = MODEL, profile: ModelProfile | None = None,
                 off_loop: Callable[[Callable[[], Any], Callable[[Any], None]], None] = inline,
                 footprints: NoFootprints | None = None, devices: DeviceAssigner | None = None) -> None:
        self.loop = FakeLoop()
        self.node = RecordingNode()
        self.started: list[FakeWorker] = []  # every process started, spares of the pool included
        self.monitor = InferenceMonitor()
        self.sink = Sink()

        def start_worker(owner: Any, instance: int, make_spec: Any, loop: Any) -> FakeWorker:
            w = FakeWorker(owner, instance, make_spec, loop)
            self.started.append(w)
            return w

        rm = ResourceManager([Core(cpu=c, core=c, socket=0) for c in range(2)])
        cfg = ServerConfig.of(data_dir=tmp_path, queue_slots=8, fast_direct=False)  # fake workers have no pages
        metrics = Metrics()
        self.pool = SparePool(cfg, self.loop, start_worker)  # type: ignore[arg-type]
        self.footprints = footprints or NoFootprints()
        env = RuntimeEnv(loop=self.loop, config=cfg,  # type: ignore[arg-type]
                         node=self.node, metrics=metrics, resources=rm,
                         placements=PlacementApplier(rm, lambda name: self.rt.placements),
                         stopping=lambda: False, workers=self.pool,  # type: ignore[arg-type]
                         footprints=self.footprints, memory=MemoryManager(cfg.memory, metrics), off_loop=off_loop,
                         devices=devices)
        self.rt = ModelRuntime(env, ModelRecord(config.name, 7, 1, "test", None, config), profile)

    @property
    def workers(self) -> list[FakeWorker]:
        """The processes the runtime took, in the order they were started."""
        return [w for w in self.started if w.owner is self.rt.instances]

    def call(self, req_id: int, payload: bytes, cls: RequestClass = BE, slo: float | None = None) -> Call:
        seq = self.rt.alloc(cls, 1)
        call = Call(self.monitor, self.rt, req_id, cls, seq, 1, self.sink, None, slo=slo)
        self.rt.input_views(cls, seq, 1)[0][:] = payload
        self.rt.submit(call)
        return call

    def run_batch(self, worker: FakeWorker) -> RunMsg:
        """The worker runs the batch it was sent last: doubles each byte, reports DONE."""
        msg = worker.sent[-1]
        x = bytes(self.rt.input_views(BE, msg.seq, msg.count)[0])
        self.rt.output_views(BE, msg.seq, msg.count)[0][:] = bytes((2 * b) % 256 for b in x)
        self.rt.instances.on_done(worker.instance, DoneMsg(Msg.DONE, msg.batch_id, 1000, 3, 0))
        return msg

    def close(self) -> None:
        self.rt.close()


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_a_call_is_answered_through_the_worker_seam_and_the_node_hears_of_its_batch(h):
    h.call(1, bytes([1, 2, 3, 4]))
    assert h.rt.state is ModelState.LOADING and len(h.workers) == 1  # the first call starts the model
    (worker,) = h.workers
    h.loop.run()
    assert worker.sent == []  # nothing is dispatched to a worker that is not ready
    worker.up()
    assert worker.loads[0].cpus == [0] and worker.loads[0].threads == 1  # placed by its LOAD
    h.loop.run()
    msg = h.run_batch(worker)
    assert h.sink.answers == [(1, bytes([2, 4, 6, 8]))]
    assert h.node.calls == [("started", "double", msg.batch_id), ("finished", "double", msg.batch_id, True)]
    assert h.monitor.in_flight == 0 and h.rt.queues.rings[BE].in_use == 0
    assert h.rt.stats.success == 1 and h.rt.describe()["pids"] == [worker.pid]


class StoredFootprints(NoFootprints):
    """A footprint store that knows one measured size and counts its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def footprint(self, record: ModelRecord) -> MemoryFootprint:
        self.reads += 1
        return MemoryFootprint(4096, 1024, measured=True)


def test_the_first_call_asks_for_memory_once_its_footprint_is_read_off_the_loop(tmp_path):
    pending: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []
    stored = StoredFootprints()
    h = Harness(tmp_path, off_loop=lambda fn, done: pending.append((fn, done)), footprints=stored)
    try:
        h.call(1, bytes([1, 2, 3, 4]))
        h.call(2, bytes([5, 6, 7, 8]))
        # the read is handed off, once, and nothing loads before it comes back
        assert len(pending) == 1 and h.workers == [] and h.rt.state is ModelState.UNLOADED
        assert stored.reads == 0  # not read on the caller's (the loop's) thread
        fn, done = pending.pop()
        done(fn())  # as the executor's thread and then the loop would
        assert stored.reads == 1 and h.rt.core.footprint == MemoryFootprint(4096, 1024, measured=True)
        assert h.rt.state is ModelState.LOADING and len(h.workers) == 1
        (worker,) = h.workers
        worker.up()
        h.loop.run()
        h.run_batch(worker)
        h.loop.run()
        h.run_batch(worker)
        assert sorted(req for req, _ in h.sink.answers) == [1, 2]  # the waiting calls are served
        h.call(3, bytes(4))
        assert pending == []  # known from then on: no second read
    finally:
        h.close()


def test_a_worker_that_dies_mid_batch_fails_its_calls_and_is_restarted_later(h):
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    (msg,) = worker.sent
    worker.die()
    (answer,) = h.sink.answers
    assert answer[0] == 1 and answer[1].status.name == "WORKER_FAILED"
    assert h.node.calls[-1] == ("finished", "double", msg.batch_id, False)
    restart = [fn for _, fn, _ in h.loop.later if getattr(fn, "__name__", "") == "_restart"]
    assert restart, "a restart is scheduled after the backoff"
    restart[0](0)
    assert len(h.workers) == 2 and h.monitor.in_flight == 0


def test_a_preempted_batch_is_suspended_reported_to_the_node_and_resumed(h):
    h.call(1, bytes([5, 5, 5, 5]))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    (msg,) = worker.sent
    assert h.rt.dispatch.preempt(0, msg.batch_id) is not None and worker.flag.raised_for == msg.batch_id
    h.rt.instances.on_done(0, DoneMsg(Msg.PREEMPTED, msg.batch_id, 10, 2, 0, preempt_ns=700))
    assert worker.flag.raised_for == 0 and h.rt.stats.preemptions == 1
    assert h.node.calls[-1] == ("preempted", "double", msg.batch_id, 2, 700)
    assert h.rt.dispatch.instance_views(lambda i, b: False)[0].suspended
    h.loop.run()  # the runtime's next pass resumes it on its own instance, from segment 2
    assert worker.sent[-1].batch_id == msg.batch_id and worker.sent[-1].resume_segment == 2
    h.run_batch(worker)
    assert h.sink.answers == [(1, bytes([10, 10, 10, 10]))]


def test_a_done_report_for_another_batch_costs_the_running_batch_nothing(h):
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    (msg,) = worker.sent
    h.rt.instances.on_done(0, DoneMsg(Msg.DONE, msg.batch_id + 99, 0, 3, 0))
    assert h.sink.answers == [] and h.monitor.in_flight == 1
    h.run_batch(worker)
    assert [a[0] for a in h.sink.answers] == [1]


def test_the_view_of_a_running_batch_says_when_it_should_end(h):
    # The coordinator reads this view on every real-time pass: when it raised, RT calls hung.
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    (view,) = h.rt.dispatch.instance_views(lambda i, b: False)
    batch = h.rt.sched.instances[view.instance].running
    assert view.running_batch == batch.batch_id and view.running_cls is BE
    assert view.expected_end == (batch.created if batch.started is None else batch.started)  # nothing measured yet
    h.run_batch(worker)
    (view,) = h.rt.dispatch.instance_views(lambda i, b: False)
    assert view.running_batch == 0 and view.expected_end is None


# -- residency: workers start bound to nothing, LOAD, and release their weights on evict ----


def test_a_worker_is_sent_batches_only_once_its_load_is_answered(h):
    h.call(1, bytes([1, 2, 3, 4]))
    (worker,) = h.workers
    worker.start()
    (bind,) = worker.loads  # READY is answered with a LOAD of the model's queues
    assert bind.model["name"] == "double" and sorted(bind.queues) == ["0", "1"]
    h.loop.run()
    assert worker.sent == [] and not h.rt.dispatch.instance_views(lambda i, b: False)[0].ready
    assert h.rt.describe()["residency"] == ["loading"]
    worker.loaded(nbytes=4096)
    h.loop.run()
    h.run_batch(worker)
    assert h.sink.answers == [(1, bytes([2, 4, 6, 8]))]
    d = h.rt.describe()
    assert d["residency"] == ["resident"] and d["weights_bytes"] == 4096 and h.rt.stats.loads == 1


def test_evict_unloads_after_the_running_batch_and_calls_that_wait_load_it_again(h):
    h.call(1, bytes([1, 1, 1, 1]))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    assert h.rt.residency.begin_eviction()
    assert h.rt.state is ModelState.EVICTED and h.rt.describe()["residency"] == ["unloading"]
    assert worker.unloads == 0  # its batch runs on: the UNLOAD waits for it
    h.call(2, bytes([3, 3, 3, 3]))  # taken and queued, not refused, and no load starts mid-unload
    h.loop.run()
    assert len(worker.sent) == 1 and len(worker.loads) == 1
    h.run_batch(worker)
    assert h.sink.answers == [(1, bytes([2, 2, 2, 2]))] and worker.unloads == 1
    h.loop.run()
    assert len(worker.sent) == 1  # nothing is dispatched to an instance that is unloading
    worker.unloaded()
    # the eviction is over; the queued call loads the model again, into the same process
    assert h.rt.stats.evictions == 1 and h.rt.stats.weights_bytes == 0
    assert h.rt.state is ModelState.LOADING and len(worker.loads) == 2 and h.workers == [worker]
    h.loop.run()
    assert len(worker.sent) == 1  # loading: still nothing dispatched
    worker.loaded()
    h.loop.run()
    h.run_batch(worker)
    assert h.sink.answers[-1] == (2, bytes([6, 6, 6, 6]))
    assert h.rt.describe()["func_id"] == 7 and h.rt.state is ModelState.READY and h.monitor.in_flight == 0


def _served_once(h):
    """The model's one worker, up and through its first call's batch."""
    h.call(1, bytes([1, 1, 1, 1]))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    h.run_batch(worker)
    return worker


def test_an_eviction_that_parks_keeps_the_worker_and_the_next_call_reloads_it_there(h):
    worker = _served_once(h)
    assert h.rt.residency.begin_eviction(park=True)
    assert worker.parks == 1 and worker.unloads == 1
    worker.parked()
    # evicted: no weights on its device, but the process stays the instance's, bound and parked
    assert h.rt.state is ModelState.EVICTED and h.rt.stats.evictions == 1 and h.rt.stats.weights_bytes == 0
    assert worker.owner is h.rt.instances and worker.alive and worker.residency is Residency.PARKED
    h.call(2, bytes([2, 2, 2, 2]))
    h.loop.run()
    # the call reloads the parked weights: a RELOAD to the same process, no LOAD, nothing dispatched yet
    assert worker.reloads == 1 and len(worker.loads) == 1 and len(worker.sent) == 1
    h.call(3, bytes([3, 3, 3, 3]))  # arrives during the reload: waits for it
    h.loop.run()
    assert len(worker.sent) == 1 and h.rt.state is ModelState.LOADING
    worker.loaded()
    h.loop.run()
    h.run_batch(worker)
    h.loop.run()
    if len(worker.sent) == 3:  # the second waiting call came in its own batch
        h.run_batch(worker)
    assert sorted(h.sink.answers) == [(1, bytes([2] * 4)), (2, bytes([4] * 4)), (3, bytes([6] * 4))]
    assert h.rt.state is ModelState.READY and h.rt.stats.loads == 2 and h.monitor.in_flight == 0


def test_a_reload_that_fails_loads_the_weights_anew_in_the_same_process_and_the_call_is_answered(h):
    worker = _served_once(h)
    h.rt.residency.begin_eviction(park=True)
    worker.parked()
    h.call(2, bytes([7, 7, 7, 7]))
    h.loop.run()
    assert worker.reloads == 1
    worker.load_failed("ModelNotReady: no parked model to reload")
    # not a failed start: the model stays LOADING, the same (now unbound) process gets a LOAD
    assert h.rt.state is ModelState.LOADING and len(worker.loads) == 2 and worker.residency is Residency.LOADING
    worker.loaded()
    h.loop.run()
    h.run_batch(worker)
    assert h.sink.answers == [(1, bytes([2] * 4)), (2, bytes([14] * 4))]


def test_a_model_the_pinned_tier_drops_releases_its_parked_worker_and_loads_anew(h):
    worker = _served_once(h)
    h.rt.residency.begin_eviction(park=True)
    worker.parked()
    h.rt.residency.release_parked()
    assert worker.unloads == 2 and worker.residency is Residency.UNLOADING
    worker.unloaded()  # back to the node's pool
    assert worker.owner is not h.rt.instances and h.rt.state is ModelState.EVICTED
    h.call(2, bytes([5, 5, 5, 5]))  # loads anew: a LOAD, from disk, into a process of the pool
    h.loop.run()
    assert worker.reloads == 0 and h.rt.state is ModelState.LOADING
    (again,) = [w for w in h.started if w.residency is Residency.LOADING]
    again.loaded()
    h.loop.run()
    h.run_batch(again)
    assert h.sink.answers[-1] == (2, bytes([10] * 4)) and len(h.sink.answers) == 2


def test_a_batch_suspended_when_its_model_is_evicted_goes_back_to_the_queue_and_reruns(h):
    h.call(1, bytes([5, 5, 5, 5]))
    (worker,) = h.workers
    worker.up()
    h.loop.run()
    (msg,) = worker.sent
    h.rt.dispatch.preempt(0, msg.batch_id)
    h.rt.instances.on_done(0, DoneMsg(Msg.PREEMPTED, msg.batch_id, 10, 2, 0, preempt_ns=700))
    assert h.rt.residency.begin_eviction()
    # the restore point dies with the binding: the batch is handed back before the UNLOAD
    assert worker.unloads == 1 and h.node.calls[-1] == ("finished", "double", msg.batch_id, False)
    assert h.rt.sched.waiting() == 1 and h.sink.answers == []
    worker.unloaded()
    worker.loaded()
    h.loop.run()
    assert worker.sent[-1].resume_segment == 0
    h.run_batch(worker)
    assert h.sink.answers == [(1, bytes([10, 10, 10, 10]))]


def test_a_failed_load_answers_the_waiting_calls_model_not_ready_with_the_error(h):
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.start()
    worker.load_failed("InvalidInput: model.safetensors is not a safetensors file")
    ((req_id, error),) = h.sink.answers
    assert req_id == 1 and error.status.name == "MODEL_NOT_READY" and "not a safetensors file" in error.message
    assert h.rt.state is ModelState.FAILED and h.monitor.in_flight == 0


def test_evicting_a_model_mid_load_kills_the_loading_worker_and_a_waiting_call_loads_it_anew(h):
    h.call(1, bytes([2, 2, 2, 2]))
    (first,) = h.workers
    first.start()  # its LOAD is under way
    assert h.rt.residency.begin_eviction()
    assert not first.alive and "evicted while loading" in first.killed_for
    # nothing was resident: the eviction ends at once, and the waiting call loads the model
    assert h.rt.stats.evictions == 1 and h.rt.state is ModelState.LOADING and len(h.workers) == 2
    second = h.workers[1]
    second.up()
    h.loop.run()
    h.run_batch(second)
    assert h.sink.answers == [(1, bytes([4, 4, 4, 4]))] and first.sent == []


def test_a_load_that_is_not_answered_in_time_kills_the_worker_and_counts_as_a_failed_start(h):
    h.call(1, bytes(4))
    (worker,) = h.workers
    worker.start()
    ((timeout, check, args),) = [t for t in h.loop.later if getattr(t[1], "__name__", "") == "_load_timed_out"]
    assert timeout == h.rt.core.settings.workers.worker_start_timeout_s
    check(*args)
    assert not worker.alive and "did not load the model" in worker.killed_for
    assert h.sink.answers == []  # a start that failed is retried after a backoff; the call waits
    restart = [fn for _, fn, _ in h.loop.later if getattr(fn, "__name__", "") == "_restart"]
    restart[-1](0)
    h.workers[1].up()
    h.loop.run()
    h.run_batch(h.workers[1])
    assert [a[0] for a in h.sink.answers] == [1]


def test_a_model_slo_multiplier_reads_the_profile_on_the_whole_node_at_max_batch(tmp_path, caplog):
    # The node has 2 CPUs; the profile reaches 2 threads: L[2, max_batch 4] = 0.05 s.
    lat = LatencyProfile("double", {(1, 1): 0.02, (1, 4): 0.08, (2, 1): 0.015, (2, 4): 0.05})
    config = MODEL.with_changes(slo={"multiplier": 3.0})
    h = Harness(tmp_path, config, ModelProfile(lat, {}, "test"))
    try:
        assert h.rt.slo_s == pytest.approx(0.15)
        rt_call = h.call(1, bytes(4), RequestClass.RT)  # names no SLO: the model's
        assert rt_call.slo == pytest.approx(rt_call.t_ready + 0.15)
        own = h.call(2, bytes(4), RequestClass.RT, slo=rt_call.t_ready + 9.0)  # its own wins
        assert own.slo == rt_call.t_ready + 9.0
        assert h.call(3, bytes(4)).slo is None  # best effort: none
        (q1, q2) = h.rt.sched.queues[RequestClass.RT]._items
        assert (q1.slo, q2.slo) == (rt_call.slo, own.slo)  # the scheduler sees it (EDF)
    finally:
        h.close()
    unprofiled = Harness(tmp_path, config)
    try:
        assert unprofiled.rt.slo_s is None and "needs a latency profile" in caplog.text
    finally:
        unprofiled.close()
