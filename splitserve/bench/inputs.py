"""Deterministic request inputs for a model's tensor specs (numpy only, no torch).

Load-generator processes build their inputs from specs and a seed, so every process and the
validation phase agree on what is sent without pickling arrays between processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from splitserve.types import TensorSpec

# Token ids stay below this: inside every zoo text model's vocabulary.
_MAX_TOKEN_ID = 1000


def specs_from_dicts(specs: Sequence[dict[str, Any] | TensorSpec]) -> tuple[TensorSpec, ...]:
    return tuple(s if isinstance(s, TensorSpec) else TensorSpec.from_dict(s) for s in specs)


def _one(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    name = spec.name.lower()
    dt = spec.dtype
    if dt == np.uint8:
        return rng.integers(0, 256, spec.shape, dtype=np.uint8)
    if np.issubdtype(dt, np.integer):
        if "mask" in name:
            return np.ones(spec.shape, dtype=dt)
        if "type" in name:
            return np.zeros(spec.shape, dtype=dt)
        return rng.integers(0, _MAX_TOKEN_ID, spec.shape).astype(dt)
    if dt == np.bool_:
        return rng.integers(0, 2, spec.shape).astype(np.bool_)
    return rng.standard_normal(spec.shape).astype(dt)


def make_inputs(specs: Sequence[dict[str, Any] | TensorSpec], count: int, seed: int = 0) -> list[list[np.ndarray]]:
    """``count`` samples, each a list of arrays (one per input, declared order, no batch dim).

    Images are random bytes or normal floats; token ids lie in ``[0, 1000)``, attention masks
    are all ones and token types all zeros, so every zoo model accepts them.
    """
    rng = np.random.default_rng(seed)
    tensors = specs_from_dicts(specs)
    return [[_one(s, rng) for s in tensors] for _ in range(count)]


def as_call_arg(sample: Sequence[np.ndarray]) -> np.ndarray | tuple[np.ndarray, ...]:
    """What a client's ``infer`` takes: the array for a one-input model, else a tuple."""
    return sample[0] if len(sample) == 1 else tuple(sample)


def nbytes(specs: Sequence[dict[str, Any] | TensorSpec]) -> int:
    """Bytes of one sample of these tensors."""
    return sum(s.nbytes for s in specs_from_dicts(specs))
