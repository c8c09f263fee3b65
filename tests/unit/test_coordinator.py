"""The coordinator's phase order (RT, then preemption, then BE, then padding) and its modes.

The coordinator is driven through its seams (``server/ports.py``) with small fakes: each
model is a ``ScheduledModel`` made of a real ``ModelScheduler``, CPUs and fake preemption
flags that record what they are told; the fake node plays the runtimes' side of
``NodeScheduler`` (started, finished, preempted). Time is a fake clock: ``schedule(model,
now)`` takes it, and the coordinator is built with the same clock for its event log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import pytest

from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ClassOrder, ModelScheduler, Residency
from splitserve.scheduler.policy import WorkConserving
from splitserve.scheduler.priority import InstanceView, PriorityMode
from splitserve.scheduler.request import Batch, QueuedRequest
from splitserve.server.coordinator import Coordinator
from splitserve.worker.messages import DIRECT_BATCH

RT, BE = RequestClass.RT, RequestClass.BE
BATCH_S = 0.5  # every fake model's profiled batch time


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeFlag:
    """A worker's preemption page: records every call, in one log shared by the whole node."""

    def __init__(self, log: list[tuple], key: tuple[str, int]) -> None:
        self.log, self.key = log, key
        self.raised_for = 0
        self.held = False  # the worker's direct best-effort batches (a word of their own)
        self.padding = 0.0

    def raise_for(self, batch_id: int) -> None:
        self.raised_for = batch_id
        self.log.append(("preempt", *self.key, batch_id))

    def clear(self) -> None:
        self.raised_for = 0

    def hold_direct(self, held: bool) -> None:
        self.held = held
        if held:
            self.log.append(("preempt", *self.key, DIRECT_BATCH))


class RecordingScheduler(ModelScheduler):
    """A real ModelScheduler that notes which classes each ``schedule`` call was asked for."""

    def __init__(self, name: str, log: list[tuple], class_order: ClassOrder = ClassOrder.PRIORITY) -> None:
        super().__init__(name, WorkConserving(), max_batch=4, queue_limit=64, class_order=class_order)
        self.log = log

    def schedule(self, now, classes=(RT, BE), may_start=None):
        out = super().schedule(now, classes, may_start)
        self.log.append(("schedule", self.model, tuple(c.name for c in classes),
                         tuple((b.instance, b.cls.name) for b in out)))
        return out


class FakeModel:
    """A ``ScheduledModel``: a real scheduler, CPUs per instance and fake flags."""

    def __init__(self, name: str, log: list[tuple], class_order: ClassOrder = ClassOrder.PRIORITY) -> None:
        self.name = name
        self.log = log
        self.sched = RecordingScheduler(name, log, class_order)
        self.cpus: dict[int, frozenset[int]] = {}
        self.flags: dict[int, FakeFlag] = {}
        self.kicks = 0
        self.preemptions = 0

    def instance_views(self, preempt_raised: Callable[[int, int], bool]) -> list[InstanceView]:
        rt_waiting = self.rt_waiting()
        out = []
        for i, st in self.sched.instances.items():
            b = st.running
            out.append(InstanceView(
                self.name, i, self.cpus[i], st.ready, b.cls if b else None, b.batch_id if b else 0,
                bool(b) and preempt_raised(i, b.batch_id), (b.created if b.started is None else b.started) + BATCH_S if b else None,
                st.suspended is not None, rt_waiting, self.sched.oldest_waiting(), be_waiting=self.sched.waiting(BE)))
        return out

    def rt_waiting(self) -> int:
        return self.sched.waiting(RT)

    def start_batches(self, now: float, classes: Sequence[RequestClass],
                      may_start: Callable[[int, RequestClass], bool] | None,
                      pick: Callable[[RequestClass, int, Sequence[int]], int | None] | None = None) -> list[Batch]:
        assert pick is None  # the node has no partitions
        return self.sched.schedule(now, tuple(classes), may_start)

    def preempt(self, instance: int, batch_id: int) -> Batch | None:
        self.flags[instance].raise_for(batch_id)
        return self.sched.instances[instance].running

    def clear_preempt(self, instance: int, batch_id: int) -> None:
        if batch_id == DIRECT_BATCH:
            self.flags[instance].hold_direct(False)
        else:
            self.flags[instance].clear()

    def pad(self, deadlines: Mapping[int, float]) -> None:
        for i, flag in self.flags.items():
            flag.padding = deadlines.get(i, 0.0)
            self.log.append(("pad", self.name, i, flag.padding))

    def kick(self) -> None:
        self.kicks += 1


