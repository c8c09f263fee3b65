"""The multimodel scenario's figures from synthetic runs: no processes, no sockets.

A run that follows the cost model exactly (every hit costs c, every miss c + s) must give the
prediction back as the measurement, so any slip in how the scenario splits hits from misses,
sums wall time or pairs cells with their baselines shows up here rather than as a noisy ratio.
"""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.bench.access import lru_misses
from splitserve.bench.multimodel.report import broken, figures, public
from splitserve.bench.multimodel.scenario import Params, Timed, _seq, summarise

HIT_MS, SWAP_MS = 10.0, 30.0  # r = 3


def _run(pattern: str, m: int, seq: list[int], capacity: int | None, every: bool = False) -> dict:
    primed = list(range(m if capacity is None else min(m, capacity)))
    ref = [True] * len(seq) if every else lru_misses(seq, capacity, primed) if capacity else [False] * len(seq)
    lat = np.where(ref, HIT_MS + SWAP_MS, HIT_MS)
    timed = Timed(seq, lat, float(lat.sum()) / 1e3)
    return summarise(pattern, m, seq, timed, ref, int(sum(ref)), int(sum(ref)))


def _params() -> Params:
    return Params(models=("lenet",), copies=6, accessed=(2, 5, 6), requests=400, every_requests=50,
                  fig2_models=5, concurrent_s=0)


def test_a_run_that_follows_the_cost_model_meets_every_prediction():
    p = _params()
    grid = [(pat, m) for pat in p.patterns for m in (2, 5, 6)]
    r = {"no-limit": {f"{pat}/{m}": _run(pat, m, _seq(p, pat, m, p.requests), None) for pat, m in grid},
         "lru": {f"{pat}/{m}": _run(pat, m, _seq(p, pat, m, p.requests), p.cache) for pat, m in grid},
         "load-every-request": {pat: _run(pat, 5, _seq(p, pat, 5, p.requests)[:50], None, every=True)
                                for pat in p.patterns}}
    f = figures(p, r)
    assert f["r"]["value"] == pytest.approx(SWAP_MS / HIT_MS)
    assert all(f["miss_ratio_equal"].values())
    for key, cell in f["vs_ceiling"].items():
        assert cell["measured"] == pytest.approx(cell["predicted"]), key
        assert cell["within"] is True
    # primed with models 0..3, the round robin hits them once, then misses every time
    assert f["vs_ceiling"]["sequential/5"]["miss_ratio"] == (400 - 4) / 400
    assert f["vs_ceiling"]["sequential/2"]["predicted"] == pytest.approx(1.0)  # fits: no misses
    assert all(c["within"] for c in f["vs_every_request"].values())
    assert f["mean_order"] is True  # sequential > uniform > zipf
    assert broken(r) == []


def test_loads_that_differ_from_the_reference_are_a_broken_promise():
    p = _params()
    seq = _seq(p, "uniform", 5, 100)
    cell = _run("uniform", 5, seq, p.cache)
    cell["loads"] += 1
    cell["loads_equal_reference"] = False
    assert broken({"lru": {"uniform/5": cell}}) == [
        f"lru uniform/5: {cell['loads']} loads, the reference LRU misses {cell['reference_misses']}"]
    assert figures(p, {"lru": {"uniform/5": cell}})["miss_ratio_equal"] == {"uniform/5": False}


def test_wrong_answers_are_a_broken_promise_and_raw_arrays_stay_out_of_the_result():
    p = _params()
    seq = _seq(p, "zipf", 5, 50)
    cell = _run("zipf", 5, seq, None)
    cell["wrong"] = 2
    assert broken({"no-limit": {"zipf/5": cell}})[0].startswith("no-limit zipf/5: 2 wrong answers")
    assert not any(k.startswith("_") for k in public({"no-limit": {"zipf/5": cell}})["no-limit"]["zipf/5"])


def test_params_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="cache 8 must be"):
        Params(copies=8, cache=8)
    with pytest.raises(ValueError, match="must lie in 1..copies"):
        Params(copies=4, cache=2, accessed=(5,), fig2_models=3, concurrent_models=4)
    with pytest.raises(ValueError, match="unknown variants"):
        Params(variants=("lfu",))


def test_drive_interleaves_the_servers_and_checks_every_answer():
    from splitserve.bench.multimodel.scenario import Copies, drive
    from splitserve.client.common import InferResult
    from splitserve.errors import ModelNotReady

    calls: list[tuple[str, str]] = []

    class Fake:
        def __init__(self, label: str, answer: dict[str, float]) -> None:
            self.label, self.answer = label, answer

        def infer_result(self, name: str, x: object) -> InferResult:
            calls.append((self.label, name))
            if name not in self.answer:
                raise ModelNotReady(f"no {name}")
            return InferResult({"y": np.array([self.answer[name]], np.float32)})

    copies = Copies("lenet", ["a", "b"], [1, 2], None, {"a": [np.array([1.0])], "b": [np.array([2.0])]}, 0)
    right, swapped = Fake("right", {"a": 1.0, "b": 2.0}), Fake("swapped", {"a": 2.0})
    evicted: list[str] = []
    timed = drive([right, swapped], copies, [0, 1, 0], after=evicted.append)
    assert calls == [("right", "a"), ("swapped", "a"), ("right", "b"), ("swapped", "b"), ("right", "a"),
                     ("swapped", "a")]
    assert evicted == ["a", "a", "b", "b", "a", "a"]
    assert (timed[0].wrong, len(timed[0].errors)) == (0, 0)
    assert (timed[1].wrong, len(timed[1].errors)) == (2, 1) and "no b" in timed[1].errors[0]
    assert all(len(t.latency_ms) == 3 for t in timed)


