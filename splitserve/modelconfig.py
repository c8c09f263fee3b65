"""A model's configuration: what ``config.toml`` in its repository directory says.

Example (every key but ``name`` and ``[artifact]`` has a default; a zoo artifact also
fills in inputs and outputs)::

    name = "lenet"
    max_batch_size = 32
    instances = 1
    threads = 1
    default_class = "be"          # "rt" (real-time / strict) or "be" (best-effort)
    be_instances = 0              # preemption idle: of instances, those kept for best-effort calls (SCHED_IDLE)
    [batching]
    policy = "work_conserving"    # "work_conserving" | "timeout" | "none" | "adaptive"
    max_delay_ms = 2.0            # timeout policy: longest wait for a fuller batch
    preferred_batch = 8           # timeout policy: dispatch at once at this size
    quantum_ms = 5.0              # adaptive: threshold updated and tested every quantum
    alpha = 0.5                   # adaptive, ewma rule: t <- alpha*t + (1-alpha)*arrivals on a rise
    threshold_cap = 128           # adaptive: largest threshold, in samples (the fixed rule's t)
    rule = "ewma"                 # adaptive: "ewma" | "aimd" (t += arrivals) | "fixed" (t = cap)
    adaptive_quantum = false      # adaptive: the quantum follows the batch compute time
    quantum_beta = 0.5            # adaptive_quantum: old quantum's weight in that average
    [memory]
    keep_resident = false         # under a memory budget: never evicted (loaded on first use, then kept)
    [slo]                         # soft SLO of its real-time calls (late ones are served, counted missed)
    target_ms = 50.0              # either a target in ms ...
    multiplier = 3.0              # ... or k x its profiled solo latency at max_batch_size on the whole node
    [artifact]
    kind = "zoo"                  # "zoo" | "safetensors" | "torchscript" | "export" (code: see below)
    arch = "lenet"                # zoo architecture (zoo and safetensors kinds)
    file = "model.safetensors"    # artifact file in the model's directory
    [[inputs]]
    name = "x"
    datatype = "UINT8"
    shape = [1, 28, 28]

``torchscript`` and ``export`` artifacts run code from their file when loaded, so a server
accepts uploads of them only when started with ``--allow-code-artifacts``.
"""

from __future__ import annotations

import functools
import math
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.models.catalog import zoo_entry
from splitserve.models.handler_spec import check_handler, handler_tensors
from splitserve.scheduler.policy import BatchingConfig
from splitserve.types import Choice, TensorSpec

__all__ = ["ArtifactConfig", "ArtifactKind", "BatchingConfig", "MemoryConfig", "ModelConfig", "SloConfig",
           "check_model_name"]

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ArtifactKind(Choice, what="artifact.kind",
                   hint="torch.save pickles are not loaded: convert them to safetensors or torch.export"):
    """What an artifact file is, and so how ``models.loader`` loads it."""

    ZOO = "zoo"  # a built-in architecture with seeded weights; no file
    SAFETENSORS = "safetensors"  # a zoo architecture with weights from a file
    TORCHSCRIPT = "torchscript"
    EXPORT = "export"  # a torch.export .pt2 archive
    EAGER = "eager"  # a TorchServe .mar of a model file (Python) and its state dict

    @property
    def runs_code(self) -> bool:
        """Loading it runs code from the file: uploads of it need --allow-code-artifacts."""
        return self in (ArtifactKind.TORCHSCRIPT, ArtifactKind.EXPORT, ArtifactKind.EAGER)

    @property
    def zoo_arch(self) -> bool:
        """It names a zoo architecture (``arch``), which also gives its inputs and outputs."""
        return self in (ArtifactKind.ZOO, ArtifactKind.SAFETENSORS)


