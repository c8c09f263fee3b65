"""Convolutional architectures of the zoo, written by hand (torchvision is not a dependency).

Each builder returns a SegmentedModel with freshly initialised weights drawn from the
global RNG, which the caller seeds (``zoo.init_zoo_model``). Activations are never
modified in place, so every segment is a pure function of its inputs. The DISB builders
narrow their layers and cut segments with ``balanced_segments``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from splitserve.models.segmented import SegmentedModel, balanced_segments


def conv_bn(cin: int, cout: int, k: int | tuple[int, int], stride: int = 1,
            padding: int | tuple[int, int] | None = None, relu: bool = True, eps: float = 1e-5) -> nn.Sequential:
    """Convolution without bias, batch norm and (optionally) ReLU; "same" padding by default."""
    if padding is None:
        padding = k // 2 if isinstance(k, int) else (k[0] // 2, k[1] // 2)
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, padding, bias=False), nn.BatchNorm2d(cout, eps=eps)]
    if relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def classifier_head(cin: int, classes: int) -> nn.Sequential:
    """Global average pool, flatten and a linear classifier."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def _sample(image: int) -> tuple[Tensor]:
    """One zero image batch: enough for ``balanced_segments`` to measure layer sizes."""
    return (torch.zeros(1, 3, image, image),)


# ---------------------------------------------------------------------------------------
# LeNet-5


class Rescale(nn.Module):
    """Integer pixels to float in [0, 1]: clients send raw UINT8 bytes, 4x fewer than FP32."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        """``x / scale`` as float32."""
        return x.to(torch.float32) / self.scale


def lenet() -> SegmentedModel:
    """Classic LeNet-5 on UINT8 [1, 28, 28] images (padded first conv, tanh, average pooling)."""
    return SegmentedModel([
        nn.Sequential(Rescale(255.0), nn.Conv2d(1, 6, 5, padding=2), nn.Tanh(), nn.AvgPool2d(2)),
        nn.Sequential(nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(400, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh()),
        nn.Linear(84, 10),
    ])


# ---------------------------------------------------------------------------------------
# ResNet


class Residual(nn.Module):
    """``relu(branch(x) + shortcut(x))``: one residual block."""

    def __init__(self, branch: nn.Module, shortcut: nn.Module) -> None:
        super().__init__()
        self.branch = branch
        self.shortcut = shortcut

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block."""
        return F.relu(self.branch(x) + self.shortcut(x))


def _residual(cin: int, width: int, stride: int, bottleneck: bool) -> tuple[Residual, int]:
    """A basic (two 3x3) or bottleneck (1x1-3x3-1x1, 4x expansion) block and its output channels."""
    if bottleneck:
        cout = 4 * width
        branch = nn.Sequential(conv_bn(cin, width, 1), conv_bn(width, width, 3, stride),
                               conv_bn(width, cout, 1, relu=False))
    else:
        cout = width
        branch = nn.Sequential(conv_bn(cin, width, 3, stride), conv_bn(width, width, 3, relu=False))
    shortcut = nn.Identity() if stride == 1 and cin == cout else conv_bn(cin, cout, 1, stride, relu=False)
    return Residual(branch, shortcut), cout


def _resnet_parts(depths: Sequence[int], bottleneck: bool, base: int, classes: int,
                  imagenet_stem: bool) -> tuple[nn.Module, list[list[nn.Module]], nn.Module]:
    """Stem, the blocks of each stage, and head of a ResNet with stage widths base * 1, 2, 4, 8."""
    if imagenet_stem:  # 7x7/2 conv and a max pool: 4x downsampling before the first stage
        stem: nn.Module = nn.Sequential(conv_bn(3, base, 7, 2), nn.MaxPool2d(3, 2, 1))
    else:  # CIFAR: one 3x3 conv, full resolution
        stem = conv_bn(3, base, 3)
    stages: list[list[nn.Module]] = []
    c = base
    for i, depth in enumerate(depths):
        blocks: list[nn.Module] = []
        for j in range(depth):
            block, c = _residual(c, base * 2**i, 2 if i > 0 and j == 0 else 1, bottleneck)
            blocks.append(block)
        stages.append(blocks)
    return stem, stages, classifier_head(c, classes)


