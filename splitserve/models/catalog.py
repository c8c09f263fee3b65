"""The built-in model zoo's catalogue: each architecture's name, specs and how to build it.

Sizes follow SplitRPC's Table 1 (request and response bytes per sample) and the DISB
benchmark models; the DISB models are narrowed, as each description says, so this CPU
serves one request in milliseconds while keeping the original depth and layer pattern.

Nothing here imports torch: the front end reads the catalogue (a model's inputs and
outputs, where its weights file lies) and never builds a model, so a server starts
without paying torch's import (seconds on a loaded machine). A ``Builder`` names the
function that builds an architecture and imports its module only when called, in a
worker; ``models.zoo`` builds and seeds them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve.errors import UnknownModel
from splitserve.types import TensorSpec

if TYPE_CHECKING:
    from splitserve.models.segmented import SegmentedModel

# Under the cache directory: the seeded zoo models' weights, one safetensors file per
# architecture and seed, written once so that every model's weights are a file to map.
WEIGHTS_DIR = "weights"
# Under the cache directory: the trained digits model's weights.
DIGITS_FILE = "digits.safetensors"


@dataclass(frozen=True)
class Builder:
    """``splitserve.models.<module>.<function>(*args, *more, **kwargs)``, imported on call."""

    module: str
    function: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __call__(self, *more: Any) -> SegmentedModel:
        """Build: import the module (and torch with it) and call the function."""
        fn = getattr(importlib.import_module(f"splitserve.models.{self.module}"), self.function)
        return fn(*self.args, *more, **dict(self.kwargs))


def _builder(module: str, function: str, *args: Any, **kwargs: Any) -> Builder:
    return Builder(module, function, args, tuple(kwargs.items()))


@dataclass(frozen=True)
class ZooEntry:
    """One built-in model: its specs (without the batch dimension) and how to build it.

    ``build`` constructs the architecture with freshly initialised weights drawn from the
    global RNG; call ``zoo.build_zoo_model`` instead for seeded weights. ``pretrained``,
    when set, builds the model from what is kept under the cache directory it is given
    (trained weights; the gate's release files); ``cached_weights`` names the safetensors
    file there that holds its weights, if it has any. ``builtin`` entries are registered
    by every server; the others only where a repository names them.
    """

    name: str
    description: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int
    build: Builder
    pretrained: Builder | None = None
    builtin: bool = True
    cached_weights: str | None = None

    @property
    def request_bytes(self) -> int:
        """Input bytes of one sample."""
        return sum(s.nbytes for s in self.inputs)

    @property
    def response_bytes(self) -> int:
        """Output bytes of one sample."""
        return sum(s.nbytes for s in self.outputs)


def _spec(name: str, datatype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, datatype, tuple(shape))


def _image_model(name: str, description: str, image: int, classes: int, max_batch: int, build: Builder) -> ZooEntry:
    """An FP32 ``[3, image, image]`` -> ``logits [classes]`` entry."""
    return ZooEntry(name, description, (_spec("input", "FP32", 3, image, image),),
                    (_spec("logits", "FP32", classes),), max_batch, build)


_ENTRIES = (
    ZooEntry("vecadd1k", "Vector addition of two 1024-element FP32 vectors (SplitRPC microbenchmark).",
             (_spec("a", "FP32", 1024), _spec("b", "FP32", 1024)), (_spec("sum", "FP32", 1024),), 32,
             _builder("zoo_micro", "vecadd")),
    ZooEntry("matmul8k", "Product of two 64x64 FP32 matrices (4096 elements each; SplitRPC microbenchmark).",
             (_spec("a", "FP32", 64, 64), _spec("b", "FP32", 64, 64)), (_spec("product", "FP32", 64, 64),), 32,
             _builder("zoo_micro", "matmul")),
    ZooEntry("lenet", "LeNet-5 on raw UINT8 28x28 images (scaled to [0, 1] inside), 4 segments.",
             (_spec("image", "UINT8", 1, 28, 28),), (_spec("logits", "FP32", 10),), 32,
             _builder("zoo_vision", "lenet")),
    ZooEntry("lstm", "2-layer LSTM (hidden 128) over 64 steps of 32 features, then a 256-wide linear layer; "
             "one segment per layer.",
             (_spec("sequence", "FP32", 64, 32),), (_spec("features", "FP32", 256),), 32,
             _builder("zoo_text", "lstm", features=32, hidden=128, layers=2, outputs=256)),
    _image_model("resnet18", "ResNet-18 for CIFAR (3x3 stem, no max pool); stem, 4 stages, head.",
                 32, 10, 16, _builder("zoo_vision", "resnet", (2, 2, 2, 2), False, 10, False)),
    _image_model("resnet50", "ResNet-50 for CIFAR (3x3 stem, no max pool); stem, 4 stages, head.",
                 32, 10, 16, _builder("zoo_vision", "resnet", (3, 4, 6, 3), True, 10, False)),
    _image_model("resnet18_imagenet", "Standard ResNet-18 (ImageNet); stem, 4 stages, head.",
                 224, 1000, 8, _builder("zoo_vision", "resnet", (2, 2, 2, 2), False, 1000, True)),
    _image_model("resnet50_imagenet", "Standard ResNet-50 v1.5 (ImageNet); stem, 4 stages, head.",
                 224, 1000, 8, _builder("zoo_vision", "resnet", (3, 4, 6, 3), True, 1000, True)),
    ZooEntry("bert_tiny", "BERT encoder for span QA: sequence 512, hidden 128, 2 layers, 2 heads; "
             "segments: embeddings, each layer, head.",
             tuple(_spec(n, "INT32", 512) for n in ("input_ids", "attention_mask", "token_type_ids")),
             (_spec("start_logits", "FP32", 512), _spec("end_logits", "FP32", 512)), 8,
             _builder("zoo_text", "bert_qa", seq_len=512, hidden=128, layers=2, heads=2)),
    _image_model("vgg19", "DISB VGG-19, scaled to ~10 ms on one CPU core: the 16-conv VGG-19 pattern at "
                 "half width (32..256 channels), 64x64 input, 1024-wide classifier; 12 even segments.",
                 64, 1000, 8, _builder("zoo_vision", "vgg19", 0.5, 64, 1024, 1000, 12)),
    _image_model("resnet152", "DISB ResNet-152, scaled to ~10 ms on one CPU core: true 3-8-36-3 bottleneck "
                 "depth at 3/8 width (base 24 channels, 64 in the original), 64x64 input; 16 even segments.",
                 64, 1000, 8, _builder("zoo_vision", "resnet_disb", (3, 8, 36, 3), 24, 64, 1000, 16)),
    _image_model("densenet201", "DISB DenseNet-201, scaled to ~10 ms on one CPU core: 6-12-48-32 dense "
                 "blocks with growth rate 16 (32 in the original), 64x64 input; 16 even segments.",
                 64, 1000, 8, _builder("zoo_vision", "densenet", (6, 12, 48, 32), 16, 64, 1000, 16)),
    _image_model("inception_v3", "DISB Inception v3, scaled to ~10 ms on one CPU core: full-width stem and "
                 "mixed blocks A, A, B, C, C, D, E (7 of v3's 11), 75x75 input (299 in the original); "
                 "6 even segments.",
                 75, 1000, 8, _builder("zoo_vision", "inception_v3", 1.0, 75, 1000, 6)),
    ZooEntry("distilbert", "DISB DistilBERT classifier, scaled to ~5 ms on one CPU core: 6 layers, hidden "
             "128 (768 in the original), 2 heads, sequence 128; 6 even segments.",
             (_spec("input_ids", "INT32", 128), _spec("attention_mask", "INT32", 128)),
             (_spec("logits", "FP32", 2),), 8,
             _builder("zoo_text", "distilbert_classifier", seq_len=128, hidden=128, layers=6, heads=2,
                      classes=2, segments=6)),
    ZooEntry("digits", "Small CNN trained on scikit-learn's 8x8 digits (inputs scaled 0..16 -> 0..1), "
             "3 segments; about 98% test accuracy.",
             (_spec("image", "FP32", 1, 8, 8),), (_spec("logits", "FP32", 10),), 32,
             _builder("digits", "digits_net"), pretrained=_builder("digits", "load_or_train_digits"),
             cached_weights=DIGITS_FILE),
    ZooEntry("gate", "For fault tests: holds each sample while the file <cache dir>/gates/<key> exists, "
             "then returns its key; 2 segments. Not a built-in model: register it through a repository.",
             (_spec("key", "INT64", 1),), (_spec("key", "INT64", 1),), 8, _builder("gate", "gate_model"),
             pretrained=_builder("gate", "gate_model"), builtin=False),
)

ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def zoo_entry(name: str) -> ZooEntry:
    """The zoo entry called ``name``; raises UnknownModel listing the known names."""
    try:
        return ZOO[name]
    except KeyError:
        raise UnknownModel(f"no zoo model {name!r}; known models: {', '.join(ZOO)}") from None


def zoo_weights_path(name: str, seed: int, cache_dir: Path) -> Path | None:
    """The safetensors file that holds the zoo model ``name``'s weights under ``cache_dir``
    (it may not be written yet): ``weights/<name>-seed<seed>.safetensors`` for seeded
    models, the trained cache for trained ones; None for a model without weights in a
    file (the gate)."""
    entry = zoo_entry(name)
    if entry.pretrained is not None:
        return Path(cache_dir) / entry.cached_weights if entry.cached_weights else None
    return Path(cache_dir) / WEIGHTS_DIR / f"{name}-seed{seed}.safetensors"