def check_model_name(name: str) -> str:
    """Model names become directory names: letters, digits, '_', '-', '.', no traversal."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise InvalidInput(
            f"bad model name {name!r}: use 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class ArtifactConfig:
    kind: ArtifactKind = ArtifactKind.ZOO
    arch: str | None = None
    file: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ArtifactKind.parse(self.kind))
        if self.kind.zoo_arch and not self.arch:
            raise InvalidInput(f"artifact.arch is required for a {self.kind} artifact")
        if self.kind is not ArtifactKind.ZOO and not self.file:
            raise InvalidInput(f"artifact.file is required for a {self.kind} artifact")
        if self.file is not None and (not isinstance(self.file, str) or Path(self.file).name != self.file
                                      or self.file.startswith(".") or not self.file.isprintable()):
            raise InvalidInput(f"artifact.file {self.file!r} must be a plain file name inside the model directory")


@dataclass(frozen=True)
class MemoryConfig:
    """``[memory]``: how the node's memory manager treats the model."""

    keep_resident: bool = False  # never chosen for eviction (an operator's explicit evict still is)

    def __post_init__(self) -> None:
        if not isinstance(self.keep_resident, bool):
            raise InvalidInput(f"memory.keep_resident must be true or false, got {self.keep_resident!r}")


