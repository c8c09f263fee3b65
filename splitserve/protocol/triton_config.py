"""A model's configuration in Triton's model-configuration schema (``model_config.proto``),
as Triton's ``GET /v2/models/{name}/config`` and gRPC ``ModelConfig`` return it: the JSON
form uses the proto's field names, enum names as strings and numbers as numbers, so the
gRPC front end parses the same dict into its ``ModelConfig`` message.

splitserve always batches along a leading dimension (``max_batch_size`` >= 1), so ``dims``
never include it, as Triton's do for a model with ``max_batch_size`` > 0.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from collections.abc import Mapping
from typing import Any

from splitserve.modelconfig import ModelConfig
from splitserve.scheduler.policy import BatchingPolicyKind
from splitserve.types import TensorSpec

# Triton reports both for a PyTorch model: ``backend`` names the backend that runs it and
# ``platform`` the model format (its config normalisation fills one from the other), and
# tools key on either.
PLATFORM = "pytorch_libtorch"
BACKEND = "pytorch"


def data_type(datatype: str) -> str:
    """The ``DataType`` enum name of a v2 datatype (``FP32`` -> ``TYPE_FP32``)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "data_type": data_type(spec.datatype), "dims": list(spec.shape)}


def _instance_group(cfg: ModelConfig, instances: int) -> dict[str, Any]:
    group: dict[str, Any] = {"name": cfg.name, "count": instances}
    if cfg.device.startswith("cuda"):
        _, _, index = cfg.device.partition(":")
        group.update(kind="KIND_GPU", gpus=[int(index or 0)])
    else:
        group["kind"] = "KIND_CPU"
    return group


def _dynamic_batching(cfg: ModelConfig) -> dict[str, Any] | None:
    """Triton's closest equivalent of the batching policy; None for one call at a time.

    An empty ``dynamic_batching`` (no preferred size, no delay) is Triton's work-conserving
    batcher; ``adaptive`` moves its release threshold itself, which Triton cannot express,
    so it shows as that too and its keys are in ``parameters``."""
    b = cfg.batching
    if b.policy is BatchingPolicyKind.NONE:
        return None
    if b.policy is BatchingPolicyKind.TIMEOUT:
        return {"preferred_batch_size": [min(b.preferred_batch, cfg.max_batch_size)],
                "max_queue_delay_microseconds": round(b.max_delay_ms * 1000)}
    return {}


def triton_model_config(cfg: ModelConfig, instances: int, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` served with ``instances`` instances, in Triton's schema (JSON form).

    ``settings`` are splitserve's own (residency, placement, ...): they go, with the batching
    policy and default class, under ``parameters`` as Triton's ``{"string_value": ...}``
    entries; a value that is not a string is written as JSON."""
    own: dict[str, Any] = {
        "batching": cfg.batching.policy.value,
        "batching_config": asdict(cfg.batching),
        "default_class": cfg.default_class,
        "threads": cfg.threads,
        **settings,
    }
    out: dict[str, Any] = {
        "name": cfg.name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "max_batch_size": cfg.max_batch_size,
        "input": [_tensor(t) for t in cfg.inputs],
        "output": [_tensor(t) for t in cfg.outputs],
        "instance_group": [_instance_group(cfg, instances)],
        "parameters": {k: {"string_value": v if isinstance(v, str) else json.dumps(v, sort_keys=True)}
                       for k, v in own.items()},
    }
    batching = _dynamic_batching(cfg)
    if batching is not None:
        out["dynamic_batching"] = batching
    return out
