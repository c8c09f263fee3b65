"""Models as an ordered list of segments, the unit the worker schedules and preempts.

A worker runs a request one segment at a time and may stop between two segments; the
activations that cross that boundary are the restore point it resumes from. That only
works if every segment is a pure function of its input activations, so segments never
modify their inputs in place and hold no state that changes at inference time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from splitserve.errors import InvalidInput

logger = logging.getLogger(__name__)

Acts = tuple[Tensor, ...]

# safetensors' dtype names (a header's "dtype") as torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

# Cost model of balanced_segments, in multiply-accumulate units, fitted on one CPU core.
# Besides its arithmetic, each leaf module call pays a fixed overhead (dispatch and the
# small-tensor ops not counted as MACs, ~10 us), and eager CPU convolutions re-lay out
# their weights on every call, which dominates for wide convs on small feature maps.
_LEAF_OVERHEAD_MACS = 500_000
_CONV_WEIGHT_MACS = 16


def as_acts(out: Any) -> Acts:
    """Normalise what a module returned (a tensor, tuple or list of tensors) to a tuple."""
    if isinstance(out, Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"a segment must return a tensor or a tuple of tensors, got {type(out).__name__}")


class Chain(nn.Module):
    """Modules run one after another, each receiving the previous one's outputs as positional args.

    Unlike ``nn.Sequential`` it threads several tensors between stages (e.g. hidden states
    and an attention mask), so it can group any run of consecutive units into one segment.
    """

    def __init__(self, *units: nn.Module) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, *acts: Tensor) -> Acts:
        """Run every unit in order and return the last one's outputs as a tuple."""
        out: Acts = acts
        for unit in self.units:
            out = as_acts(unit(*out))
        return out


class SegmentedModel(nn.Module):
    """A model split into ordered segments that can be run one at a time.

    Segment 0 receives the model inputs in declared order; segment ``i + 1`` receives what
    segment ``i`` returned; the last segment returns the outputs in declared order. The
    model is always in eval mode: it is only ever used for inference.
    """

    def __init__(self, segments: Iterable[nn.Module]) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        if len(self.segments) == 0:
            raise ValueError("a SegmentedModel needs at least one segment")
        # The same modules as a plain tuple: a batch looks its segments up here, as a
        # ModuleList's indexing and a submodule's attribute lookup cost microseconds a call
        self._segs = tuple(self.segments)
        self.eval()

    @property
    def num_segments(self) -> int:
        """How many segments a request goes through."""
        return len(self._segs)

    def run_segment(self, i: int, acts: Acts) -> Acts:
        """Run segment ``i`` on ``acts`` and return its outputs as a tuple.

        Pure: calling it again with the same ``acts`` gives identical outputs, and ``acts``
        themselves are left untouched, so they can serve as a restore point.
        """
        segs = self._segs
        if not 0 <= i < len(segs):
            raise IndexError(f"segment {i} out of range: model has {len(segs)} segments")
        return as_acts(segs[i](*acts))

    def forward(self, *inputs: Tensor) -> Acts:
        """Run all segments in order and return the outputs as a tuple."""
        acts: Acts = inputs
        for i in range(len(self._segs)):
            acts = self.run_segment(i, acts)
        return acts

    def train(self, mode: bool = True) -> SegmentedModel:
        """Set train/eval mode on every segment that allows switching it.

        Graphs loaded with ``torch.export`` have their mode fixed when exported and raise
        NotImplementedError on ``train()``/``eval()``; they are left as they are.
        """
        self.training = mode
        self.segments.training = mode
        for seg in self.segments:
            with contextlib.suppress(NotImplementedError):
                seg.train(mode)
        return self


