"""``hetero launch``: train a model on a (mixed) cluster with a plan; per-node torchrun under the hood."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    # a flag of a RunOptions field takes its help and its default from the field
    from hetero.runtime.lr_schedule import SCHEDULES
    from hetero.runtime.options import ALLOCATORS, ENGINES, option_default as default, option_help as doc

    p = sub.add_parser(
        "launch", help="train with a plan: per-node torchrun, pipeline/tensor/data parallel workers",
        description="Build one torchrun per node from the cluster and the plan's rank layout (different "
                    "process counts per node and device type, static rendezvous with explicit node ranks, "
                    "per-vendor visible devices) and run the training workers. On one machine every node "
                    "slot runs here, rendezvous on 127.0.0.1; over several machines run one call per node "
                    "slot (--node-rank R on its machine), rendezvous at node slot 0's host or --master-addr, "
                    "port 29500 unless --master-port. Arguments after `--` go to every worker.")
    p.add_argument("--cluster", required=True, help="cluster file (YAML, docs/formats.md)")
    p.add_argument("--model", required=True, help="model file (YAML)")
    p.add_argument("--plan", required=True, help="plan file (YAML; `hetero plan -o` writes one)")
    p.add_argument("--steps", type=int, default=default("steps"), help=doc("steps"))
    p.add_argument("--seed", type=int, default=default("seed"), help=doc("seed"))
    p.add_argument("--summary", metavar="OUT.json", help=doc("summary"))
    p.add_argument("--trace", metavar="OUT.json", help=doc("trace"))
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw the predicted step above one measured step of the run (the median after the "
                        "first), on one time scale, as a PNG (needs matplotlib)")
    p.add_argument("--dry-run", action="store_true", help="print every node's command and environment, run nothing")
    p.add_argument("--node-rank", type=int, help="run only this node slot (multi-node: one call per host)")
    p.add_argument("--master-addr", help="rendezvous address: node slot 0's machine (default 127.0.0.1 when every "
                                          "node slot runs here, else node slot 0's host from the cluster's 'hosts')")
    p.add_argument("--master-port", type=int, help="rendezvous port (default: a free one when every node slot "
                                                   "runs here in this call, else 29500)")
    p.add_argument("--data", metavar="FILE", help=doc("data"))
    p.add_argument("--engine", choices=ENGINES, default=default("engine"), help=doc("engine"))
    p.add_argument("--timeout", type=float, default=default("timeout_s"), metavar="SEC", help=doc("timeout_s"))
    p.add_argument("--inject-failure", metavar="STEP:RANK", help=doc("inject_failure"))
    p.add_argument("--elastic", action="store_true", help=doc("elastic"))
    p.add_argument("--machine-lost-after", type=float, default=default("machine_lost_after_s"), metavar="SEC",
                   help=doc("machine_lost_after_s"))
    p.add_argument("--lr", type=float, default=default("lr"), help=doc("lr"))
    p.add_argument("--lr-schedule", choices=SCHEDULES, default=default("lr_schedule"), help=doc("lr_schedule"))
    p.add_argument("--warmup-steps", type=int, default=default("warmup_steps"), metavar="N", help=doc("warmup_steps"))
    p.add_argument("--min-lr", type=float, default=default("min_lr"), metavar="X", help=doc("min_lr"))
    p.add_argument("--weight-decay", type=float, default=default("weight_decay"), help=doc("weight_decay"))
    p.add_argument("--clip", type=float, default=default("clip"), help=doc("clip"))
    p.add_argument("--loss-scale", type=float, metavar="S", help=doc("loss_scale"))
    p.add_argument("--save", metavar="DIR", help=doc("save"))
    p.add_argument("--load", metavar="DIR", help=doc("load"))
    p.add_argument("--tokenizer", metavar="PATH", help="tokenize the text or prompt/completion (.jsonl) --data with "
                                                       "this Hugging Face tokenizer (a model folder or its "
                                                       "tokenizer.json; a text's ids are cached beside it), or "
                                                       "'bytes': UTF-8 bytes as ids (the default)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow --load with --engine deepspeed, whose loader unpickles the checkpoint files")
    p.add_argument("--threads", type=int, default=default("threads"), help=doc("threads"))
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help=doc("overlap"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default("compile"), help=doc("compile"))
    p.add_argument("--bucket-mb", type=float, default=default("bucket_mb"), metavar="MB", help=doc("bucket_mb"))
    p.add_argument("--run-dir", help=doc("run_dir"))
    p.add_argument("--quiet", action="store_true", help=doc("quiet"))
    p.add_argument("--allocator", choices=ALLOCATORS, default=default("allocator"), help=doc("allocator"))
    p.add_argument("--skip-memory-check", action="store_true",
                   help="launch a plan although the predictor says a stage does not fit its devices' memory (by "
                        "default refused before any worker starts; for emulated device types whose 'memory' is "
                        "not what this machine gives each process)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    from ._common import folder_outputs

    p.set_defaults(func=run,  # the files read and written: check_outputs_apart
                   inputs={"--cluster": "cluster", "--model": "model", "--plan": "plan", "--data": "data",
                           "--load": "load", "--tokenizer": "tokenizer"},
                   outputs={"--summary": "summary", "--trace": "trace", "--plot": "plot", **folder_outputs()},
                   work_dirs={"--run-dir": "run_dir"})


def _check_inputs(args) -> None:
    """Reject what the run options cannot judge (the rendezvous port, this machine's files, flags that do
    not go together) here, in dry runs too, rather than in every worker's traceback; the options' own
    values are checked by :class:`~hetero.runtime.options.RunOptions`."""
    import os

    from hetero.errors import HeteroError

    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise HeteroError(f"--master-port {args.master_port}: out of range (fix: give a TCP port in 1..65535)")
    # --data's contents (dtype, ids, length) are checked by the launcher's prepare, against the model
    if args.data and not os.path.isfile(args.data):
        what = "not found" if not os.path.exists(args.data) else "not a file"
        raise HeteroError(f"--data {args.data}: {what} (fix: give the path of a token file (.npy, .bin, "
                          f".int32.bin), a prompt/completion file (.jsonl) or a text file)")
    from hetero.hf import hf_dir_of

    folder = hf_dir_of(args.load)
    if args.load and not os.path.isdir(folder or args.load):
        what = "not found" if not os.path.exists(folder or args.load) else "a file, not a folder"
        fix = ("give hf: the Hugging Face model folder save_pretrained wrote, with config.json and *.safetensors"
               if folder is not None else "give a checkpoint directory written by --save, or hf:DIR")
        raise HeteroError(f"--load {args.load}: {what} (fix: {fix})")
    for flag, value, fix in (("--save", args.save, "give a directory for the checkpoint's files"),
                             ("--run-dir", args.run_dir, "give a directory, or leave --run-dir out for a "
                                                         "temporary one")):
        if value:  # checked before training: --save is written only at the end of the run
            from hetero.specs.io import nearest_existing

            existing = nearest_existing(value)
            if not existing.is_dir():
                raise HeteroError(f"{flag} {value}: {existing} is a file, not a directory (fix: {fix})")
    if args.save and os.path.isdir(args.save):
        from hetero.runtime.checkpoint import is_checkpoint_dir

        # the new checkpoint replaces the directory when it is complete: never one with other files
        if not is_checkpoint_dir(args.save):
            raise HeteroError(f"--save {args.save}: the directory holds files that are not a checkpoint, and the "
                              f"new checkpoint replaces the whole directory (fix: give a new directory or one "
                              f"an earlier --save wrote)")
    if args.plot is not None and args.elastic:
        raise HeteroError("--plot draws one plan's step next to its prediction, and --elastic may change the plan "
                          "(fix: use --trace for an elastic run's timeline)")
    if args.plot is not None and not args.dry_run:   # not after the training run it would draw
        from hetero.plots import require_matplotlib

        require_matplotlib("--plot")
    for flag, value in (("--summary", args.summary), ("--trace", args.trace), ("--plot", args.plot)):
        if value is not None:   # rank 0 writes them at the end as every output is written (write_output's way)
            from ._common import check_output

            check_output(value, flag)


_DEST_OF = {"timeout_s": "timeout", "machine_lost_after_s": "machine_lost_after"}
"""RunOptions fields whose flag has another name (``--timeout`` sets ``timeout_s``)."""


def _flagged(error, args):
    """The run options' problems said of the flags that gave the values (``--lr -1.0: out of range``)."""
    from hetero.specs.errors import SpecError

    problems = []
    for p in error.problems:
        dest = _DEST_OF.get(p.path, p.path)
        problems.append(p.as_flag("--" + dest.replace("_", "-"), getattr(args, dest)))
    return SpecError(problems)


