"""A model's weights as a file: which file (``weights_file``), their size read from the
safetensors header without loading (``header_bytes``), and dropping them from the page
cache (``drop_page_cache``).

Every model whose artifact names a zoo architecture has its weights in a safetensors
file that workers map: a ``safetensors`` artifact's own file, or for a ``zoo`` artifact
the seeded weights written once to ``<cache dir>/weights/<arch>-seed<seed>.safetensors``
(``models.zoo.load_zoo_model``). TorchScript and ``torch.export`` artifacts are loaded
by their own formats, so they have no such file: their size is known only once a worker
has loaded them (LOADED).

A safetensors file starts with an 8-byte little-endian header length and a JSON header that
names every tensor with its dtype, shape and ``data_offsets`` into the data section; the
sum of the tensors' byte ranges is what the weights take once mapped, known before any
worker loads them (Rafiqi had to sample device memory around a load for this, §3.4).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

from splitserve.errors import InvalidInput
from splitserve.modelconfig import ArtifactKind, ModelConfig
from splitserve.models.catalog import zoo_weights_path

log = logging.getLogger(__name__)

# The format's own bound on the header (safetensors refuses larger ones): a file claiming
# more is not one, and reading it must not allocate what its first 8 bytes say.
MAX_HEADER_BYTES = 100_000_000


def header_bytes(path: Path) -> int:
    """Bytes of tensor data in the safetensors file ``path`` (``__metadata__`` excluded);
    InvalidInput naming the file if it is not a safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"header of {n} B exceeds {MAX_HEADER_BYTES} B")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        return sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0])
                   for name, t in header.items() if name != "__metadata__")
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise InvalidInput(f"{path}: not a readable safetensors file ({e})") from None


def weights_file(config: ModelConfig, model_dir: Path | None, cache_dir: Path) -> Path | None:
    """The safetensors file a worker maps the weights of the model ``config`` from (a zoo
    model's may not be written yet: its first load writes it). None for TorchScript and
    export artifacts, and for zoo models without weights in a file (the gate)."""
    art = config.artifact
    if art.kind is ArtifactKind.ZOO:
        return zoo_weights_path(str(art.arch), art.seed, cache_dir)
    if art.kind is ArtifactKind.SAFETENSORS and model_dir is not None and art.file:
        return Path(model_dir) / art.file
    return None


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache, so the next load reads
    it from disk (pages a process still maps stay). Never raises: a file that is gone or
    refuses the advice is logged and left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("could not drop %s from the page cache: %s", path, e)