class Node:
    """A fake node: models on CPU sets, the coordinator over them, and the runtimes' side
    of ``NodeScheduler``."""

    def __init__(self, mode: PriorityMode, models: dict[str, list[set[int]]],
                 class_order: ClassOrder = ClassOrder.PRIORITY) -> None:
        self.log: list[tuple] = []
        self.clock = FakeClock()
        self.models: dict[str, FakeModel] = {}
        for name, cpu_sets in models.items():
            m = FakeModel(name, self.log, class_order)
            for cpus in cpu_sets:
                i = m.sched.add_instance()
                m.sched.set_residency(i, Residency.RESIDENT)
                m.cpus[i] = frozenset(cpus)
                m.flags[i] = FakeFlag(self.log, (name, i))
            self.models[name] = m
        self.coord = Coordinator(lambda: self.models.values(), mode, clock=self.clock, class_order=class_order)
        self._seq = {name: {RT: 0, BE: 0} for name in models}

    def enqueue(self, model: str, cls: RequestClass, n: int = 1) -> None:
        for _ in range(n):
            seq = self._seq[model][cls]
            self._seq[model][cls] += 1
            self.models[model].sched.enqueue(QueuedRequest(seq, 1, cls, self.clock.now))

    def schedule(self, model: str) -> list[tuple[int, str]]:
        """One runtime's scheduling pass, as ``ModelRuntime._schedule`` does it."""
        m = self.models[model]
        batches = self.coord.schedule(m, self.clock.now)
        for b in batches:
            self.coord.started(m, b)
        return [(b.instance, b.cls.name) for b in batches]

    def finish(self, model: str, instance: int) -> None:
        m = self.models[model]
        batch = m.sched.complete(instance)
        assert batch is not None
        self.coord.finished(m, instance, batch, True)

    def preempted(self, model: str, instance: int, restore: int = 1) -> None:
        """The worker stopped at a segment boundary, as ``ModelRuntime._on_preempted`` reports it."""
        m = self.models[model]
        batch = m.sched.preempted(instance, restore)
        assert batch is not None
        m.flags[instance].clear()
        m.preemptions += 1
        self.coord.preempted(m, instance, batch, restore, 2000)

    def flag(self, model: str, instance: int) -> FakeFlag:
        return self.models[model].flags[instance]

    def kinds(self) -> list[tuple]:
        return [e for e in self.log if e[0] in ("preempt", "pad") or (e[0] == "schedule" and e[3])]

    def events(self) -> list[tuple[str, str, int, str]]:
        return [(e.kind, e.model, e.instance, e.cls) for e in self.coord.events]


def test_normal_mode_never_builds_the_node_view(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{1}]})

    def no_view() -> None:
        raise AssertionError("normal mode must not build the node view")

    monkeypatch.setattr(node.coord, "view", no_view)
    node.enqueue("a", BE, 3)
    assert node.schedule("a") == [(0, "BE")]
    assert [e[1:3] for e in node.log if e[0] == "schedule"] == [("a", ("RT", "BE"))]  # one plain pass


@pytest.mark.parametrize("mode", [PriorityMode.CONCURRENT, PriorityMode.RT_ONLY])
def test_modes_without_priority_skip_the_view_even_with_rt_waiting(monkeypatch, mode):
    node = Node(mode, {"a": [{0}], "b": [{0}]})
    monkeypatch.setattr(node.coord, "view", lambda: pytest.fail("no view in a mode without priority"))
    node.enqueue("b", BE)
    assert node.schedule("b") == [(0, "BE")]
    node.enqueue("a", RT)
    assert node.schedule("a") == [(0, "RT")]
    assert not [e for e in node.log if e[0] == "preempt"]  # the BE batch on cpu 0 runs on


