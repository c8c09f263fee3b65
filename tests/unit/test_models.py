"""Tests of the model package: the segment contract, the zoo, digits and artifact loading."""

from __future__ import annotations

import pickle
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from splitserve.errors import InvalidInput, UnknownModel
from splitserve.models import digits
from splitserve.models.catalog import DIGITS_FILE, ZOO, ZooEntry, zoo_entry
from splitserve.models.digits import digits_dataset
from splitserve.models.loader import load_artifact
from splitserve.models.segmented import SegmentedModel, _even_partition, save_safetensors
from splitserve.models.zoo import build_zoo_model, init_zoo_model

# Checked only for output shapes: a full comparison costs seconds on a small CPU.
IMAGENET = {"resnet18_imagenet", "resnet50_imagenet"}
# Run at batch 1 to keep the suite fast.
LARGE = IMAGENET | {"vgg19", "resnet152", "densenet201", "inception_v3", "bert_tiny", "distilbert"}

# (request bytes, response bytes, max batch) per sample, as documented in the zoo.
SIZES = {
    "vecadd1k": (8192, 4096, 32),
    "matmul8k": (32768, 16384, 32),
    "lenet": (784, 40, 32),
    "lstm": (8192, 1024, 32),
    "resnet18": (12288, 40, 16),
    "resnet50": (12288, 40, 16),
    "resnet18_imagenet": (602112, 4000, 8),
    "resnet50_imagenet": (602112, 4000, 8),
    "bert_tiny": (6144, 4096, 8),
    "vgg19": (49152, 4000, 8),
    "resnet152": (49152, 4000, 8),
    "densenet201": (49152, 4000, 8),
    "inception_v3": (67500, 4000, 8),
    "distilbert": (1024, 8, 8),
    "digits": (256, 40, 32),
    "gate": (8, 8, 8),
}


def make_inputs(entry: ZooEntry, batch: int, seed: int = 0) -> tuple[Tensor, ...]:
    """Valid random inputs for ``entry`` with a leading batch dimension."""
    rng = np.random.default_rng(seed)
    out = []
    for spec in entry.inputs:
        shape = (batch, *spec.shape)
        a: np.ndarray
        if spec.datatype == "FP32":
            a = rng.standard_normal(shape).astype(np.float32)
        elif spec.datatype == "UINT8":
            a = rng.integers(0, 256, shape, dtype=np.uint8)
        elif spec.name == "input_ids":
            a = rng.integers(0, 30522, shape, dtype=np.int32)
        elif spec.name == "attention_mask":
            a = np.ones(shape, dtype=np.int32)
            a[0, shape[1] // 2:] = 0  # padding in the first sample
        else:
            a = rng.integers(0, 2, shape, dtype=spec.dtype)
        assert a.dtype == spec.dtype
        out.append(torch.from_numpy(a))
    return tuple(out)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def built(cache_dir: Path) -> Callable[[str], SegmentedModel]:
    """Zoo models built once per module (seed 0)."""
    models: dict[str, SegmentedModel] = {}

    def get(name: str) -> SegmentedModel:
        if name not in models:
            models[name] = build_zoo_model(name, cache_dir=cache_dir)
        return models[name]

    return get


# --- the zoo --------------------------------------------------------------------------


def test_zoo_lists_every_model_with_its_sizes() -> None:
    assert set(ZOO) == set(SIZES)
    for name, (request, response, max_batch) in SIZES.items():
        entry = zoo_entry(name)
        assert (entry.request_bytes, entry.response_bytes, entry.max_batch) == (request, response, max_batch), name


def test_unknown_zoo_model_lists_names() -> None:
    with pytest.raises(UnknownModel, match="lenet"):
        zoo_entry("alexnet")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_builds_deterministically(name: str, built: Callable[[str], SegmentedModel], cache_dir: Path) -> None:
    again = build_zoo_model(name, cache_dir=cache_dir).state_dict()
    first = built(name).state_dict()
    assert first.keys() == again.keys()
    for key, value in first.items():
        assert torch.equal(value, again[key]), key


def test_seed_changes_weights_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = init_zoo_model("lenet", seed=0), init_zoo_model("lenet", seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(a.state_dict()["segments.0.1.weight"], b.state_dict()["segments.0.1.weight"])


@pytest.mark.parametrize("name", sorted(ZOO))
def test_outputs_match_declared_specs(name: str, built: Callable[[str], SegmentedModel]) -> None:
    entry, model = zoo_entry(name), built(name)
    batch = 1 if name in LARGE else 2
    assert not model.training and not any(m.training for m in model.modules())
    assert 1 <= model.num_segments <= 16
    with torch.inference_mode():
        outputs = model(*make_inputs(entry, batch))
    assert len(outputs) == len(entry.outputs)
    for out, spec in zip(outputs, entry.outputs, strict=True):
        assert tuple(out.shape) == (batch, *spec.shape), spec.name
        assert out.numpy().dtype == spec.dtype, spec.name
        assert torch.isfinite(out).all(), spec.name


@pytest.mark.parametrize("name", sorted(set(ZOO) - IMAGENET))
def test_segments_are_pure_and_compose_to_forward(name: str, built: Callable[[str], SegmentedModel]) -> None:
    entry, model = zoo_entry(name), built(name)
    inputs = make_inputs(entry, 1)
    with torch.inference_mode():
        expected = model(*inputs)
        acts = inputs
        for i in range(model.num_segments):
            before = tuple(t.clone() for t in acts)
            out = model.run_segment(i, acts)
            again = model.run_segment(i, acts)
            assert all(torch.equal(a, b) for a, b in zip(acts, before, strict=True)), f"segment {i} changed its inputs"
            assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True)), f"segment {i} is not idempotent"
            acts = out
    assert len(acts) == len(expected)
    for got, want in zip(acts, expected, strict=True):
        assert torch.equal(got, want)


def test_disb_models_have_several_segments(built: Callable[[str], SegmentedModel]) -> None:
    for name in ("vgg19", "resnet152", "densenet201", "inception_v3", "distilbert"):
        assert 4 <= built(name).num_segments <= 16, name
    for name in ("resnet18", "resnet50", "resnet18_imagenet", "resnet50_imagenet"):
        assert built(name).num_segments == 6, name


# --- the segment contract -------------------------------------------------------------


def test_run_segment_normalises_to_tuples_and_checks_range() -> None:
    model = SegmentedModel([nn.Identity(), nn.Flatten()])
    x = torch.ones(2, 3, 4)
    assert model.run_segment(0, (x,))[0] is x
    assert model(x)[0].shape == (2, 12)
    with pytest.raises(IndexError):
        model.run_segment(2, (x,))
    with pytest.raises(IndexError):
        model.run_segment(-1, (x,))


def test_even_partition_balances_groups() -> None:
    assert _even_partition([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert _even_partition([5, 1, 1, 1, 1, 1], 3) == [0, 1, 3, 6]


# --- digits ---------------------------------------------------------------------------


def test_digits_dataset_split() -> None:
    x_train, y_train, x_test, y_test = digits_dataset()
    assert x_train.shape == (1347, 1, 8, 8) and x_test.shape == (450, 1, 8, 8)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.min() >= 0.0 and x_train.max() <= 1.0
    assert np.bincount(y_test).min() >= 40  # stratified: every class held out in proportion


def test_digits_trains_once_then_loads_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = digits.load_or_train_digits(tmp_path)
    assert (tmp_path / DIGITS_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [DIGITS_FILE]  # no temp files left
    _, _, x_test, y_test = digits_dataset()
    with torch.inference_mode():
        predicted = model(torch.from_numpy(x_test))[0].argmax(1).numpy()
    assert (predicted == y_test).mean() >= 0.95

    def no_training() -> SegmentedModel:
        raise AssertionError("the cached weights should have been used")

    monkeypatch.setattr(digits, "train_digits", no_training)
    start = time.perf_counter()
    cached = digits.load_or_train_digits(tmp_path)
    assert time.perf_counter() - start < 1.0
    for key, value in model.state_dict().items():
        assert torch.equal(value, cached.state_dict()[key]), key


def test_digits_replaces_a_corrupt_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / DIGITS_FILE).write_bytes(b"not safetensors")
    monkeypatch.setattr(digits, "train_digits", digits.digits_net)  # skip the real training
    digits.load_or_train_digits(tmp_path)
    load_artifact("safetensors", tmp_path / DIGITS_FILE, "digits")


# --- artifacts ------------------------------------------------------------------------


def test_safetensors_round_trip(tmp_path: Path) -> None:
    model = init_zoo_model("lenet", seed=3)
    path = tmp_path / "lenet.safetensors"
    save_safetensors(model, path)
    loaded = load_artifact("safetensors", path, "lenet")  # seed 0 weights, then overwritten
    x = make_inputs(zoo_entry("lenet"), 2)
    with torch.inference_mode():
        assert torch.equal(loaded(*x)[0], model(*x)[0])
    assert [p.name for p in tmp_path.iterdir()] == ["lenet.safetensors"]


def test_safetensors_of_another_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "lenet.safetensors"
    save_safetensors(init_zoo_model("lenet"), path)
    mismatch = r"missing keys .*segments\.0\.0\.weight.*unexpected keys .*segments\.3\.weight"
    with pytest.raises(InvalidInput, match=mismatch):
        load_artifact("safetensors", path, "digits")


def test_torchscript_artifacts_keep_their_segments(tmp_path: Path) -> None:
    model = init_zoo_model("lenet")
    x = make_inputs(zoo_entry("lenet"), 2)
    with warnings.catch_warnings():  # torch.jit is deprecated upstream
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.trace(model, x).save(str(tmp_path / "lenet.ts"))
        torch.jit.trace(model.segments[0], x).save(str(tmp_path / "stem.ts"))
    loaded = load_artifact("torchscript", tmp_path / "lenet.ts", None)
    stem = load_artifact("torchscript", tmp_path / "stem.ts", None)
    assert loaded.num_segments == model.num_segments and stem.num_segments == 1
    x3 = make_inputs(zoo_entry("lenet"), 3, seed=1)
    with torch.inference_mode():
        assert torch.equal(loaded(*x3)[0], model(*x3)[0])
        assert torch.equal(loaded.run_segment(0, x3)[0], model.run_segment(0, x3)[0])
        assert torch.equal(stem(*x3)[0], model.run_segment(0, x3)[0])


def test_export_artifact_loads_as_one_segment(tmp_path: Path) -> None:
    model = init_zoo_model("lenet")
    x = make_inputs(zoo_entry("lenet"), 2)
    batch = torch.export.Dim("batch", min=1, max=32)
    program = torch.export.export(model, x, dynamic_shapes=(({0: batch},),))
    torch.export.save(program, str(tmp_path / "lenet.pt2"))
    loaded = load_artifact("export", tmp_path / "lenet.pt2", None)
    assert loaded.num_segments == 1
    x3 = make_inputs(zoo_entry("lenet"), 3, seed=1)
    with torch.inference_mode():
        assert torch.equal(loaded(*x3)[0], model(*x3)[0])


def test_pickle_files_are_refused_without_unpickling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lenet.pt"
    torch.save(init_zoo_model("lenet").state_dict(), path)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the loader must never unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    with pytest.raises(InvalidInput, match="pickle"):
        load_artifact("pickle", path, "lenet")
    for kind in ("safetensors", "torchscript", "export"):
        with pytest.raises(InvalidInput):
            load_artifact(kind, path, "lenet")


def test_loader_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="needs a path"):
        load_artifact("safetensors", None, "lenet")
    with pytest.raises(InvalidInput, match="does not exist"):
        load_artifact("torchscript", tmp_path / "missing.ts", None)
    with pytest.raises(InvalidInput, match="architecture"):
        load_artifact("zoo", None, None)
    with pytest.raises(UnknownModel):
        load_artifact("zoo", None, "alexnet")
    assert load_artifact("zoo", None, "vecadd1k").num_segments == 1


# --- the gate (fault tests' model) ----------------------------------------------------


def test_gate_holds_a_closed_key_until_it_is_opened(tmp_path: Path) -> None:
    import threading

    from splitserve.models.gate import Gates, gate_model
    from splitserve.registry import builtin_configs

    assert "gate" not in {c.name for c in builtin_configs()}
    gates, model = Gates(tmp_path), gate_model(tmp_path)
    gates.close(7)
    done = threading.Event()
    out: list = []

    def run() -> None:
        with torch.inference_mode():
            out.append(model(torch.tensor([[3], [7]], dtype=torch.int64)))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert not done.wait(0.2)  # held while key 7 is closed
    gates.open(7)
    assert done.wait(10)
    assert out[0][0].reshape(-1).tolist() == [3, 7]


def test_skeletons_and_seeded_builds_in_threads_at_once_leave_nn_init_whole_and_seeds_exact():
    """A skeleton patches ``nn.init`` for the whole process while it builds; the node reads
    several models' sizes at once, off the loop (``_zoo_state_bytes``), so builds overlap in
    threads. Each must restore what it found, and a seeded build beside them must still draw
    its seed's weights."""
    import threading

    from splitserve.models.zoo import zoo_skeleton

    inits = {n: f for n, f in vars(nn.init).items() if n.endswith("_") and not n.startswith("_") and callable(f)}
    want = init_zoo_model("lenet", 3).state_dict()
    barrier = threading.Barrier(6)
    seeded: list[dict[str, Tensor]] = []

    def skeletons() -> None:
        barrier.wait()
        for _ in range(15):
            zoo_skeleton("lenet")

    def seeds() -> None:
        barrier.wait()
        for _ in range(5):
            seeded.append(init_zoo_model("lenet", 3).state_dict())

    threads = [threading.Thread(target=skeletons) for _ in range(4)] + [threading.Thread(target=seeds)
                                                                        for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [n for n, f in inits.items() if getattr(nn.init, n) is not f] == []
    assert len(seeded) == 10 and all(torch.equal(s[k], want[k]) for s in seeded for k in want)
