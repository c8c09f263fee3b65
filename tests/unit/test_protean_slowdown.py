"""PROTEAN's slowdown model (Eq. 1, Eq. 2, RDF) and the FBR fit, on hand-computed tables and
seeded synthetic co-locations."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from splitserve.errors import InvalidInput
from splitserve.protean.slowdown import Colocation, FbrFit, SlowdownModel, eta, fit_fbr, interference

TRUTH = {"a@8": 0.3, "b@8": 0.55, "c@8": 0.8, "d@8": 1.1}


def test_interference_floor_at_one() -> None:
    assert interference([0.2, 0.4]) == 1.0  # Σ 0.6 -> the max{·,1} floor
    assert interference([0.5, 0.6, 0.4]) == 1.5
    assert interference([]) == 1.0


def test_eta_hand_table() -> None:
    # RDF × max{own + co-runners, 1}
    assert eta(1.3, 0.2, [0.4]) == pytest.approx(1.3)  # Σ 0.6: RDF alone
    assert eta(1.3, 0.5, [0.6, 0.4]) == pytest.approx(1.3 * 1.5)
    assert eta(2.0, 1.5, []) == pytest.approx(3.0)
    assert eta(1.0, 0.0, [0.0]) == 1.0


SOLO = {("s", 7, 8): 0.10, ("s", 4, 8): 0.15, ("s", 2, 8): 0.30}


def _model(**fbr: float) -> SlowdownModel:
    return SlowdownModel(lambda m, c, b: SOLO.get((m, c, b)), fbr, whole_cores=7, unknown_fbr=0.9)


def test_slowdown_model_rdf_eta_and_prediction() -> None:
    m = _model(s=0.3, b=0.7, c=0.5)
    assert m.rdf("s", 8, 4) == pytest.approx(1.5)
    assert m.rdf("s", 8, 2) == pytest.approx(3.0)
    assert m.rdf("s", 8, 7) == 1.0
    # 4 cores with b and c: RDF 1.5 × (0.3 + 0.7 + 0.5) = 2.25; 2 cores alone: 3.0 × 1 (floor)
    assert m.eta("s", 8, 4, ["b", "c"]) == pytest.approx(2.25)
    assert m.eta("s", 8, 2, []) == pytest.approx(3.0)
    assert m.predict("s", 8, 4, ["b", "c"]) == pytest.approx(0.15 * 1.5)
    assert m.predict("s", 8, 2, ["b"]) == pytest.approx(0.30)  # Σ 1.0
    # not profiled: RDF 1, no prediction; no fitted FBR: unknown_fbr
    assert m.rdf("s", 16, 4) == 1.0
    assert m.predict("s", 16, 4, []) is None
    assert m.fbr_of("zz") == 0.9
    assert m.eta("s", 8, 4, ["zz"]) == pytest.approx(1.5 * 1.2)


def test_a_job_alone_is_predicted_at_its_solo_time_whatever_its_fbr() -> None:
    # a CPU core time-slices, so fitted FBRs above 1 happen (resnet152 1.41 on one core): Eq. 1's
    # max{FBR, 1} would have a job alone run 1.4x slower than its own solo measurement
    m = _model(s=1.4, b=0.7)
    assert m.predict("s", 8, 4, []) == pytest.approx(0.15)
    assert m.predict("s", 8, 4, ["b"]) == pytest.approx(0.15 * 2.1)


def _synthetic_runs(truth: dict[str, float], noise: float, seed: int) -> list[Colocation]:
    """Every pair (self-pairs included) and triple, each member's slowdown from Eq. 1 times
    a uniform ±noise factor drawn per member."""
    rng = random.Random(seed)
    keys = sorted(truth)
    combos = list(itertools.combinations_with_replacement(keys, 2)) + list(itertools.combinations(keys, 3))
    runs = []
    for combo in combos:
        s = interference(truth[k] for k in combo)
        runs.append(Colocation(combo, tuple(s * (1 + rng.uniform(-noise, noise)) for _ in combo)))
    return runs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fit_recovers_fbrs_from_noisy_eq1(seed: int) -> None:
    fit = fit_fbr(_synthetic_runs(TRUTH, 0.05, seed))
    assert fit.unidentified == ()
    assert set(fit.fbr) == set(TRUTH)
    for k, v in TRUTH.items():
        assert fit.fbr[k] == pytest.approx(v, abs=0.05), k
    assert fit.equations > len(TRUTH)
    assert all(0 <= r < 0.15 for r in fit.residuals.values())


def test_fit_ignores_noise_at_the_floor() -> None:
    """a+a and a+b run at slowdown 1 ± 5 %; the draws just above 1 carry no equation, so a's
    FBR is not inflated (with floor_margin=0 the same data give a ≈ 0.37)."""
    runs = _synthetic_runs(TRUTH, 0.05, 12)
    assert fit_fbr(runs).fbr["a@8"] == pytest.approx(0.3, abs=0.02)
    assert fit_fbr(runs, floor_margin=0.0).fbr["a@8"] > 0.33


def test_fit_exact_without_noise() -> None:
    fit = fit_fbr(_synthetic_runs(TRUTH, 0.0, 0))
    for k, v in TRUTH.items():
        assert fit.fbr[k] == pytest.approx(v, abs=1e-9)


def test_fit_reports_unidentified_when_every_slowdown_is_at_most_one() -> None:
    runs = [Colocation(("a", "b"), (0.98, 1.0)), Colocation(("a", "a"), (1.0, 0.99))]
    fit = fit_fbr(runs)
    assert fit.fbr == {}
    assert fit.unidentified == ("a", "b")
    assert fit.equations == 0


def test_fit_refuses_a_key_the_equations_do_not_pin() -> None:
    # b and c only ever run together: b + c is known, b and c are not. a is pinned by its
    # self-pair; d only ran at the floor.
    runs = [
        Colocation(("a", "a"), (1.4, 1.4)),
        Colocation(("b", "c"), (1.3, 1.3)),
        Colocation(("a", "d"), (1.0, 1.0)),
    ]
    fit = fit_fbr(runs)
    assert fit.fbr == {"a": pytest.approx(0.7)}
    assert fit.unidentified == ("b", "c", "d")
    # a pair with a known partner pins the other: FBR_b = s_ab − FBR_a
    fit = fit_fbr([*runs, Colocation(("a", "b"), (1.5, 1.5))])
    assert fit.fbr == {"a": pytest.approx(0.7), "b": pytest.approx(0.8), "c": pytest.approx(0.5)}
    assert fit.unidentified == ("d",)


def test_fit_round_trips_through_json() -> None:
    fit = fit_fbr(_synthetic_runs(TRUTH, 0.05, 4))
    assert FbrFit.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit


def test_colocation_rejects_mismatched_or_bad_input() -> None:
    with pytest.raises(InvalidInput, match="one measured slowdown per member"):
        Colocation(("a", "b"), (1.2,))
    with pytest.raises(InvalidInput):
        Colocation((), ())
    with pytest.raises(InvalidInput):
        Colocation(("a",), (float("nan"),))
    with pytest.raises(InvalidInput):
        fit_fbr([], floor_margin=-0.1)
