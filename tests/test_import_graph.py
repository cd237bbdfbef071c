"""The modules of hetero import each other one way: no import circle, no private name across modules.

A circle (``a`` imports ``b`` imports ... imports ``a``) means none of its modules can be read,
tested or changed on its own, and whether the package imports at all depends on which module of
the circle is imported first. A private name (``_name``) taken from another module is a promise
that module never made. Every import counts: at the top of a file, inside a function (a lazy
import still ties the two modules together), relative or absolute, and ``importlib.import_module``
with a literal name.

The graph is built from the source (AST), over ``hetero/`` and the folders ``setup.py`` maps into
it (``predictor/`` -> ``hetero.predictor``, ``planner/`` -> ``hetero.planner``, ``backends/`` ->
``hetero.backends``). An edge goes from a file to the module it names: ``import a.b.c`` and
``from a.b import c`` (``c`` a module) name ``a.b.c``; ``from a.b import name`` names ``a.b``. The
package a module sits in is not an edge of its own (Python imports it first, but a package that
gathers its modules in ``__init__`` would otherwise close a circle with every one of them).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass, field

import pytest
from helpers.imports import from_source, literal_import

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the folders setup.py maps into the one ``hetero`` namespace
ROOTS = {"hetero": ROOT / "hetero", "hetero.predictor": ROOT / "predictor",
         "hetero.planner": ROOT / "planner", "hetero.backends": ROOT / "backends"}

pytestmark = pytest.mark.timeout(60)


@dataclass
class Module:
    name: str
    path: pathlib.Path
    is_package: bool
    # (line, imported module) for every import; (line, module, private name) for names taken
    imports: list[tuple[int, str]] = field(default_factory=list)
    private: list[tuple[int, str, str]] = field(default_factory=list)


def _module_files(roots: dict[str, pathlib.Path]) -> dict[str, Module]:
    modules = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            modules[name] = Module(name, path, is_package)
    return modules


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scan(module: Module, known: dict[str, Module]) -> None:
    """Fill ``module.imports`` and ``module.private`` from its source."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    tree = ast.parse(module.path.read_text(), str(module.path))
    aliases: dict[str, str] = {}  # local name -> imported module, for ``alias._name`` look-ups
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                module.imports.append((node.lineno, a.name))
                if a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = from_source(node, package)
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in known:
                    module.imports.append((node.lineno, sub))
                    aliases[a.asname or a.name] = sub
                else:
                    module.imports.append((node.lineno, source))
                    if _private(a.name):
                        module.private.append((node.lineno, source, a.name))
        elif (literal := literal_import(node)) is not None:
            module.imports.append((node.lineno, literal))
    # ``import hetero.runtime.zero as z; z._name``: a private name reached through a module alias
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                and aliases.get(node.value.id) in known):
            module.private.append((node.lineno, aliases[node.value.id], node.attr))


def build(roots: dict[str, pathlib.Path] = ROOTS) -> dict[str, Module]:
    """Every module under ``roots`` with its imports, restricted to modules under ``roots``."""
    modules = _module_files(roots)
    for module in modules.values():
        _scan(module, modules)
        module.imports = [(line, m) for line, m in module.imports if m in modules and m != module.name]
        module.private = [p for p in module.private if p[1] in modules and p[1] != module.name]
    return modules


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted, largest first
    (Tarjan's algorithm, iterative; a module importing itself gets the module it is)."""
    graph = {name: sorted({m for _, m in mod.imports}) for name, mod in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def _describe(component: list[str], modules: dict[str, Module]) -> str:
    inside = set(component)
    edges = [f"    {modules[a].path.relative_to(ROOT)}:{line} -> {b}"
             for a in component for line, b in modules[a].imports if b in inside]
    return f"  {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges)


def test_no_import_circles():
    modules = build()
    assert len(modules) > 100, "the scan found too few modules to mean anything"
    found = circles(modules)
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(_describe(c, modules) for c in found)


def test_no_private_name_crosses_modules():
    bad = [f"{mod.path.relative_to(ROOT)}:{line} takes {name} from {source}"
           for mod in build().values() for line, source, name in mod.private]
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_the_scan_sees_every_kind_of_import(tmp_path):
    # a scan that saw too little would pass the two tests above vacuously
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("import os\nfrom .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import _hidden\n")
    (pkg / "c.py").write_text("def g():\n    import importlib\n    importlib.import_module('pkg.d')\n")
    (pkg / "d.py").write_text("import pkg.a as alias\nalias._peek\n")
    (pkg / "e.py").write_text("from pkg import a\nfrom . import d\n")  # imports, but in no circle
    modules = build({"pkg": pkg})
    assert circles(modules) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]
    assert sorted((m.name, p[1], p[2]) for m in modules.values() for p in m.private) == [
        ("pkg.d", "pkg.a", "_peek"), ("pkg.sub.b", "pkg.c", "_hidden")]

