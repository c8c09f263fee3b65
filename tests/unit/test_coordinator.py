"""The coordinator's phase order (RT, then preemption, then BE, then padding) and its modes.

The coordinator is driven through its real interface with small fakes: a server that is
only ``runtimes`` and ``metrics``, runtimes that are a real ``ModelScheduler`` plus CPUs and
fake worker handles whose preemption flag records what it is told. Times come from a fake
clock: ``schedule(rt, now)`` takes it, and the module's own ``time`` reads (padding
deadlines, event stamps) are pointed at the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ModelScheduler
from splitserve.scheduler.policy import WorkConserving
from splitserve.scheduler.priority import PriorityMode
from splitserve.scheduler.request import QueuedRequest
from splitserve.server import coordinator as coordinator_mod
from splitserve.server.coordinator import Coordinator
from splitserve.worker.messages import DoneMsg

RT, BE = RequestClass.RT, RequestClass.BE
BATCH_S = 0.5  # every fake model's profiled batch time


class FakeClock:
    """Stands in for ``time`` inside the coordinator: perf_counter in s, monotonic_ns in ns."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic_ns(self) -> int:
        return int(self.now * 1e9)


class FakeFlag:
    """A worker's preemption page: records every call, in one log shared by the whole node."""

    def __init__(self, log: list[tuple], key: tuple[str, int]) -> None:
        self.log, self.key = log, key
        self.raised_for = 0
        self.padding_ns = 0

    def raise_for(self, batch_id: int) -> None:
        self.raised_for = batch_id
        self.log.append(("preempt", *self.key, batch_id))

    def clear(self) -> None:
        self.raised_for = 0

    def set_padding_deadline(self, deadline_ns: int) -> None:
        self.padding_ns = deadline_ns
        self.log.append(("pad", *self.key, deadline_ns))


class RecordingScheduler(ModelScheduler):
    """A real ModelScheduler that notes which classes each ``schedule`` call was asked for."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        super().__init__(name, WorkConserving(), max_batch=4, queue_limit=64)
        self.log = log

    def schedule(self, now, classes=(RT, BE), may_start=None):
        out = super().schedule(now, classes, may_start)
        self.log.append(("schedule", self.model, tuple(c.name for c in classes),
                         tuple((b.instance, b.cls.name) for b in out)))
        return out


@dataclass
class FakeRuntime:
    """What the coordinator reads of a ``ModelRuntime``."""

    name: str
    sched: RecordingScheduler
    cpus: dict[int, list[int]] = field(default_factory=dict)
    workers: dict[int, Any] = field(default_factory=dict)
    stats: Any = field(default_factory=lambda: SimpleNamespace(preemptions=0))
    kicks: int = 0

    def expected_batch_s(self, count: int) -> float:
        return BATCH_S

    def kick(self) -> None:
        self.kicks += 1


class _Counter:
    def __init__(self) -> None:
        self.values: list[float] = []

    def labels(self, *_: str) -> "_Counter":
        return self

    def inc(self) -> None:
        self.values.append(1)

    def observe(self, v: float) -> None:
        self.values.append(v)


class Node:
    """A fake server with models on CPU sets, and the coordinator over it."""

    def __init__(self, mode: PriorityMode, models: dict[str, list[set[int]]], monkeypatch) -> None:
        self.log: list[tuple] = []
        self.clock = FakeClock()
        monkeypatch.setattr(coordinator_mod, "time", self.clock)
        self.runtimes: dict[str, FakeRuntime] = {}
        for name, cpu_sets in models.items():
            rt = FakeRuntime(name, RecordingScheduler(name, self.log))
            for cpus in cpu_sets:
                i = rt.sched.add_instance()
                rt.sched.set_ready(i, True)
                rt.cpus[i] = sorted(cpus)
                rt.workers[i] = SimpleNamespace(flag=FakeFlag(self.log, (name, i)), pid=1000 + i)
            self.runtimes[name] = rt
        self.metrics = SimpleNamespace(preemptions=_Counter(), preemption_latency=_Counter())
        self.coord = Coordinator(self, mode, max_events=10_000)  # type: ignore[arg-type]
        self._seq = {name: {RT: 0, BE: 0} for name in models}

    def enqueue(self, model: str, cls: RequestClass, n: int = 1) -> None:
        for _ in range(n):
            seq = self._seq[model][cls]
            self._seq[model][cls] += 1
            self.runtimes[model].sched.enqueue(QueuedRequest(seq, 1, cls, self.clock.now))

    def schedule(self, model: str) -> list[tuple[int, str]]:
        """One runtime's scheduling pass, as ``ModelRuntime._schedule`` does it."""
        rt = self.runtimes[model]
        batches = self.coord.schedule(rt, self.clock.now)  # type: ignore[arg-type]
        for b in batches:
            self.coord.started(rt, b)  # type: ignore[arg-type]
        return [(b.instance, b.cls.name) for b in batches]

    def finish(self, model: str, instance: int) -> None:
        rt = self.runtimes[model]
        batch = rt.sched.complete(instance)
        assert batch is not None
        self.coord.finished(rt, instance, batch, True)  # type: ignore[arg-type]

    def preempted(self, model: str, instance: int, restore: int = 1) -> None:
        rt = self.runtimes[model]
        batch = rt.sched.instances[instance].running
        msg = DoneMsg(kind=0, batch_id=batch.batch_id, compute_ns=0, segments_run=restore, first_segment=0,
                      preempt_ns=2000)
        self.coord.preempted(rt, instance, msg)  # type: ignore[arg-type]

    def flag(self, model: str, instance: int) -> FakeFlag:
        return self.runtimes[model].workers[instance].flag

    def kinds(self) -> list[tuple]:
        return [e for e in self.log if e[0] in ("preempt", "pad") or (e[0] == "schedule" and e[3])]

    def events(self) -> list[tuple[str, str, int, str]]:
        return [(e.kind, e.model, e.instance, e.cls) for e in self.coord.events]


