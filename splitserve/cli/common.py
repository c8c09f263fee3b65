"""What the command modules share: the console they print on, the help of their
``--data-dir`` option and the narrow size column of their tables."""

from __future__ import annotations

from rich.console import Console

console = Console()
DATA_DIR_HELP = "The server's data directory (default: ./.splitserve)."


def size_text(n: int | None) -> str:
    """Bytes for a narrow column: ``44.7M``; ``-`` when unknown."""
    if not n:
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
