"""The validation phase (SplitRPC §6.1): check the answers before timing anything.

For each model and transport a scenario will measure, a few inputs are sent and the answers
compared with the same model run locally (``build_zoo_model`` with the expected seed, torch in
this process). A server that answers wrongly gets no numbers: ``check_all`` raises
``ValidationFailed`` and the scenario writes a refusal instead of a report.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from splitserve.bench.inputs import as_call_arg

# Largest accepted error relative to the largest expected magnitude: far above float32
# rounding (batched kernels reorder sums) and far below a different model's answer.
DEFAULT_TOLERANCE = 1e-3

# send(model, sample) -> outputs by name, in declared order
Sender = Callable[[str, Any], "dict[str, np.ndarray]"]


@dataclass(frozen=True)
class Expected:
    """What a served model name should be: a zoo architecture with seeded weights."""

    arch: str
    seed: int = 0


@dataclass
class Check:
    """One (model, transport) validation: passed or not, and by how much it was off."""

    model: str
    transport: str
    ok: bool
    samples: int
    max_rel_error: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ValidationFailed(Exception):
    """The server answered wrongly; the scenario must not report numbers for it."""

    def __init__(self, checks: Sequence[Check]) -> None:
        self.checks = list(checks)
        bad = [c for c in self.checks if not c.ok]
        super().__init__("; ".join(f"{c.model} over {c.transport}: {c.detail}" for c in bad) or "validation failed")


@functools.lru_cache(maxsize=16)
def reference_model(arch: str, seed: int = 0) -> Any:
    """The zoo model the server should be running, built here (cached per process)."""
    from splitserve.models.zoo import build_zoo_model

    return build_zoo_model(arch, seed)


def reference_outputs(arch: str, seed: int, samples: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
    """The local model's outputs for each sample (one forward pass for all of them)."""
    import torch

    model = reference_model(arch, seed)
    batch = [torch.from_numpy(np.stack([s[i] for s in samples])) for i in range(len(samples[0]))]
    with torch.inference_mode():
        outs = model(*batch)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [[np.asarray(o[k].numpy()) for o in outs] for k in range(len(samples))]


def compare(got: Sequence[np.ndarray], want: Sequence[np.ndarray], tolerance: float = DEFAULT_TOLERANCE) -> tuple[bool, float, str]:
    """(ok, relative error, what was wrong) for one sample's outputs."""
    if len(got) != len(want):
        return False, float("inf"), f"{len(got)} outputs, expected {len(want)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        if g.shape != w.shape:
            return False, float("inf"), f"output {i} has shape {list(g.shape)}, expected {list(w.shape)}"
        if not np.all(np.isfinite(g)):
            return False, float("inf"), f"output {i} has non-finite values"
        scale = max(float(np.max(np.abs(w))), 1e-6) if w.size else 1.0
        err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) / scale if w.size else 0.0
        worst = max(worst, err)
    if worst > tolerance:
        return False, worst, f"answers differ from the local model by {worst:.3g} (relative; limit {tolerance:g})"
    return True, worst, ""


def check(send: Sender, model: str, transport: str, samples: Sequence[Sequence[np.ndarray]],
          expected: Sequence[Sequence[np.ndarray]], tolerance: float = DEFAULT_TOLERANCE) -> Check:
    """Send every sample and compare; errors from ``send`` count as a failed check."""
    worst = 0.0
    for sample, want in zip(samples, expected):
        try:
            out = send(model, as_call_arg(sample))
        except Exception as e:  # a server that cannot answer fails validation, whatever the error
            return Check(model, transport, False, len(samples), None, f"request failed: {type(e).__name__}: {e}")
        got = list(out.values()) if isinstance(out, dict) else [out]
        ok, err, detail = compare(got, want, tolerance)
        if not ok:
            return Check(model, transport, False, len(samples), err, detail)
        worst = max(worst, err)
    return Check(model, transport, True, len(samples), worst)


def check_all(checks: Iterable[Check]) -> list[Check]:
    """The checks, or ``ValidationFailed`` if any failed."""
    checks = list(checks)
    if any(not c.ok for c in checks):
        raise ValidationFailed(checks)
    return checks