def resnet(depths: Sequence[int], bottleneck: bool, classes: int, imagenet_stem: bool) -> SegmentedModel:
    """Standard-width ResNet (v1.5) in six segments: stem, the four stages, head."""
    stem, stages, head = _resnet_parts(depths, bottleneck, 64, classes, imagenet_stem)
    return SegmentedModel([stem, *(nn.Sequential(*blocks) for blocks in stages), head])


def resnet_disb(depths: Sequence[int], width: int, image: int, classes: int, segments: int) -> SegmentedModel:
    """Bottleneck ResNet of full depth but base width ``width`` (64 in the original), cut evenly."""
    stem, stages, head = _resnet_parts(depths, True, width, classes, imagenet_stem=True)
    units = [stem, *(b for blocks in stages for b in blocks), head]
    return balanced_segments(units, _sample(image), segments)


# ---------------------------------------------------------------------------------------
# VGG

VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def vgg19(width: float, image: int, hidden: int, classes: int, segments: int) -> SegmentedModel:
    """``vgg`` over VGG-19's layer pattern."""
    return vgg(VGG19, width, image, hidden, classes, segments)


def vgg(cfg: Sequence[int | str], width: float, image: int, hidden: int, classes: int,
        segments: int) -> SegmentedModel:
    """VGG with every conv narrowed by ``width`` and a ``hidden``-wide three-layer classifier."""
    units: list[nn.Module] = []
    c, side = 3, image
    for v in cfg:
        if v == "M":
            units.append(nn.MaxPool2d(2))
            side //= 2
        else:
            units.append(nn.Sequential(nn.Conv2d(c, int(int(v) * width), 3, padding=1), nn.ReLU()))
            c = int(int(v) * width)
    units.append(nn.Sequential(nn.Flatten(), nn.Linear(c * side * side, hidden), nn.ReLU(),
                               nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)))
    return balanced_segments(units, _sample(image), segments)


# ---------------------------------------------------------------------------------------
# DenseNet


class DenseLayer(nn.Module):
    """BN-ReLU-1x1-BN-ReLU-3x3 producing ``growth`` new channels, appended to the input."""

    def __init__(self, cin: int, growth: int, bn_size: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, bn_size * growth, 1, bias=False),
            nn.BatchNorm2d(bn_size * growth), nn.ReLU(), nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        """The input's channels followed by the new ones."""
        return torch.cat([x, self.body(x)], 1)


def densenet(blocks: Sequence[int], growth: int, image: int, classes: int, segments: int) -> SegmentedModel:
    """DenseNet-BC (compression 0.5) with the given block depths and growth rate, cut evenly."""
    c = 2 * growth
    units: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                            nn.MaxPool2d(3, 2, 1))]
    for i, depth in enumerate(blocks):
        for _ in range(depth):
            units.append(DenseLayer(c, growth))
            c += growth
        if i < len(blocks) - 1:
            units.append(nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False),
                                       nn.AvgPool2d(2)))
            c //= 2
    units.append(nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), classifier_head(c, classes)))
    return balanced_segments(units, _sample(image), segments)


# ---------------------------------------------------------------------------------------
# Inception v3
#
# A mixed block is a list of branches whose outputs are concatenated along channels. A branch
# is a list of steps: a ``Conv``, "max" (3x3/2 max pool), "avg" (3x3/1 average pool) or a
# nested mixed block.

Kernel = int | tuple[int, int]


class Conv(NamedTuple):
    """A conv-BN-ReLU step; "same" padding unless ``padding`` is given."""

    out: int
    k: Kernel
    stride: int = 1
    padding: Kernel | None = None


Step = Union[Conv, str, "MixedSpec"]
MixedSpec = list[list[Step]]


