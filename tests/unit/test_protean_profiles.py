"""The profiles PROTEAN reads: the new registry kinds (footprint, colocation, fbr) round trip,
``ProteanProfiles`` answers from them with its fallbacks and never invents a number, the
per-batch memory measurement sees what a batch allocates, and ``splitserve profile``
refuses co-location options that do not go together (before anything is measured)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from splitserve.placement.measure import peak_added
from splitserve.placement.optimizer import LatencyProfile
from splitserve.placement.profiler import (
    ColocationProfile,
    ColocationRun,
    ModelProfile,
    colocation_sets,
    fit_stored_fbr,
    footprint_at,
    load_colocations,
    load_fbr,
    load_footprint,
    load_profile,
    save_colocation,
    save_profile,
)
from splitserve.protean.profiles import ProteanProfiles
from splitserve.protean.slowdown import FbrFit
from splitserve.registry import Registry

M = "test-machine"


@pytest.fixture
def registry(tmp_path: Path) -> Any:
    reg = Registry(tmp_path)
    yield reg
    reg.close()


def _latency(model: str) -> LatencyProfile:
    return LatencyProfile(model, {(1, 1): 0.010, (1, 4): 0.030, (2, 1): 0.006, (2, 4): 0.016})


def test_footprint_round_trips_with_the_latency_profile_and_interpolates(registry: Any) -> None:
    save_profile(registry, ModelProfile(_latency("a"), {(1, 1): [0.01]}, M, {1: 1000, 4: 4000}))
    assert load_profile(registry, "a", M).footprint == {1: 1000, 4: 4000}  # type: ignore[union-attr]
    assert [load_footprint(registry, "a", b, M) for b in (1, 2, 4, 8)] == [1000, 2000, 4000, 8000]
    # a profile saved without footprints (a benchmark merging thread counts) keeps the stored one
    save_profile(registry, ModelProfile(_latency("a"), {}, M))
    assert load_footprint(registry, "a", 4, M) == 4000
    assert load_footprint(registry, "never-profiled", 4, M) is None
    assert footprint_at({2: 500, 8: 800}, 1) == 500  # never assumed below what was measured


def test_colocation_runs_are_kept_under_every_member_and_a_rerun_replaces_its_set(registry: Any) -> None:
    def run(members: tuple[str, ...], s: float) -> ColocationRun:
        return ColocationRun(1, members, tuple(s for _ in members), tuple(0.01 for _ in members),
                             tuple(0.01 * s for _ in members))

    first = [run(("a@4", "b@2"), 2.0), run(("a@4", "a@4"), 1.8)]
    save_colocation(registry, ColocationProfile(1, (0,), {"a@4": 0.01, "b@2": 0.01}, first, M))
    assert load_colocations(registry, "a", M) == first
    assert load_colocations(registry, "b", M) == first[:1]
    again = run(("b@2", "a@4"), 2.5)  # the same set, measured again
    save_colocation(registry, ColocationProfile(1, (0,), {}, [again], M))
    assert load_colocations(registry, "a", M) == [first[1], again]
    assert ColocationRun.from_dict(again.to_dict()) == again
    with pytest.raises(Exception, match="differ in length"):
        ColocationRun.from_dict({"cores": 1, "members": ["a@4"], "slowdowns": [1.0, 2.0], "solo_s": [0.1]})


def test_fbrs_are_fitted_from_stored_runs_and_an_unidentified_one_is_never_stored(
        registry: Any) -> None:
    runs = [ColocationRun(1, ("a@4", "a@4"), (1.6, 1.6), (0.01, 0.01), (0.016, 0.016)),
            ColocationRun(1, ("a@4", "b@2"), (1.3, 1.3), (0.01, 0.02), (0.013, 0.026)),
            # c never slowed anything past Eq. 1's floor: nothing identifies it
            ColocationRun(1, ("c@1", "c@1"), (0.98, 1.0), (0.01, 0.01), (0.0098, 0.01)),
            ColocationRun(2, ("a@4", "a@4"), (3.0, 3.0), (0.01, 0.01), (0.03, 0.03))]  # other cores: not mixed in
    save_colocation(registry, ColocationProfile(1, (0,), {}, runs, M))
    fit = fit_stored_fbr(registry, ["a", "b", "c"], 1, M)
    assert fit.fbr["a@4"] == pytest.approx(0.8, abs=0.05) and fit.fbr["b@2"] == pytest.approx(0.5, abs=0.05)
    assert "c@1" in fit.unidentified
    assert load_fbr(registry, "a", M) == pytest.approx(fit.fbr["a@4"])
    assert load_fbr(registry, "c", M) is None
    assert load_fbr(registry, "never-colocated", M) is None


def test_protean_profiles_read_solo_fbr_and_footprint_with_their_fallbacks(
        registry: Any) -> None:
    save_profile(registry, ModelProfile(_latency("a"), {}, M, {2: 2048}))
    save_profile(registry, ModelProfile(_latency("b"), {}, M))
    registry.save_profile("b", M, "memory", {"version": 1, "weights_bytes": 10, "private_bytes": 777})
    registry.save_profile("a", M, "fbr", FbrFit({"a@4": 0.7, "a@1": 0.5}, (), {}, 2).to_dict())
    p = ProteanProfiles(registry, M)
    assert p.solo("a", 2, 4) == pytest.approx(0.016) and p.solo("a", 1, 2) == pytest.approx(0.05 / 3)
    assert p.solo("a", 3, 4) is None and p.solo("nothing", 1, 1) is None  # never measured: no number
    assert p.fbr("a") == pytest.approx(0.6) and p.fbr("b") is None
    assert p.footprint("a", 4) == 4096  # per-batch footprint, scaled past the largest measured batch
    assert p.footprint("b", 4) == 777  # no per-batch footprint: the load's measured private bytes
    assert p.footprint("nothing", 4) is None
    save_profile(registry, ModelProfile(_latency("nothing"), {}, M))
    assert p.solo("nothing", 1, 1) is None  # read once and kept: the deciders do not hit SQLite per batch
    p.forget("nothing")
    assert p.solo("nothing", 1, 1) == pytest.approx(0.010)


def test_peak_added_sees_what_a_batch_allocates() -> None:
    n = 64 * 2**20

    def batch() -> None:
        np.ones(n, np.uint8)  # written, so resident: the peak rises by about n

    added = peak_added(batch)
    if added is None:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    assert 0.9 * n <= added <= 1.5 * n


def test_default_colocation_sets_are_pairs_self_pair_and_the_full_set() -> None:
    assert colocation_sets(["m", "x", "y"]) == [("m", "x"), ("m", "y"), ("m", "m"), ("m", "x", "y")]
    assert colocation_sets(["m", "x"]) == [("m", "x"), ("m", "m")]
    assert colocation_sets(["m"]) == [("m", "m")]


@pytest.mark.parametrize(("args", "message"), [
    (["lenet", "--cores", "1"], "go with --colocate"),
    (["lenet", "--batch", "2"], "go with --colocate"),
    (["lenet", "--colocate", "lenet_nope"], "unknown model"),
    (["lenet", "--colocate", "vecadd1k", "--threads", "1"], "use --cores and --batch"),
    (["lenet", "--colocate", "vecadd1k", "--omp-wait-policy", "sometimes"], "PASSIVE or ACTIVE"),
])
def test_profile_refuses_options_that_do_not_go_together(tmp_path: Path, args: list[str], message: str) -> None:
    from splitserve.cli import app

    out = CliRunner().invoke(app, ["profile", *args, "--data-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and message in out.output, out.output


def test_slowdown_bench_holds_out_runs_whose_members_the_training_runs_identify() -> None:
    from splitserve.bench.scenarios.slowdown import rel_errors, split_sets

    train, held = split_sets(["a", "b", "c"])
    assert train == [("a", "a"), ("b", "b"), ("c", "c"), ("a", "b")]
    assert held == [("a", "c"), ("b", "c"), ("a", "b", "c")]
    errs = rel_errors([{"predicted_s": p, "measured_s": 1.0} for p in (1.1, 0.8, 1.0, None)] +
                      [{"predicted_s": 2.0, "measured_s": 1.0}])
    assert errs == {"median": pytest.approx(0.15), "p90": pytest.approx(0.76), "n": 4}


def test_slowdown_bench_keeps_the_median_of_each_members_measurements_over_rounds() -> None:
    from splitserve.bench.scenarios.slowdown import median_rounds

    def rnd(solo: float, s: tuple[float, float]) -> tuple[dict[str, float], list[ColocationRun]]:
        return {"a@1": solo}, [ColocationRun(1, ("a@1", "a@1"), s, (solo, solo), (solo * s[0], solo * s[1]))]

    solo, (run,) = median_rounds([rnd(1.0, (2.0, 2.2)), rnd(3.0, (1.0, 9.0)), rnd(2.0, (2.1, 2.0))])
    assert solo == {"a@1": 2.0}
    assert run.members == ("a@1", "a@1") and run.slowdowns == (2.0, 2.2) and run.solo_s == (2.0, 2.0)


def test_slowdown_bench_reports_predictions_errors_and_interference_from_measured_runs() -> None:
    from splitserve.bench.scenarios.slowdown import Params, _fit, _output

    def run(members: tuple[str, ...], s: float) -> ColocationRun:
        solo = {"a@2": 0.01, "b@2": 0.02, "c@2": 0.04}
        return ColocationRun(1, members, tuple(s for _ in members), tuple(solo[m] for m in members),
                             tuple(solo[m] * s for m in members))

    ps = {"omp_wait_policy": None, "batches": {"a": 2, "b": 2, "c": 2}, "load_average_before": (0.0, 0.0, 0.0),
          "load_average_after": (0.1, 0.0, 0.0),
          "cores": {1: {"solo_s": {"a@2": 0.01, "b@2": 0.02, "c@2": 0.04},
                        "train": [run(("a@2", "a@2"), 2.0), run(("b@2", "b@2"), 2.0), run(("c@2", "c@2"), 2.0),
                                  run(("a@2", "b@2"), 2.0)],
                        "held_out": [run(("a@2", "c@2"), 2.2), run(("b@2", "c@2"), 2.0),
                                     run(("a@2", "b@2", "c@2"), 3.0)]}},
          "interference": [{"model": "a", "busy": "b", "alone_s": 0.01, "beside_s": 0.011, "ratio": 1.1}]}
    _fit(ps)
    r = ps["cores"][1]
    assert r["fit"]["fbr"] == pytest.approx({"a@2": 1.0, "b@2": 1.0, "c@2": 1.0})
    assert r["error"]["n"] == 7 and r["error"]["median"] == pytest.approx(0.0, abs=1e-9)
    assert r["error"]["p90"] == pytest.approx(0.2 / 2.2, rel=0.3)  # the 2.2 pair: Eq. 1 says 2
    out = _output(Params.quick(), [ps])
    assert "median 0.0%" in out.report and "| a | b | 10.00 | 11.00 | 1.100 |" in out.report
    assert out.result["passes"][0]["cores"]["1"]["held_out"][0]["members"] == ["a@2", "c@2"]
    assert "slowdown" in out.figures
