"""DISB workloads (REEF §7.1): real-time clients on a schedule next to best-effort ones.

Reads DISB's JSON workload form into typed dataclasses, refusing every malformed file with an
InvalidInput that names the field path (``tasks[2].load.frequency: ...``), and provides the
published workloads A-E and REAL. ``workload_arrivals`` turns a workload into an open-loop
arrival schedule (periodic, poisson and trace tasks) plus the continuous tasks, which run as
closed-loop clients.

Two details follow DISB's own files: ``load.trace`` lists milliseconds from the start, and a
task without ``load.priority`` is real-time unless its load is ``continuous``. DISB's long
model names (``vgg19-imagenet`` ...) are read as splitserve's short ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench import arrivals as arr
from splitserve.bench.arrivals import Arrival
from splitserve.errors import InvalidInput

MODELS: tuple[str, ...] = ("resnet152", "densenet201", "vgg19", "inception_v3", "distilbert")
LOAD_TYPES: tuple[str, ...] = ("periodic", "poisson", "continuous", "trace")
BUILTIN: tuple[str, ...] = ("A", "B", "C", "D", "E", "REAL")

# DISB's model names -> splitserve's, so DISB's published workload files load as they are.
MODEL_ALIASES: dict[str, str] = {
    "vgg19-imagenet": "vgg19",
    "resnet152-imagenet": "resnet152",
    "densenet201-imagenet": "densenet201",
    "inceptionv3-imagenet": "inception_v3",
    "inceptionv3": "inception_v3",
}

_TOP_KEYS = {"time", "tasks", "name"}
_TASK_KEYS = {"id", "load", "client"}
_LOAD_KEYS = {"type", "priority", "frequency", "trace"}
# DISB clients also carry their framework's server addresses; accepted and not used here.
_CLIENT_KEYS = {"name", "model_name", "batch_size", "tfs_grpc_addr", "triton_grpc_addr"}


@dataclass(frozen=True)
class Load:
    """When a task sends: ``frequency`` req/s for periodic and poisson, ``trace`` (ms from the
    start, ascending) for trace, nothing for continuous (closed loop, back to back)."""

    type: str
    priority: int | None = None  # 0 = real-time, anything else best-effort; None = by type
    frequency: float | None = None
    trace: tuple[float, ...] | None = None

    @property
    def cls(self) -> str:
        """``"rt"`` or ``"be"``: from the priority, else real-time unless continuous."""
        if self.priority is not None:
            return "rt" if self.priority == 0 else "be"
        return "be" if self.type == "continuous" else "rt"


@dataclass(frozen=True)
class ClientSpec:
    """Which model a task's requests go to and with how many samples per request."""

    model_name: str
    batch_size: int = 1
    name: str | None = None


@dataclass(frozen=True)
class Task:
    """One DISB client: its id, its load and the model it calls."""

    id: str
    load: Load
    client: ClientSpec

    @property
    def cls(self) -> str:
        """The task's class, ``"rt"`` or ``"be"``."""
        return self.load.cls


