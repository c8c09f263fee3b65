"""Results folders shared by every benchmark scenario, and the one percentile helper.

A scenario makes a ``ResultsDir`` and writes ``result.json`` (its numbers plus, under fixed
keys, the machine, the git commit and the parameters it ran with), ``report.md`` and PNG
plots, so every run can be compared later without remembering how it was made.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

# Keys write_json adds to every result; a result that uses them itself is refused.
RESERVED_KEYS: tuple[str, ...] = ("scenario", "created", "machine", "commit", "params")


def percentiles(values: Sequence[float] | np.ndarray, ps: Sequence[float]) -> list[float]:
    """The ``ps`` percentiles (0-100) of ``values``, linearly interpolated, in order of ``ps``.

    NaN for every percentile when ``values`` is empty, so callers can summarise an empty run
    without a special case (``json_safe`` turns NaN into null).
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return [math.nan] * len(ps)
    return [float(v) for v in np.percentile(arr, list(ps))]


def json_safe(value: Any) -> Any:
    """``value`` with numpy scalars, paths, dataclasses and tuples made JSON-friendly.

    NaN and infinities become None: strict JSON has no spelling for them.
    """
    if is_dataclass(value) and not isinstance(value, type):
        return json_safe(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu_names() -> list[str]:
    # nvidia-smi answers in milliseconds; importing torch just to ask would cost seconds.
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            return [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            logger.debug("nvidia-smi failed", exc_info=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return []


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: cores, CPU, memory, Python, torch, GPUs, host.

    ``torch`` is the installed version (read from package metadata, without importing torch),
    None when torch is not installed; ``gpus`` lists CUDA device names, empty without one.
    """
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch_version,
        "gpus": _gpu_names(),
    }


def git_commit(repo: Path | None = None) -> str | None:
    """The commit checked out in ``repo`` (default: the splitserve source tree), or None.

    None outside a git checkout or without git; a result must never fail for want of it.
    """
    where = repo if repo is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
            timeout=10, check=True,
            # a read-only question must not take git's index lock from a concurrent commit
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


class ResultsDir:
    """One run's folder, ``root/<scenario>-<UTC timestamp>/``, created on construction.

    Made by a scenario before it starts measuring; ``params`` (what the scenario ran with) is
    recorded in every JSON it writes. ``now`` exists for tests that need a fixed timestamp.
    """

    def __init__(
        self,
        root: Path,
        scenario: str,
        params: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> None:
        if not scenario or any(c in scenario for c in "/\\") or scenario.startswith("."):
            raise ValueError(f"scenario name {scenario!r} must be a plain folder name")
        self.scenario = scenario
        self.params: dict[str, Any] = dict(params or {})
        self.created = (now or datetime.now(UTC)).astimezone(UTC)
        stamp = self.created.strftime("%Y%m%dT%H%M%SZ")
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{scenario}-{stamp}"
        n = 1
        while True:
            try:
                path.mkdir()
                break
            except FileExistsError:  # two runs in the same second keep separate folders
                n += 1
                path = root / f"{scenario}-{stamp}-{n}"
        self.path = path
        self._machine: dict[str, Any] | None = None
        logger.info("results go to %s", path)

    def write_json(self, result: Mapping[str, Any], name: str = "result.json") -> Path:
        """Write ``result`` plus scenario, created, machine, commit and params; return the path."""
        clash = sorted(set(result) & set(RESERVED_KEYS))
        if clash:
            raise ValueError(f"result keys {clash} are reserved for ResultsDir")
        if self._machine is None:
            self._machine = machine_info()
        doc = {
            "scenario": self.scenario,
            "created": self.created.isoformat(),
            "machine": self._machine,
            "commit": git_commit(),
            "params": self.params,
            **result,
        }
        path = self.path / name
        path.write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    def write_report(self, markdown: str, name: str = "report.md") -> Path:
        """Write the human-readable report; return its path."""
        path = self.path / name
        path.write_text(markdown if markdown.endswith("\n") else markdown + "\n", encoding="utf-8")
        return path

    def save_plot(self, fig: Figure, name: str, dpi: int = 120) -> Path:
        """Save ``fig`` as ``<name>.png`` (Agg renderer, no display needed); return its path.

        Build figures with ``matplotlib.figure.Figure()`` rather than pyplot, so no GUI backend
        is ever chosen and nothing has to be closed afterwards.
        """
        stem = name[:-4] if name.lower().endswith(".png") else name
        if not stem or any(c in stem for c in "/\\"):
            raise ValueError(f"plot name {name!r} must be a plain file name")
        path = self.path / f"{stem}.png"
        # format="png" renders through Agg whatever backend pyplot may have selected
        fig.savefig(path, format="png", dpi=dpi, bbox_inches="tight")
        return path
