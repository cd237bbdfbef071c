"""Terminal output shared by every layer: rich consoles and JSON on stdout.

The CLI, the planner's progress bar and the runtime's report print through these, so none of them
imports another's module just to print.
"""
from __future__ import annotations

import json
import sys


def console(stderr: bool = False):
    """A rich ``Console`` on stdout (or stderr), 160 columns wide when the stream is not a terminal."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped output (logs, tests) would otherwise be squeezed to 80 columns.
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, highlight=False, width=width)


def print_json(data) -> None:
    """``data`` as JSON on stdout. A value that is not finite is an error, not the ``Infinity`` /
    ``NaN`` that no JSON reader takes (it comes from an input far out of range)."""
    try:
        text = json.dumps(data, indent=2, allow_nan=False)
    except ValueError:
        from hetero.errors import HeteroError

        raise HeteroError("the result holds a number that is not finite (fix: an input is far out of range; "
                          "check the sizes, links and factors in the files given)") from None
    sys.stdout.write(text + "\n")


__all__ = ["console", "print_json"]
