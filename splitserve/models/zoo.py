"""Building the zoo's models: seeded weights, skeletons, and weights mapped from their file.

The catalogue (names, specs, builders) is ``models.catalog``, which imports no torch;
this module builds from it. Weights are random but deterministic (``build_zoo_model``),
except ``digits``, which is trained once and cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from splitserve.config import env_cache_dir
from splitserve.models import catalog, segmented, zoo_micro, zoo_text, zoo_vision
from splitserve.models.catalog import zoo_entry, zoo_weights_path
from splitserve.models.segmented import (SegmentedModel, load_safetensors, safetensors_metadata, save_safetensors,
                                         state_matches)
logger = logging.getLogger(__name__)

# Building a model draws from torch's global RNG (a seeded build) or patches ``nn.init`` for the
# whole process (a skeleton): one build at a time per process, else two threads' skeletons
# restore each other's patches (nn.init left doing nothing) or a seeded build runs unseeded.
_BUILDING = threading.RLock()


def init_zoo_model(name: str, seed: int = 0) -> SegmentedModel:
    """The architecture ``name`` with random weights drawn from ``seed``; never trained or cached.

    The same seed gives bit-identical weights in every process, and the global RNG state
    is left as it was.
    """
    entry = zoo_entry(name)
    with _BUILDING, torch.random.fork_rng(devices=[]):
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


@contextlib.contextmanager
def _init_skipped() -> Iterator[None]:
    """Modules built inside get uninitialised tensors: ``torch.nn.init``'s in-place
    initialisers do nothing (modules call them through the module, so this reaches every
    ``reset_parameters``). For skeletons whose tensors are replaced by a file's at once;
    the meta device would do too, but costs seconds on its first use in a process. Held
    under the process's one build lock: the patch is global."""
    with _BUILDING:
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
    for module in (sys.modules[__name__], catalog, zoo_micro, zoo_vision, zoo_text, segmented):
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
