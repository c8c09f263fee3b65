"""The pinned host tier through a real server and real worker processes, on the CPU.

CPU models never park (host memory is their device: ``ModelResidency.pinned_charge`` is 0
for them); this test overrides only that choice, so that everything after it runs as it
does for a GPU model: the manager offers the evicted model to the tier, its worker answers
PARK over its socket and stays the instance's, and the next calls (several at once, during
the reload) send RELOAD to the same process and are each answered once, by the batch that
copies the weights back (``HostLanes`` on the CPU). ``tests/gpu/test_pinned_tier.py`` runs
the same story on a GPU with nothing overridden."""

from __future__ import annotations

from splitserve.server.model.residency import ModelResidency
from tests.pinned_story import assert_parked_then_reloaded_in_place, park_and_reload


def test_the_evicted_model_parks_in_its_worker_and_calls_during_its_reload_are_each_answered(tmp_path, monkeypatch):
    monkeypatch.setattr(ModelResidency, "pinned_charge",
                        lambda self: self.core.footprint.weights_bytes * max(1, self.instance_count))
    story = park_and_reload(tmp_path, "max_batch_size = 4", calls=5)
    assert len(story.answers) == 5
    assert_parked_then_reloaded_in_place(story, rtol=1e-5, atol=1e-6)
