"""Helpers shared by the subcommands: consoles, JSON output, loading inputs."""
from __future__ import annotations

import json
import sys


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped output (logs, tests) would otherwise be squeezed to 80 columns.
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, highlight=False, width=width)


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def load_inputs(args, need_plan: bool = True):
    """Load ``--cluster``, ``--model`` and (optionally) ``--plan`` and check the plan against them."""
    from hetero.specs.cluster import load_cluster
    from hetero.specs.errors import SpecError
    from hetero.specs.model import load_model
    from hetero.specs.plan import load_plan

    problems = []

    def attempt(load, *inputs):
        """``load(*inputs)``, or None with its problems collected (so all files are reported at once)."""
        try:
            return load(*inputs)
        except SpecError as e:
            problems.extend(e.problems)
            return None

    cluster = attempt(load_cluster, args.cluster)
    model = attempt(load_model, args.model)
    plan = attempt(load_plan, args.plan, cluster, model) if need_plan else None
    if problems:
        raise SpecError(problems)
    return cluster, model, plan
