"""A model's configuration in Triton's model-configuration schema (``model_config.proto``),
as Triton's ``GET /v2/models/{name}/config`` and gRPC ``ModelConfig`` return it: the JSON
form uses the proto's field names, enum names as strings and numbers as numbers, so the
gRPC front end parses the same dict into its ``ModelConfig`` message.

splitserve always batches along a leading dimension (``max_batch_size`` >= 1), so ``dims``
never include it, as Triton's do for a model with ``max_batch_size`` > 0.

``from_triton_config`` reads the other way: Triton's configuration as a client sends it to
load a model (``RepositoryModelLoad``'s ``config``), refusing what splitserve does not do.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from collections.abc import Mapping
from typing import Any

from splitserve.errors import InvalidInput
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


# -- Triton's configuration in: RepositoryModelLoad's "config" parameter ------------------------

# What a Triton configuration may ask for that splitserve does not do: refused, naming the field.
_REFUSED = {
    "sequence_batching": "splitserve has no sequence batcher: it serves stateless models, each call on its own",
    "ensemble_scheduling": "splitserve does not run ensembles (pipelines of models inside the server)",
}
_FIELDS = {"name", "platform", "backend", "max_batch_size", "input", "output", "instance_group", "dynamic_batching",
           "parameters", "default_model_filename", "model_transaction_policy", *_REFUSED}
_TENSOR_FIELDS = {"name", "data_type", "dims"}
# splitserve's own settings a Triton configuration may carry as ``parameters`` (string values)
_OWN = {"threads", "default_class"}
# What ``triton_model_config`` reports beside them: read back unchanged in a round trip, and
# not settings (the batching policy comes from ``dynamic_batching``)
_REPORTED = {"batching", "batching_config", "residency", "placement", "func_id", "version"}


def _refuse(field: str, why: str) -> InvalidInput:
    return InvalidInput(f"Triton config field {field!r}: {why}")


def _tensor_in(t: Any, where: str) -> dict[str, Any]:
    if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
        raise _refuse(where, f"each tensor must be an object with a name, got {t!r}")
    unknown = sorted(set(t) - _TENSOR_FIELDS)
    if unknown:
        raise _refuse(f"{where}.{unknown[0]}", f"is not served (tensor {t['name']!r}); a tensor takes name, "
                      "data_type and dims")
    dtype = str(t.get("data_type", ""))
    if not dtype.startswith("TYPE_"):
        raise _refuse(f"{where}.data_type", f"tensor {t['name']!r} needs a TYPE_* data_type, got {dtype!r}")
    dims = t.get("dims")
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise _refuse(f"{where}.dims", f"tensor {t['name']!r} needs a list of integer dims, got {dims!r}")
    if any(d < 1 for d in dims):
        raise _refuse(f"{where}.dims", f"tensor {t['name']!r} has a variable dimension ({dims}): splitserve's "
                      "tensor queues hold fixed-size samples, so every dim (batch left out) must be fixed")
    return {"name": t["name"], "datatype": "BYTES" if dtype == "TYPE_STRING" else dtype[5:], "shape": dims}


def _instances(groups: Any) -> tuple[int, str]:
    """The instance count and device of ``instance_group``."""
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise _refuse("instance_group", f"must be a list of objects, got {groups!r}")
    kinds = {str(g.get("kind", "KIND_AUTO")) for g in groups}
    if len(kinds) > 1 or not kinds <= {"KIND_AUTO", "KIND_CPU", "KIND_GPU"}:
        raise _refuse("instance_group.kind", f"{sorted(kinds)}: give one kind, KIND_CPU or KIND_GPU, for all groups")
    count = sum(int(g.get("count", 1)) for g in groups)
    gpus = sorted({int(i) for g in groups for i in g.get("gpus", [])})
    if kinds == {"KIND_GPU"}:
        if len(gpus) > 1:
            raise _refuse("instance_group.gpus", f"{gpus}: a model is served on one GPU")
        return count, f"cuda:{gpus[0] if gpus else 0}"
    return count, "cpu"


def _batching(dynamic: Any) -> dict[str, Any]:
    """The ``[batching]`` of ``dynamic_batching`` (absent: one call at a time, as Triton runs a
    model without it)."""
    if dynamic is None:
        return {"policy": "none"}
    if not isinstance(dynamic, Mapping):
        raise _refuse("dynamic_batching", f"must be an object, got {dynamic!r}")
    unknown = sorted(set(dynamic) - {"preferred_batch_size", "max_queue_delay_microseconds"})
    if unknown:
        raise _refuse(f"dynamic_batching.{unknown[0]}", "is not served: give preferred_batch_size and "
                      "max_queue_delay_microseconds")
    delay_us = int(dynamic.get("max_queue_delay_microseconds", 0))
    preferred = [int(b) for b in dynamic.get("preferred_batch_size", [])]
    if not delay_us and not preferred:
        return {"policy": "work_conserving"}
    out: dict[str, Any] = {"policy": "timeout", "max_delay_ms": delay_us / 1000}
    if preferred:
        out["preferred_batch"] = max(preferred)
    return out


def _own_settings(params: Any) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise _refuse("parameters", f"must be an object of {{\"string_value\": ...}} entries, got {params!r}")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _REPORTED:
            continue
        if key not in _OWN:
            raise _refuse(f"parameters.{key}", f"is not a setting splitserve reads; it reads {sorted(_OWN)}")
        text = value.get("string_value") if isinstance(value, Mapping) else None
        if not isinstance(text, str):
            raise _refuse(f"parameters.{key}", f"must be {{\"string_value\": ...}}, got {value!r}")
        try:
            out[key] = int(text) if key == "threads" else text
        except ValueError:
            raise _refuse(f"parameters.{key}", f"must be an integer, got {text!r}") from None
    return out


def from_triton_config(doc: Any, model_name: str, files: Mapping[str, bytes]) -> tuple[dict[str, Any], bytes]:
    """A splitserve configuration (``config.toml``'s keys) and the artifact's bytes from
    Triton's model configuration in JSON (``doc``) and the model's files (Triton's
    ``file:<version>/<name>`` parameters, by path). What splitserve does not do (sequence
    batching, ensembles, decoupled models, variable-size tensors) is refused, naming the
    field; so is any field it does not read."""
    if not isinstance(doc, Mapping):
        raise InvalidInput("the 'config' parameter must be a JSON object (Triton's model configuration)")
    for key, why in _REFUSED.items():
        if key in doc:
            raise _refuse(key, why)
    if doc.get("platform") == "ensemble":
        raise _refuse("platform", f"'ensemble': {_REFUSED['ensemble_scheduling']}")
    policy = doc.get("model_transaction_policy") or {}
    if isinstance(policy, Mapping) and policy.get("decoupled"):
        raise _refuse("model_transaction_policy.decoupled", "splitserve answers every call exactly once; decoupled "
                      "models (any number of answers per call) are not served")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise _refuse(unknown[0], f"is not served; splitserve reads {', '.join(sorted(_FIELDS - set(_REFUSED)))}")
    name = doc.get("name") or model_name
    if model_name and name != model_name:
        raise _refuse("name", f"the config names the model {name!r}, but the load is for {model_name!r}")
    if doc.get("platform", PLATFORM) not in (PLATFORM, "") or doc.get("backend", BACKEND) not in (BACKEND, ""):
        raise _refuse("platform", f"{doc.get('platform') or doc.get('backend')!r} is not served: splitserve serves "
                      f"PyTorch models (platform {PLATFORM!r}, backend {BACKEND!r})")
    max_batch = doc.get("max_batch_size", 0)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise _refuse("max_batch_size", f"{max_batch!r}: splitserve batches along a leading dimension; give a "
                      "max_batch_size of at least 1 and leave the batch dimension out of dims")
    if len(files) != 1:
        raise InvalidInput(f"give the model's file as one 'file:<version>/<name>' parameter, got {len(files)}: "
                           f"{sorted(files)}")
    (path, data), = files.items()
    file = path.rsplit("/", 1)[-1]
    instances, device = _instances(doc.get("instance_group", []))
    cfg: dict[str, Any] = {
        "name": name, "max_batch_size": max_batch, "instances": max(1, instances), "device": device,
        "batching": _batching(doc.get("dynamic_batching")),
        "artifact": {"kind": "export" if file.endswith(".pt2") else "torchscript", "file": file},
        "inputs": [_tensor_in(t, "input") for t in doc.get("input") or []],
        "outputs": [_tensor_in(t, "output") for t in doc.get("output") or []],
        **_own_settings(doc.get("parameters", {})),
    }
    return cfg, data
