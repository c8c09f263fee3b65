"""Load a model artifact into a SegmentedModel.

Artifact kinds: ``zoo`` (a built-in architecture with seeded weights), ``safetensors``
(a zoo architecture with weights from a file), ``torchscript``, ``export``
(``torch.export`` ``.pt2`` archives) and ``eager`` (a TorchServe ``.mar`` of a model file and
its state dict). Pickle files (``torch.save``) are refused: no kind
reads them, because unpickling runs arbitrary code.

Only ``zoo`` and ``safetensors`` are safe for files from untrusted sources. TorchScript
and ``.pt2`` archives describe code to run, and ``torch.export.load`` itself unpickles
some archive entries (its documentation warns never to load untrusted files), which is
why the server refuses uploads of those kinds unless started with
``--allow-code-artifacts`` (``ArtifactKind.runs_code``)."""

from __future__ import annotations

import io
import json
import logging
import pickle
import types
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ArtifactKind
from splitserve.models.handler_spec import MANIFEST
from splitserve.models.segmented import SegmentedModel, load_safetensors, save_safetensors
from splitserve.models.zoo import build_zoo_model, load_zoo_model, zoo_skeleton

__all__ = ["load_artifact", "save_safetensors"]

logger = logging.getLogger(__name__)

def _existing_file(kind: str, path: Path | None) -> Path:
    if path is None:
        raise InvalidInput(f"a '{kind}' artifact needs a path")
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{kind} artifact {path} does not exist or is not a file")
    return path


def _load_torchscript(path: Path) -> SegmentedModel:
    try:
        # TorchScript is deprecated upstream, but artifacts in that format still exist;
        # the warning says nothing actionable to someone serving one.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated", category=DeprecationWarning)
            module = torch.jit.load(str(path), map_location="cpu")
    except (RuntimeError, ValueError) as e:
        raise InvalidInput(f"{path} is not a TorchScript archive: {e}") from None
    segments = getattr(module, "segments", None)
    if isinstance(segments, nn.Module):
        # A scripted ModuleList cannot be iterated from Python; its children can.
        parts = [child for _, child in segments.named_children()]
        if parts:
            return SegmentedModel(parts)
    return SegmentedModel([module])


def _load_export(path: Path) -> SegmentedModel:
    if path.suffix != ".pt2":
        # torch.export.load only reads .pt2 archives and logs a traceback for anything else.
        raise InvalidInput(f"{path}: a torch.export artifact must be a .pt2 file")
    try:
        program = torch.export.load(str(path))
    except (RuntimeError, ValueError, KeyError) as e:
        raise InvalidInput(f"{path} is not a torch.export archive: {e}") from None
    return SegmentedModel([program.module()])


def _load_eager(path: Path) -> SegmentedModel:
    """A TorchServe eager archive: the one ``nn.Module`` class its model file defines, built
    with no arguments, with the state dict of its serialized file (read ``weights_only``:
    tensors, never pickled objects). Importing the model file runs its code, which is why
    the kind ``runs_code``."""
    try:
        with zipfile.ZipFile(path) as z:
            model = json.loads(z.read(MANIFEST))["model"]
            source = z.read(model["modelFile"]).decode()
            weights = z.read(model["serializedFile"])
    except (zipfile.BadZipFile, KeyError, ValueError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{path} is not an eager .mar archive: {e}") from None
    module = types.ModuleType(Path(model["modelFile"]).stem)
    exec(compile(source, model["modelFile"], "exec"), module.__dict__)
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == module.__name__]
    if len(classes) != 1:
        raise InvalidInput(f"{model['modelFile']} must define exactly one nn.Module class, found "
                           f"{[c.__name__ for c in classes]}")
    net = classes[0]()
    try:
        net.load_state_dict(torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True))
    except (RuntimeError, pickle.UnpicklingError) as e:
        raise InvalidInput(f"{model['serializedFile']} is not a state dict of {classes[0].__name__}: {e}") from None
    return SegmentedModel([net.eval()])


def load_artifact(kind: ArtifactKind | str, path: Path | None, arch: str | None, seed: int = 0,
                  cache_dir: Path | None = None) -> SegmentedModel:
    """Load the model an artifact describes, in eval mode.

    ``arch`` names the zoo architecture for ``zoo`` and ``safetensors``. Their weights are
    mapped from a safetensors file, never copied: the artifact's own, or for ``zoo`` the
    seeded weights' file under ``cache_dir`` (written on first use; without a
    ``cache_dir`` the model is built in memory from its seed). TorchScript and export
    artifacts load as their formats do (a copy in this process). Raises UnknownModel for
    an unknown architecture and InvalidInput for an unknown kind or an unreadable or
    mismatched file.
    """
    kind = ArtifactKind.parse(kind)
    if kind.zoo_arch and not arch:
        raise InvalidInput(f"a '{kind}' artifact needs an architecture name (arch)")
    if kind is ArtifactKind.ZOO:
        return build_zoo_model(str(arch), seed) if cache_dir is None else load_zoo_model(str(arch), seed, cache_dir)
    file = _existing_file(kind, path)
    logger.info("loading %s artifact %s", kind, file)
    if kind is ArtifactKind.SAFETENSORS:
        model = zoo_skeleton(str(arch))
        load_safetensors(model, file)
        return model.eval()
    if kind is ArtifactKind.TORCHSCRIPT:
        return _load_torchscript(file)
    if kind is ArtifactKind.EAGER:
        return _load_eager(file)
    return _load_export(file)
