"""TorchServe model archives (``.mar``, made by ``torch-model-archiver``): what one holds,
and the splitserve model config that serves it, or a refusal naming what was found.

An archive is a zip with ``MAR-INF/MANIFEST.json`` (``model.modelName``,
``serializedFile``, ``handler``, optional ``modelFile``, ``modelVersion``,
``configFile``) and its extra files at the top (``index_to_name.json``). Served:

- a TorchScript serialized file (no ``modelFile``): loaded with ``torch.jit.load``, which
  runs no Python;
- an eager archive (``modelFile`` + a state dict): kind ``eager``, which imports the model
  file, so only on a server started with ``--allow-code-artifacts``;
- with the stock handlers ``image_classifier`` and ``base_handler`` (``models/handlers.py``
  runs them in the worker). A custom handler (a ``.py`` of the archive's or a
  ``module:function``) is TorchServe code, which splitserve does not run.

The archive's ``configFile`` (TorchServe's ``model-config.yaml``) gives ``batchSize``,
``maxBatchDelay`` and ``minWorkers``; its ``splitserve`` key what is splitserve's own: a
``base_handler`` model's tensors, which a TorchScript file does not declare (``inputs``
and ``outputs`` as in config.toml), and an image_classifier's ``max_input_bytes`` (the
largest image it takes, default 1 MiB: the size of its input row in the tensor queues). Nothing in an archive is unpickled."""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from typing import Any

import tomli_w
import yaml

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig, check_model_name
from splitserve.models.handler_spec import BASE_HANDLER, HANDLERS, MANIFEST

__all__ = ["MarArchive", "ServedArchive", "read_mar", "serve_archive"]

INDEX_TO_NAME = "index_to_name.json"
TORCHSCRIPT_FILE = "model.pt"
EAGER_FILE = "model.mar"
IMAGE_QUEUE_SLOTS = 32


@dataclass(frozen=True)
class MarArchive:
    """What an archive's manifest and extra files say."""

    model_name: str
    version: str
    handler: str
    serialized_file: str
    model_file: str | None
    index_to_name: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # its configFile (model-config.yaml)

    @property
    def eager(self) -> bool:
        """Built from a model file and a state dict: loading it imports the model file."""
        return self.model_file is not None


@dataclass(frozen=True)
class ServedArchive:
    """An archive as splitserve registers it: its config.toml and the artifact file."""

    archive: MarArchive
    config_toml: str
    artifact: bytes
    config: ModelConfig
    workers: int  # TorchServe's initial workers: 0 registers the model unloaded


def _member(z: zipfile.ZipFile, name: str, limit: int) -> bytes:
    try:
        info = z.getinfo(name)
    except KeyError:
        raise InvalidInput(f"the archive names {name!r} but has no such file; it has {sorted(z.namelist())[:20]}") from None
    if info.file_size > limit:
        raise InvalidInput(f"{name} is {info.file_size} bytes unpacked, over the {limit} byte upload limit")
    return z.read(info)


def _names(raw: bytes) -> dict[str, str]:
    """index_to_name.json as index -> name (ImageNet's ``[wnid, name]`` pairs: the name)."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"{INDEX_TO_NAME} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{INDEX_TO_NAME} must map class indices to names, got {type(doc).__name__}")
    out = {}
    for k, v in doc.items():
        name = v[-1] if isinstance(v, list) and v else v
        if not str(k).isdigit() or not isinstance(name, str):
            raise InvalidInput(f"{INDEX_TO_NAME}: entry {k!r}: {v!r} is not a class index and its name")
        out[str(int(k))] = name
    return out


def _manifest(z: zipfile.ZipFile) -> dict[str, Any]:
    if MANIFEST not in z.namelist():
        raise InvalidInput(f"not a TorchServe archive: no {MANIFEST}; it has {sorted(z.namelist())[:20]}")
    try:
        model = json.loads(z.read(MANIFEST))["model"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise InvalidInput(f"{MANIFEST} is not a TorchServe manifest (no 'model' object): {e}") from None
    if not isinstance(model, dict):
        raise InvalidInput(f"{MANIFEST}: 'model' must be an object, got {model!r}")
    return model


def _handler(model: dict[str, Any]) -> str:
    handler = str(model.get("handler") or "")
    if handler in HANDLERS:
        return handler
    if handler.removesuffix(".py") in ("image_segmenter", "object_detector", "text_classifier", "dali_image_classifier"):
        raise InvalidInput(f"the archive's handler is TorchServe's {handler!r}; splitserve runs the stock handlers "
                           f"{', '.join(HANDLERS)}")
    raise InvalidInput(f"the archive's handler {handler!r} is custom code; splitserve runs the stock handlers "
                       f"{', '.join(HANDLERS)} in its workers and does not run TorchServe handler code: archive "
                       f"the model with --handler image_classifier or base_handler")


def read_mar(data: bytes, limit: int, handler: str | None = None) -> MarArchive:
    """The archive ``data`` describes (files unpacked past ``limit`` bytes refused), with
    ``handler`` in place of its manifest's when given; InvalidInput naming what was found
    when it is not one splitserve can serve."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise InvalidInput(f"not a .mar archive: a .mar is a zip file; these {len(data)} bytes start "
                           f"{data[:8]!r}") from None
    with z:
        model = _manifest(z)
        handler = _handler({"handler": handler} if handler else model)
        serialized = model.get("serializedFile")
        if not serialized:
            raise InvalidInput(f"{MANIFEST} names no serializedFile (the model's weights); it says {model}")
        if not _member(z, serialized, limit):
            raise InvalidInput(f"the archive's serializedFile {serialized!r} is empty")
        model_file = model.get("modelFile") or None
        if model_file is not None:
            _member(z, model_file, limit)
        names = _names(_member(z, INDEX_TO_NAME, limit)) if INDEX_TO_NAME in z.namelist() else {}
        settings: dict[str, Any] = {}
        if model.get("configFile"):
            try:
                settings = yaml.safe_load(_member(z, model["configFile"], limit)) or {}
            except yaml.YAMLError as e:
                raise InvalidInput(f"{model['configFile']} is not YAML: {e}") from None
            if not isinstance(settings, dict):
                raise InvalidInput(f"{model['configFile']} must be a mapping, got {settings!r}")
    return MarArchive(str(model.get("modelName") or ""), str(model.get("modelVersion") or "1.0"), handler,
                      serialized, model_file, names, settings)