@pytest.mark.parametrize("mode", list(PriorityMode))
def test_a_pass_is_plain_only_where_it_would_start_the_models_own_batches_and_nothing_else(mode):
    """``plain``: no class priority in play (concurrent, rt-only, or reef with no real-time
    work anywhere) and no padding left to lift; seq and idle decide over the whole node."""
    node = Node(mode, {"a": [{0}], "b": [{1}]})
    own_only = mode in (PriorityMode.CONCURRENT, PriorityMode.RT_ONLY, PriorityMode.REEF)
    assert node.coord.plain() is own_only
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    assert node.coord.plain() is (mode in (PriorityMode.CONCURRENT, PriorityMode.RT_ONLY))  # rt waits
    node.schedule("a")
    if mode is PriorityMode.REEF:
        assert not node.coord.plain()  # rt runs, b's batch is padded
        node.finish("a", 0)
        assert not node.coord.plain()  # rt ended, but b's padding is lifted only at the next pass
        node.schedule("b")
        assert node.coord.plain()


def test_reef_phases_run_rt_then_preempt_then_be_then_pad():
    # a: two instances on cpus 0 and 1; b: one instance sharing cpu 0, running BE.
    node = Node(PriorityMode.REEF, {"a": [{0}, {1}], "b": [{0}]})
    node.enqueue("b", BE)
    assert node.schedule("b") == [(0, "BE")]
    node.log.clear()
    node.enqueue("a", RT)
    node.enqueue("a", BE, 2)
    assert node.schedule("a") == [(0, "RT"), (1, "BE")]
    b_batch = node.models["b"].sched.instances[0].running.batch_id
    end = node.clock.now + BATCH_S  # the RT batch's expected end
    assert node.kinds() == [
        ("schedule", "a", ("RT",), ((0, "RT"),)),  # 1. RT starts first, on the first idle instance
        ("preempt", "b", 0, b_batch),  # 2. then BE on the cpu that RT took is preempted
        ("schedule", "a", ("BE",), ((1, "BE"),)),  # 3. then BE starts where RT claims nothing
        ("pad", "a", 0, 0.0), ("pad", "a", 1, end), ("pad", "b", 0, 0.0),  # 4. BE beside RT is padded
    ]


def test_padding_deadline_is_lifted_once_rt_mode_ends():
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{1}]})
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    node.schedule("a")
    assert node.flag("b", 0).padding == node.clock.now + BATCH_S
    node.clock.now += 0.4
    node.finish("a", 0)  # the RT batch ends: back to normal mode
    assert node.models["b"].kicks == 1  # and every model hears of it
    node.log.clear()
    node.enqueue("a", BE)
    assert node.schedule("a") == [(0, "BE")]
    assert node.flag("b", 0).padding == 0.0
    assert [e for e in node.log if e[0] == "pad"] == [("pad", "a", 0, 0.0), ("pad", "b", 0, 0.0)]
    node.log.clear()
    node.enqueue("b", BE)
    node.schedule("a")
    assert [e for e in node.log if e[0] == "pad"] == []  # lifted once, not on every pass


def test_preempted_be_batch_resumes_from_its_restore_point_after_rt():
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{0}]})
    node.enqueue("b", BE, 2)
    node.schedule("b")
    node.enqueue("a", RT)
    assert node.schedule("a") == [(0, "RT")]  # RT starts at once beside the BE batch it preempts
    assert node.flag("b", 0).raised_for == node.models["b"].sched.instances[0].running.batch_id
    node.preempted("b", 0, restore=3)
    assert node.flag("b", 0).raised_for == 0  # the flag is down again for the next batch
    assert [(e.kind, e.segment, e.latency_ns) for e in node.coord.events if e.kind == "preempted"] == [
        ("preempted", 3, 2000)]
    node.enqueue("b", BE)
    assert node.schedule("b") == []  # cpu 0 is claimed: neither the suspended batch nor new BE work
    node.finish("a", 0)
    assert node.schedule("b") == [(0, "BE")]
    resumed = node.models["b"].sched.instances[0].running
    assert resumed.resume_segment == 3 and resumed.count == 2  # the preempted batch, not the new request
    # the flag goes up inside schedule(), before the runtime starts the RT batch it returned
    assert node.events() == [("start", "b", 0, "be"), ("preempt", "b", 0, "be"), ("start", "a", 0, "rt"),
                             ("preempted", "b", 0, "be"), ("done", "a", 0, "rt"), ("resume", "b", 0, "be")]


