"""``server.applier.PlacementApplier`` driving a fake ``PlacedModel`` (only the seam's members)
with a fake clock: a change starts the new set as standby, switches, drains the old set and
reports the change once, and the model it drives can be nothing but its placement piece."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from splitserve.placement.partition import Cpus, InstancePlacement
from splitserve.placement.resources import ResourceManager
from splitserve.placement.topology import Core
from splitserve.server.applier import PlacedModel, PlacementApplier


class FakePlaced:
    """A ``PlacedModel`` and nothing more: it records the applier's calls in order."""

    def __init__(self, rm: ResourceManager, name: str = "m") -> None:
        self.rm, self.name = rm, name
        self.calls: list[tuple] = []
        self._ids = iter(range(1, 100))

    def add_standby(self, placements: Sequence[InstancePlacement]) -> list[int]:
        ids = [next(self._ids) for _ in placements]
        for i, p in zip(ids, placements):
            self.rm.place(self.name, i, p)
        self.calls.append(("standby", ids))
        return ids

    async def until_ready(self, instances: Sequence[int]) -> None:
        self.calls.append(("ready", list(instances)))

    def switch(self, activate: Sequence[int], retire: Sequence[int], final: bool) -> None:
        self.calls.append(("switch", list(activate), list(retire), final))

    async def retire(self, instances: Sequence[int]) -> None:
        for i in instances:
            self.rm.unplace(self.name, i)
        self.calls.append(("retire", list(instances)))

    def changed(self, record: Mapping[str, Any]) -> None:
        self.calls.append(("changed", record["ok"], record["waves"]))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_the_fake_has_only_the_seam():
    seam = {n for n in vars(PlacedModel) if not n.startswith("_")}
    fake = {n for n in vars(FakePlaced) if not n.startswith("_")}
    assert fake == seam - {"name"}  # ``name`` is an attribute of each fake


def test_a_change_starts_the_new_set_switches_then_drains_the_old_one():
    rm = ResourceManager([Core(cpu=c, core=c, socket=0) for c in range(4)])
    model = FakePlaced(rm)
    old = rm.allocate("m", Cpus(1))
    rm.place("m", 0, InstancePlacement(1, 4, old.cpus))
    applier = PlacementApplier(rm, {"m": model}.__getitem__, clock=Clock())

    def decide() -> dict[str, list[InstancePlacement]]:
        new = rm.allocate("m", Cpus(2))
        return {"m": [InstancePlacement(2, 4, new.cpus)]}

    records = asyncio.run(applier.apply(decide))
    assert model.calls == [("standby", [1]), ("ready", [1]), ("switch", [1], [0], True), ("retire", [0]),
                           ("changed", True, 1)]
    (record,) = records.values()
    assert record["ok"] and record["shapes"] == [(2, 4)] and record["start_s"] >= 0 and record["drain_s"] >= 0
    assert sorted(rm.placement()["m"]) == [1]
