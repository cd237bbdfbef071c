"""The command line's argument parser: a mistyped option gets its subcommand's usage and the option
it was most likely meant as (``--num-steps``: did you mean --steps?)."""
from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` (its subcommands' parsers are of this class too) whose usage
    errors name the closest known option to each unknown one, and whose unknown options are reported
    by the subcommand they were given to, with that subcommand's usage, not the top-level one."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)   # what error() looks through
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._subcommand_parser(getattr(parsed, "command", None)) or self
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message):
        unknown = self._unknown_options()
        if len(unknown) == 1 and message.endswith(f": {unknown[0][0]}"):   # "unrecognized arguments: --num-steps"
            message += f" (did you mean {unknown[0][1]}?)"
        elif unknown:
            message += " (" + "; ".join(f"{option}: did you mean {close}?" for option, close in unknown) + ")"
        super().error(message)

    def _subcommand_parser(self, command):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return None

    def _unknown_options(self) -> list[tuple[str, str]]:
        """``(given, closest known)`` for each option given to this parser that it does not know."""
        from hetero.specs.errors import closest

        known = [s for s in self._option_string_actions if s.startswith("--")]
        out = []
        for token in getattr(self, "_given", []):
            if token == "--":   # the rest goes to the workers
                break
            option = token.split("=", 1)[0]
            if not option.startswith("--") or option in self._option_string_actions:
                continue
            if any(k.startswith(option) for k in known):   # an abbreviation argparse accepts or calls ambiguous
                continue
            close = closest(option, known)
            if close and (option, close) not in out:
                out.append((option, close))
        return out
