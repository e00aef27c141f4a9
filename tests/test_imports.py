"""Imports only point down (STYLE.md §1): each module of the package belongs to a layer, imports only what its
layer may, and no two modules import each other, directly or around a circle (top-level and deferred
imports alike). Read from the source with `ast`; nothing is imported."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import pkgutil

PACKAGE = "marljax"

# The entry points (`python -m marljax.NAME`): at the top of marljax/, each with a `__main__`, imported by
# nothing (what they share lives below them: `marljax.build`, `marljax.analysis`).
ENTRY_POINTS = ("train", "evaluate", "report", "compare", "generate", "matrix")
# Layers, lowest first, and what each may import (STYLE.md §1). A module's layer is that of the longest
# prefix listed here; a module none matches fails the test until it is placed.
LAYERS: dict[str, str] = {
    "marljax.core": "core",
    "marljax.models": "models",
    "marljax.sampling": "sampling",
    "marljax.tasks": "tasks",
    "marljax.workflows": "workflows",
    "marljax.rl": "rl",
    "marljax.config": "build", "marljax.build": "build", "marljax.aot": "build",
    "marljax.analysis": "analysis",
    **{f"marljax.{m}": "entry" for m in ENTRY_POINTS},
    "marljax": "entry",
}
MAY_IMPORT: dict[str, set[str]] = {
    "core": {"core"},
    "models": {"models", "core"},
    "sampling": {"sampling", "models", "core"},
    "tasks": {"tasks"},
    "workflows": {"workflows", "tasks"},
    "rl": {"rl", "sampling", "models", "core"},
    "build": {"build", "rl", "workflows", "tasks", "sampling", "models", "core"},
    "analysis": {"analysis", "build", "rl", "workflows", "tasks", "sampling", "models", "core"},
    "entry": {"analysis", "build", "rl", "workflows", "tasks", "sampling", "models", "core"},
}
# Where each layer lives: a package of its own, or (build, entry) modules at the top of marljax/.
PACKAGES = ("core", "models", "sampling", "tasks", "workflows", "rl", "analysis")

Graph = dict[str, list[tuple[str, int]]]  # module -> [(imported module of the package, line)]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    prefixes = [".".join(parts[:n]) for n in range(len(parts), 1, -1)] + [module]  # the root: itself only
    return next((LAYERS[p] for p in prefixes if p in LAYERS), None)


def package_root() -> pathlib.Path:
    return pathlib.Path(importlib.util.find_spec(PACKAGE).origin).parent


def package_sources(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package under `root`: dotted name -> source file (a package: its __init__.py)."""
    sources = {PACKAGE: root / "__init__.py"}

    def walk(path: pathlib.Path, prefix: str):
        for info in pkgutil.iter_modules([str(path)]):
            name = f"{prefix}.{info.name}"
            if info.ispkg:
                sources[name] = path / info.name / "__init__.py"
                walk(path / info.name, name)
            else:
                sources[name] = path / f"{info.name}.py"

    walk(root, PACKAGE)
    return sources


def import_graph(sources: dict[str, pathlib.Path]) -> Graph:
    """Each module's imports of other modules of the package, at any depth of its code. `from pkg import
    name` counts as an import of pkg.name when that is a module, else of pkg; the root package itself (run
    by every import of a submodule) is not an edge."""
    graph: Graph = {}
    for module, path in sources.items():
        is_pkg = path.name == "__init__.py"
        edges = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    anchor = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                    base = ".".join(anchor + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in sources]
                edges += [(s, node.lineno) for s in subs]
                if len(subs) < len(node.names):
                    edges.append((base, node.lineno))
        graph[module] = [(t, line) for t, line in edges if t != module and t.startswith(PACKAGE + ".")]
    return graph


def layer_violations(graph: Graph, files: dict[str, str]) -> list[str]:
    """One line per import that leaves what its module's layer may import (or per unplaced module)."""
    out = []
    for module, edges in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            out.append(f"{module}: not in any layer; add it to LAYERS in tests/test_imports.py (STYLE.md §1)")
            continue
        for target, line in edges:
            target_layer = layer_of(target)
            if target_layer is None or target_layer not in MAY_IMPORT[layer]:
                out.append(f"{files[module]}:{line}: {module} ({layer}) imports {target} ({target_layer}); "
                           f"the {layer} layer may import only {sorted(MAY_IMPORT[layer])}")
    return out


def cycles(graph: Graph) -> list[list[str]]:
    """The import cycles of `graph`: one module circle per strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                found.append(_circle(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle(graph: Graph, component: set[str]) -> list[str]:
    """One closed path through a strongly connected component, from its first module back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to `start`
        nxt = []
        for v in frontier:
            for w, _ in graph.get(v, ()):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_imports_point_down_and_form_no_cycle():
    root = package_root()
    sources = package_sources(root)
    graph = import_graph(sources)
    assert {"marljax.sampling", "marljax.models.lora", "marljax.tasks.problem"} <= set(graph)
    assert "marljax.models.decoder" in {t for t, _ in graph["marljax.sampling"]}
    problems = layer_violations(graph, {m: str(p.relative_to(root.parent)) for m, p in sources.items()})
    problems += ["import cycle: " + " -> ".join(c) for c in cycles(graph)]
    assert not problems, "\n".join(problems)


def test_nothing_imports_an_entry_point():
    """No module of the package imports an entry point (what they share lives below them), and no script
    in bench/ reaches into `train` or `evaluate` (the benchmarks build through `marljax.build`)."""
    root = package_root()
    graph = import_graph(package_sources(root))
    entries = {f"{PACKAGE}.{m}" for m in ENTRY_POINTS}
    into = [f"{m}:{line} imports {t}" for m, edges in sorted(graph.items()) for t, line in edges if t in entries]
    for script in sorted((root.parent / "bench").glob("*.py")):
        into += [f"{script.name}:{node.lineno} imports {name}" for node in ast.walk(ast.parse(script.read_text()))
                 if isinstance(node, (ast.Import, ast.ImportFrom))
                 for name in [a.name if isinstance(node, ast.Import) else f"{node.module}.{a.name}" for a in node.names]
                 if name in (f"{PACKAGE}.train", f"{PACKAGE}.evaluate")]
    assert len(graph) > 40 and not into, "\n".join(into)


def test_the_package_imports_nothing_from_the_checkout():
    """bench/ and tests/ are not installed: a module of the package that imports them works only from a
    checkout with it on sys.path (aot once imported bench.flops, and `python bench/aot_short_rows.py` failed)."""
    found = [f"{path.name}:{node.lineno} imports {name}" for path in package_sources(package_root()).values()
             for node in ast.walk(ast.parse(path.read_text()))
             for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                          else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
             if name.split(".")[0] in ("bench", "tests", "benchdoc", "conftest")]
    assert found == []


def test_the_tree_shows_the_layers():
    """A module's path names its layer: each layer below build is a package of that name; the top of
    marljax/ holds the build modules and the entry points, each of which runs as `python -m`."""
    root = package_root()
    top = {info.name: info.ispkg for info in pkgutil.iter_modules([str(root)])}
    assert {name for name, ispkg in top.items() if ispkg} == set(PACKAGES)
    assert all(layer_of(f"{PACKAGE}.{name}") == name for name in PACKAGES)
    modules = sorted(name for name, ispkg in top.items() if not ispkg)
    assert [m for m in modules if layer_of(f"{PACKAGE}.{m}") not in ("build", "entry")] == []
    mains = {m for m in modules if 'if __name__ == "__main__":' in (root / f"{m}.py").read_text()}
    assert mains == set(ENTRY_POINTS), "entry points: exactly the top-level modules that run as `python -m`"


