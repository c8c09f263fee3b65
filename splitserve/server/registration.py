"""What a model-repository load registers, Triton's way: its ``config`` parameter (Triton's
model configuration in JSON, or splitserve's ``config.toml``) with the model's files as
``file:<path>`` parameters and, splitserve's addition, ``labels``. HTTP and gRPC share it;
each front end decodes its file values (base64 text over HTTP, bytes over gRPC) first."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import tomli_w

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.triton_config import from_triton_config

FILE_PREFIX = "file:"


class Registration(NamedTuple):
    """What ``ModelRegistrar.register`` takes: config.toml, the artifact, the labels."""

    config_toml: str
    artifact: bytes | None
    labels: str | None


def registration(model_name: str, params: Mapping[str, Any], files: Mapping[str, bytes]) -> Registration | None:
    """The registration a load's ``params`` ask for, with ``files`` (their ``file:`` ones,
    decoded, by path); None when there is no ``config`` (a load of a model already
    registered). A JSON config is Triton's (``from_triton_config``: what it asks for that
    splitserve does not do is refused, naming the field); anything else is config.toml,
    with at most one file, its artifact."""
    config = params.get("config")
    if config is None:
        if files:
            raise InvalidInput("'file:' parameters come with a 'config' parameter (the model's configuration)")
        return None
    if not isinstance(config, str):
        raise InvalidInput("parameter 'config' must be a string: Triton's model configuration in JSON, or "
                           "splitserve's config.toml")
    labels = params.get("labels")
    if labels is not None and not isinstance(labels, str):
        raise InvalidInput("parameter 'labels' must be a string, one label per line")
    if config.lstrip().startswith("{"):
        try:
            doc = json.loads(config)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"parameter 'config' is not valid JSON: {e}") from None
        try:
            cfg, artifact = from_triton_config(doc, model_name, files)
        except (TypeError, ValueError) as e:  # a value of the wrong kind deep in the document
            raise InvalidInput(f"the Triton config has a value of the wrong type: {e}") from None
        return Registration(tomli_w.dumps(cfg), artifact, labels)
    if len(files) > 1:
        raise InvalidInput("with a config.toml, give at most one 'file:<name>' parameter: the model's artifact")
    declared = ModelConfig.from_toml(config).name
    if model_name and model_name != declared:
        raise InvalidInput(f"config.toml names the model {declared!r}, but the load is for {model_name!r}")
    return Registration(config, next(iter(files.values()), None), labels)
