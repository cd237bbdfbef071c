"""Validation errors that name the file, the field path and the fix.

Loading collects every problem of a file before raising, so a user sees all of them at once
rather than fixing one, re-running, and meeting the next. :class:`Problem` and :class:`SpecError`
are defined in :mod:`hetero.errors` (the root of every error; both import paths work), which imports
nothing of the specs.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from hetero.errors import Problem, SpecError

__all__ = ["Problem", "SpecError", "Problems", "closest", "did_you_mean", "join_path"]


@dataclass
class Problems:
    """Collector used while loading one file."""

    source: str = "<dict>"
    items: list[Problem] = field(default_factory=list)
    misplaced: int = 0
    """How many of ``items`` name a top-level field of another kind of file (``recompute`` in a model
    file). Such a field cannot be a misspelling of one of this file's own, so every other check still
    runs on the values that are there: see :meth:`blocking`."""

    def add(self, path: str, message: str, fix: str = "") -> None:
        self.items.append(Problem(path, message, fix, self.source))

    def add_misplaced(self, path: str, message: str, fix: str = "") -> None:
        """Record a field that belongs to another kind of file (counted in :attr:`misplaced`)."""
        self.add(path, message, fix)
        self.misplaced += 1

    def blocking(self) -> bool:
        """True when a problem other than a misplaced field was found: then a value is missing or out
        of range, and the rules across fields are not judged on it."""
        return len(self.items) > self.misplaced

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecError(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


SUGGEST_CUTOFF = 0.65
"""How alike (difflib ratio) a name must be to a known one to be suggested: 'num_layer' and
'num_layers' are (0.95), 'recompute' and 'dropout' (0.62) or 'mamba' and 'llama' (0.4) are not."""


def closest(name: str, candidates) -> str | None:
    """The candidate ``name`` was most likely meant as, or None when none is alike enough."""
    close = difflib.get_close_matches(str(name), sorted(str(c) for c in candidates), n=1, cutoff=SUGGEST_CUTOFF)
    return close[0] if close else None


def did_you_mean(name: str, candidates) -> str:
    """``"did you mean 'hidden_size'?"`` for the closest candidate, or a list of valid names."""
    candidates = sorted(str(c) for c in candidates)
    close = closest(name, candidates)
    if close:
        return f"did you mean '{close}'?"
    shown = ", ".join(candidates[:12]) + (", ..." if len(candidates) > 12 else "")
    return f"known names: {shown}"


def join_path(parent: str, child: str | int) -> str:
    if isinstance(child, int):
        return f"{parent}[{child}]"
    return f"{parent}.{child}" if parent else str(child)
