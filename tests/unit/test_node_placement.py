"""Runtimes wired to one node-wide ``ResourceManager`` and ``PlacementApplier``, driven with
fakes (no processes, no sockets): fake workers report for themselves, and the node's CPUs
are a synthetic topology. What the issue asks of the node's one owner of CPUs: Packrat
budgets and fixed instances never share a CPU, a request the node cannot meet is refused
naming what is in use, and a change across two models at once answers every request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from splitserve.config import ServerConfig
from splitserve.modelconfig import ModelConfig
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import ModelProfile
from splitserve.placement.resources import ResourceManager
from splitserve.placement.topology import Core
from splitserve.protocol.header import RequestClass
from splitserve.registry import ModelRecord
from splitserve.server.applier import PlacementApplier
from splitserve.server.metrics import Metrics
from splitserve.memory.manager import MemoryManager
from splitserve.server.monitor import Call, InferenceMonitor
from splitserve.server.model.env import RuntimeEnv
from splitserve.server.ports import ModelState
from splitserve.server.model.runtime import ModelRuntime
from splitserve.worker.messages import DoneMsg, Msg, RunMsg
from splitserve.worker.spares import SparePool
from tests.unit.test_runtime_seams import FakeLoop, FakeWorker, NoFootprints, RecordingNode, Sink, inline

BE = RequestClass.BE


def config(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig.from_dict({
        "name": name, "max_batch_size": 16, "artifact": {"kind": "zoo", "arch": "vecadd1k"},
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "UINT8", "shape": [4]}], **kw,
    })


def packrat(name: str, threads: int) -> ModelConfig:
    return config(name, placement={"kind": "packrat", "threads": threads, "batch": 16, "adaptive": False})


def profile(name: str) -> ModelProfile:
    """Thin instances win at every batch (sub-linear thread scaling), so a plan uses them all."""
    table = {(t, b): 1e-3 + b * 1e-4 * (0.5 + 0.5 / t) for t in (1, 2, 3, 4) for b in (1, 2, 4, 8, 16)}
    return ModelProfile(LatencyProfile(name, table), {k: [v] for k, v in table.items()}, "test")


class AutoWorker(FakeWorker):
    """A fake worker that starts, answers its LOAD, and reports each batch DONE (doubling its
    bytes), one loop step after it is asked: the runtimes serve on their own while a change runs."""

    def __init__(self, owner: Any, instance: int, make_spec: Any, loop: Any) -> None:
        super().__init__(owner, instance, make_spec, loop)
        self.loop = loop
        if isinstance(loop, asyncio.AbstractEventLoop):
            loop.call_soon(self._start)

    def _start(self) -> None:
        if self.alive:
            self.start()

    def send_load(self, bind: Any) -> bool:
        ok = super().send_load(bind)
        if self.alive and isinstance(self.loop, asyncio.AbstractEventLoop):
            self.loop.call_soon(self._loaded)
        return ok

    def _loaded(self) -> None:
        if self.alive:
            self.loaded()

    def send_run(self, msg: RunMsg) -> bool:
        self.sent.append(msg)
        if self.alive and isinstance(self.loop, asyncio.AbstractEventLoop):
            self.loop.call_soon(self._done, msg)
        return self.alive

    def _done(self, msg: RunMsg) -> None:
        owner = self.owner  # the model's instances (its workers' WorkerOwner) and their queues
        cls = RequestClass(msg.cls)
        x = bytes(owner.queues.input_views(cls, msg.seq, msg.count)[0])
        owner.queues.output_views(cls, msg.seq, msg.count)[0][:] = bytes((2 * b) % 256 for b in x)
        owner.on_done(self.instance, DoneMsg(Msg.DONE, msg.batch_id, 1000, 1, 0))


class Node:
    """One node's resource manager and applier, and runtimes built on them on demand."""

    def __init__(self, tmp_path: Path, cpus: int, loop: Any, **settings: Any) -> None:
        self.rm = ResourceManager([Core(cpu=c, core=c, socket=0) for c in range(cpus)])
        self.runtimes: dict[str, ModelRuntime] = {}
        self.applier = PlacementApplier(self.rm, lambda name: self.runtimes[name].placements)
        self.workers: list[FakeWorker] = []
        self.monitor = InferenceMonitor()
        self.sink = Sink()
        self.loop = loop
        config = ServerConfig.of(data_dir=tmp_path, queue_slots=32, **{"fast_direct": False, **settings})  # fake workers have no pages
        metrics = Metrics()
        self.env = RuntimeEnv(
            loop=loop, config=config,  # type: ignore[arg-type]
            node=RecordingNode(), metrics=metrics, resources=self.rm, placements=self.applier,
            stopping=lambda: False,
            workers=SparePool(ServerConfig.of(data_dir=tmp_path, spare_workers=0), loop, self._start_worker),
            footprints=NoFootprints(), memory=MemoryManager(config.memory, metrics), off_loop=inline)
        self._ids = 0

    def _start_worker(self, owner: Any, instance: int, make_spec: Any, loop: Any) -> FakeWorker:
        w = AutoWorker(owner, instance, make_spec, loop)
        self.workers.append(w)
        return w

    def model(self, cfg: ModelConfig) -> ModelRuntime:
        record = ModelRecord(cfg.name, len(self.runtimes) + 1, 1, "test", None, cfg)
        stored = profile(cfg.name) if cfg.name.startswith("pk") else None
        rt = self.runtimes[cfg.name] = ModelRuntime(self.env, record, stored)
        return rt

    def call(self, rt: ModelRuntime, payload: bytes) -> Call:
        self._ids += 1
        seq = rt.alloc(BE, 1)
        call = Call(self.monitor, rt, self._ids, BE, seq, 1, self.sink, None)
        rt.input_views(BE, seq, 1)[0][:] = payload
        rt.submit(call)
        return call

    def pins(self, rt: ModelRuntime) -> list[frozenset[int]]:
        """The CPUs of each instance of ``rt`` with a live worker (what its LOAD pins it to)."""
        return [frozenset(rt.resources.placed(rt.name, i).cpus) for i, w in sorted(rt.workers.items()) if w.alive]

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.close()


