"""TorchServe's stock handlers' pre- and post-processing, run in the worker as segments of
the model, so batching, REEF's restore points and the fast path apply to them as to the
model itself.

A model config's ``[handler]`` table names one (``name``; ``models/handler_spec.py`` checks
it and gives the tensors its model is served with); ``with_handler`` wraps a loaded model in
its parts:

- ``image_classifier``: input ``data``, UINT8 ``[4 + max_input_bytes]`` rounded up to
  4 KiB: a little-endian uint32 byte count and then the encoded image (PNG, JPEG, anything
  Pillow reads), zero padded; TorchServe's preprocessing (resize the short side to 256, centre crop 224,
  ImageNet normalisation); output the softmax's top 5 as ``scores`` (FP32 ``[5]``) and
  ``classes`` (INT64 ``[5]``), class -1 where the model has fewer than 5 classes. A row
  whose image cannot be decoded runs as NaN and answers NaN scores and class -1 everywhere,
  so one client's bad image never fails the batch it shares with others.
- ``base_handler``: the model's own tensors, nothing around it (TorchServe's base
  handler: the request's tensor in, the model's output out).

Pillow decodes the images; the resize is Pillow's bilinear, as torchvision's ``Resize``
does on a PIL image, so the tensor matches TorchServe's bit for bit."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from splitserve.models.handler_spec import IMAGE_CLASSIFIER, LENGTH_BYTES, TOP_K
from splitserve.models.segmented import SegmentedModel

__all__ = ["preprocess_image", "with_handler"]

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
RESIZE, CROP = 256, 224


def preprocess_image(image: Image.Image) -> np.ndarray:
    """TorchServe's image_classifier preprocessing of one image: CHW float32."""
    image = image.convert("RGB")
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(RESIZE * long / short)
    size = (RESIZE, new_long) if w <= h else (new_long, RESIZE)
    image = image.resize(size, Image.BILINEAR)
    top = int(round((size[1] - CROP) / 2.0))
    left = int(round((size[0] - CROP) / 2.0))
    image = image.crop((left, top, left + CROP, top + CROP))
    x = np.asarray(image, np.float32) / 255.0
    return ((x - MEAN) / STD).transpose(2, 0, 1)


def _decode_row(row: np.ndarray) -> np.ndarray:
    n = int.from_bytes(row[:LENGTH_BYTES].tobytes(), "little")
    if n > row.size - LENGTH_BYTES:
        raise ValueError(f"byte count {n} exceeds the row")
    with Image.open(io.BytesIO(row[LENGTH_BYTES:LENGTH_BYTES + n].tobytes())) as image:
        return preprocess_image(image)


class ImagePreprocess(nn.Module):
    """Encoded images in, the model's normalised 3x224x224 batch out (undecodable rows: NaN)."""

    def forward(self, data: torch.Tensor) -> tuple[torch.Tensor]:
        rows = data.cpu().numpy()
        out = np.empty((len(rows), 3, CROP, CROP), np.float32)
        for i, row in enumerate(rows):
            try:
                out[i] = _decode_row(row)
            except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
                out[i] = math.nan  # answered as such by TopK: the client hears its image was bad
        return (torch.from_numpy(out).to(data.device),)


class TopK(nn.Module):
    """The model's logits in, the softmax's top ``TOP_K`` scores and class indices out."""

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.reshape(len(logits), -1).float(), dim=1)
        k = min(TOP_K, probs.shape[1])
        scores, classes = torch.topk(probs, k, dim=1)
        if k < TOP_K:
            scores = torch.nn.functional.pad(scores, (0, TOP_K - k), value=0.0)
            classes = torch.nn.functional.pad(classes, (0, TOP_K - k), value=-1)
        bad = ~torch.isfinite(scores).all(dim=1)
        classes = torch.where(bad[:, None], torch.full_like(classes, -1), classes)
        return scores, classes


def _segments(model: nn.Module) -> list[nn.Module]:
    segs = getattr(model, "segments", None)
    return list(segs) if isinstance(segs, nn.ModuleList) else [model]


def with_handler(model: nn.Module, handler: Mapping[str, Any]) -> nn.Module:
    """``model`` (a SegmentedModel) with ``handler``'s pre- and post-processing as its first
    and last segments; the model itself when the handler adds none."""
    if handler.get("name") != IMAGE_CLASSIFIER:
        return model
    return SegmentedModel([ImagePreprocess(), *_segments(model), TopK()])
