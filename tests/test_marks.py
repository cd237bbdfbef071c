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


def test_make_test_runs_the_suite_in_two_processes_that_the_setup_installs():
    """The 15-minute budget on 2 cores holds with two pytest-xdist processes (docs/testing.md: 564 s
    against 900 s in one); dropping ``-n`` from the Makefile, or pytest-xdist from the extras the
    setup installs, would put the suite back over it."""
    import re

    make = (TESTS.parent / "Makefile").read_text()
    test_recipe = make.split("\ntest: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "-n $(TEST_WORKERS)" in test_recipe, test_recipe
    assert re.search(r"^TEST_WORKERS \?= 2$", make, re.M)
    assert "dev" in re.search(r"^EXTRAS \?= (.*)$", make, re.M).group(1).split(",")
    setup = (TESTS.parent / "setup.py").read_text()
    assert re.search(r'"dev": \[[^\]]*"pytest-xdist', setup)
