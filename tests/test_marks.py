"""pytest marks sit on tests: a mark on a helper class or function marks nothing that runs (a
``slow`` mark there leaves the slow test it was meant for in the fast tier)."""
from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _misplaced_marks(source: str) -> list[str]:
    """``name:line`` of every module-level class or function whose name pytest does not collect
    (``test*`` functions, ``Test*`` classes) and that carries a ``pytest.mark`` decorator."""
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        collected = node.name.startswith("Test" if isinstance(node, ast.ClassDef) else "test")
        marked = any("pytest.mark." in ast.unparse(d) for d in node.decorator_list)
        if marked and not collected:
            out.append(f"{node.name}:{node.lineno}")
    return out


def test_no_pytest_mark_sits_on_a_helper():
    bad = [f"{path.name}: {m}" for path in sorted(TESTS.rglob("test_*.py"))
           for m in _misplaced_marks(path.read_text())]
    assert not bad, "pytest marks on objects pytest does not collect:\n" + "\n".join(bad)


def test_the_scan_sees_a_mark_on_a_helper_class():
    src = "import pytest\n@pytest.mark.slow\nclass _Helper:\n    pass\n@pytest.mark.slow\ndef test_x():\n    pass\n"
    assert _misplaced_marks(src) == ["_Helper:3"]