def test_normal_mode_never_builds_the_node_view(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{1}]}, monkeypatch)

    def no_view() -> None:
        raise AssertionError("normal mode must not build the node view")

    monkeypatch.setattr(node.coord, "view", no_view)
    node.enqueue("a", BE, 3)
    assert node.schedule("a") == [(0, "BE")]
    assert [e[1:3] for e in node.log if e[0] == "schedule"] == [("a", ("RT", "BE"))]  # one plain pass


@pytest.mark.parametrize("mode", [PriorityMode.CONCURRENT, PriorityMode.RT_ONLY])
def test_modes_without_priority_skip_the_view_even_with_rt_waiting(monkeypatch, mode):
    node = Node(mode, {"a": [{0}], "b": [{0}]}, monkeypatch)
    monkeypatch.setattr(node.coord, "view", lambda: pytest.fail("no view in a mode without priority"))
    node.enqueue("b", BE)
    assert node.schedule("b") == [(0, "BE")]
    node.enqueue("a", RT)
    assert node.schedule("a") == [(0, "RT")]
    assert not [e for e in node.log if e[0] == "preempt"]  # the BE batch on cpu 0 runs on


def test_reef_phases_run_rt_then_preempt_then_be_then_pad(monkeypatch):
    # a: two instances on cpus 0 and 1; b: one instance sharing cpu 0, running BE.
    node = Node(PriorityMode.REEF, {"a": [{0}, {1}], "b": [{0}]}, monkeypatch)
    node.enqueue("b", BE)
    assert node.schedule("b") == [(0, "BE")]
    node.log.clear()
    node.enqueue("a", RT)
    node.enqueue("a", BE, 2)
    assert node.schedule("a") == [(0, "RT"), (1, "BE")]
    b_batch = node.runtimes["b"].sched.instances[0].running.batch_id
    end_ns = int((node.clock.now + BATCH_S) * 1e9)  # the RT batch's expected end
    assert node.kinds() == [
        ("schedule", "a", ("RT",), ((0, "RT"),)),  # 1. RT starts first, on the first idle instance
        ("preempt", "b", 0, b_batch),  # 2. then BE on the cpu that RT took is preempted
        ("schedule", "a", ("BE",), ((1, "BE"),)),  # 3. then BE starts where RT claims nothing
        ("pad", "a", 0, 0), ("pad", "a", 1, end_ns), ("pad", "b", 0, 0),  # 4. BE beside RT is padded
    ]


