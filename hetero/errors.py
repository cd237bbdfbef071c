"""User-facing errors. The CLI prints them without a traceback and exits with status 1.

:class:`HeteroError` is the root of every error the project raises on purpose: bad input files
(:class:`SpecError`, one :class:`Problem` per mistake; :class:`~hetero.specs.io.InputFileError`; a
profile's ``ProfileError``; also ``ValueError`` s), runs that cannot go on (``LaunchError``, ``PlannerError``,
``CalibrationError``, ...) and the communicator's ``HeteroCommError`` (also a ``RuntimeError``).
``except HeteroError`` catches them all.
"""
from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where it is, what is wrong, and what would fix it."""

    path: str
    """Field path inside the file, e.g. ``groups[1].devices_per_node`` (empty for the whole file)."""
    message: str
    fix: str = ""
    source: str = ""
    """The file (or ``<dict>``) the value came from."""

    def __str__(self) -> str:
        where = self.source or "<input>"
        if self.path:
            where += f": {self.path}"
        text = f"{where}: {self.message}"
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


class SpecError(HeteroError, ValueError):
    """Raised for bad input; carries every problem found, formatted one per line."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


__all__ = ["HeteroError", "Problem", "SpecError", "clip", "lost_connection"]