def _int(value: Any, what: str, low: int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{what} must be an integer, got {value!r}") from None
    if n < low:
        raise InvalidInput(f"{what} must be at least {low}, got {n}")
    return n


def serve_archive(data: bytes, limit: int, *, name: str | None, source: str, handler: str | None = None,
                  batch_size: Any = None, max_batch_delay: Any = None, workers: Any = None,
                  allow_code: bool) -> ServedArchive:
    """The config and artifact that serve the archive ``data`` as ``name`` (default: its
    manifest's), with TorchServe's registration parameters (None: the archive's
    model-config.yaml, then TorchServe's defaults: batch 1, 100 ms; ``handler`` overrides the
    manifest's); ``source`` is where it came from (kept with the model). An eager archive is refused unless ``allow_code``."""
    mar = read_mar(data, limit, handler)
    name = check_model_name(name or mar.model_name)
    if mar.eager and not allow_code:
        raise InvalidInput(f"{source} is an eager archive (model file {mar.model_file!r} and state dict "
                           f"{mar.serialized_file!r}): serving it imports {mar.model_file}, which runs its code, so "
                           "this server refuses it; archive a TorchScript model instead, or start the server with "
                           "--allow-code-artifacts if every token holder may run code on it")
    s = mar.settings
    batch = _int(batch_size if batch_size is not None else s.get("batchSize", 1), "batch_size", 1)
    delay = _int(max_batch_delay if max_batch_delay is not None else s.get("maxBatchDelay", 100), "max_batch_delay", 0)
    instances = _int(workers if workers is not None else s.get("minWorkers", 1), "initial_workers", 0)
    doc: dict[str, Any] = {
        "name": name, "max_batch_size": batch, "instances": max(1, instances),
        "batching": {"policy": "timeout", "max_delay_ms": float(delay), "preferred_batch": batch},
        "artifact": {"kind": "eager" if mar.eager else "torchscript",
                     "file": EAGER_FILE if mar.eager else TORCHSCRIPT_FILE},
        "handler": {"name": mar.handler, "index_to_name": mar.index_to_name, "archive": source,
                    "archive_version": mar.version},
    }
    ours = s.get("splitserve") if isinstance(s.get("splitserve"), dict) else {}
    if "max_input_bytes" in ours:
        doc["handler"]["max_input_bytes"] = ours["max_input_bytes"]
    if mar.handler == BASE_HANDLER:
        tensors = ours
        if "inputs" not in tensors or "outputs" not in tensors:
            raise InvalidInput(f"{source}: a base_handler model's tensors are not in a TorchScript file; declare them "
                               "in the archive's model-config.yaml (--config-file) under splitserve: inputs: and "
                               "outputs: (name, datatype, shape), or use --handler image_classifier")
        doc["inputs"], doc["outputs"] = tensors["inputs"], tensors["outputs"]
    else:
        # an image_classifier's input row is max_input_bytes (1 MiB): a ring of the default 256
        # slots would map 256 MiB per class; calls waiting past these many answer 503 instead
        doc["queue_slots"] = max(IMAGE_QUEUE_SLOTS, 4 * batch)
    config_toml = tomli_w.dumps(doc)
    config = ModelConfig.from_toml(config_toml)
    if mar.eager:
        artifact = data
    else:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            artifact = _member(z, mar.serialized_file, limit)
    return ServedArchive(mar, config_toml, artifact, config, instances)
