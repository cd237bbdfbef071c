"""``hetero plan``: search plans for a cluster and a model; show the best, save one as plan.yaml."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from ._common import add_fit_allocator_argument, positive_int

    p = sub.add_parser("plan", help="search the best hybrid-parallel plan",
                       description="Search pipelines, stage splits, tp, micro-batching, recompute, ZeRO and the "
                                   "schedule (1F1B or interleaved) for "
                                   "the highest predicted throughput that fits in memory; show the top plans "
                                   "and why the best one wins.")
    p.add_argument("--cluster", required=True, help="cluster file")
    p.add_argument("--model", required=True, help="model file")
    p.add_argument("--global-batch-size", type=int, required=True, metavar="N", help="samples per iteration")
    p.add_argument("--top-k", type=positive_int, default=5, metavar="K", help="plans to show (default 5)")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the best plan here (YAML)")
    p.add_argument("--calibration", help="calibration file from `hetero calibrate`")
    p.add_argument("--json", action="store_true", help="print a JSON list of {plan, prediction} (with --objectives: "
                                                         "{front: [{plan, objectives}], evaluations, seconds})")
    p.add_argument("--no-interleave", action="store_true",
                   help="plan the 1F1B schedule only (by default interleaved 1F1B with 2-4 model chunks per "
                        "device is weighed too, and kept where it predicts faster; never for a pipeline of "
                        "exactly two physical stages that are both on NCCL/RCCL or both on HCCL devices, whose "
                        "send/recv ignore the tags that keep activations and gradients apart)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_fit_allocator_argument(p)
    p.add_argument("--objectives", metavar="LIST",
                   help="search a Pareto front over these objectives instead of one best plan: two or more of "
                        "throughput, cost (USD per million tokens, indicative), memory_headroom, energy (J/token), "
                        "resilience (throughput kept after the worst single node loss)")
    p.add_argument("--pick", metavar="RULE",
                   help="with --objectives: the plan to write with -o (and mark), e.g. 'fastest under 40 USD/Mtok' "
                        "or 'cheapest within 5%% of fastest' (default: the fastest)")
    p.add_argument("--plot", metavar="FRONT.png",
                   help="with --objectives: draw the front (parallel coordinates, throughput-cost projection)")
    p.add_argument("--budget", type=positive_int, default=600, metavar="N",
                   help="with --objectives: plans evaluated by the search (default 600)")
    p.add_argument("--seed", type=int, default=0, help="with --objectives: random seed of the search")
    p.set_defaults(func=run,  # the files read and written: check_outputs_apart
                   inputs={"--cluster": "cluster", "--model": "model", "--calibration": "calibration"},
                   outputs={"-o": "output", "--plot": "plot"})


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def headroom(prediction) -> dict[str, float]:
    """Smallest free fraction of device memory per group, over the plan's stages."""
    d = prediction.to_dict()
    out: dict[str, float] = {}
    for p in d.get("pipelines", []):
        for s in p.get("stages", []):
            cap = s.get("memory_capacity_bytes") or 0
            if not cap:
                continue
            free = 1 - s.get("peak_memory_bytes", 0) / cap
            out[s["group"]] = min(out.get(s["group"], 1.0), free)
    return out


def run(args) -> int:
    from hetero.planner import search

    from ._common import (check_output, console, host_memory_note, load_calibration_arg, load_inputs, print_json,
                          warn_if_cpu_unprofiled, write_output)

    if args.global_batch_size < 1:
        print("error: --global-batch-size must be >= 1", file=sys.stderr)
        return 1
    if args.objectives is None:
        for flag in ("pick", "plot"):
            if getattr(args, flag) is not None:
                print(f"error: --{flag} needs --objectives (e.g. --objectives throughput,cost)", file=sys.stderr)
                return 1
    cluster, model, _ = load_inputs(args, need_plan=False)
    if args.objectives is not None:
        from .plan_front import run_front

        return run_front(args, cluster, model)
    if args.output is not None:   # "" too: an error, not a plan silently unsaved
        check_output(args.output, "-o")
    calibration = load_calibration_arg(args.calibration, cluster)
    show_progress = not args.no_progress and sys.stderr.isatty()
    results = search(cluster, model, global_batch_size=args.global_batch_size, top_k=args.top_k,
                     calibration=calibration, progress=show_progress, allocator=args.allocator,
                     **({"interleaves": ()} if args.no_interleave else {}))
    best = results[0]
    warn_if_cpu_unprofiled(cluster, best.prediction.provenance)
    if args.output:
        header = (f"# hetero plan: {cluster.name} / {model.name}, predicted "
                  f"{best.prediction.tokens_per_s:,.0f} tokens/s\n# {best.one_line}")
        write_output(args.output, "-o", lambda path: best.plan.save(path, header=header))
    if args.json:
        print_json([r.to_dict() for r in results])
        return 0
    out = console()
    from rich.markup import escape
    from rich.table import Table

    ub = results.upper_bound_tokens_per_s   # no plan predicts more (hetero.planner.bound)
    alone = results.alone_by_group
    cannot = [g for g, v in alone.items() if not v]
    table = Table(title=f"{cluster.name} / {model.name}, global batch {args.global_batch_size}", title_justify="left")
    table.add_column("", no_wrap=True)
    table.add_column("tokens/s", justify="right")
    table.add_column("iter (s)", justify="right")
    table.add_column("MFU", justify="right")
    if ub:
        table.add_column("% bound", justify="right")
    table.add_column("memory headroom")
    table.add_column("plan")
    for r in results:
        pred = r.prediction
        mark = "[bold green]*[/bold green]" if r is best else str(r.rank + 1)
        room = ", ".join(f"{g} {v * 100:.0f}%" for g, v in headroom(pred).items())
        mfu = getattr(pred, "mfu", None)
        row = [mark, f"{pred.tokens_per_s:,.0f}", f"{pred.iteration_time_s:.3f}",
               f"{mfu * 100:.1f}%" if mfu is not None else "-"]
        if ub:
            row.append(f"{pred.tokens_per_s / ub * 100:.1f}%")
        row += [room, escape(r.one_line)]
        table.add_row(*row)
    out.print(table)
    from hetero.planner.search import NOTATION

    out.print(f"[dim]{escape(NOTATION)}[/dim]")
    parts = ", ".join(f"{g} {v:,.0f}" for g, v in alone.items())
    if ub:
        out.print(f"upper bound {ub:,.0f} tokens/s (compute only: no memory limit, bubble, sync or optimizer)")
    if cannot:
        out.print(f"each group's best plan alone: {parts} tokens/s ({', '.join(cannot)} cannot hold the model alone)")
    elif len(alone) > 1:
        out.print(f"each group's best plan alone: {parts} tokens/s (sum {sum(alone.values()):,.0f}; a mixed plan may "
                  "beat it: each group then holds only part of the model)")
    note = host_memory_note(cluster, best.plan, best.prediction)
    if note:
        out.print(f"[bold]note[/bold] {note}")
    out.print("[bold]why[/bold]")
    for reason in results.reasons:
        out.print(f"  - {escape(reason)}")
    if args.output:
        out.print(f"[green]wrote[/green] {args.output} (* above)")
    return 0
