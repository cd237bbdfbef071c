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
    cluster = model = plan = None
    for loader, attr in ((load_cluster, "cluster"), (load_model, "model")):
        try:
            value = loader(getattr(args, attr))
        except SpecError as e:
            problems.extend(e.problems)
            value = None
        if attr == "cluster":
            cluster = value
        else:
            model = value
    if need_plan:
        try:
            plan = load_plan(args.plan, cluster, model) if cluster and model else load_plan(args.plan)
        except SpecError as e:
            problems.extend(e.problems)
    if problems:
        raise SpecError(problems)
    return cluster, model, plan
