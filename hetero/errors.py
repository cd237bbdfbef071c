"""User-facing errors. The CLI prints them without a traceback and exits with status 1."""
from __future__ import annotations

from .specs.errors import Problem, SpecError


class HeteroError(RuntimeError):
    """A problem the user can fix (bad combination of inputs, a run that cannot fit, ...)."""


__all__ = ["HeteroError", "Problem", "SpecError"]
