"""The import graph of ``splitserve/`` has no cycle, counting every import: module level,
inside functions, and under ``TYPE_CHECKING``. A cycle means two parts are written against
each other, so neither can be replaced or tested without the other (``docs/node.md``).

Edges follow what an import names. ``from package import submodule`` depends on the
submodule, and ``import a.b.c`` on ``a.b.c``: that Python runs ``a/__init__`` and
``a/b/__init__`` first is how packages load, not a dependency of the importer (else every
module in a package whose ``__init__`` re-exports it would sit in a cycle with it).
Nothing is excluded.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import splitserve

PACKAGE = Path(splitserve.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name, with whether it is a package's ``__init__``."""
    out = {}
    # a C extension (splitserve/_fastwire.c) is a module too, one that imports nothing of the
    # package: without it, ``from splitserve import _fastwire`` would count as importing the package
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c")]:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


@functools.cache  # every test reads the same files: each is parsed once a run, not once a test
def _parse(path: Path) -> ast.Module:
    """A module's syntax tree (a C extension's: empty, it imports nothing of ours)."""
    return ast.parse(path.read_text() if path.suffix == ".py" else "", str(path))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        while name not in modules and "." in name:  # ``import a.b.func``-style: the module part
            name = name.rsplit(".", 1)[0]
        if name in modules and name != module:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, (path, is_pkg) in modules.items():
        deps = graph[module] = set()
        for node in ast.walk(_parse(path)):  # every import, at any depth
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_targets(node, module, is_pkg, modules))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path = [root]
        stack = [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_type_only_and_function_level_imports():
    graph = import_graph()
    assert "splitserve.server.ports" in graph["splitserve.server.model.core"]
    # function-level: the CLI imports the composition root only when it serves
    assert "splitserve.server.app" in graph["splitserve.cli.serve"]
    # a deliberately cyclic pair is reported as a cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_splitserve_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_nothing_below_the_composition_root_imports_it():
    importers = sorted(m for m, deps in import_graph().items() if "splitserve.server.app" in deps)
    assert importers == ["splitserve.cli.serve"]


def test_only_the_tests_and_benchmarks_import_the_fakes_of_the_seams():
    """``splitserve.testing`` holds fakes of the node's seams: no part of the server may lean on them."""
    importers = sorted(m for m, deps in import_graph().items()
                       if any(d == "splitserve.testing" or d.startswith("splitserve.testing.") for d in deps))
    assert importers, "the graph should see the fuzz targets import the fakes"
    assert [m for m in importers if not m.startswith(("splitserve.bench.", "splitserve.testing."))] == []


def _imports_run_on_load(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: not those inside functions (run when
    called) nor under ``if TYPE_CHECKING:`` (never run)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def loaded_with(root: str) -> tuple[set[str], set[str]]:
    """What importing ``root`` loads: its splitserve modules (with the packages Python runs
    first) and the dotted names of every other module they import at load."""
    modules = _modules()
    ours: set[str] = set()
    theirs: set[str] = set()
    todo = [root]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for name in [".".join(parts[:i]) for i in range(1, len(parts))] + [module]:
            if name in ours or name not in modules:
                continue
            ours.add(name)
            path, is_pkg = modules[name]
            for node in _imports_run_on_load(_parse(path)):
                found = _targets(node, name, is_pkg, modules)
                todo.extend(found)
                if isinstance(node, ast.Import):
                    theirs.update(a.name for a in node.names if not a.name.startswith("splitserve"))
                elif node.level == 0 and node.module and not node.module.startswith("splitserve"):
                    theirs.add(node.module)
    return ours, theirs


# The processes that never run a model: the node's front end (its composition root and the
# CLI that starts it), the client library, the cluster's data plane and its Ray actors. Importing
# torch costs ~3 s of CPU per process on this 2-core machine: each server start paid it,
# through the models package's re-exports, before the catalogue was split from the builders.
TORCH_FREE = ("splitserve.server.app", "splitserve.cli", "splitserve.client",
              "splitserve.cluster.gateway.dataplane", "splitserve.cluster.actors.controller",
              "splitserve.cluster.actors.node_server", "splitserve.cluster.actors.ingress")


def test_processes_that_run_no_model_do_not_import_torch():
    for root in TORCH_FREE:
        ours, theirs = loaded_with(root)
        torch = sorted(m for m in theirs if m.split(".")[0] == "torch" or m.endswith(".torch"))
        assert not torch, f"importing {root} loads {torch}"
    assert "splitserve.models.catalog" in loaded_with("splitserve.server.app")[0]


def test_the_load_time_imports_skip_functions_and_type_checking():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\ndef f():\n    import c\ntry:\n    import d\n"
                     "except ImportError:\n    pass\n")
    assert sorted(n.names[0].name for n in _imports_run_on_load(tree)) == ["a", "d"]


# cluster mode's layers, each allowed to import only those before it: the pure deciders, the
# gateway's data plane, the Ray half (docs/cluster.md)
CLUSTER_LAYERS = ("splitserve.cluster.policy", "splitserve.cluster.gateway", "splitserve.cluster.actors")


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_cluster_layers_import_only_the_layers_before_them():
    graph = import_graph()
    for i, layer in enumerate(CLUSTER_LAYERS):
        later = CLUSTER_LAYERS[i + 1:]
        wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() if _in_package(m, layer)
                       for d in deps if any(_in_package(d, other) for other in later))
        assert not wrong, wrong
    # the layering does bind: the Ray half does import the data plane
    assert "splitserve.cluster.gateway.core" in graph["splitserve.cluster.actors.controller"]


def test_the_clusters_deciders_and_data_plane_import_no_ray():
    """The data plane is a plain process the Gateway actor supervises (docs/cluster.md): it
    starts fast and carries every request with no Ray in it; what it sends up to the
    controller (a registration's ``ModelSpec``) lives in its package for that reason. The
    deciders are pure. So no module of either package imports Ray, at any depth, and
    neither does anything they load."""
    modules = _modules()
    for module, (path, _) in sorted(modules.items()):
        if not any(_in_package(module, layer) for layer in CLUSTER_LAYERS[:2]):
            continue
        direct = [n for n in ast.walk(_parse(path)) if isinstance(n, (ast.Import, ast.ImportFrom))
                  and any(name.split(".")[0] == "ray" for name in
                          ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
        assert not direct, f"{module} imports Ray"
        _, theirs = loaded_with(module)
        assert not sorted(m for m in theirs if m.split(".")[0] == "ray"), f"importing {module} loads Ray"
