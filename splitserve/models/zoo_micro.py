"""SplitRPC's microbenchmark models: they do almost no work, so a call measures the serving path."""

from __future__ import annotations

from torch import Tensor, nn

from splitserve.models.segmented import SegmentedModel


class VecAdd(nn.Module):
    """Elementwise ``a + b``."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """Return ``a + b``."""
        return a + b


class MatMul(nn.Module):
    """Batched matrix product ``a @ b``."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """Return ``a @ b``."""
        return a @ b


def vecadd() -> SegmentedModel:
    """VecAdd1K: one segment, no weights."""
    return SegmentedModel([VecAdd()])


def matmul() -> SegmentedModel:
    """MatMul8K: one segment, no weights."""
    return SegmentedModel([MatMul()])
