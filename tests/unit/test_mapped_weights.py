"""Every zoo-architecture model's weights are a safetensors file that workers map: zoo
models' seeded weights are written once under the cache directory (checked, rewritten
when they do not match), the file's header gives their size, and the mapped model
computes exactly what the seeded build computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from splitserve.memory.weights import header_bytes, weights_file
from splitserve.modelconfig import ModelConfig
from splitserve.models import digits
from splitserve.models.catalog import DIGITS_FILE, ZOO, zoo_entry
from splitserve.models.loader import load_artifact
from splitserve.models.segmented import save_safetensors
from splitserve.models.zoo import build_zoo_model, init_zoo_model, load_zoo_model
from tests.unit.test_models import make_inputs

# One of each kind of layer whose tensors matter on load: convolutions with BatchNorm's
# running statistics (buffers), an LSTM, embeddings with LayerNorm, a plain MLP.
KINDS = ["lenet", "lstm", "resnet18", "bert_tiny", "vgg19"]


def zoo_config(name: str, seed: int = 0) -> ModelConfig:
    return ModelConfig.from_dict({"name": name, "artifact": {"kind": "zoo", "arch": name, "seed": seed}})


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in model.state_dict().values())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_header_bytes_of_every_zoo_models_weights_file_are_its_state_dict_bytes(
        name: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digits, "train_digits", digits.digits_net)  # its weights, not its accuracy, matter here
    model = load_artifact("zoo", None, name, 0, cache)  # writes the file on first use
    path = weights_file(zoo_config(name), None, cache)
    if path is None:  # the gate: no weights at all
        assert name == "gate" and state_bytes(model) == 0
        return
    assert header_bytes(path) == state_bytes(model)


@pytest.mark.parametrize("name", KINDS)
def test_a_mapped_zoo_model_computes_exactly_what_its_seeded_build_computes(name: str, cache: Path) -> None:
    mapped = load_zoo_model(name, 0, cache)
    built = build_zoo_model(name, 0)
    assert mapped.num_segments == built.num_segments and not mapped.training
    for (k, a), (_, b) in zip(mapped.state_dict().items(), built.state_dict().items()):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), k
    x = make_inputs(zoo_entry(name), 2)
    with torch.inference_mode():
        for a, b in zip(mapped(*x), built(*x)):
            assert torch.equal(a, b)


def mapped_files(model: torch.nn.Module) -> set[str]:
    """The files whose mappings hold the model's tensors (from /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        ranges.append((lo, hi, parts[5] if len(parts) == 6 else ""))
    found = set()
    for t in model.state_dict().values():
        p = t.untyped_storage().data_ptr()
        found.update(name for lo, hi, name in ranges if lo <= p < hi)
    return found


def test_the_weights_are_views_of_the_file_not_copies(cache: Path) -> None:
    model = load_zoo_model("resnet18", 0, cache)
    assert mapped_files(model) == {str(weights_file(zoo_config("resnet18"), None, cache))}


@pytest.mark.parametrize("bad", ["another seed", "other code", "a truncated file", "other tensors"])
def test_a_weights_file_that_does_not_hold_the_seeded_weights_is_rewritten(bad: str, tmp_path: Path) -> None:
    path = weights_file(zoo_config("lenet", seed=2), None, tmp_path)
    assert path is not None and path.name == "lenet-seed2.safetensors"
    path.parent.mkdir(parents=True)
    if bad == "another seed":  # the right tensors, the wrong values: only the metadata tells
        save_safetensors(init_zoo_model("lenet", 5), path, metadata={"arch": "lenet", "seed": "5"})
    elif bad == "other code":  # written by another version of the zoo (or of torch): its values may differ
        save_safetensors(init_zoo_model("lenet", 5), path, metadata={"arch": "lenet", "seed": "2", "zoo": "0" * 16})
    elif bad == "a truncated file":  # right in every way but its length: mapping it would fault past its end
        load_zoo_model("lenet", 2, tmp_path)
        path.write_bytes(path.read_bytes()[:-100])
    else:  # claims to be lenet seed 2, holds something else
        save_file({"w": torch.zeros(3)}, str(path), metadata={"arch": "lenet", "seed": "2"})
    x = make_inputs(zoo_entry("lenet"), 2)
    with torch.inference_mode():
        assert torch.equal(load_zoo_model("lenet", 2, tmp_path)(*x)[0], build_zoo_model("lenet", 2)(*x)[0])
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # rewritten in place, no temp files left


def test_a_safetensors_artifact_in_another_dtype_is_cast_to_the_architectures(tmp_path: Path) -> None:
    model = init_zoo_model("lenet", seed=3)
    path = tmp_path / "lenet64.safetensors"
    save_file({k: v.double() for k, v in model.state_dict().items()}, str(path))
    loaded = load_artifact("safetensors", path, "lenet")
    assert {t.dtype for t in loaded.state_dict().values()} == {t.dtype for t in model.state_dict().values()}
    x = make_inputs(zoo_entry("lenet"), 2)
    with torch.inference_mode():
        assert torch.equal(loaded(*x)[0], model(*x)[0])


def test_which_file_holds_a_models_weights(tmp_path: Path) -> None:
    cache, model_dir = tmp_path / "cache", tmp_path / "m"
    assert weights_file(zoo_config("resnet18", seed=7), None, cache) == cache / "weights" / "resnet18-seed7.safetensors"
    assert weights_file(zoo_config("digits"), None, cache) == cache / DIGITS_FILE
    assert weights_file(zoo_config("gate"), None, cache) is None
    own = ModelConfig.from_dict({"name": "m", "artifact": {"kind": "safetensors", "arch": "lenet",
                                                           "file": "model.safetensors"}})
    assert weights_file(own, model_dir, cache) == model_dir / "model.safetensors"
    script = ModelConfig.from_dict({"name": "m", "artifact": {"kind": "torchscript", "file": "m.pt"},
                                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
                                    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]})
    assert weights_file(script, model_dir, cache) is None  # its size is known from its LOADED only
