"""The pinned host tier through a real server and real worker processes, on the CPU.

CPU models never park (host memory is their device: ``ModelResidency.pinned_charge`` is 0
for them); this test overrides only that choice, so that everything after it runs as it
does for a GPU model: the manager offers the evicted model to the tier, its worker answers
PARK over its socket and stays the instance's, and the next calls (several at once, during
the reload) send RELOAD to the same process and are each answered once, by the batch that
copies the weights back (``HostLanes`` on the CPU). ``tests/gpu/test_pinned_tier.py`` runs
the same story on a GPU with nothing overridden."""

from __future__ import annotations

import asyncio

import numpy as np

from splitserve.server.model.residency import ModelResidency
from tests.inproc import quiet_config, run_server, write_model


def test_the_evicted_model_parks_in_its_worker_and_calls_during_its_reload_are_each_answered(tmp_path, monkeypatch):
    monkeypatch.setattr(ModelResidency, "pinned_charge",
                        lambda self: self.core.footprint.weights_bytes * max(1, self.instance_count))
    repo = tmp_path / "repo"
    for name in ("lenet_a", "lenet_b"):
        write_model(repo, name, "lenet", "max_batch_size = 4")
    cfg = quiet_config(tmp_path / "data", repository=repo, max_resident_models=1)
    x = np.random.default_rng(0).integers(0, 256, (2, 1, 28, 28), dtype=np.uint8)

    async def scenario(server):
        first = (await server.infer("lenet_a", [x])).outputs[0]
        pid = server.runtime("lenet_a").workers[0].pid
        await server.infer("lenet_b", [x])  # lenet_a is evicted for it: parked
        parked = server.memory.status()
        calls = await asyncio.gather(*(server.infer("lenet_a", [x]) for _ in range(5)))  # lenet_b parks
        return first, [c.outputs[0] for c in calls], pid, server.runtime("lenet_a").workers[0].pid, parked, \
            server.memory.status()

    first, answers, pid, pid_after, parked, after = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), 120))
    assert parked["pinned_tier"] == ["lenet_a"] and parked["lru"] == ["lenet_b"]
    assert parked["models"]["lenet_a"]["residency"] == "EVICTED" and parked["models"]["lenet_a"]["pinned_bytes"] > 0
    assert len(answers) == 5
    for a in answers:  # batched with one another: float sums in another order
        np.testing.assert_allclose(a, first, rtol=1e-5, atol=1e-6)
    assert pid_after == pid  # reloaded where it was parked, no load from disk into another process
    assert after["pinned_tier"] == ["lenet_b"] and after["models"]["lenet_a"]["pinned_bytes"] == 0
    assert after["models"]["lenet_a"]["loads"] == 2 and after["lru"] == ["lenet_a"]