def test_a_batch_stopped_by_its_padding_deadline_is_held_until_rt_ends():
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{1}]})
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    node.schedule("a")
    node.preempted("b", 0)  # b's worker reached its padding deadline and stopped
    assert node.schedule("b") == []  # off the claimed cpus, yet held while RT runs
    node.enqueue("a", RT)
    node.finish("a", 0)
    assert node.schedule("a") == [(0, "RT")]  # the second RT request
    assert node.schedule("b") == []  # still held: RT runs again
    node.finish("a", 0)
    assert node.schedule("b") == [(0, "BE")]


def test_not_normal_mode_while_a_preemption_is_on_its_way():
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{0}]})
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    node.schedule("a")
    node.finish("a", 0)  # RT is done before b's worker reached a segment boundary
    assert not node.coord._normal_mode()  # the raised flag still counts as RT work
    node.preempted("b", 0)
    assert not node.coord._normal_mode()  # and so does the suspended batch
    node.schedule("b")
    node.finish("b", 0)
    assert node.coord._normal_mode()


def test_a_be_batch_that_finishes_before_its_preemption_lowers_the_flag():
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{0}]})
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    node.schedule("a")
    assert node.flag("b", 0).raised_for
    node.finish("b", 0)
    assert node.flag("b", 0).raised_for == 0
    node.finish("a", 0)
    assert node.coord._normal_mode()


def test_seq_starts_nothing_while_any_batch_runs_and_rt_first_after():
    node = Node(PriorityMode.SEQ, {"a": [{0}], "b": [{1}]})
    node.enqueue("a", BE)
    assert node.schedule("a") == [(0, "BE")]
    node.enqueue("b", RT)
    node.enqueue("b", BE)
    assert node.schedule("b") == []  # another model's batch holds the node; no preemption in seq
    assert not [e for e in node.log if e[0] == "preempt"]
    node.finish("a", 0)
    assert node.models["b"].kicks == 1  # any end frees the node in seq mode
    assert node.schedule("b") == [(0, "RT")]
    node.finish("b", 0)
    assert node.schedule("b") == [(0, "BE")]


def test_seq_under_arrival_order_gives_the_node_to_the_oldest_waiting_request_whatever_its_class():
    node = Node(PriorityMode.SEQ, {"a": [{0}], "b": [{1}]}, ClassOrder.ARRIVAL)
    node.enqueue("a", BE)  # arrives first
    node.clock.now += 1
    node.enqueue("b", RT)
    node.clock.now += 1
    node.enqueue("a", RT)
    assert node.schedule("b") == []  # a's best-effort request is older: a takes the node
    assert node.schedule("a") == [(0, "BE")]
    node.finish("a", 0)
    assert node.schedule("a") == []  # b's real-time request came before a's
    assert node.schedule("b") == [(0, "RT")]
    node.finish("b", 0)
    assert node.schedule("a") == [(0, "RT")]


@pytest.mark.parametrize("order", [ClassOrder.PRIORITY, ClassOrder.ARRIVAL])
def test_seq_runs_one_batch_on_the_node_even_when_a_model_has_several_idle_instances(order):
    # an autoscaled model (one instance per pending batch) must still get one batch at a time
    node = Node(PriorityMode.SEQ, {"a": [{0, 1}, {0, 1}, {0, 1}]}, order)
    node.enqueue("a", RT, 12)  # three full batches waiting, three idle instances
    assert len(node.schedule("a")) == 1
    assert node.schedule("a") == []
    (running,) = [i for i, st in node.models["a"].sched.instances.items() if st.running is not None]
    node.finish("a", running)
    assert len(node.schedule("a")) == 1


