"""Reading the imports of a source file from its AST, for the tests that check how modules import
each other (tests/test_import_graph.py, tests/test_layers.py)."""
from __future__ import annotations

import ast


def from_source(node: ast.ImportFrom, package: str) -> str:
    """The module ``from X import ...`` names, a relative ``X`` resolved against ``package`` (the
    package the importing file sits in)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def literal_import(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("x")`` or ``__import__("x")`` with a literal name,
    else None."""
    if (isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None
