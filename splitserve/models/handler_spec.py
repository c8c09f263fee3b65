"""What a model config's ``[handler]`` table says, without torch: its checks, the tensors a
model is served with under it, and a request's image as its input row. The handlers
themselves, which run in the worker, are ``models/handlers.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from splitserve.errors import InvalidInput
from splitserve.types import TensorSpec

__all__ = ["BASE_HANDLER", "HANDLERS", "IMAGE_CLASSIFIER", "LENGTH_BYTES", "TOP_K", "check_handler", "encode_image",
           "handler_tensors", "row_bytes"]

IMAGE_CLASSIFIER = "image_classifier"
BASE_HANDLER = "base_handler"
HANDLERS = (IMAGE_CLASSIFIER, BASE_HANDLER)
TOP_K = 5
LENGTH_BYTES = 4  # the uint32 byte count in front of an encoded image
DEFAULT_MAX_INPUT_BYTES = 1 << 20
PAGE = 4096
MANIFEST = "MAR-INF/MANIFEST.json"  # a TorchServe archive's manifest


def check_handler(handler: Mapping[str, Any]) -> dict[str, Any]:
    """``handler`` validated (InvalidInput naming the key): ``name`` one of ``HANDLERS``,
    ``max_input_bytes`` a positive int (image_classifier), ``index_to_name`` a table of
    class index to name, the rest (where the model came from) kept as given."""
    if not handler:
        return {}
    h = dict(handler)
    if h.get("name") not in HANDLERS:
        raise InvalidInput(f"handler.name {h.get('name')!r}: splitserve runs the handlers {', '.join(HANDLERS)}")
    size = h.setdefault("max_input_bytes", DEFAULT_MAX_INPUT_BYTES)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= 1 << 30:
        raise InvalidInput(f"handler.max_input_bytes must be a positive number of bytes, got {size!r}")
    names = h.get("index_to_name", {})
    if not isinstance(names, Mapping) or not all(isinstance(v, str) for v in names.values()):
        raise InvalidInput("handler.index_to_name must map class indices to names")
    return h


def row_bytes(max_input_bytes: int) -> int:
    """The image_classifier's input row: the byte count and the largest image, rounded up to
    whole pages, so a tensor-queue ring of it needs no more slots than asked (a ring's slots
    must end on a page boundary together)."""
    return -(-(LENGTH_BYTES + max_input_bytes) // PAGE) * PAGE


def handler_tensors(handler: Mapping[str, Any]) -> tuple[list[TensorSpec], list[TensorSpec]] | None:
    """The inputs and outputs a model is served with under ``handler`` (None: its own)."""
    if handler.get("name") != IMAGE_CLASSIFIER:
        return None
    return ([TensorSpec("data", "UINT8", (row_bytes(int(handler["max_input_bytes"])),))],
            [TensorSpec("scores", "FP32", (TOP_K,)), TensorSpec("classes", "INT64", (TOP_K,))])


def encode_image(data: bytes, max_input_bytes: int) -> np.ndarray:
    """One image's bytes as the image_classifier's ``data`` row; InvalidInput when too large."""
    if len(data) > max_input_bytes:
        raise InvalidInput(f"the image is {len(data)} bytes; this model takes at most {max_input_bytes}")
    row = np.zeros(row_bytes(max_input_bytes), np.uint8)
    row[:LENGTH_BYTES] = np.frombuffer(len(data).to_bytes(LENGTH_BYTES, "little"), np.uint8)
    row[LENGTH_BYTES:LENGTH_BYTES + len(data)] = np.frombuffer(data, np.uint8)
    return row