class DirectModel(FakeModel):
    """A model whose workers also take calls directly: what each instance's direct path
    runs (its page), reported in its views as the runtime does."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        super().__init__(name, log)
        self.direct: dict[int, RequestClass | None] = {}
        self.bell = False

    def instance_views(self, preempt_raised: Callable[[int, int], bool]) -> list[InstanceView]:
        out = []
        for v in super().instance_views(preempt_raised):
            cls = self.direct.get(v.instance)
            if v.running_cls is None and cls is not None:
                v = dataclasses.replace(v, running_cls=cls, running_batch=DIRECT_BATCH,
                                        preempt_raised=preempt_raised(v.instance, DIRECT_BATCH))
            out.append(v)
        return out

    def preempt(self, instance: int, batch_id: int) -> Batch | None:
        if batch_id != DIRECT_BATCH:
            return super().preempt(instance, batch_id)
        self.flags[instance].hold_direct(True)
        return Batch(self.name, instance, BE, 0, 0, [], 0.0, DIRECT_BATCH)

    def direct_activity(self) -> tuple[bool, bool, bool]:
        classes = set(self.direct.values())
        return RT in classes, BE in classes, RT in classes

    def set_direct_bell(self, on: bool) -> None:
        self.bell = on

    def direct_use(self, now: float) -> bool:
        return bool(self.direct)  # what it tells the memory manager and Packrat is tests/integration's


def test_a_direct_rt_batch_holds_direct_be_on_its_cpus_only_while_it_runs():
    node = Node(PriorityMode.REEF, {})
    for name, cpus in (("be_same_cpu", {0}), ("rt", {0}), ("be_other_cpu", {1})):
        m = DirectModel(name, node.log)
        i = m.sched.add_instance()
        m.sched.set_residency(i, Residency.RESIDENT)
        m.cpus[i], m.flags[i] = frozenset(cpus), FakeFlag(node.log, (name, i))
        node.models[name] = m
    node.models["be_same_cpu"].direct[0] = node.models["be_other_cpu"].direct[0] = BE
    node.coord.watch_direct()  # best-effort work only: no doorbells, nothing held
    assert not any(m.bell for m in node.models.values()) and node.coord._normal_mode()

    node.models["rt"].direct[0] = RT  # a worker took a real-time batch straight from a client
    node.coord.watch_direct()
    assert all(m.bell for m in node.models.values())  # both classes about: workers ring from now on
    assert not node.coord._normal_mode()
    node.schedule("be_same_cpu")  # the pass the doorbell's kick starts
    assert node.flag("be_same_cpu", 0).held and node.flag("be_same_cpu", 0).raised_for == 0
    assert not node.flag("be_other_cpu", 0).held  # its CPUs are not claimed
    assert ("preempt", "be_same_cpu", 0, "be") in node.events()

    node.models["rt"].direct[0] = None  # the real-time batch ended: its doorbell
    node.coord.direct_changed()
    assert not node.flag("be_same_cpu", 0).held and node.coord._normal_mode()
    node.coord.watch_direct()
    assert not any(m.bell for m in node.models.values())


@pytest.mark.parametrize("fbr", [{"a": 0.5, "b": 0.8}, {"a": 0.5, "b": 0.2}, None])
def test_idle_stops_and_holds_best_effort_work_only_where_measured_interference_breaks_the_limit(fbr):
    node = Node(PriorityMode.IDLE, {"a": [{0}], "b": [{1}]})
    node.coord.fbr = fbr.get if fbr else None
    heavy = fbr is not None and fbr["b"] > 0.5
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    assert node.schedule("a") == [(0, "RT")]
    assert bool([e for e in node.log if e[0] == "preempt"]) == heavy  # 0.5 + 0.8 > 1.05: stopped
    if heavy:
        node.preempted("b", 0)
        assert node.schedule("b") == []  # held while the RT work runs
        node.finish("a", 0)
        assert node.schedule("b") == [(0, "BE")]


def test_a_done_event_carries_the_workers_compute_start_and_each_requests_wait():
    node = Node(PriorityMode.IDLE, {"a": [{0}]})
    node.enqueue("a", RT, 2)
    node.schedule("a")
    batch = node.models["a"].sched.instances[0].running
    batch.compute_start = node.clock.now + 0.002
    node.finish("a", 0)
    done = node.coord.events[-1]
    assert done.kind == "done" and done.compute_start == batch.compute_start and done.waits_us == (2000, 2000)