@dataclass(frozen=True)
class Workload:
    """A DISB workload: run for ``time`` seconds with all ``tasks`` at once."""

    time: float
    tasks: tuple[Task, ...]
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """DISB's JSON form; ``parse_workload(w.to_dict()) == w``."""
        tasks = []
        for t in self.tasks:
            load: dict[str, Any] = {"type": t.load.type}
            if t.load.priority is not None:
                load["priority"] = t.load.priority
            if t.load.frequency is not None:
                load["frequency"] = t.load.frequency
            if t.load.trace is not None:
                load["trace"] = list(t.load.trace)
            client: dict[str, Any] = {"model_name": t.client.model_name, "batch_size": t.client.batch_size}
            if t.client.name is not None:
                client["name"] = t.client.name
            tasks.append({"id": t.id, "load": load, "client": client})
        out: dict[str, Any] = {"time": self.time, "tasks": tasks}
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload a DISB run uses: a built-in name, or a parsed file (``workload`` set)."""

    label: str
    builtin: str | None = None
    workload: Workload | None = None


def _fail(path: str, message: str) -> InvalidInput:
    return InvalidInput(f"{path}: {message}")


def _object(value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, f"must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        where = f"{path}.{unknown[0]}" if path != "workload" else unknown[0]
        raise _fail(where, f"unknown field; expected one of {', '.join(sorted(allowed))}")
    return value


def _positive_number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(path, f"must be a positive number, got {value!r}")
    return float(value)


def _int(value: Any, path: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise _fail(path, f"must be >= {minimum}, got {value}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _parse_load(value: Any, path: str) -> Load:
    raw = _object(value, path, _LOAD_KEYS)
    if "type" not in raw:
        raise _fail(f"{path}.type", "missing; expected one of " + ", ".join(LOAD_TYPES))
    kind = raw["type"]
    if kind not in LOAD_TYPES:
        raise _fail(f"{path}.type", f"unknown load type {kind!r}; expected one of {', '.join(LOAD_TYPES)}")
    priority = _int(raw["priority"], f"{path}.priority") if "priority" in raw else None
    frequency = trace = None
    if kind in ("periodic", "poisson"):
        if "frequency" not in raw:
            raise _fail(f"{path}.frequency", f"missing; a {kind} load needs a rate in req/s")
        frequency = _positive_number(raw["frequency"], f"{path}.frequency")
    elif "frequency" in raw:
        raise _fail(f"{path}.frequency", f"not used by a {kind} load; remove it")
    if kind == "trace":
        if "trace" not in raw:
            raise _fail(f"{path}.trace", "missing; a trace load needs a list of send times in ms")
        items = raw["trace"]
        if not isinstance(items, list) or not items:
            raise _fail(f"{path}.trace", "must be a non-empty list of send times in ms")
        times = []
        for i, t in enumerate(items):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise _fail(f"{path}.trace[{i}]", f"must be a number of ms >= 0, got {t!r}")
            times.append(float(t))
        trace = tuple(sorted(times))  # DISB sorts its traces too
    elif "trace" in raw:
        raise _fail(f"{path}.trace", f"not used by a {kind} load; remove it")
    return Load(type=kind, priority=priority, frequency=frequency, trace=trace)


def _parse_client(value: Any, path: str) -> ClientSpec:
    raw = _object(value, path, _CLIENT_KEYS)
    if "model_name" not in raw:
        raise _fail(f"{path}.model_name", "missing")
    model = _string(raw["model_name"], f"{path}.model_name")
    batch = _int(raw.get("batch_size", 1), f"{path}.batch_size", minimum=1)
    name = _string(raw["name"], f"{path}.name") if "name" in raw else None
    for key in ("tfs_grpc_addr", "triton_grpc_addr"):
        if key in raw and not isinstance(raw[key], str):
            raise _fail(f"{path}.{key}", f"must be a string, got {raw[key]!r}")
    return ClientSpec(model_name=MODEL_ALIASES.get(model, model), batch_size=batch, name=name)


def parse_workload(doc: Any) -> Workload:
    """Validate DISB's JSON form (already decoded) and return the typed workload."""
    raw = _object(doc, "workload", _TOP_KEYS)
    if "time" not in raw:
        raise _fail("time", "missing; the run length in seconds")
    duration = _positive_number(raw["time"], "time")
    name = _string(raw["name"], "name") if "name" in raw else None
    if "tasks" not in raw:
        raise _fail("tasks", "missing; a list of tasks")
    items = raw["tasks"]
    if not isinstance(items, list) or not items:
        raise _fail("tasks", "must be a non-empty list of tasks")
    tasks: list[Task] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        path = f"tasks[{i}]"
        task = _object(item, path, _TASK_KEYS)
        for key in ("load", "client"):
            if key not in task:
                raise _fail(f"{path}.{key}", "missing")
        if "id" in task:
            tid = task["id"]
            if isinstance(tid, bool) or not isinstance(tid, (str, int)) or (isinstance(tid, str) and not tid.strip()):
                raise _fail(f"{path}.id", f"must be a non-empty string or an integer, got {tid!r}")
            tid = str(tid).strip()
        else:
            tid = str(i)
        if tid in seen:
            raise _fail(f"{path}.id", f"duplicate task id {tid!r}")
        seen.add(tid)
        tasks.append(Task(tid, _parse_load(task["load"], f"{path}.load"),
                          _parse_client(task["client"], f"{path}.client")))
    return Workload(time=duration, tasks=tuple(tasks), name=name)