class Mixed(nn.Module):
    """Parallel branches on the same input, concatenated along channels."""

    def __init__(self, branches: Sequence[nn.Module]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: Tensor) -> Tensor:
        """Concatenate every branch's output."""
        return torch.cat([b(x) for b in self.branches], 1)


def _branch(cin: int, steps: Sequence[Step], width: float) -> tuple[nn.Sequential, int]:
    """Build one branch, scaling conv channels by ``width``; returns it and its output channels."""
    layers: list[nn.Module] = []
    c = cin
    for step in steps:
        if isinstance(step, Conv):
            layers.append(conv_bn(c, int(step.out * width), step.k, step.stride, step.padding, eps=1e-3))
            c = int(step.out * width)
        elif isinstance(step, list):
            block, c = _mixed(c, step, width)
            layers.append(block)
        elif step == "max":
            layers.append(nn.MaxPool2d(3, 2))
        else:
            layers.append(nn.AvgPool2d(3, 1, 1))
    return nn.Sequential(*layers), c


def _mixed(cin: int, spec: MixedSpec, width: float) -> tuple[Mixed, int]:
    """Build a mixed block from its spec; returns it and its output channels."""
    branches = [_branch(cin, steps, width) for steps in spec]
    return Mixed([b for b, _ in branches]), sum(c for _, c in branches)


def _inception_a(pool: int) -> MixedSpec:
    """35x35 module of v3 (here at 7x7): 1x1, 5x5, double 3x3 and pooled branches."""
    return [[Conv(64, 1)], [Conv(48, 1), Conv(64, 5)], [Conv(64, 1), Conv(96, 3), Conv(96, 3)],
            ["avg", Conv(pool, 1)]]


def _inception_c(c7: int) -> MixedSpec:
    """17x17 module of v3 (here at 3x3): factorised 7x7 convs with ``c7`` inner channels."""
    return [[Conv(192, 1)],
            [Conv(c7, 1), Conv(c7, (1, 7)), Conv(192, (7, 1))],
            [Conv(c7, 1), Conv(c7, (7, 1)), Conv(c7, (1, 7)), Conv(c7, (7, 1)), Conv(192, (1, 7))],
            ["avg", Conv(192, 1)]]


_STEM: list[Step] = [Conv(32, 3, 2, 0), Conv(32, 3, 1, 0), Conv(64, 3), "max", Conv(80, 1), Conv(192, 3, 1, 0), "max"]
_REDUCE_B: MixedSpec = [[Conv(384, 3, 2, 0)], [Conv(64, 1), Conv(96, 3), Conv(96, 3, 2, 0)], ["max"]]
_REDUCE_D: MixedSpec = [[Conv(192, 1), Conv(320, 3, 2, 0)],
                        [Conv(192, 1), Conv(192, (1, 7)), Conv(192, (7, 1)), Conv(192, 3, 2, 0)], ["max"]]
_SPLIT_3: MixedSpec = [[Conv(384, (1, 3))], [Conv(384, (3, 1))]]
_INCEPTION_E: MixedSpec = [[Conv(320, 1)], [Conv(384, 1), _SPLIT_3], [Conv(448, 1), Conv(384, 3), _SPLIT_3],
                           ["avg", Conv(192, 1)]]


def inception_v3(width: float, image: int, classes: int, segments: int) -> SegmentedModel:
    """Inception v3 stem and mixed blocks A, A, B, C, C, D, E (v3 has 3 A, 4 C and 2 E), narrowed."""
    stem, c = _branch(3, _STEM, width)
    units: list[nn.Module] = [stem]
    for spec in (_inception_a(32), _inception_a(64), _REDUCE_B, _inception_c(128), _inception_c(160),
                 _REDUCE_D, _INCEPTION_E):
        block, c = _mixed(c, spec, width)
        units.append(block)
    units.append(classifier_head(c, classes))
    return balanced_segments(units, _sample(image), segments)
