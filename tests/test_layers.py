"""The layers point one way: the predictor and the planner import neither the CLI nor the runtime.

The CLI is the top floor and the runtime trains; the predictor and planner sit below both (the
runtime's elastic replanning calls the planner, not the other way round). An import that goes up,
even a lazy one inside a function, would make the predict path depend on the training code.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOWER = {"hetero.predictor": ROOT / "predictor", "hetero.planner": ROOT / "planner"}
UPPER = ("hetero.cli", "hetero.runtime")

pytestmark = pytest.mark.timeout(60)


def imported_modules(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in a file, at any depth (functions included), relative
    imports resolved against ``package``, and ``importlib.import_module("...")`` with a literal."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def _upward(root_package: str, folder: pathlib.Path) -> list[str]:
    bad = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        # the package a relative import in this file is relative to
        package = ".".join([root_package, *parts[:-1]] if path.name != "__init__.py" else [root_package, *parts])
        for line, module in imported_modules(path, package):
            if any(module == up or module.startswith(up + ".") for up in UPPER):
                bad.append(f"{path.relative_to(folder.parent)}:{line} imports {module}")
    return bad


def test_predictor_and_planner_import_neither_cli_nor_runtime():
    bad = [b for package, folder in LOWER.items() for b in _upward(package, folder)]
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_the_scan_sees_lazy_relative_and_from_imports(tmp_path):
    # a scan that found nothing because it looked at too little would pass the test above vacuously
    (tmp_path / "a.py").write_text(
        "import os\n"
        "def f():\n"
        "    from hetero.cli._common import console\n"
        "    from ..runtime import model\n"
        "    import hetero.runtime.grads as g\n"
        "    from hetero import cli\n"
        "    importlib.import_module('hetero.runtime.zero')\n")
    found = _upward("hetero.predictor", tmp_path)
    assert [b.split(" imports ")[1] for b in found] == [
        "hetero.cli._common", "hetero.cli._common.console", "hetero.runtime", "hetero.runtime.model",
        "hetero.runtime.grads", "hetero.cli", "hetero.runtime.zero"]


def test_every_predictor_and_planner_module_imports_without_torch():
    # the measuring code (hetero.measure) runs torch; what predicts and plans never loads it
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys\n"
            "import hetero.predictor, hetero.planner\n"
            "names = [m.name for p in (hetero.predictor, hetero.planner)\n"
            "         for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
            "for name in names:\n"
            "    importlib.import_module(name)\n"
            "assert len(names) > 20, names\n"
            "up = sorted(k for k in sys.modules if k == 'torch' or k.startswith(('hetero.cli', 'hetero.runtime')))\n"
            "assert not up, up\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
