"""``hetero validate FILE...``: check cluster, model and plan files and examples indexes; report every
problem at once."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check cluster / model / plan files and examples indexes",
                       description="Check cluster, model and plan files. The kind of each file is told by its "
                                   "fields. A plan is checked against a cluster and a model when one of each is "
                                   "given (as files in the list or with --cluster/--model). An examples index "
                                   "(configs/examples.yaml: a list of {cluster, model, plan} names, files in the "
                                   "clusters/, models/ and plans/ folders beside it) gets one verdict per entry: "
                                   "its files exist and its plan fits its cluster and model. A plan checked against "
                                   "a cluster and a model also fits: every stage's predicted peak memory within its "
                                   "devices' capacity (else an error naming the stage, its need and the capacity).")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--cluster", help="cluster file to check plans against")
    p.add_argument("--model", help="model file to check plans against")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.markup import escape

    from hetero.rl.job import load_rl_job, looks_like_rl_job
    from hetero.specs.cluster import load_cluster, model_problems
    from hetero.specs.device import resolve_devices
    from hetero.specs.errors import Problem, Problems, SpecError
    from hetero.specs.examples import read_examples
    from hetero.specs.io import read_mapping
    from hetero.specs.kinds import file_kind
    from hetero.specs.model import load_model
    from hetero.specs.plan import load_plan

    from ._common import console, load_inputs, memory_problems, print_problems, warn_cross_node_tp

    for name in (args.cluster, args.model):
        if name and name not in args.files:
            args.files.append(name)
    given_as = {args.model: "model", args.cluster: "cluster"}   # --cluster / --model say the kind
    # Every check runs first, then each file gets one verdict: a plan is "ok" once it passed every
    # check there is for it (against the cluster and the model when one of each is at hand).
    results = [{"path": path, "kind": None, "data": None, "source": None, "spec": None, "problems": [],
                "against": None, "examples": []} for path in dict.fromkeys(args.files)]

    def attempt(problems: list, load) -> None:
        try:
            load()
        except SpecError as e:
            problems.extend(e.problems)

    for r in results:
        def read(r=r):
            r["data"], r["source"] = read_mapping(r["path"], "input")
            r["kind"] = given_as.get(r["path"]) or file_kind(r["data"])
            if r["kind"] == "cluster":   # the mapping already read, named by its file in errors
                r["spec"] = load_cluster(r["data"], source=r["source"])
            elif r["kind"] == "model":
                r["spec"] = load_model(r["data"], source=r["source"])
            elif r["kind"] == "catalog":
                problems = Problems(source=r["source"])
                resolve_devices(r["data"].get("devices") or {}, {}, "devices", problems)
                problems.raise_if_any()
            elif r["kind"] == "examples":
                index_problems, r["examples"] = read_examples(r["data"], r["source"])
                r["problems"].extend(index_problems)
            elif r["kind"] == "unknown" and looks_like_rl_job(r["data"]):
                r["kind"] = "rl job"   # checked against the cluster below when one is given
                r["spec"] = load_rl_job(r["path"])
            elif r["kind"] != "plan":
                raise SpecError([Problem("", "cannot tell whether this is a cluster, model or plan file",
                                         "a cluster has 'groups', a model 'num_layers', a plan 'pipelines', "
                                         "an examples index 'examples', an RL job 'reward'", r["source"])])
        attempt(r["problems"], read)
        for example in r["examples"]:   # each entry as `predict --cluster C --model M --plan P` reads it
            if example.complete:
                inputs = argparse.Namespace(**{kind: str(path) for kind, path in example.paths.items()})

                def check(inputs=inputs, example=example):
                    example.problems.extend(memory_problems(*load_inputs(inputs), source=inputs.plan))
                attempt(example.problems, check)
    # Plans are checked against a cluster and a model when exactly one of each is at hand.
    clusters = [r for r in results if r["kind"] == "cluster" and r["spec"] is not None
                and (not args.cluster or r["path"] == args.cluster)]
    models = [r for r in results if r["kind"] == "model" and r["spec"] is not None
              and (not args.model or r["path"] == args.model)]
    plans = [r for r in results if r["kind"] == "plan" and not r["problems"]]
    c = m = None
    if len(clusters) == 1 and len(models) == 1:
        c, m = clusters[0], models[0]
        mismatch = model_problems(c["spec"], m["spec"])   # the model's dtype on every group
        if mismatch:
            c["problems"].extend(mismatch)
            c["against"] = f"model {m['spec'].name}"
    if clusters and len(clusters) == 1:   # an RL job's placement judged on the one cluster at hand
        for r in results:
            if r["kind"] == "rl job" and r["spec"] is not None:
                r["against"] = f"cluster {clusters[0]['spec'].name}"
                attempt(r["problems"], lambda r=r: load_rl_job(r["path"], clusters[0]["spec"]))
    for r in plans:
        if c is None:
            attempt(r["problems"], lambda r=r: load_plan(r["data"], source=r["source"]))
            continue
        r["against"] = f"{c['spec'].name} / {m['spec'].name}"
        try:
            plan = load_plan(r["data"], c["spec"], m["spec"], source=r["source"])
            r["problems"].extend(memory_problems(c["spec"], m["spec"], plan, r["source"]))
            warn_cross_node_tp(c["spec"], plan, r["source"])
        except SpecError as e:
            for problem in e.problems:   # each problem goes with the file that holds its fix
                owner = c if problem.source == c["spec"].source else r
                if str(problem) not in map(str, owner["problems"]):
                    owner["problems"].append(problem)
            if not r["problems"]:   # only the cluster's: this plan cannot run there either
                r["problems"].append(Problem("", f"cannot run on cluster {c['spec'].name} as it is: see the "
                                                 f"errors of {c['path']}", f"fix {c['path']}", r["source"]))
    out = console()
    told: set[str] = set()   # a file several entries of an index name: its problems are told once

    def verdict(ok: bool, subject: str, detail: str, problems) -> None:
        status = "[green]ok[/green]   " if ok else "[red]error[/red]"
        out.print(f"{status} {escape(subject)}{escape(detail)}", soft_wrap=True)   # one line per verdict, for grep
        new = [p for p in dict.fromkeys(map(str, problems)) if p not in told]
        told.update(new)
        print_problems(new)   # at most MAX_PROBLEMS, then how many more

    failed = 0
    for r in results:
        kind = f" ({r['kind']})" if r["kind"] in ("cluster", "model", "plan", "catalog", "examples", "rl job") else ""
        bad_examples = [e for e in r["examples"] if e.problems]
        if r["kind"] == "examples" and r["examples"]:
            kind += (f" {len(bad_examples)} of {len(r['examples'])} entries fail" if bad_examples
                     else f" {len(r['examples'])} entries")
        if r["problems"] or bad_examples:
            failed += 1
            verdict(False, str(r["path"]), kind + (f" against {r['against']}" if r["against"] else ""), r["problems"])
        else:
            verdict(True, str(r["path"]), kind + (f" fits {r['against']}" if r["against"] else ""), [])
        for e in r["examples"]:
            detail = " (example)"
            if e.entry is not None:
                names = f" plan {e.entry.plan} {{}} {e.entry.cluster} / {e.entry.model}"
                detail += names.format("against" if e.problems else "fits")
            verdict(not e.problems, f"{r['path']} {e.where}", detail, e.problems)
    if plans and c is None:
        broken = [r["path"] for r in results if r["kind"] in ("cluster", "model") and r["spec"] is None]
        out.print("[yellow]note[/yellow]  plans were checked on their own; " +
                  (f"fix {', '.join(map(str, broken))} to check them against a cluster and a model" if broken else
                   "give one cluster and one model (--cluster/--model) to check them against those"))
    return 1 if failed else 0
