"""``hetero validate FILE...``: check cluster, model and plan files; report every problem at once."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check cluster / model / plan files",
                       description="Check cluster, model and plan files. The kind of each file is told by its "
                                   "fields. A plan is checked against a cluster and a model when one of each is "
                                   "given (as files in the list or with --cluster/--model).")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--cluster", help="cluster file to check plans against")
    p.add_argument("--model", help="model file to check plans against")
    p.set_defaults(func=run)


def run(args) -> int:
    from hetero.specs.cluster import load_cluster
    from hetero.specs.device import resolve_devices
    from hetero.specs.errors import Problem, Problems, SpecError
    from hetero.specs.io import read_mapping
    from hetero.specs.kinds import file_kind
    from hetero.specs.model import load_model
    from hetero.specs.plan import check_plan, load_plan

    from ._common import console

    out = console()
    failed = 0
    loaded: dict[str, list] = {"cluster": [], "model": [], "plan": []}
    for name in (args.cluster, args.model):
        if name and name not in args.files:
            args.files.append(name)
    given_as = {args.model: "model", args.cluster: "cluster"}   # --cluster / --model say the kind
    for path in args.files:
        try:
            data, source = read_mapping(path, "input")
            kind = given_as.get(path) or file_kind(data)
            if kind == "cluster":   # the mapping already read, named by its file in errors
                loaded["cluster"].append((path, load_cluster(data, source=source)))
            elif kind == "model":
                loaded["model"].append((path, load_model(data, source=source)))
            elif kind == "plan":
                loaded["plan"].append((path, load_plan(data, source=source)))
            elif kind == "catalog":
                problems = Problems(source=source)
                resolve_devices(data.get("devices") or {}, {}, "devices", problems)
                problems.raise_if_any()
            else:
                raise SpecError([Problem("", "cannot tell whether this is a cluster, model or plan file",
                                         "a cluster has 'groups', a model 'num_layers', a plan 'pipelines'",
                                         source)])
            out.print(f"[green]ok[/green]    {path} ({kind})")
        except SpecError as e:
            failed += 1
            out.print(f"[red]error[/red] {path}")
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
    # Plans are checked against a cluster and a model when exactly one of each is at hand.
    clusters = [c for p, c in loaded["cluster"] if not args.cluster or p == args.cluster]
    models = [m for p, m in loaded["model"] if not args.model or p == args.model]
    if loaded["plan"]:
        if len(clusters) == 1 and len(models) == 1:
            for path, plan in loaded["plan"]:
                try:
                    check_plan(plan, clusters[0], models[0], str(path))
                    out.print(f"[green]ok[/green]    {path} fits {clusters[0].name} / {models[0].name}")
                except SpecError as e:
                    failed += 1
                    out.print(f"[red]error[/red] {path} against {clusters[0].name} / {models[0].name}")
                    for problem in e.problems:
                        print(f"error: {problem}", file=sys.stderr)
        else:
            out.print("[yellow]note[/yellow]  plans were checked on their own; give one cluster and one model "
                      "(--cluster/--model) to check them against those")
    return 1 if failed else 0
