"""The import graph of ``shmkv/`` has no cycle.

Layers import downwards only (``/work/shared/STYLE.md``, "Layers, imports pointing down
only"): a module that imports one that imports it back, even from inside a function, is
a circle that makes the order of loading matter and the layering unreadable. The graph
is built from the source with :mod:`ast` (nothing is imported): every ``import`` and
``from ... import`` in a module, at its top level, in its functions and classes, relative
or absolute, resolved to the modules of this package it names.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "shmkv"


def module_names(package_dir: Path = PACKAGE_DIR) -> Dict[str, Path]:
    """``{dotted module name: source file}`` for every module of the package."""
    root = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_base(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute module named by ``from <level dots><target> import ...`` in ``module``."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]  # a module's dot is its package
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def _with_packages(name: str, importer: str, modules: Dict[str, Path]) -> Set[str]:
    """``name`` and the packages above it that importing it loads, less those the
    importer is inside of (they are loaded before it)."""
    out = set()
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in modules and not (importer == prefix or importer.startswith(prefix + ".")):
            out.add(prefix)
    return out


def imports_of(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The modules of this package that ``module`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out |= _with_packages(alias.name, module, modules)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, is_package, node.level, node.module)
            out |= _with_packages(base, module, modules)
            for alias in node.names:  # "from . import protocol" names a module
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in modules:
                    out.add(sub)
    out.discard(module)
    return out


def import_graph(package_dir: Path = PACKAGE_DIR) -> Dict[str, Set[str]]:
    """``{module: modules of the package it imports}``."""
    modules = module_names(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan),
    each as the modules along it, the first repeated at the end."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: Dict[str, Set[str]], component: Set[str]) -> List[str]:
    """A shortest cycle through the component's first module, by breadth-first search."""
    start = min(component)
    parents: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in strongly connected component {sorted(component)}")


def test_resolves_relative_and_absolute_imports(tmp_path):
    """The graph builder sees every form of import this package uses (so the test
    below can fail): a circle through a function-level import is found and named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import C\n    return C\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.d\nfrom .. import e\nC = 2\n")
    (pkg / "d.py").write_text("def g():\n    from .a import A\n    return A\n")
    (pkg / "e.py").write_text("from pkg.sub import c\n")
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.d", "pkg.e"}  # its own package is loaded first
    assert graph["pkg.e"] == {"pkg.sub", "pkg.sub.c"}
    cycles = find_cycles(graph)
    assert len(cycles) == 1
    cycle = cycles[0]
    assert cycle[0] == cycle[-1]
    for src, dst in zip(cycle, cycle[1:]):
        assert dst in graph[src], (src, dst)
    assert cycle == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.a"]


def test_no_import_cycles():
    """No module of ``shmkv/`` imports, directly or through others, one that imports it."""
    graph = import_graph()
    assert "shmkv.coordinator.server" in graph and graph["shmkv.coordinator.server"], (
        "no graph built"
    )
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in shmkv/:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )
