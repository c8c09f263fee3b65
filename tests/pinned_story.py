"""The pinned host tier's story through a real server, shared by the CPU and GPU tests: two
models with room for one resident, the first evicted for the second (it parks), then calls
for the first (it reloads in the worker it parked in)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.inproc import quiet_config, run_server, write_model


@dataclass
class Story:
    first: np.ndarray  # lenet_a's answer before it was evicted
    answers: list[np.ndarray]  # its answers to the calls sent together after
    pid: int  # its worker before
    pid_after: int  # and after
    parked: dict[str, Any]  # /v2/memory once it parked
    after: dict[str, Any]  # /v2/memory at the end (lenet_b parked for it)


def park_and_reload(tmp_path: Path, toml: str, calls: int) -> Story:
    """``toml`` configures both lenets; ``calls`` calls for lenet_a go at once after its park."""
    repo = tmp_path / "repo"
    for name in ("lenet_a", "lenet_b"):
        write_model(repo, name, "lenet", toml)
    cfg = quiet_config(tmp_path / "data", repository=repo, max_resident_models=1)
    x = np.random.default_rng(0).integers(0, 256, (2, 1, 28, 28), dtype=np.uint8)

    async def scenario(server: Any) -> Story:
        first = (await server.infer("lenet_a", [x])).outputs[0]
        pid = server.runtime("lenet_a").workers[0].pid
        await server.infer("lenet_b", [x])  # lenet_a is evicted for it: parked
        parked = server.memory.status()
        again = await asyncio.gather(*(server.infer("lenet_a", [x]) for _ in range(calls)))  # lenet_b parks
        return Story(first, [c.outputs[0] for c in again], pid, server.runtime("lenet_a").workers[0].pid, parked,
                     server.memory.status())

    return run_server(cfg, lambda s: asyncio.wait_for(scenario(s), 120))


def assert_parked_then_reloaded_in_place(story: Story, rtol: float, atol: float) -> None:
    """lenet_a parked (in the tier, evicted, its pinned bytes counted), then answered as
    before by the same process, and lenet_b parked in its turn."""
    parked, after = story.parked, story.after
    assert parked["pinned_tier"] == ["lenet_a"] and parked["lru"] == ["lenet_b"]
    assert parked["models"]["lenet_a"]["residency"] == "EVICTED" and parked["models"]["lenet_a"]["pinned_bytes"] > 0
    for a in story.answers:  # batched with one another: float sums in another order
        np.testing.assert_allclose(a, story.first, rtol=rtol, atol=atol)
    assert story.pid_after == story.pid  # reloaded where it was parked, no load from disk into another process
    assert after["pinned_tier"] == ["lenet_b"] and after["models"]["lenet_a"]["pinned_bytes"] == 0
    assert after["models"]["lenet_a"]["loads"] == 2 and after["lru"] == ["lenet_a"]