def load_workload(path: Path | str) -> Workload:
    """Read and validate a DISB workload file; errors name the file and the field."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read workload file: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{path}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    try:
        return parse_workload(doc)
    except InvalidInput as e:
        raise InvalidInput(f"{path}: {e.message}") from None


def _task(tid: str, model: str, load: dict[str, Any]) -> dict[str, Any]:
    return {"id": tid, "load": load, "client": {"model_name": model, "batch_size": 1}}


def _be_all() -> list[dict[str, Any]]:
    return [_task(f"{m}_be", m, {"type": "continuous"}) for m in MODELS]


# REAL: the Apollo perception trace DISB replays is camera-driven chains at roughly fixed
# rates, ~43 req/s in all. These (model, frames/s, requests per frame) reproduce that mix:
# vgg19 answers each frame with a burst of four requests a few ms apart.
_REAL_CHAINS: tuple[tuple[str, float, int], ...] = (
    ("resnet152", 10.0, 1),
    ("densenet201", 4.5, 1),
    ("vgg19", 3.5, 4),
    ("inception_v3", 10.0, 1),
    ("distilbert", 4.5, 1),
)
_REAL_JITTER = 0.03  # frame-time jitter, as a fraction of the frame period
_REAL_BURST_GAP_MS = 4.0
_REAL_SEED = 0x5EEF  # REAL is a fixed trace: the same schedule in every run


def _real_trace(model_rate: float, per_frame: int, duration: float, rng: np.random.Generator) -> list[float]:
    period_ms = 1000.0 / model_rate
    frames = int(duration * 1000.0 / period_ms)
    start = rng.uniform(0.0, period_ms)
    out: list[float] = []
    for k in range(frames):
        t = start + k * period_ms + rng.normal(0.0, _REAL_JITTER * period_ms)
        for j in range(per_frame):
            ms = max(0.0, t + j * _REAL_BURST_GAP_MS)
            if ms < duration * 1000.0:
                out.append(round(ms, 3))
    return out


def builtin(name: str, duration: float = 60.0, rate_scale: float = 1.0) -> Workload:
    """DISB workload ``name`` (A, B, C, D, E or REAL) running for ``duration`` seconds.

    ``rate_scale`` multiplies every real-time rate (CPU runs cannot take 100 VGG-19 req/s);
    continuous best-effort clients are closed loop and need no scaling.

    - A: real-time vgg19 periodic 100 req/s + best-effort resnet152 continuous.
    - B: real-time vgg19 continuous + best-effort resnet152 continuous.
    - C: real-time vgg19 periodic 100 req/s + five best-effort continuous clients, one per model.
    - D: five real-time periodic clients at 20 req/s, one per model + the five best-effort.
    - E: as D with Poisson arrivals.
    - REAL: real-time perception-like trace, ~43 req/s over the five models + the five
      best-effort.
    """
    key = name.upper()
    if key not in BUILTIN:
        raise InvalidInput(f"unknown DISB workload {name!r}; expected one of {', '.join(BUILTIN)}")
    _positive_number(duration, "duration")
    _positive_number(rate_scale, "rate_scale")
    tasks: list[dict[str, Any]]
    if key == "A":
        tasks = [_task("vgg19_rt", "vgg19", {"type": "periodic", "priority": 0, "frequency": 100 * rate_scale}),
                 _task("resnet152_be", "resnet152", {"type": "continuous"})]
    elif key == "B":
        # DISB marks this continuous client real-time by its id only; say it with a priority.
        tasks = [_task("vgg19_rt", "vgg19", {"type": "continuous", "priority": 0}),
                 _task("resnet152_be", "resnet152", {"type": "continuous"})]
    elif key == "C":
        tasks = [_task("vgg19_rt", "vgg19", {"type": "periodic", "priority": 0, "frequency": 100 * rate_scale}),
                 *_be_all()]
    elif key in ("D", "E"):
        kind = "periodic" if key == "D" else "poisson"
        tasks = [_task(f"{m}_rt", m, {"type": kind, "priority": 0, "frequency": 20 * rate_scale})
                 for m in MODELS] + _be_all()
    else:
        rng = np.random.default_rng(_REAL_SEED)
        traces = [(m, _real_trace(hz * rate_scale, n, duration, rng)) for m, hz, n in _REAL_CHAINS]
        # a chain too slow to fire once in a short, scaled-down run is left out, not refused
        tasks = [_task(f"{m}_rt", m, {"type": "trace", "priority": 0, "trace": tr})
                 for m, tr in traces if tr] + _be_all()
    return parse_workload({"name": key, "time": duration, "tasks": tasks})


def workload_arrivals(
    workload: Workload, rng: np.random.Generator
) -> tuple[list[Arrival], list[Task]]:
    """The open-loop schedule of ``workload`` and its closed-loop (continuous) tasks.

    Arrivals are tagged with their task id and ordered by time. Periodic real-time tasks that
    share a frequency are spread evenly over one period, as DISB staggers them, so they do not
    all fire at once. Continuous tasks are returned whole: run each as one closed-loop client
    of ``task.client.model_name`` in class ``task.cls``.
    """
    periodic_groups: dict[float, list[Task]] = {}
    for t in workload.tasks:
        if t.load.type == "periodic" and t.cls == "rt" and t.load.frequency is not None:
            periodic_groups.setdefault(t.load.frequency, []).append(t)
    streams: list[list[Arrival]] = []
    closed: list[Task] = []
    for t in workload.tasks:
        load, model = t.load, t.client.model_name
        if load.type == "continuous":
            closed.append(t)
            continue
        if load.type == "periodic":
            assert load.frequency is not None
            group = periodic_groups.get(load.frequency, [])
            phase = group.index(t) / (len(group) * load.frequency) if t in group else 0.0
            times = arr.uniform(load.frequency, workload.time, phase)
        elif load.type == "poisson":
            assert load.frequency is not None
            times = arr.poisson(load.frequency, workload.time, rng)
        else:
            assert load.trace is not None
            times = np.asarray(load.trace) / 1000.0
            times = times[times < workload.time]
        streams.append(arr.to_arrivals(times, model, t.cls, t.id))
    return arr.merge(*streams), closed