def test_the_checker_finds_an_upward_import_a_forbidden_one_and_a_cycle():
    graph: Graph = {
        "marljax.models.decoder": [("marljax.core.sharding", 3), ("marljax.train", 4)],  # upward
        "marljax.core.sharding": [],
        "marljax.train": [("marljax.models.decoder", 1)],
        "marljax.tasks.arith": [("marljax.tasks.data", 2)],
        "marljax.tasks.data": [("marljax.tasks.arith", 5), ("marljax.sampling", 6)],  # tasks may not
        "marljax.sampling": [],
        "marljax.widgets": [],
    }
    problems = layer_violations(graph, {m: m for m in graph})
    assert problems == [
        "marljax.models.decoder:4: marljax.models.decoder (models) imports marljax.train (entry); the models "
        "layer may import only ['core', 'models']",
        "marljax.tasks.data:6: marljax.tasks.data (tasks) imports marljax.sampling (sampling); the tasks layer "
        "may import only ['tasks']",
        "marljax.widgets: not in any layer; add it to LAYERS in tests/test_imports.py (STYLE.md §1)"]
    assert sorted(cycles(graph)) == [["marljax.models.decoder", "marljax.train", "marljax.models.decoder"],
                                     ["marljax.tasks.arith", "marljax.tasks.data", "marljax.tasks.arith"]]
    assert cycles({"a": [("b", 1)], "b": [("c", 1)], "c": [("a", 1)], "d": [("a", 1)]}) == [["a", "b", "c", "a"]]


def test_import_graph_reads_deferred_relative_and_from_imports(tmp_path):
    pkg = tmp_path / "marljax"
    (pkg / "tasks").mkdir(parents=True)
    (pkg / "core").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "sharding.py").write_text("")
    (pkg / "tasks" / "__init__.py").write_text("from . import data\n")
    (pkg / "tasks" / "data.py").write_text("import os\n\ndef f():\n    from marljax.tasks.arith import g\n")
    (pkg / "tasks" / "arith.py").write_text("from .data import f\nfrom marljax.core import sharding\n"
                                            "from marljax import __version__\n")
    graph = import_graph(package_sources(pkg))
    assert graph == {"marljax": [], "marljax.core": [], "marljax.core.sharding": [],
                     "marljax.tasks": [("marljax.tasks.data", 1)],
                     "marljax.tasks.data": [("marljax.tasks.arith", 4)],
                     "marljax.tasks.arith": [("marljax.tasks.data", 1), ("marljax.core.sharding", 2)]}
    assert cycles(graph) == [["marljax.tasks.arith", "marljax.tasks.data", "marljax.tasks.arith"]]
    assert layer_violations(graph, {m: m for m in graph}) == [
        "marljax.tasks.arith:2: marljax.tasks.arith (tasks) imports marljax.core.sharding (core); the tasks layer "
        "may import only ['tasks']"]


# namedtuple's public methods, and the standard library's documented private-looking names
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_exit"}


def private_uses(sources: dict[str, pathlib.Path]) -> list[str]:
    """Uses of another module's private (`_`-prefixed) names: `from marljax.x import _f`, or `obj._f` where
    `_f` is not defined in the module that uses it (its own classes' private members are its business)."""
    found = []
    for module, path in sorted(sources.items()):
        tree = ast.parse(path.read_text())
        own = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(PACKAGE):
                found += [f"{path.name}:{n.lineno} imports {n.module}.{a.name}" for a in n.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                  and n.attr not in own | PUBLIC_UNDERSCORE):
                found.append(f"{path.name}:{n.lineno} uses {ast.unparse(n)}")
    return found


def test_no_module_uses_another_modules_private_names():
    """Modules meet through public names only (issue #47): what another module needs is made public."""
    assert private_uses(package_sources(package_root())) == []


def test_private_uses_are_found(tmp_path):
    (tmp_path / "a.py").write_text("from marljax.sampling.engine.engine import _hidden\nx = engine._spare()\n"
                                   "class C:\n    def _own(self):\n        return other._own(), t._replace()\n")
    assert private_uses({"a": tmp_path / "a.py"}) == ["a.py:1 imports marljax.sampling.engine.engine._hidden",
                                                      "a.py:2 uses engine._spare"]
