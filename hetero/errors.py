"""User-facing errors. The CLI prints them without a traceback and exits with status 1.

:class:`HeteroError` is the root of every error the project raises on purpose: bad input files
(:class:`~hetero.specs.errors.SpecError`, :class:`~hetero.specs.io.InputFileError`, a profile's
``ProfileError``; also ``ValueError`` s), runs that cannot go on (``LaunchError``, ``PlannerError``,
``CalibrationError``, ...) and the communicator's ``HeteroCommError`` (also a ``RuntimeError``).
``except HeteroError`` catches them all.
"""
from __future__ import annotations


class HeteroError(RuntimeError):
    """A problem the user can fix (bad combination of inputs, a run that cannot fit, ...)."""


# After HeteroError: hetero.specs.errors derives SpecError from it (imported from here).
from .specs.errors import Problem, SpecError  # noqa: E402


__all__ = ["HeteroError", "Problem", "SpecError"]
