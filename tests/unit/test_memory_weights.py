"""header_bytes: a safetensors file's tensor bytes from its header alone."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from splitserve.errors import InvalidInput
from splitserve.memory.weights import header_bytes


def test_header_bytes_sums_the_tensors(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.float64), "c": torch.zeros(2, dtype=torch.int8)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"model": "x"})
    assert header_bytes(path) == sum(t.nbytes for t in tensors.values()) == 3 * 5 * 4 + 7 * 8 + 2


@pytest.mark.parametrize("content", [b"", b"\x05\x00", b"\xff" * 8 + b"{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]",
                                     b"\x04\x00\x00\x00\x00\x00\x00\x00{x}!"])
def test_header_bytes_refuses_what_is_not_safetensors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(InvalidInput, match="not a readable safetensors file"):
        header_bytes(path)
