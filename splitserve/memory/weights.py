"""A model's weights as a file: their size read from the safetensors header, without loading.

A safetensors file starts with an 8-byte little-endian header length and a JSON header that
names every tensor with its dtype, shape and ``data_offsets`` into the data section; the
sum of the tensors' byte ranges is what the weights take once mapped, known before any
worker loads them (Rafiqi had to sample device memory around a load for this, §3.4).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from splitserve.errors import InvalidInput

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
