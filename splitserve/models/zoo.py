"""The built-in model zoo: named architectures with their input and output specs.

Sizes follow SplitRPC's Table 1 (request and response bytes per sample) and the DISB
benchmark models; the DISB models are narrowed, as each description says, so this CPU
serves one request in milliseconds while keeping the original depth and layer pattern.
Weights are random but deterministic (``build_zoo_model``), except ``digits``, which is
trained once and cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from splitserve.config import env_cache_dir
from splitserve.errors import UnknownModel
from splitserve.models import segmented, zoo_text, zoo_vision
from splitserve.models.digits import CACHE_FILE as DIGITS_FILE
from splitserve.models.digits import digits_net, load_or_train_digits
from splitserve.models.gate import gate_model
from splitserve.models.segmented import (SegmentedModel, load_safetensors, safetensors_metadata, save_safetensors,
                                         state_matches)
from splitserve.types import TensorSpec


@dataclass(frozen=True)
class ZooEntry:
    """One built-in model: its specs (without the batch dimension) and how to build it.

    ``build`` constructs the architecture with freshly initialised weights drawn from the
    global RNG; call ``build_zoo_model`` instead for seeded weights. ``pretrained``, when
    set, builds the model from what is kept under the given cache directory (trained
    weights; the gate's release files); ``cached_weights`` names the safetensors file
    there that holds its weights, if it has any. ``builtin`` entries are registered by
    every server; the others only where a repository names them.
    """

    name: str
    description: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int
    build: Callable[[], SegmentedModel]
    pretrained: Callable[[Path], SegmentedModel] | None = None
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


class VecAdd(nn.Module):
    """Elementwise ``a + b``."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """Return ``a + b``."""
        return a + b


class MatMul(nn.Module):
    """Batched matrix product ``a @ b``."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """Return ``a @ b``."""
        return a @ b


def _spec(name: str, datatype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, datatype, tuple(shape))


def _image_model(name: str, description: str, image: int, classes: int, max_batch: int,
                 build: Callable[[int, int], SegmentedModel]) -> ZooEntry:
    """An FP32 ``[3, image, image]`` -> ``logits [classes]`` entry; ``build(image, classes)`` makes it."""
    return ZooEntry(name, description, (_spec("input", "FP32", 3, image, image),),
                    (_spec("logits", "FP32", classes),), max_batch, functools.partial(build, image, classes))


_ENTRIES = (
    ZooEntry("vecadd1k", "Vector addition of two 1024-element FP32 vectors (SplitRPC microbenchmark).",
             (_spec("a", "FP32", 1024), _spec("b", "FP32", 1024)), (_spec("sum", "FP32", 1024),), 32,
             lambda: SegmentedModel([VecAdd()])),
    ZooEntry("matmul8k", "Product of two 64x64 FP32 matrices (4096 elements each; SplitRPC microbenchmark).",
             (_spec("a", "FP32", 64, 64), _spec("b", "FP32", 64, 64)), (_spec("product", "FP32", 64, 64),), 32,
             lambda: SegmentedModel([MatMul()])),
    ZooEntry("lenet", "LeNet-5 on raw UINT8 28x28 images (scaled to [0, 1] inside), 4 segments.",
             (_spec("image", "UINT8", 1, 28, 28),), (_spec("logits", "FP32", 10),), 32, zoo_vision.lenet),
    ZooEntry("lstm", "2-layer LSTM (hidden 128) over 64 steps of 32 features, then a 256-wide linear layer; "
             "one segment per layer.",
             (_spec("sequence", "FP32", 64, 32),), (_spec("features", "FP32", 256),), 32,
             functools.partial(zoo_text.lstm, features=32, hidden=128, layers=2, outputs=256)),
    _image_model("resnet18", "ResNet-18 for CIFAR (3x3 stem, no max pool); stem, 4 stages, head.",
                 32, 10, 16, lambda image, classes: zoo_vision.resnet((2, 2, 2, 2), False, classes, False)),
    _image_model("resnet50", "ResNet-50 for CIFAR (3x3 stem, no max pool); stem, 4 stages, head.",
                 32, 10, 16, lambda image, classes: zoo_vision.resnet((3, 4, 6, 3), True, classes, False)),
    _image_model("resnet18_imagenet", "Standard ResNet-18 (ImageNet); stem, 4 stages, head.",
                 224, 1000, 8, lambda image, classes: zoo_vision.resnet((2, 2, 2, 2), False, classes, True)),
    _image_model("resnet50_imagenet", "Standard ResNet-50 v1.5 (ImageNet); stem, 4 stages, head.",
                 224, 1000, 8, lambda image, classes: zoo_vision.resnet((3, 4, 6, 3), True, classes, True)),
    ZooEntry("bert_tiny", "BERT encoder for span QA: sequence 512, hidden 128, 2 layers, 2 heads; "
             "segments: embeddings, each layer, head.",
             tuple(_spec(n, "INT32", 512) for n in ("input_ids", "attention_mask", "token_type_ids")),
             (_spec("start_logits", "FP32", 512), _spec("end_logits", "FP32", 512)), 8,
             functools.partial(zoo_text.bert_qa, seq_len=512, hidden=128, layers=2, heads=2)),
    _image_model("vgg19", "DISB VGG-19, scaled to ~10 ms on one CPU core: the 16-conv VGG-19 pattern at "
                 "half width (32..256 channels), 64x64 input, 1024-wide classifier; 12 even segments.",
                 64, 1000, 8, lambda image, classes: zoo_vision.vgg(zoo_vision.VGG19, 0.5, image, 1024, classes, 12)),
    _image_model("resnet152", "DISB ResNet-152, scaled to ~10 ms on one CPU core: true 3-8-36-3 bottleneck "
                 "depth at 3/8 width (base 24 channels, 64 in the original), 64x64 input; 16 even segments.",
                 64, 1000, 8, lambda image, classes: zoo_vision.resnet_disb((3, 8, 36, 3), 24, image, classes, 16)),
    _image_model("densenet201", "DISB DenseNet-201, scaled to ~10 ms on one CPU core: 6-12-48-32 dense "
                 "blocks with growth rate 16 (32 in the original), 64x64 input; 16 even segments.",
                 64, 1000, 8, lambda image, classes: zoo_vision.densenet((6, 12, 48, 32), 16, image, classes, 16)),
    _image_model("inception_v3", "DISB Inception v3, scaled to ~10 ms on one CPU core: full-width stem and "
                 "mixed blocks A, A, B, C, C, D, E (7 of v3's 11), 75x75 input (299 in the original); "
                 "6 even segments.",
                 75, 1000, 8, lambda image, classes: zoo_vision.inception_v3(1.0, image, classes, 6)),
    ZooEntry("distilbert", "DISB DistilBERT classifier, scaled to ~5 ms on one CPU core: 6 layers, hidden "
             "128 (768 in the original), 2 heads, sequence 128; 6 even segments.",
             (_spec("input_ids", "INT32", 128), _spec("attention_mask", "INT32", 128)),
             (_spec("logits", "FP32", 2),), 8,
             functools.partial(zoo_text.distilbert_classifier, seq_len=128, hidden=128, layers=6, heads=2,
                               classes=2, segments=6)),
    ZooEntry("digits", "Small CNN trained on scikit-learn's 8x8 digits (inputs scaled 0..16 -> 0..1), "
             "3 segments; about 98% test accuracy.",
             (_spec("image", "FP32", 1, 8, 8),), (_spec("logits", "FP32", 10),), 32,
             digits_net, pretrained=load_or_train_digits, cached_weights=DIGITS_FILE),
    ZooEntry("gate", "For fault tests: holds each sample while the file <cache dir>/gates/<key> exists, "
             "then returns its key; 2 segments. Not a built-in model: register it through a repository.",
             (_spec("key", "INT64", 1),), (_spec("key", "INT64", 1),), 8, gate_model, pretrained=gate_model,
             builtin=False),
)

ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}

logger = logging.getLogger(__name__)

# Under the cache directory: the seeded zoo models' weights, one safetensors file per
# architecture and seed, written once so that every model's weights are a file to map.
WEIGHTS_DIR = "weights"


def zoo_entry(name: str) -> ZooEntry:
    """The zoo entry called ``name``; raises UnknownModel listing the known names."""
    try:
        return ZOO[name]
    except KeyError:
        raise UnknownModel(f"no zoo model {name!r}; known models: {', '.join(ZOO)}") from None


def init_zoo_model(name: str, seed: int = 0) -> SegmentedModel:
    """The architecture ``name`` with random weights drawn from ``seed``; never trained or cached.

    The same seed gives bit-identical weights in every process, and the global RNG state
    is left as it was.
    """
    entry = zoo_entry(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return entry.build()


def build_zoo_model(name: str, seed: int = 0, cache_dir: Path | None = None) -> SegmentedModel:
    """The zoo model ``name``, ready to serve.

    Random-weight models are seeded with ``seed``. Trained models (``digits``) ignore the
    seed and load their weights from ``cache_dir`` (default ``$SPLITSERVE_CACHE_DIR`` or
    ``~/.cache/splitserve``), training and caching them on first use.
    """
    entry = zoo_entry(name)
    if entry.pretrained is not None:
        if cache_dir is None:  # in-process use outside a server: share the user's cache
            cache_dir = env_cache_dir() or Path.home() / ".cache" / "splitserve"
        return entry.pretrained(cache_dir)
    return init_zoo_model(name, seed)


def zoo_weights_path(name: str, seed: int, cache_dir: Path) -> Path | None:
    """The safetensors file that holds the zoo model ``name``'s weights under ``cache_dir``
    (it may not be written yet): ``weights/<name>-seed<seed>.safetensors`` for seeded
    models, the trained cache for trained ones; None for a model without weights in a
    file (the gate)."""
    entry = zoo_entry(name)
    if entry.pretrained is not None:
        return Path(cache_dir) / entry.cached_weights if entry.cached_weights else None
    return Path(cache_dir) / WEIGHTS_DIR / f"{name}-seed{seed}.safetensors"


@contextlib.contextmanager
def _init_skipped() -> Iterator[None]:
    """Modules built inside get uninitialised tensors: ``torch.nn.init``'s in-place
    initialisers do nothing (modules call them through the module, so this reaches every
    ``reset_parameters``). For skeletons whose tensors are replaced by a file's at once;
    the meta device would do too, but costs seconds on its first use in a process."""
    inits = {n: f for n, f in vars(nn.init).items() if n.endswith("_") and not n.startswith("_") and callable(f)}
    for n in inits:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in inits.items():
            setattr(nn.init, n, f)


def zoo_skeleton(name: str) -> SegmentedModel:
    """The architecture ``name`` with uninitialised tensors (no random init paid), to be
    given its weights by ``load_safetensors``."""
    entry = zoo_entry(name)
    with _init_skipped():
        return entry.build()


@functools.cache
def _zoo_fingerprint() -> str:
    """What seeded weights depend on besides the architecture's name and seed: the zoo's
    code and torch's version (its random streams). A file written under another one is
    stale even if its tensors have the right names and shapes."""
    h = hashlib.sha256(torch.__version__.encode())
    for module in (sys.modules[__name__], zoo_vision, zoo_text, segmented):
        h.update(Path(inspect.getfile(module)).read_bytes())
    return h.hexdigest()[:16]


def load_zoo_model(name: str, seed: int, cache_dir: Path) -> SegmentedModel:
    """The seeded zoo model ``name`` with its weights mapped from its file under
    ``cache_dir`` (``zoo_weights_path``), which is written first if it is missing or does
    not hold this architecture and seed as this code draws them (its metadata: arch,
    seed, the zoo's fingerprint; its tensors' names, shapes and dtypes: all are checked,
    never trusted). Trained models load as ``build_zoo_model`` does.

    Processes racing to write the file each write the same bytes to a temporary name and
    rename it into place, so a reader never sees a partial file."""
    entry = zoo_entry(name)
    path = zoo_weights_path(name, seed, cache_dir)
    if entry.pretrained is not None or path is None:
        return build_zoo_model(name, seed, cache_dir)
    model = zoo_skeleton(name)
    wanted = {"arch": name, "seed": str(seed), "zoo": _zoo_fingerprint()}
    meta = safetensors_metadata(path) if path.is_file() else None
    if meta is None or {k: meta.get(k) for k in wanted} != wanted or not state_matches(model, path):
        if path.exists():
            logger.warning("rewriting %s: it does not hold the weights of %s seed %d", path, name, seed)
        save_safetensors(init_zoo_model(name, seed), path, metadata=wanted)
        logger.info("wrote the weights of %s seed %d to %s", name, seed, path)
    load_safetensors(model, path)
    return model.eval()
