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
    pinned_bytes: int = 0  # what parking its weights takes (0: a CPU model)
    parks: bool = True  # its workers manage to park when asked
    parked: bool = False

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
        self.parked = False  # reloaded: the host copy goes
        self.state = "loading"
        return []

    def pinned_charge(self) -> int:
        return self.pinned_bytes

    def release_parked(self) -> None:
        self.calls.append("drop parked")
        self.parked = False

    def weights_parked(self) -> bool:
        return self.parked

    def release_residency(self, park: bool = False) -> list[Report]:
        self.calls.append("park" if park else "release")
        self.parked = park and self.parks
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


def _gpu_models(mm: MemoryManager, *names: str, pinned: int = 40) -> list[FakeModel]:
    """Models of 60 device bytes each on one GPU, ``pinned`` bytes of weights to park."""
    return [FakeModel(n, mm, device={"GPU-0": 60}, pinned_bytes=pinned) for n in names]


def test_an_evicted_gpu_model_parks_in_the_pinned_tier_and_its_device_bytes_come_back():
    mm, events = manager(device_budget_bytes=100, pinned_tier_bytes=100)
    a, b = _gpu_models(mm, "a", "b")
    mm.request(a, False)
    a.finish_load()
    mm.request(b, False)
    assert a.calls == ["load", "park"] and b.calls == []  # parking frees the device: b waits for it
    a.finish_eviction()
    assert b.calls == ["load"]
    b.finish_load()
    status = mm.status()
    assert status["device_reserved_bytes"] == {"GPU-0": 60}  # a's device bytes are back in the budget
    assert status["pinned_tier"] == ["a"] and status["pinned_tier_bytes"] == 40
    assert status["pinned_tier_budget_bytes"] == 100 and status["models"]["a"]["pinned_bytes"] == 40
    assert status["models"]["a"]["residency"] == "EVICTED" and ("evict_done", "a") in events
    # a call for a: b parks too (LRU on the device), and a's reload takes it out of the tier
    mm.request(a, False)
    assert b.calls == ["load", "park"]
    b.finish_eviction()
    assert a.calls[-1] == "load" and mm.status()["loading"] == ["a"]
    a.finish_load()
    status = mm.status()
    assert status["pinned_tier"] == ["b"] and status["pinned_tier_bytes"] == 40
    assert status["models"]["a"]["residency"] == "RESIDENT" and status["models"]["a"]["pinned_bytes"] == 0


def test_the_tier_drops_its_least_recently_used_and_what_cannot_park_is_released():
    mm, _ = manager(device_budget_bytes=100, pinned_tier_bytes=100)
    a, b, c = _gpu_models(mm, "a", "b", "c", pinned=60)
    big = FakeModel("big", mm, device={"GPU-0": 60}, pinned_bytes=101)
    cpu = FakeModel("cpu", mm, device={"GPU-0": 60})  # pinned_charge 0: never parks
    mm.request(a, False)
    a.finish_load()
    order = [a, b, c, big, cpu, a]
    for prev, m in zip(order, order[1:]):
        mm.request(m, False)
        assert prev.calls[-1] in ("park", "release")
        prev.finish_eviction()
        m.finish_load()
    assert a.calls[:2] == ["load", "park"]
    assert b.calls == ["load", "park", "drop parked"]  # a was dropped for it (60 + 60 > 100), it for c
    assert "drop parked" in a.calls and a.calls.index("drop parked") > a.calls.index("park")
    assert c.calls[:2] == ["load", "park"]
    assert big.calls == ["load", "release"] and cpu.calls == ["load", "release"]  # too large; a CPU model
    assert "drop parked" not in c.calls  # neither big nor cpu took c's place in the tier
    assert mm.status()["pinned_tier"] == ["c"]


def test_a_parked_model_a_call_waits_for_is_never_dropped_and_an_unload_forgets_its_copy():
    mm, _ = manager(device_budget_bytes=100, pinned_tier_bytes=100)
    a, b = _gpu_models(mm, "a", "b", pinned=60)
    mm.request(a, False)
    a.finish_load()
    mm.request(b, False)
    a.finish_eviction()
    b.finish_load()
    mm.request(a, False)  # a waits to reload from the tier: b cannot take its place there
    assert b.calls == ["load", "release"] and "drop parked" not in a.calls
    b.finish_eviction()
    assert a.calls[-1] == "load"
    a.finish_load()
    mm.request(b, False)  # b loads from disk; a, resident, parks again
    assert a.calls[-1] == "park" and mm.status()["pinned_tier"] == ["a"]
    a.finish_eviction()
    b.finish_load()
    a.enabled, a.parked = False, False  # an operator's unload stops its workers, parked copy and all
    a.state = "evicting"
    mm.evicting(a)
    a.finish_eviction()
    assert mm.status()["pinned_tier"] == [] and mm.status()["models"]["a"]["residency"] == "UNLOADED"


def test_a_model_whose_workers_could_not_park_leaves_the_tier_when_its_eviction_ends():
    mm, _ = manager(device_budget_bytes=100, pinned_tier_bytes=100)
    a, b = _gpu_models(mm, "a", "b")
    a.parks = False  # e.g. page-locking failed: the worker released the model as UNLOAD does
    mm.request(a, False)
    a.finish_load()
    mm.request(b, False)
    assert a.calls == ["load", "park"] and mm.status()["pinned_tier"] == ["a"]  # offered, in flight
    a.finish_eviction()
    assert mm.status()["pinned_tier"] == [] and mm.status()["pinned_tier_bytes"] == 0
