"""No module of ``splitserve/`` over 700 lines and no class over 35 methods: past those sizes
a module or a class plays more than one role, and a newcomer can no longer hold it in their
head. Generated code (``protocol/_generated``) is not written by hand and is left out.

A method is any ``def`` or ``async def`` directly in a class's body (properties and static
methods included); a class nested in another is a class of its own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import splitserve

PACKAGE = Path(splitserve.__file__).parent
GENERATED = PACKAGE / "protocol" / "_generated"
MAX_MODULE_LINES = 700
MAX_CLASS_METHODS = 35


def _sources() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if not path.is_relative_to(GENERATED):
            yield path


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_the_scan_sees_the_package() -> None:
    names = {_name(p) for p in _sources()}
    assert "splitserve/__init__.py" in names and len(names) > 50
    assert not any(n.startswith("splitserve/protocol/_generated/") for n in names)


def test_no_module_over_700_lines() -> None:
    offenders = []
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            offenders.append(f"{_name(path)}: {lines} lines")
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(offenders)


def test_no_class_over_35_methods() -> None:
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
            if methods > MAX_CLASS_METHODS:
                offenders.append(f"{_name(path)}:{node.lineno} {node.name}: {methods} methods")
    assert not offenders, f"classes over {MAX_CLASS_METHODS} methods:\n  " + "\n  ".join(offenders)
