"""``hetero plan --objectives ...``: the Pareto front of plans as a table, JSON or PNG, and the
plan a ``--pick`` rule chooses written with ``-o``."""
from __future__ import annotations

import sys

_FORMAT = {"throughput": ("tokens/s", "{:,.0f}"), "cost": ("USD/Mtok*", "{:.4g}"),
           "memory_headroom": ("headroom", "{:.1%}"), "energy": ("J/token", "{:.4g}"),
           "resilience": ("resilience", "{:.1%}")}


def run_front(args, cluster, model) -> int:
    """Search, show and write the front; bad input raises HeteroError (one line, exit 1)."""
    from hetero.planner.front import parse_objectives, search_front
    from hetero.planner.pick import parse_rule, pick

    from ._common import check_output, console, load_calibration_arg, print_json, write_output

    names = parse_objectives(args.objectives, cluster)
    if args.pick is not None:
        parse_rule(args.pick)   # a rule that cannot parse fails before the search
    for path, flag in ((args.output, "-o"), (args.plot, "--plot")):
        if path is not None:
            check_output(path, flag)
    if args.plot is not None:
        from hetero.plots import require_matplotlib

        require_matplotlib("--plot")
    calibration = load_calibration_arg(args.calibration, cluster)
    show_progress = not args.no_progress and sys.stderr.isatty()
    result = search_front(cluster, model, args.global_batch_size, names, calibration=calibration,
                          budget=args.budget, seed=args.seed, progress=show_progress,
                          **({"interleaves": ()} if args.no_interleave else {}))
    # a rule picks from every non-dominated plan, not only those the front was thinned to
    everyone = result.nondominated or result.front
    chosen = pick(everyone, args.pick, names) if args.pick else max(everyone, key=lambda p: p.prediction.tokens_per_s)
    front = result.front if any(p is chosen for p in result.front) else \
        sorted(result.front + [chosen], key=lambda p: -p.prediction.tokens_per_s)
    result.front = front
    from hetero.planner.search import describe

    if args.output:
        summary = ", ".join(f"{n} {_FORMAT[n][1].format(chosen.objectives[n])}" for n in names)
        header = (f"# hetero plan --objectives {','.join(names)}: {cluster.name} / {model.name}"
                  + (f", picked '{args.pick}'" if args.pick else ", the fastest of the front")
                  + f"\n# {summary}\n# {describe(chosen.plan, cluster)}")
        write_output(args.output, "-o", lambda path: chosen.plan.save(path, header=header))
    if args.plot:
        from hetero.front_plot import front_figure
        from hetero.plots import png_bytes

        title = f"{cluster.name} / {model.name}, global batch {args.global_batch_size}: front of {len(front)} plans"
        write_output(args.plot, "--plot", png_bytes(front_figure(front, names, title, chosen)))
    if args.json:
        print_json(result.to_dict())
        return 0
    from rich.markup import escape
    from rich.table import Table

    out = console()
    table = Table(title=f"{cluster.name} / {model.name}, global batch {args.global_batch_size}: Pareto front "
                        f"({len(front)} plans, {result.evaluations} evaluated in {result.seconds:.1f} s)",
                  title_justify="left")
    table.add_column("", no_wrap=True)
    for n in names:
        table.add_column(_FORMAT[n][0], justify="right")
    table.add_column("plan")
    for k, p in enumerate(front):
        mark = "[bold green]*[/bold green]" if p is chosen else str(k + 1)
        table.add_row(mark, *[_FORMAT[n][1].format(p.objectives[n]) for n in names], escape(describe(p.plan, cluster)))
    out.print(table)
    if "cost" in names:
        out.print("* cost from the catalog's indicative on-demand prices per device-hour of the devices a plan "
                  "uses (not a quote; set price_per_hour in the cluster file's devices: for yours)")
    if "resilience" in names:
        out.print("resilience: the throughput a plan keeps after losing the worst single node it uses, the "
                  "replanner's best plan on the rest standing in")
    what = f"'{args.pick}'" if args.pick else "the fastest"
    out.print(f"[bold]*[/bold] {what}: {escape(describe(chosen.plan, cluster))}")
    if args.output:
        out.print(f"[green]wrote[/green] {args.output}")
    if args.plot:
        out.print(f"plot written to {args.plot}")
    return 0
