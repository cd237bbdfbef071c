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


CLOSED_CONNECTION = ("connection closed", "connection reset", "broken pipe", "closed its connection",
                     "lost the connection")
"""Phrases of a transport error that says a peer's connection went away (the peer died or left)."""


def lost_connection(text: str) -> bool:
    """Whether an error's text says a peer's connection closed (not that something timed out)."""
    low = text.lower()
    return any(s in low for s in CLOSED_CONNECTION)


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with "..." when cut (a message
    quoted inside another is not left ending mid-word)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    if text[limit - 3] != " ":   # the last word was cut: drop it
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:") + "..."


# After HeteroError: hetero.specs.errors derives SpecError from it (imported from here).
from .specs.errors import Problem, SpecError  # noqa: E402


__all__ = ["HeteroError", "Problem", "SpecError", "clip", "lost_connection"]