def run(args) -> int:
    from hetero.errors import HeteroError
    from hetero.specs.errors import Problem, SpecError

    from ._common import console, load_inputs

    cluster, model, plan = load_inputs(args)
    from hetero.hf import hf_dir_of

    if args.load and args.engine == "deepspeed" and not args.trust_checkpoint and hf_dir_of(args.load) is None:
        # DeepSpeed's loader calls torch.load(weights_only=False): unpickling runs code from the files.
        raise HeteroError(f"--load {args.load} with --engine deepspeed: DeepSpeed's checkpoint loader unpickles the "
                          f"files, which runs any code they carry; load only checkpoints you wrote and pass "
                          f"--trust-checkpoint, or use --engine native (torch.distributed.checkpoint, no unpickling)")
    extra = list(args.extra or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    import os

    from hetero.hf.launch import absolute_load

    from hetero.runtime.options import OptionsError, RunOptions, parse_failure

    try:   # every out-of-range value at once, each said of its flag
        options = RunOptions(steps=args.steps, seed=args.seed,
                             data=os.path.abspath(args.data) if args.data else None,
                             engine=args.engine, timeout_s=args.timeout, machine_lost_after_s=args.machine_lost_after,
                             summary=os.path.abspath(args.summary) if args.summary else None,
                             trace=os.path.abspath(args.trace) if args.trace else None,
                             inject_failure=parse_failure(args.inject_failure), lr=args.lr,
                             lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                             weight_decay=args.weight_decay, clip=args.clip, loss_scale=args.loss_scale,
                             save=os.path.abspath(args.save) if args.save else None,
                             load=absolute_load(args.load),
                             threads=args.threads, quiet=args.quiet, elastic=args.elastic, extra=extra,
                             allocator=args.allocator, overlap=args.overlap, bucket_mb=args.bucket_mb,
                             compile=args.compile)
    except OptionsError as e:
        raise _flagged(e, args) from None
    _check_inputs(args)
    if not args.skip_memory_check:   # before any worker starts, dry runs too
        from ._common import memory_problems

        problems = memory_problems(cluster, model, plan, args.plan)
        if problems:
            raise SpecError([*problems, Problem("", "the plan does not fit memory: nothing was started",
                                                "a plan that fits, or --skip-memory-check to launch this one "
                                                "anyway on emulated devices", args.plan)])
    if args.tokenizer or hf_dir_of(args.load):
        from hetero.hf.launch import prepare_launch

        prepare_launch(args, model, options, None if args.quiet else console().print)
    if options.inject_failure:
        world = sum(plan.devices_by_group().values())  # interleaved: virtual stages share devices
        if options.inject_failure[1] >= world:
            raise HeteroError(f"--inject-failure: rank {options.inject_failure[1]} but the plan runs {world} ranks")
    if args.allocator == "planned" and not args.dry_run:   # a slow build: after every check of the input
        _build_planned_allocator(options)
    out = console()
    if args.elastic:
        from hetero.runtime.elastic.policy import check_elastic
        from hetero.runtime.elastic.report import reconfiguration_table
        from hetero.runtime.elastic.run import run_elastic

        caveat = check_elastic(plan, options, args.node_rank)
        if caveat and not options.quiet:
            out.print(caveat)
        if not args.dry_run:
            merged = run_elastic(cluster, model, plan, options, master_addr=args.master_addr,
                                 master_port=args.master_port, print_fn=out.print, run_dir=args.run_dir,
                                 cluster_path=args.cluster, node_rank=args.node_rank)
            if merged["reconfigurations"] and not options.quiet:
                out.print(reconfiguration_table(merged["reconfigurations"]))
            if options.summary and not options.quiet:
                out.print(f"summary: {options.summary}")
            if options.trace and not options.quiet:
                out.print(f"trace: {options.trace} (open in ui.perfetto.dev)")
            return 0
    plot_dir = None
    if args.plot and not args.trace and not args.dry_run:   # the trace --plot draws, not asked for: temporary
        import tempfile

        plot_dir = tempfile.mkdtemp(prefix="hetero-plot-")
        options.trace = os.path.join(plot_dir, "trace.json")
    try:
        _launch(args, cluster, model, plan, options, out)
    finally:
        if plot_dir:
            import shutil

            shutil.rmtree(plot_dir, ignore_errors=True)
    if options.summary and not options.quiet and not args.dry_run:
        out.print(f"summary: {options.summary}")
    if args.trace and not options.quiet and not args.dry_run:   # not the temporary one --plot draws
        out.print(f"trace: {options.trace} (open in ui.perfetto.dev)")
    return 0


def _launch(args, cluster, model, plan, options, out) -> None:
    """Prepare and run (or print, ``--dry-run``) this launch; ``--plot`` once it has run."""
    from hetero.runtime.launcher import check_node_rank, dry_run_text, prepare
    from hetero.runtime.launcher import run as run_launch

    launch = prepare(cluster, model, plan, options, master_addr=args.master_addr, master_port=args.master_port,
                     run_dir=args.run_dir, separate=args.node_rank is not None, dry_run=args.dry_run)
    try:
        if args.dry_run:
            check_node_rank(launch, args.node_rank)   # a run checks it as it starts (run_launch)
            print(dry_run_text(launch, _relaunch(args)))
            launch.owns_run_dir = False  # kept: the commands printed read its run file
            return
        run_launch(launch, node_rank=args.node_rank, print_fn=out.print)
        if args.plot:
            _write_plot(args, cluster, model, plan, options.trace, out)
    finally:
        launch.remove_run_dir()


def _relaunch(args) -> list[str] | None:
    """This call's ``hetero launch`` argument list with this interpreter, less what a dry run shows
    per node slot (``--dry-run``, ``--node-rank``, ``--master-addr``, ``--master-port``)."""
    import sys

    argv = getattr(args, "argv", None)
    if not argv or argv[0] != "launch":
        return None
    out, skip = [sys.executable, "-m", "hetero"], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--dry-run" or a.split("=")[0] in ("--node-rank", "--master-addr", "--master-port"):
            skip = "=" not in a and a != "--dry-run"   # the value follows as its own word
        else:
            out.append(a)
    return out


def _write_plot(args, cluster, model, plan, trace_path: str, out) -> None:
    """``--plot``: the predicted step above one measured step of the run's trace."""
    import json
    import os

    from hetero.plots import png_bytes, run_figure
    from hetero.predictor import predict

    from ._common import write_output

    if not os.path.exists(trace_path):   # another node slot's launch: rank 0 writes the trace
        out.print(f"--plot: no trace here (rank 0 writes it, on node slot 0's machine); {args.plot} not written")
        return
    with open(trace_path) as f:
        trace = json.load(f)
    pred = predict(cluster, model, plan, timeline=True)
    title = f"{cluster.name} / {model.name}: schedule {plan.schedule}, predicted vs measured"
    write_output(args.plot, "--plot", png_bytes(run_figure(pred, trace, title)))
    if not args.quiet:
        out.print(f"plot written to {args.plot}")


def _build_planned_allocator(options) -> None:
    """Build the planned allocator's library once, here, before the workers load it from the cache;
    where it cannot be built, say why in one line: the workers then run with the default allocator."""
    from hetero.memplan.serve import load_extension

    try:
        load_extension(False)
    except RuntimeError as e:
        if not options.quiet:
            print(f"note: --allocator planned: {e}; the ranks run with the default allocator")