def _leaf_cost(module: nn.Module, out: Any) -> int:
    """Estimated cost of one call of a leaf module, from its output size and conv weights."""
    if not isinstance(out, Tensor):
        return _LEAF_OVERHEAD_MACS
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        macs = out.numel() * (module.in_channels // module.groups) * kh * kw
        macs += _CONV_WEIGHT_MACS * module.weight.numel()
    elif isinstance(module, nn.Linear):
        macs = out.numel() * module.in_features
    else:
        macs = out.numel()
    return _LEAF_OVERHEAD_MACS + macs


def _unit_costs(units: Sequence[nn.Module], sample: Acts) -> list[int]:
    """Estimated cost of each unit on ``sample`` (see ``_leaf_cost``).

    Analytic rather than timed, so a model splits the same way on every machine.
    """
    total = [0]

    def hook(module: nn.Module, _args: Any, out: Any) -> None:
        total[0] += _leaf_cost(module, out)

    costs: list[int] = []
    acts = sample
    with torch.inference_mode():
        for unit in units:
            leaves = [m for m in unit.modules() if not list(m.children())] or [unit]
            handles = [m.register_forward_hook(hook) for m in leaves]
            try:
                total[0] = 0
                acts = as_acts(unit(*acts))
            finally:
                for h in handles:
                    h.remove()
            costs.append(total[0])
    return costs


def _even_partition(costs: Sequence[int], k: int) -> list[int]:
    """Cut points splitting ``costs`` into ``k`` contiguous groups of near-equal sums.

    Minimises the sum of squared group costs: unlike minimising only the largest group,
    this also avoids leaving tiny groups (a segment that is all overhead).
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][i]: smallest sum of squares for the first i units in j groups.
    best: list[list[int | None]] = [[None] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for p in range(j - 1, i):
                prev = best[j - 1][p]
                if prev is None:
                    continue
                v = prev + (prefix[i] - prefix[p]) ** 2
                cur = best[j][i]
                if cur is None or v < cur:
                    best[j][i], cut[j][i] = v, p
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]


def balanced_segments(units: Sequence[nn.Module], sample: Acts, k: int) -> SegmentedModel:
    """Group consecutive ``units`` into ``k`` segments of roughly equal estimated cost.

    ``sample`` is one input batch, used only to measure each unit's arithmetic.
    """
    k = min(k, len(units))
    for unit in units:
        unit.eval()  # so batch-norm statistics are not updated by the sizing pass
    costs = _unit_costs(units, sample)
    bounds = _even_partition(costs, k)
    spans = list(itertools.pairwise(bounds))
    logger.debug("segment costs: %s", [sum(costs[a:b]) for a, b in spans])
    return SegmentedModel(units[a] if b == a + 1 else Chain(*units[a:b]) for a, b in spans)


def save_safetensors(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``model``'s state dict to ``path`` as safetensors, atomically.

    The file is written under a temporary name in the same directory and renamed into
    place, so a reader (or a second writer racing this one) never sees a partial file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Cloned so tensors that share storage (views, tied weights) can still be written.
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide weights from other users' servers
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_safetensors(model: nn.Module, path: Path) -> None:
    """Make ``model``'s parameters and buffers views of the safetensors file ``path``; every
    key must match exactly.

    The file is memory-mapped (copy on write), not read: the tensors page in from the page
    cache as they are used, every process mapping the file shares those pages, and
    dropping the model unmaps them. ``load_state_dict(assign=True)`` keeps each module's
    own tensor properties (requires_grad) but takes the file's tensors as they are, so a
    tensor whose dtype differs from the module's is cast here (a private copy) to keep
    the module's dtype, as a copying load would. Tied weights come back untied (each key
    is its own tensor, equal in value), like any safetensors round trip.

    Raises InvalidInput when the file cannot be read or its keys or shapes do not match
    the architecture, naming the missing and unexpected keys.
    """
    try:
        state = load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as e:
        raise InvalidInput(f"{path}: not a readable safetensors file ({e})") from None
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise InvalidInput(
            f"{path} does not match the architecture: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )
    state = {k: t if t.dtype == own[k].dtype else t.to(own[k].dtype) for k, t in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # same keys, wrong shapes
        raise InvalidInput(f"{path} does not match the architecture: {e}") from None


def state_matches(model: nn.Module, path: Path) -> bool:
    """Whether the safetensors file ``path`` holds exactly ``model``'s keys, with the same
    shapes and dtypes (read from its header: no tensor is loaded). False if unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            own = model.state_dict()
            if keys != own.keys():
                return False
            for k in keys:
                s = f.get_slice(k)
                if tuple(s.get_shape()) != tuple(own[k].shape) or _DTYPES.get(s.get_dtype()) != own[k].dtype:
                    return False
    except (SafetensorError, OSError):
        return False
    return True


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file, or None if it has none or is unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata()
    except (SafetensorError, OSError):
        return None
