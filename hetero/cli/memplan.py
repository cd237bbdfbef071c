"""``hetero memplan --model M --plan P``: fragmentation under the caching allocator vs a planned layout."""
from __future__ import annotations

from ._common import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("memplan", help="plan a stage's memory layout ahead of time; compare with the caching allocator",
                       description="Record one stage's training steps as an allocation trace (on fake tensors: no "
                                   "memory needed), or read a CUDA memory snapshot with --trace; then report the "
                                   "most bytes live at once, what PyTorch's caching allocator reserves for the "
                                   "trace, and the arena a layout planned ahead of time needs (greedy by size).")
    p.add_argument("--model", help="model file (needed unless --trace is given)")
    p.add_argument("--plan", help="plan file (needed unless --trace is given)")
    p.add_argument("--stage", type=int, help="physical stage of the pipeline to record (default 0)")
    p.add_argument("--pipeline", type=int, help="pipeline of the plan (default 0)")
    p.add_argument("--steps", type=positive_int,
                   help="training steps to record (default 2: the first allocates the optimizer's moments)")
    p.add_argument("--trace", metavar="SNAPSHOT.pickle",
                   help="a CUDA memory snapshot (torch.cuda.memory._dump_snapshot) to plan instead of recording")
    p.add_argument("--device", type=int,
                   help="with --trace: the snapshot's device to plan (default: the one with the most events)")
    p.add_argument("--json", action="store_true", help="print the memory-plan JSON (docs/formats.md) only")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw the planned layout (every block over its lifetime and byte range), the bytes live "
                        "and what the caching allocator reserves, as a PNG (needs matplotlib)")
    p.set_defaults(func=run,  # the files read and written: check_outputs_apart
                   inputs={"--model": "model", "--plan": "plan", "--trace": "trace"}, outputs={"--plot": "plot"})


def _bytes(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"


def run(args) -> int:
    from hetero.memplan import load_snapshot, memory_plan_and_layout

    from ._common import check_output, console, print_json, write_output

    recording = [f"--{k}" for k in ("model", "plan", "stage", "pipeline", "steps") if getattr(args, k) is not None]
    if args.trace is None and (args.model is None or args.plan is None):
        return _usage("--model and --plan are needed to record a trace (or give --trace SNAPSHOT.pickle)")
    if args.trace is not None and recording:
        return _usage(f"--trace plans a snapshot as it is: {', '.join(recording)} would record a stage instead "
                      f"(give one or the other)")
    if args.trace is None and args.device is not None:
        return _usage("--device picks a device of a --trace snapshot; a recorded stage has one")
    if args.plot is not None:   # before the recording, which can take minutes
        from hetero.plots import require_matplotlib

        check_output(args.plot, "--plot")
        require_matplotlib("--plot")
    from rich.progress import Progress

    with Progress(console=console(stderr=True), transient=True) as bar:
        def progress(task):
            return lambda done, total: bar.update(task, completed=done, total=total)

        if args.trace is not None:
            trace = load_snapshot(args.trace, args.device)
        else:
            trace = _record(args, progress(bar.add_task("recording the stage's steps", total=None)))
        report, cached, arena = memory_plan_and_layout(trace, progress(bar.add_task("planning the layout", total=None)))
    if args.plot:
        from hetero.plots import arena_figure, png_bytes

        title = (f"{trace.source}: planned arena {_bytes(arena.arena_bytes)}, caching allocator "
                 f"{_bytes(cached.reserved_bytes)}, lower bound {_bytes(report['lower_bound_bytes'])}")
        write_output(args.plot, "--plot", png_bytes(arena_figure(trace, arena, cached.reserved_bytes, title)))
    if args.json:
        print_json(report)
    else:
        _print_report(trace, report)
        if args.plot:
            console().print(f"plot written to {args.plot}")
    return 0


def _usage(message: str) -> int:
    import sys

    print(f"hetero memplan: error: {message}", file=sys.stderr)
    return 2


def _record(args, progress):
    from hetero.memplan.record import record_stage

    from ._common import load_inputs

    _, model, plan = load_inputs(args, need_cluster=False)
    return record_stage(model, plan, args.pipeline or 0, args.stage or 0, args.steps or 2, progress)


def _print_report(trace, report: dict) -> None:
    from rich.table import Table

    from ._common import console

    c, p = report["caching_allocator"], report["planned"]
    out = console()
    out.print(f"trace: {trace.source}, {report['events']:,} events")
    table = Table(show_header=True, header_style="bold")
    for col in ("layout", "bytes held", "fragmentation", "note"):
        table.add_column(col, justify="left" if col in ("layout", "note") else "right")
    table.add_row("lower bound", _bytes(report["lower_bound_bytes"]), "-", "the most bytes live at once")
    table.add_row("caching allocator", _bytes(c["reserved_bytes"]), f"{c['fragmentation']:.1%}",
                  "PyTorch's default block policy, replayed")
    note = "every block at a fixed offset, planned ahead"
    if p["dynamic_fallback_bytes"]:
        note += f"; {_bytes(p['dynamic_fallback_bytes'])} left to the caching allocator (allocated before the trace)"
    table.add_row("planned arena", _bytes(p["arena_bytes"] + p["dynamic_fallback_bytes"]), f"{p['fragmentation']:.1%}",
                  note)
    out.print(table)
    out.print(f"fragmentation reduction: {report['fragmentation_reduction']:.1%} "
              f"(1 - planned / caching allocator fragmentation)")

