"""DISB workloads: the built-ins, their arrival rates, and refusal of malformed files."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitserve.bench.disb import scenario, workload
from splitserve.errors import InvalidInput


def _rng() -> np.random.Generator:
    return np.random.default_rng(11)


@pytest.mark.parametrize("name", workload.BUILTIN)
def test_builtins_parse_and_round_trip(name: str) -> None:
    w = workload.builtin(name, duration=2.0)
    assert w.name == name and w.time == 2.0
    assert workload.parse_workload(json.loads(json.dumps(w.to_dict()))) == w
    assert {t.client.model_name for t in w.tasks} <= set(workload.MODELS)
    rt, closed = workload.workload_arrivals(w, _rng())
    assert all(a.cls == "rt" for a in rt)
    assert [a.t for a in rt] == sorted(a.t for a in rt)
    assert all(0 <= a.t < 2.0 for a in rt)
    assert closed and all(t.load.type == "continuous" for t in closed)


def test_a_is_periodic_vgg19_at_100_per_second_with_one_be_client() -> None:
    rt, closed = workload.workload_arrivals(workload.builtin("A", duration=2.0), _rng())
    assert len(rt) == 200
    assert {(a.model, a.tag) for a in rt} == {("vgg19", "vgg19_rt")}
    assert np.allclose(np.diff([a.t for a in rt]), 0.01)
    assert [(t.client.model_name, t.cls) for t in closed] == [("resnet152", "be")]


def test_b_has_a_real_time_continuous_client() -> None:
    rt, closed = workload.workload_arrivals(workload.builtin("B"), _rng())
    assert rt == []
    assert [(t.client.model_name, t.cls) for t in closed] == [("vgg19", "rt"), ("resnet152", "be")]


def test_c_has_five_be_clients() -> None:
    rt, closed = workload.workload_arrivals(workload.builtin("C", duration=2.0), _rng())
    assert len(rt) == 200
    assert sorted(t.client.model_name for t in closed) == sorted(workload.MODELS)
    assert all(t.cls == "be" for t in closed)


def test_d_staggers_five_periodic_clients() -> None:
    rt, closed = workload.workload_arrivals(workload.builtin("D", duration=2.0), _rng())
    assert Counter(a.model for a in rt) == {m: 40 for m in workload.MODELS}
    firsts = sorted({a.model: a.t for a in reversed(rt)}.values())
    assert np.allclose(firsts, [0.0, 0.01, 0.02, 0.03, 0.04])  # spread over the 50 ms period
    assert len(closed) == 5


def test_e_is_poisson_at_20_per_second_per_model() -> None:
    rt, _ = workload.workload_arrivals(workload.builtin("E", duration=50.0), _rng())
    counts = Counter(a.model for a in rt)
    assert set(counts) == set(workload.MODELS)
    for model in workload.MODELS:
        assert counts[model] == pytest.approx(1000, abs=130)  # ~4 sigma
        gaps = np.diff([a.t for a in rt if a.model == model])
        assert gaps.std() > 0.5 * gaps.mean()  # not periodic


def test_real_is_about_43_per_second() -> None:
    w = workload.builtin("REAL", duration=20.0)
    rt, closed = workload.workload_arrivals(w, _rng())
    assert len(rt) / 20.0 == pytest.approx(43.0, rel=0.1)
    assert set(Counter(a.model for a in rt)) == set(workload.MODELS)
    assert len(closed) == 5
    again, _ = workload.workload_arrivals(workload.builtin("REAL", duration=20.0), np.random.default_rng(99))
    assert again == rt  # a fixed trace: the rng does not change it


def test_rate_scale_lowers_the_real_time_rates() -> None:
    rt, _ = workload.workload_arrivals(workload.builtin("A", duration=2.0, rate_scale=0.1), _rng())
    assert len(rt) == 20
    real, _ = workload.workload_arrivals(workload.builtin("REAL", duration=20.0, rate_scale=0.5), _rng())
    assert len(real) / 20.0 == pytest.approx(21.5, rel=0.15)
    with pytest.raises(InvalidInput, match="rate_scale"):
        workload.builtin("A", rate_scale=0)
    with pytest.raises(InvalidInput, match="unknown DISB workload 'F'"):
        workload.builtin("F")


def test_disb_file_form_loads_with_its_long_model_names(tmp_path: Path) -> None:
    doc = {
        "time": 2,
        "tasks": [
            {"id": "rn", "load": {"type": "trace", "trace": [500, 0, 1500, 2500]},
             "client": {"name": "rn", "model_name": "resnet152-imagenet", "batch_size": 1,
                        "tfs_grpc_addr": "localhost:8500", "triton_grpc_addr": "localhost:8001"}},
            {"id": 7, "load": {"type": "continuous"},
             "client": {"model_name": "inceptionv3-imagenet", "batch_size": 4}},
        ],
    }
    f = tmp_path / "w.json"
    f.write_text(json.dumps(doc))
    w = workload.load_workload(f)
    assert w.tasks[0].load.trace == (0.0, 500.0, 1500.0, 2500.0)
    assert w.tasks[1].id == "7" and w.tasks[1].client == workload.ClientSpec("inception_v3", 4)
    rt, closed = workload.workload_arrivals(w, _rng())
    assert [a.t for a in rt] == [0.0, 0.5, 1.5]  # trace in ms; 2500 ms is past the end
    assert all(a.model == "resnet152" and a.cls == "rt" for a in rt)
    assert closed[0].cls == "be"


def _good() -> dict[str, Any]:
    return {
        "time": 10,
        "tasks": [
            {"id": "a", "load": {"type": "periodic", "priority": 0, "frequency": 10},
             "client": {"model_name": "vgg19", "batch_size": 1}},
            {"id": "b", "load": {"type": "continuous"}, "client": {"model_name": "resnet152"}},
            {"id": "c", "load": {"type": "poisson", "frequency": 5}, "client": {"model_name": "distilbert"}},
        ],
    }


def _broken(path: list[Any], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(_good())
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["tasks"], _DELETE, "tasks: missing"),
        (["tasks"], [], "tasks: must be a non-empty list"),
        (["time"], _DELETE, "time: missing"),
        (["time"], -1, "time: must be a positive number"),
        (["time"], True, "time: must be a positive number"),
        (["extra"], 1, "extra: unknown field"),
        (["tasks", 2, "load", "frequency"], -5, r"tasks\[2\]\.load\.frequency: must be a positive number"),
        (["tasks", 2, "load", "frequency"], _DELETE, r"tasks\[2\]\.load\.frequency: missing"),
        (["tasks", 0, "load", "type"], "bursty", r"tasks\[0\]\.load\.type: unknown load type 'bursty'"),
        (["tasks", 0, "load", "type"], _DELETE, r"tasks\[0\]\.load\.type: missing"),
        (["tasks", 0, "load", "priority"], "high", r"tasks\[0\]\.load\.priority: must be an integer"),
        (["tasks", 0, "load", "priority"], 0.5, r"tasks\[0\]\.load\.priority: must be an integer"),
        (["tasks", 0, "client", "batch_size"], 0, r"tasks\[0\]\.client\.batch_size: must be >= 1"),
        (["tasks", 0, "client", "batch_size"], "2", r"tasks\[0\]\.client\.batch_size: must be an integer"),
        (["tasks", 0, "client", "model_name"], "", r"tasks\[0\]\.client\.model_name: must be a non-empty"),
        (["tasks", 1, "client", "model_name"], _DELETE, r"tasks\[1\]\.client\.model_name: missing"),
        (["tasks", 1, "client", "gpu"], 0, r"tasks\[1\]\.client\.gpu: unknown field"),
        (["tasks", 1, "load", "frequency"], 3, r"tasks\[1\]\.load\.frequency: not used by a continuous load"),
        (["tasks", 1, "load", "type"], "trace", r"tasks\[1\]\.load\.trace: missing"),
        (["tasks", 1, "client"], _DELETE, r"tasks\[1\]\.client: missing"),
        (["tasks", 1, "id"], "a", r"tasks\[1\]\.id: duplicate task id 'a'"),
        (["tasks", 1, "id"], None, r"tasks\[1\]\.id: must be a non-empty string or an integer"),
        (["tasks", 1], "task", r"tasks\[1\]: must be an object"),
    ],
)
def test_bad_workloads_are_refused_naming_the_field(path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        workload.parse_workload(_broken(path, value))


def test_bad_trace_entries_are_refused() -> None:
    doc = _good()
    doc["tasks"][0]["load"] = {"type": "trace", "trace": [0, -3]}
    with pytest.raises(InvalidInput, match=r"tasks\[0\]\.load\.trace\[1\]: must be a number of ms >= 0"):
        workload.parse_workload(doc)
    doc["tasks"][0]["load"] = {"type": "trace", "trace": "0,1"}
    with pytest.raises(InvalidInput, match=r"tasks\[0\]\.load\.trace: must be a non-empty list"):
        workload.parse_workload(doc)


def test_files_errors_name_the_file(tmp_path: Path) -> None:
    f = tmp_path / "w.json"
    f.write_text("{\"time\": 1,")
    with pytest.raises(InvalidInput, match=r"w\.json: not valid JSON: line 1"):
        workload.load_workload(f)
    f.write_text(json.dumps(_broken(["time"], 0)))
    with pytest.raises(InvalidInput, match=r"w\.json: time: must be a positive number"):
        workload.load_workload(f)
    with pytest.raises(InvalidInput, match="cannot read"):
        workload.load_workload(tmp_path / "missing.json")
    with pytest.raises(InvalidInput, match="workload: must be an object"):
        workload.parse_workload([1, 2])


def test_real_scaled_far_down_leaves_out_silent_chains() -> None:
    w = workload.builtin("REAL", duration=1.0, rate_scale=0.2)  # chains below 1 frame/s never fire
    models = {t.client.model_name for t in w.tasks if t.cls == "rt"}
    assert models == {"resnet152", "inception_v3"}


def test_best_effort_models_are_those_no_real_time_task_calls() -> None:
    # C: vgg19 takes both classes, so it stays rt; D's models all take rt work
    assert scenario.best_effort_models([workload.WorkloadSpec("C", builtin="C")]) == {
        "resnet152", "densenet201", "inception_v3", "distilbert"}
    assert scenario.best_effort_models([workload.WorkloadSpec("D", builtin="D")]) == set()
    assert scenario.both_class_models([workload.WorkloadSpec("C", builtin="C")]) == {"vgg19"}
    assert scenario.both_class_models([workload.WorkloadSpec("D", builtin="D")]) == {
        "resnet152", "densenet201", "inception_v3", "distilbert", "vgg19"}
