"""What ``pip install splitserve`` brings and what the ``bench`` extra adds: every third-party
import in the package is declared in pyproject.toml where the importing code needs it."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable
from importlib.metadata import packages_distributions
from pathlib import Path

import splitserve
from splitserve.bench import EXTRA_MODULES
from splitserve.bench.peers import PEERS

PACKAGE = Path(splitserve.__file__).parent
BENCH = PACKAGE / "bench"
ROOT = PACKAGE.parent
# the peers' server scripts: they import the peers (pytriton, ray) from environments of their own
PEER_SCRIPTS = [BENCH / "peers" / p.script for p in PEERS.values()]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# the Ray half of cluster mode: imported only by `splitserve cluster` and Ray's own processes
RAY_HALF = [*sorted((PACKAGE / "cluster" / "actors").glob("*.py")), PACKAGE / "cluster" / "cli.py"]
# benchmarks of a live Ray cluster: they need the cluster extra besides the bench one
CLUSTER_BENCH = [BENCH / "scenarios" / "cluster_tax.py", BENCH / "scenarios" / "cluster_check.py",
                 BENCH / "netns.py", BENCH / "netns_driver.py"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(requirements: Iterable[str]) -> set[str]:
    """Distribution names of requirement strings (``uvloop>=0.19; sys_platform != 'win32'``)."""
    out = set()
    for r in requirements:
        m = re.match(r"[A-Za-z0-9._-]+", r)
        assert m, r
        out.add(_norm(m.group()))
    return out


def _third_party_imports(files: Iterable[Path]) -> dict[str, set[str]]:
    """Top-level module -> the files importing it, every import counted (function-level and
    type-only ones too)."""
    out: dict[str, set[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("__future__", "splitserve"):
                    out.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return out


def _undeclared(files: Iterable[Path], allowed: set[str]) -> dict[str, list[str]]:
    """Imported modules that no distribution in ``allowed`` provides, with their importers."""
    provides = packages_distributions()
    return {m: sorted(where) for m, where in _third_party_imports(files).items()
            if not {_norm(d) for d in provides.get(m, ())} & allowed}


def test_the_server_and_cli_import_only_core_dependencies() -> None:
    core = _declared(PROJECT["dependencies"])
    files = [f for f in PACKAGE.rglob("*.py") if BENCH not in f.parents and f not in RAY_HALF]
    assert _undeclared(files, core) == {}
    assert "matplotlib" not in core


def test_the_ray_half_imports_only_core_and_cluster_dependencies() -> None:
    allowed = _declared(PROJECT["dependencies"]) | _declared(PROJECT["optional-dependencies"]["cluster"])
    assert _undeclared(RAY_HALF, allowed) == {}


def test_the_benchmarks_import_only_core_and_bench_dependencies() -> None:
    allowed = _declared(PROJECT["dependencies"]) | _declared(PROJECT["optional-dependencies"]["bench"])
    assert _undeclared([f for f in BENCH.rglob("*.py") if f not in PEER_SCRIPTS + CLUSTER_BENCH], allowed) == {}
    assert _undeclared(CLUSTER_BENCH, allowed | _declared(PROJECT["optional-dependencies"]["cluster"])) == {}


def test_the_peers_server_scripts_import_their_peer_and_never_splitserve() -> None:
    # they run in the peers' own environments (bench peers), where splitserve is not installed
    for f in PEER_SCRIPTS:
        tops: set[str] = set()
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(n, ast.Import):
                tops |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module:
                tops.add(n.module.split(".")[0])
        assert "splitserve" not in tops and "torch" in tops, f


def test_the_bench_extra_is_what_splitserve_bench_checks_for_and_the_setup_installs() -> None:
    provides = packages_distributions()
    checked = {_norm(d) for m in EXTRA_MODULES for d in provides.get(m, ())}
    assert checked == _declared(PROJECT["optional-dependencies"]["bench"])
    assert '".[test,bench,cluster]"' in (ROOT / "scripts" / "setup.sh").read_text()
