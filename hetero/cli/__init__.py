"""The ``hetero`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Exit status: 0 success, 1 bad input (a clear message, no traceback), 2 usage errors (argparse).
``hetero predict`` exits 3 when it predicted a plan that does not fit memory.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order of ``hetero --help``.
COMMANDS = ("validate", "devices", "env", "predict", "plan", "profile", "calibrate", "launch", "memplan",
            "import_hf", "export_hf", "generate", "rl")


def build_parser() -> argparse.ArgumentParser:
    from hetero import __version__

    from .argparser import ArgumentParser   # a mistyped option: its subcommand's usage, the closest option

    parser = ArgumentParser(
        prog="hetero",
        description="Plan, predict and run training of large models on clusters that mix accelerator types and vendors.",
    )
    parser.add_argument("--version", action="version", version=f"hetero {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hetero.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hetero.errors import HeteroError
    from hetero.specs.errors import SpecError
    from hetero.specs.io import InputFileError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # as typed (a dry run repeats it)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        from ._common import check_outputs_apart

        check_outputs_apart(args)   # before any work: no output flag names an input file
        return int(args.func(args) or 0)
    except SpecError as e:
        from ._common import print_problems

        print_problems(e.problems)   # at most MAX_PROBLEMS, then how many more
        return 1
    except InputFileError as e:
        print(f"error: {e.message} (fix: {e.fix})", file=sys.stderr)
        return 1
    except HeteroError as e:   # the root of every error above and of the project's others
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`hetero devices | head`): stop quietly, as Unix tools do.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        # reading or writing a file the checks above could not foresee (disk full, a vanished dir)
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e} (fix: check the path, its permissions and free space)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
