"""``memory.manager.MemoryManager`` with fake models and a fake clock: it grants loads,
starts evictions, logs events, and takes what a model reports while carrying out one of its
commands with the command's answer (a model never calls back into the manager that commanded it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.config import ServerConfig
from splitserve.memory.manager import MemoryManager, Report, ReportKind
from splitserve.server.metrics import Metrics
from splitserve.memory.footprints import MemoryFootprint


@dataclass
class FakeModel:
    """A ``ResidentModel`` whose loads and evictions end when the test says so."""

    name: str
    manager: MemoryManager
    size: int = 0
    enabled: bool = True
    keep_resident: bool = False
    busy: bool = False
    state: str = "cold"  # cold | loading | resident | evicting
    calls: list[str] = field(default_factory=list)
    instance_count: int = 1
    device: dict[str, int] = field(default_factory=dict)  # partition UUID -> device bytes

    @property
    def footprint(self) -> MemoryFootprint:
        return MemoryFootprint(self.size, 0, measured=True)

    def charge(self) -> int:
        return self.size

    def device_charge(self) -> dict[str, int]:
        return dict(self.device)

    def pinned(self) -> bool:
        return self.busy

    def holds_memory(self) -> bool:
        return self.state != "cold"

    def begin_load(self) -> list[Report]:
        self.calls.append("load")
        self.state = "loading"
        return []

    def release_residency(self) -> list[Report]:
        self.calls.append("release")
        if self.state in ("cold", "evicting"):
            return []
        self.state = "evicting"
        return [Report(ReportKind.EVICTING)]  # with the command's answer, never a call back

    def refuse_load(self, reason: str) -> list[Report]:
        self.calls.append(f"refused: {reason}")
        return []

    # the test's side: the worker reports
    def finish_load(self) -> None:
        self.state = "resident"
        self.manager.loaded(self, self.size)

    def finish_eviction(self) -> None:
        self.state = "cold"
        self.manager.released(self)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def manager(**settings) -> tuple[MemoryManager, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    config = ServerConfig.of(**settings)
    return MemoryManager(config.memory, Metrics(), lambda kind, model: events.append((kind, model)), clock=Clock()), events


def test_without_a_budget_every_request_loads_at_once_and_nothing_is_logged():
    mm, events = manager()
    a, b = FakeModel("a", mm), FakeModel("b", mm)
    mm.request(a, False)
    mm.request(b, False)  # no one-loader rule without a manager
    assert a.calls == b.calls == ["load"]
    assert events == []


def test_a_victim_is_evicted_before_the_waiting_model_loads_and_the_events_say_so():
    mm, events = manager(max_resident_models=1)
    a, b = FakeModel("a", mm, size=10), FakeModel("b", mm, size=10)
    mm.request(a, False)
    a.finish_load()
    mm.touch(a.name, 5.0)
    mm.request(b, False)
    assert a.calls == ["load", "release"] and b.calls == []  # b waits for a's bytes
    a.finish_eviction()
    assert b.calls == ["load"]
    b.finish_load()
    assert events == [("load_start", "a"), ("load_done", "a"), ("evict_start", "a"), ("evict_done", "a"),
                      ("load_start", "b"), ("load_done", "b")]
    status = mm.status()
    assert status["lru"] == ["b"] and status["loads"] == 2 and status["evictions"] == 1
    assert status["models"]["a"]["residency"] == "EVICTED" and status["reserved_bytes"] == 10


def test_a_busy_victim_is_evicted_when_its_batch_ends():
    mm, _ = manager(max_resident_models=1)
    a, b = FakeModel("a", mm), FakeModel("b", mm)
    mm.request(a, False)
    a.finish_load()
    a.busy = True
    mm.request(b, False)
    assert a.calls == ["load"]  # nothing to do until a's batch ends
    a.busy = False
    mm.batch_done(a.name)
    assert a.calls == ["load", "release"]


def test_a_grant_the_model_no_longer_wants_is_given_back_without_looping():
    mm, _ = manager(max_resident_models=1)
    a = FakeModel("a", mm)

    def refuse() -> list[Report]:  # e.g. unloaded meanwhile: it holds nothing, and says so with its answer
        a.calls.append("load")
        return [Report(ReportKind.RELEASED)]

    a.begin_load = refuse  # type: ignore[method-assign]
    mm.request(a, False)
    assert a.calls == ["load"]
    assert mm.status()["load_queue"] == [] and mm.status()["reserved_bytes"] == 0


def test_a_model_that_can_never_fit_is_refused_with_both_numbers():
    mm, _ = manager(memory_budget_bytes=100)
    big = FakeModel("big", mm, size=120)
    mm.request(big, False)
    (refusal,) = big.calls
    assert refusal.startswith("refused") and "120" in refusal and "100" in refusal
    assert mm.status()["models"]["big"]["residency"] == "FAILED"


def test_a_failed_load_answered_with_the_command_is_planned_again_without_a_call_back():
    mm, events = manager(max_resident_models=1)
    a, b = FakeModel("a", mm, size=10), FakeModel("b", mm, size=10)

    def fails() -> list[Report]:  # e.g. its CPUs are taken: it fails at once, and says so with its answer
        a.calls.append("load")
        return [Report(ReportKind.LOAD_FAILED, reason="no CPUs")]

    a.begin_load = fails  # type: ignore[method-assign]
    mm.request(a, False)
    mm.request(b, False)  # a's failure gave its place back: b loads
    assert a.calls == ["load"] and b.calls == ["load"]
    assert mm.status()["models"]["a"]["residency"] == "FAILED" and mm.status()["loading"] == ["b"]


def test_a_device_budget_alone_makes_a_manager_that_evicts_per_gpu_and_reports_device_bytes():
    mm, events = manager(device_budget_bytes=100)
    a = FakeModel("a", mm, device={"GPU-0": 60})
    b = FakeModel("b", mm, device={"GPU-1": 60})
    c = FakeModel("c", mm, device={"GPU-0": 60})
    for m in (a, b):
        mm.request(m, False)
        m.finish_load()
    mm.request(c, False)
    assert a.calls == ["load", "release"] and b.calls == ["load"]  # b holds nothing on GPU-0
    a.finish_eviction()
    assert c.calls == ["load"]
    c.finish_load()
    status = mm.status()
    assert status["device_budget_bytes"] == 100
    assert status["device_reserved_bytes"] == {"GPU-0": 60, "GPU-1": 60}
    assert status["models"]["c"]["device_reserved_bytes"] == {"GPU-0": 60}
    assert ("evict_done", "a") in events