def test_a_wrong_answer_to_the_b4_background_client_is_a_broken_promise():
    quiet = {"wrong": 0, "errors": 0, "background": {"requests": 9, "wrong": 0, "errors": 0}}
    loading = {"wrong": 0, "errors": 0, "background": {"requests": 3, "wrong": 1, "errors": 0}}
    assert broken({"overlap": {"quiet": quiet, "loading": loading}}) == [
        "B4 loading, the other client: 1 wrong answers, 0 errors"]


def test_the_gpu_arm_compares_pinned_reloads_with_disk_and_holds_the_device_budget():
    """lru (pinned tier) and lru-disk get the same sequences; a miss costs 10 ms more than a hit
    from pinned memory and 45 ms from disk: 4.5x, past the 3x goal. Device bytes over the
    budget are a broken promise."""
    from splitserve.bench.multimodel import device

    p = _params()
    seqs = {(pat, m): _seq(p, pat, m, p.requests) for pat in p.patterns for m in (2, 5)}

    def arm(swap_ms: float) -> dict:
        out = {}
        for (pat, m), seq in seqs.items():
            ref = lru_misses(seq, p.cache, list(range(min(m, p.cache))))
            lat = np.where(ref, HIT_MS + swap_ms, HIT_MS)
            out[f"{pat}/{m}"] = summarise(pat, m, seq, Timed(seq, lat, float(lat.sum()) / 1e3), ref, int(sum(ref)),
                                          int(sum(ref)))
        return out

    mem = {"device_budget_bytes": 1000, "device_reserved_bytes": {"GPU-a": 900}, "pinned_tier_budget_bytes": 4 << 30,
           "pinned_tier_bytes": 2 << 20, "models": {}}
    r = {"lru": arm(10.0), "lru-disk": arm(45.0), "memory": mem, "copies": []}
    f = figures(Params(**{**_params().__dict__, "device": "cuda"}), r)
    assert f["reload"]["pinned_ms"] == pytest.approx(10.0) and f["reload"]["disk_ms"] == pytest.approx(45.0)
    assert f["reload"]["ratio"] == pytest.approx(4.5) and f["reload"]["ok"] is True
    assert f["device_memory"]["within"] is True and broken(r) == []
    lines, text = device.markdown("cuda", f)
    assert lines == ["reload: pinned tier 4.50x faster than disk (goal >= 3x)"]
    assert any("B6 (Fig. 5)" in t for t in text) and any("within: yes" in t for t in text)
    over = {**r, "memory": {**mem, "device_reserved_bytes": {"GPU-a": 1001}}}
    assert broken(over) == ["device bytes {'GPU-a': 1001} exceed the device budget 1000"]


def test_the_gpu_arm_says_plainly_it_is_unavailable_without_cuda(tmp_path):
    """On a machine without CUDA, device=cuda fails at once with that reason, and no numbers."""
    import io
    import json

    from rich.console import Console

    from splitserve.bench.multimodel import device
    from splitserve.bench.runner import EXIT_FAILED, run_scenario

    device.require_cuda("cpu", lambda: False)  # the CPU arm never needs CUDA
    with pytest.raises(ValueError, match="unavailable without CUDA"):
        device.require_cuda("cuda", lambda: False)
    if device.cuda_available():
        return  # a GPU machine runs the arm for real (scripts/gpu-check, bench multimodel -p device=cuda)
    summary = run_scenario("multimodel", quick=True, out=tmp_path, models=("lenet",),
                           overrides={"device": "cuda"}, console=Console(file=io.StringIO()))
    assert summary.exit_code == EXIT_FAILED and "unavailable without CUDA" in summary.lines[0]
    doc = json.loads((summary.path / "result.json").read_text())
    assert doc["status"] == "failed" and "lru" not in doc


def test_reloads_by_a_new_interpreter_and_by_a_fork_are_each_set_against_the_other_and_a_spare():
    p = _params()
    seq = _seq(p, "sequential", 5, 40)
    spare = _run("sequential", 5, seq, p.cache)  # its misses cost HIT_MS + SWAP_MS

    def per_load(miss_ms: float) -> dict:
        lat = np.full(6, miss_ms)
        return summarise("alternate", 2, [1, 0] * 3, Timed([1, 0] * 3, lat, float(lat.sum()) / 1e3), [True] * 6, 6, 6)

    r = {"lru": {"sequential/5": spare}, "spawn-per-load": per_load(4000.0), "fork-per-load": per_load(200.0)}
    f = figures(p, r)
    assert f["reload_spawn_over_spares"]["value"] == pytest.approx(4000.0 / (HIT_MS + SWAP_MS))
    assert f["reload_fork"] == {"fork_ms": 200.0, "spawn_over_fork": pytest.approx(20.0),
                                "fork_over_spares": pytest.approx(200.0 / (HIT_MS + SWAP_MS))}
    r["fork-per-load"]["errors"] = 1
    assert broken(r) == ["fork-per-load: 0 wrong answers, 1 errors"]