def test_padding_deadline_is_lifted_once_rt_mode_ends(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{1}]}, monkeypatch)
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    node.schedule("a")
    assert node.flag("b", 0).padding_ns == int((node.clock.now + BATCH_S) * 1e9)
    node.clock.now += 0.4
    node.finish("a", 0)  # the RT batch ends: back to normal mode
    assert node.runtimes["b"].kicks == 1  # and every model hears of it
    node.log.clear()
    node.enqueue("a", BE)
    assert node.schedule("a") == [(0, "BE")]
    assert node.flag("b", 0).padding_ns == 0
    assert [e for e in node.log if e[0] == "pad"] == [("pad", "a", 0, 0), ("pad", "b", 0, 0)]
    node.log.clear()
    node.enqueue("b", BE)
    node.schedule("a")
    assert [e for e in node.log if e[0] == "pad"] == []  # lifted once, not on every pass


def test_preempted_be_batch_resumes_from_its_restore_point_after_rt(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{0}]}, monkeypatch)
    node.enqueue("b", BE, 2)
    node.schedule("b")
    node.enqueue("a", RT)
    assert node.schedule("a") == [(0, "RT")]  # RT starts at once beside the BE batch it preempts
    assert node.flag("b", 0).raised_for == node.runtimes["b"].sched.instances[0].running.batch_id
    node.preempted("b", 0, restore=3)
    assert node.flag("b", 0).raised_for == 0  # the flag is down again for the next batch
    assert node.runtimes["b"].stats.preemptions == 1 and node.metrics.preemption_latency.values == [2e-6]
    node.enqueue("b", BE)
    assert node.schedule("b") == []  # cpu 0 is claimed: neither the suspended batch nor new BE work
    node.finish("a", 0)
    assert node.schedule("b") == [(0, "BE")]
    resumed = node.runtimes["b"].sched.instances[0].running
    assert resumed.resume_segment == 3 and resumed.count == 2  # the preempted batch, not the new request
    # the flag goes up inside schedule(), before the runtime starts the RT batch it returned
    assert node.events() == [("start", "b", 0, "be"), ("preempt", "b", 0, "be"), ("start", "a", 0, "rt"),
                             ("preempted", "b", 0, "be"), ("done", "a", 0, "rt"), ("resume", "b", 0, "be")]


def test_a_batch_stopped_by_its_padding_deadline_is_held_until_rt_ends(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{1}]}, monkeypatch)
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


def test_not_normal_mode_while_a_preemption_is_on_its_way(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{0}]}, monkeypatch)
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


def test_a_be_batch_that_finishes_before_its_preemption_lowers_the_flag(monkeypatch):
    node = Node(PriorityMode.REEF, {"a": [{0}], "b": [{0}]}, monkeypatch)
    node.enqueue("b", BE)
    node.schedule("b")
    node.enqueue("a", RT)
    node.schedule("a")
    assert node.flag("b", 0).raised_for
    node.finish("b", 0)
    assert node.flag("b", 0).raised_for == 0
    node.finish("a", 0)
    assert node.coord._normal_mode()


def test_seq_starts_nothing_while_any_batch_runs_and_rt_first_after(monkeypatch):
    node = Node(PriorityMode.SEQ, {"a": [{0}], "b": [{1}]}, monkeypatch)
    node.enqueue("a", BE)
    assert node.schedule("a") == [(0, "BE")]
    node.enqueue("b", RT)
    node.enqueue("b", BE)
    assert node.schedule("b") == []  # another model's batch holds the node; no preemption in seq
    assert not [e for e in node.log if e[0] == "preempt"]
    node.finish("a", 0)
    assert node.runtimes["b"].kicks == 1  # any end frees the node in seq mode
    assert node.schedule("b") == [(0, "RT")]
    node.finish("b", 0)
    assert node.schedule("b") == [(0, "BE")]