def test_two_packrat_models_and_a_fixed_model_get_disjoint_cpus(tmp_path):
    node = Node(tmp_path, 6, FakeLoop())
    try:
        models = [node.model(packrat("pk_a", 2)), node.model(packrat("pk_b", 2)),
                  node.model(config("fixed", instances=2))]
        for rt in models:
            rt.residency.ensure_started()
            assert rt.state is ModelState.LOADING, rt.error
        pins = {rt.name: node.pins(rt) for rt in models}
        assert [len(p) for p in pins.values()] == [2, 2, 2]  # Packrat's thin instances, two fixed ones
        every = [c for ps in pins.values() for p in ps for c in p]
        assert len(every) == len(set(every)) == 6, pins  # no CPU is pinned twice
        snap = node.rm.snapshot()
        assert [(p["owner"], p["request"]) for p in snap["partitions"]] == [
            ("pk_a", "a budget of 2 cores"), ("pk_b", "a budget of 2 cores"),
            ("fixed", "1 shared CPUs"), ("fixed", "1 shared CPUs")]
        assert all(len(p["instances"]) == (2 if p["owner"].startswith("pk") else 1) for p in snap["partitions"])
        # What the coordinator sees of an instance is what the resource manager recorded.
        views = [v for rt in models for v in rt.dispatch.instance_views(lambda i, b: False)]
        assert sorted(tuple(sorted(v.cpus)) for v in views) == sorted(
            tuple(sorted(p)) for ps in pins.values() for p in ps)
    finally:
        node.close()


def test_a_load_the_node_cannot_meet_is_refused_naming_what_is_in_use(tmp_path):
    node = Node(tmp_path, 2, FakeLoop())
    try:
        a, b = node.model(packrat("pk_a", 1)), node.model(packrat("pk_b", 1))
        a.residency.ensure_started()
        b.residency.ensure_started()
        late = node.model(config("late"))
        call = node.call(late, bytes(4))  # the first call loads it: no CPU is left
        assert late.state is ModelState.FAILED
        (answer,) = node.sink.answers
        assert answer[0] == call.req_id and answer[1].status.name == "MODEL_NOT_READY"
        for text in (late.error, str(answer[1])):
            assert "'late' asks for 1 shared CPUs" in text and "'pk_a' holds 0" in text and "'pk_b' holds 1" in text
        assert [p.owner for p in node.rm.partitions()] == ["pk_a", "pk_b"]  # the refused load holds nothing
        assert node.monitor.in_flight == 0 and late.queues.rings[BE].in_use == 0
    finally:
        node.close()


def test_a_change_across_two_models_at_once_answers_every_request(tmp_path):
    async def scenario() -> tuple[Node, list[Call], list[dict]]:
        node = Node(tmp_path, 4, asyncio.get_running_loop(), fixed_cpus_shared=False)
        pk = node.model(packrat("pk", 2))
        fixed = node.model(config("fixed"))
        await pk.wait_ready()
        await fixed.wait_ready()
        calls = [node.call(rt, bytes([i, i, i, i])) for i in range(6) for rt in (pk, fixed)]
        # Packrat repacks to B=4 (its two instances switch one at a time inside its budget)
        # while the fixed model grows to two instances, in one change of the node.
        records = await node.applier.apply(lambda: {
            "pk": pk.core.placer.plan_for(4),
            "fixed": fixed.core.placer.resize(node.rm, fixed.core.serving_placements(), 2),
        })
        calls += [node.call(rt, bytes([7, 7, 7, 7])) for rt in (pk, fixed) for _ in range(3)]
        await pk.core.until(lambda: node.monitor.in_flight == 0, float("inf"))
        return node, calls, [records["pk"], records["fixed"], pk.placement(), fixed.placement()]

    node, calls, (rec_pk, rec_fixed, pk_view, fixed_view) = asyncio.run(scenario())
    try:
        answered = {req_id: out for req_id, out in node.sink.answers}
        assert sorted(answered) == sorted(c.req_id for c in calls)  # each call answered once
        assert all(isinstance(out, bytes) for out in answered.values()), answered
        assert rec_pk["ok"] and rec_fixed["ok"] and rec_pk["shapes"] == [(1, 2), (1, 2)]
        assert [i["batch"] for i in pk_view["instances"]] == [2, 2] and pk_view["batch"] == 4
        assert len(fixed_view["instances"]) == 2
        pins = [c for i in pk_view["instances"] + fixed_view["instances"] for c in i["cpus"]]
        assert len(pins) == len(set(pins)) == 4  # no CPU double-booked after the change
        assert pk_view["reconfigurations"][-1]["switched_at"] is not None
    finally:
        node.close()


@pytest.mark.parametrize("share", [False, True])
def test_configured_cpus_are_shared_only_when_both_models_ask(tmp_path, share):
    node = Node(tmp_path, 2, FakeLoop())
    try:
        first = node.model(config("first", cpus=[0], share_cpus=share))
        second = node.model(config("second", cpus=[0, 1], share_cpus=share))
        first.residency.ensure_started()
        second.residency.ensure_started()
        if share:
            assert second.state is ModelState.LOADING and node.pins(second) == [frozenset({0})]
        else:
            assert second.state is ModelState.FAILED
            assert "0 held by 'first'" in second.error and "both must ask to share" in second.error
    finally:
        node.close()