@dataclass(frozen=True)
class SloConfig:
    """``[slo]``: the soft latency target of the model's real-time calls (PROTEAN §5: 3x the
    solo batch latency on the whole device), unless a call names its own ``slo_ms``. A late
    call is still served; it is counted ``missed``. Neither key: no SLO."""

    target_ms: float | None = None  # a fixed target
    multiplier: float | None = None  # k x L[all worker cores, max_batch_size] from the stored latency profile

    def __post_init__(self) -> None:
        for key in ("target_ms", "multiplier"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise InvalidInput(f"slo.{key} must be a positive number, got {value!r}")
        if self.target_ms is not None and self.multiplier is not None:
            raise InvalidInput("[slo] takes target_ms or multiplier, not both")

    def seconds(self, solo_s: float | None) -> float | None:
        """The SLO in seconds, given the profiled solo latency (None: not profiled); None when
        there is none (no key, or a multiplier without a profile)."""
        if self.target_ms is not None:
            return self.target_ms / 1e3
        if self.multiplier is not None and solo_s is not None:
            return self.multiplier * solo_s
        return None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the server needs to serve one model."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    artifact: ArtifactConfig
    version: int = 1
    max_batch_size: int = 8
    instances: int = 1
    threads: int = 1
    device: str = "cpu"
    default_class: str = "be"
    # Under preemption ``idle``, how many of ``instances`` take only best-effort batches, their
    # workers under SCHED_IDLE, while the others take only real-time ones at normal priority:
    # a model called in both classes is demoted for its best-effort calls alone. 0: every
    # instance takes both classes, demoted by ``default_class``.
    be_instances: int = 0
    queue_slots: int | None = None
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    placement: dict[str, Any] = field(default_factory=dict)  # e.g. {"kind": "packrat", "threads": 2}
    # REEF's device-queue capacity c: segments launched ahead of the one known finished
    # (None: 4 on a GPU, where launches are asynchronous; 1 on the CPU, where they are not).
    segment_capacity: int | None = None
    # CUDA graphs on a GPU, captured per batch size at load and replayed (``worker/launch.py``
    # ``graph_sizes``): "auto" for a small model, "on" whatever its size, "off".
    cuda_graphs: str = "auto"
    # Fixed placement: pin this model's instances to these CPUs (instance i takes the next
    # ``threads`` of them, wrapping). Empty: spread over the node round-robin.
    cpus: tuple[int, ...] = ()
    # Whether ``cpus`` may be shared with other models that ask to share them too (REEF's RT
    # and BE models on one CPU set); without it, a CPU another model holds refuses the load.
    share_cpus: bool = False
    labels: tuple[str, ...] = ()
    # TorchServe's pre- and post-processing run around the model (``models/handlers.py``)
    handler: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_model_name(self.name)
        object.__setattr__(self, "handler", check_handler(self.handler))
        if not self.inputs or not self.outputs:
            raise InvalidInput(f"model {self.name!r} needs at least one input and one output")
        for group in (self.inputs, self.outputs):
            names = [t.name for t in group]
            if len(set(names)) != len(names):
                raise InvalidInput(f"model {self.name!r}: duplicate tensor names {names}")
        if not 1 <= self.max_batch_size <= 4096:
            raise InvalidInput("max_batch_size must be between 1 and 4096")
        if not 1 <= self.instances <= 64 or not 1 <= self.threads <= 256:
            raise InvalidInput("instances must be 1..64 and threads 1..256")
        if not 0 <= self.be_instances < self.instances:
            raise InvalidInput(f"model {self.name!r}: be_instances={self.be_instances} must leave at least one of "
                               f"its {self.instances} instances for real-time calls (0 <= be_instances < instances)")
        if any(c < 0 for c in self.cpus):
            raise InvalidInput(f"cpus {list(self.cpus)}: CPU numbers cannot be negative")
        if self.share_cpus and not self.cpus:
            raise InvalidInput(f"model {self.name!r}: share_cpus needs cpus (the CPUs to share)")
        if self.segment_capacity is not None and not 1 <= self.segment_capacity <= 64:
            raise InvalidInput("segment_capacity must be between 1 and 64")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise InvalidInput(f"cuda_graphs {self.cuda_graphs!r}: use 'auto', 'on' or 'off'")
        if self.default_class not in ("rt", "be"):
            raise InvalidInput(f"default_class {self.default_class!r}: use 'rt' or 'be'")
        from splitserve.placement.devices import parse_device
        from splitserve.placement.packrat import PackratConfig

        parse_device(self.device)  # refuse "cuda:x", "gpu" early

        PackratConfig.parse(self.placement, self.max_batch_size)  # refuse a bad [placement] early

    @property
    def capacity(self) -> int:
        """The effective device-queue capacity (see ``segment_capacity``)."""
        if self.segment_capacity is not None:
            return self.segment_capacity
        return 4 if self.device.startswith("cuda") else 1

    # cached: every fast-path frame's check divides by it (the config is frozen)
    @functools.cached_property
    def request_bytes(self) -> int:
        """Payload bytes of one sample's inputs (fast path: payload_len / this = samples)."""
        return sum(t.nbytes for t in self.inputs)

    @functools.cached_property
    def response_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    def with_changes(self, **changes: Any) -> "ModelConfig":
        d = self.to_dict()
        d.update(changes)
        return ModelConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = [t.to_dict() for t in self.inputs]
        d["outputs"] = [t.to_dict() for t in self.outputs]
        d["labels"] = list(self.labels)
        d["cpus"] = list(self.cpus)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise InvalidInput(f"unknown config keys: {', '.join(sorted(unknown))}")
        if "name" not in d:
            raise InvalidInput("config has no 'name'")
        try:
            art = ArtifactConfig(**d.pop("artifact", {}))
            batching = d.pop("batching", {})
            if not isinstance(batching, dict):
                raise InvalidInput(f"model {d.get('name')!r}: [batching] must be a table, got {batching!r}")
            batching = BatchingConfig().changed(batching)
            memory = MemoryConfig(**d.pop("memory", {}))
            slo = d.pop("slo", {})
            if not isinstance(slo, dict):
                raise InvalidInput(f"model {d.get('name')!r}: [slo] must be a table, got {slo!r}")
            slo = SloConfig(**slo)
        except TypeError as e:
            raise InvalidInput(f"model {d.get('name')!r}: {e}") from None
        inputs = d.pop("inputs", None)
        outputs = d.pop("outputs", None)
        if (inputs is None or outputs is None) and art.kind.zoo_arch:
            entry = zoo_entry(art.arch or "")
            inputs = inputs if inputs is not None else [t.to_dict() for t in entry.inputs]
            outputs = outputs if outputs is not None else [t.to_dict() for t in entry.outputs]
            d.setdefault("max_batch_size", entry.max_batch)
        served = handler_tensors(check_handler(d.get("handler") or {}))
        if served is not None:
            inputs, outputs = [t.to_dict() for t in served[0]], [t.to_dict() for t in served[1]]
        if inputs is None or outputs is None:
            raise InvalidInput(f"model {d.get('name')!r}: inputs and outputs must be declared")
        try:
            return cls(
                inputs=tuple(TensorSpec.from_dict(t) for t in inputs),
                outputs=tuple(TensorSpec.from_dict(t) for t in outputs),
                artifact=art,
                batching=batching,
                memory=memory,
                slo=slo,
                labels=tuple(d.pop("labels", ())),
                cpus=tuple(int(c) for c in d.pop("cpus", ())),
                **d,
            )
        except TypeError as e:
            raise InvalidInput(f"model {d.get('name')!r}: {e}") from None

    @classmethod
    def from_toml(cls, text: str) -> "ModelConfig":
        try:
            return cls.from_dict(tomllib.loads(text))
        except tomllib.TOMLDecodeError as e:
            raise InvalidInput(f"config.toml is not valid TOML: {e}") from None
