"""``hetero rl JOB --cluster C``: RL post-training (GRPO) with rollout and training placed on the
cluster's groups; ``--dry-run`` checks everything and prints the placement and the run's sizes."""
from __future__ import annotations


def add_parser(sub) -> None:
    from ._common import positive_int

    p = sub.add_parser("rl", help="RL post-training (GRPO): rollout and training on device groups",
                       description="Run an RL job file (docs/rl.md): sample completions of the job's prompts, score "
                                   "them with its reward, train the actor with GRPO, send the new weights to the "
                                   "rollout; one progress line per step. --dry-run checks the job against the "
                                   "cluster and prints the placement and sizes without running anything.")
    p.add_argument("job", metavar="JOB", help="RL job file (YAML)")
    p.add_argument("--cluster", required=True, help="cluster file (YAML)")
    p.add_argument("--steps", type=positive_int, help="RL steps to run (default: the job's steps)")
    p.add_argument("--load", metavar="DIR", help="start from this checkpoint (a --save directory or hf:DIR) instead "
                                                 "of the job's load")
    p.add_argument("--summary", metavar="OUT.json", help="write the run summary (JSON, docs/rl.md) here")
    p.add_argument("--save", metavar="DIR", help="save the trained actor as a checkpoint (loadable by hetero launch "
                                                 "--load, hetero generate --load and hetero export-hf)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--dry-run", action="store_true", help="check everything, print the placement and sizes, run nothing")
    p.add_argument("--predict", action="store_true", help="print the placements weighed with their predicted "
                                                          "step times; run nothing")
    p.add_argument("--json", action="store_true", help="with --predict: print JSON")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SEC",
                   help="give up when a rank makes no progress for this long (default 120)")
    from ._common import folder_outputs

    p.set_defaults(func=run, inputs={"JOB": "job", "--cluster": "cluster", "--load": "load"},
                   outputs={"--summary": "summary", **folder_outputs()})


def run(args) -> int:
    import os

    from hetero.errors import HeteroError
    from hetero.rl.job import load_rl_job
    from hetero.specs.cluster import load_cluster

    from ._common import check_output, check_outputs_apart

    if args.json and not args.predict:
        raise HeteroError("--json goes with --predict (fix: add --predict, or drop --json)")
    if args.predict:
        return _predict(args)
    if args.summary is not None:
        check_output(args.summary, "--summary")
    _check_save(args.save)
    if args.load:
        from hetero.rl.job import check_load

        args.load = check_load(args.load, "--load")
    cluster = load_cluster(args.cluster)
    job = load_rl_job(args.job, cluster)
    # the job's own files may not be written either: --summary naming its prompts or model file
    args.job_files = [p for p in (job.model, job.prompts, job.eval_prompts, job.reward_ref.path) if p]
    if job.placement.actor.plan:
        args.job_files.append(os.path.join(os.path.dirname(os.path.abspath(job.source)), job.placement.actor.plan))
    args.inputs = {**args.inputs, "job's": "job_files"}
    check_outputs_apart(args)
    if args.steps:
        job = job.replace(steps=args.steps)
    if args.dry_run or not args.quiet:
        print(describe(job, cluster, args.load), flush=True)
    if args.dry_run:
        return 0
    from hetero.rl.run import run_rl

    args.timeout_s = args.timeout
    summary = run_rl(job, cluster, args)
    if not args.quiet:
        before = (summary.get("eval") or {}).get("before", {}).get("reward_mean")
        after = (summary.get("eval") or {}).get("after", {}).get("reward_mean")
        if before is not None and after is not None:
            print(f"eval reward (greedy, {len(job.eval_records)} prompts): {before:.3f} -> {after:.3f}")
        if args.summary:
            print(f"summary: {args.summary}")
        if args.save:
            print(f"checkpoint: {args.save}")
    return 0


def _predict(args) -> int:
    """``--predict [--json]``: the placements weighed with their predicted step times, nothing run."""
    import json

    from hetero.planner.rl_placement import format_report, predict_placements
    from hetero.rl.job import load_rl_job
    from hetero.specs.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    job = load_rl_job(args.job, cluster)
    report = predict_placements(job, cluster)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def _check_save(path) -> None:
    """``--save``: a new directory, or one an earlier --save wrote (the new checkpoint replaces it
    when complete, so never a folder with other files)."""
    if not path:
        return
    import os

    from hetero.errors import HeteroError
    from hetero.specs.io import nearest_existing

    existing = nearest_existing(path)
    if not existing.is_dir():
        raise HeteroError(f"--save {path}: {existing} is a file, not a directory (fix: give a directory for the "
                          f"checkpoint's files)")
    if os.path.isdir(path):
        from hetero.rl.job import CHECKPOINT_MARKERS

        names = set(os.listdir(path))
        if names and not names & set(CHECKPOINT_MARKERS):
            raise HeteroError(f"--save {path}: the directory holds files that are not a checkpoint, and the new "
                              f"checkpoint replaces the whole directory (fix: give a new directory or one an "
                              f"earlier --save wrote)")


def describe(job, cluster, load_override=None) -> str:
    """The placement (actor plan stage by stage, rollout copies) and the run's sizes, as text."""
    from hetero.specs.units import plural

    model = job.model_spec
    lines = [f"RL job {job.source}: {job.algorithm}, model {model.name} ({model.total_params():,} parameters), "
             f"start from {load_override or job.load or 'random weights'}",
             f"placement: {job.placement.mode}"]
    plan = job.actor_plan
    if plan is not None:
        lines.append(f"  actor: plan {job.placement.actor.plan}: {plan.global_batch_size} samples a step, "
                     f"schedule {plan.schedule}, zero {plan.zero_stage}")
        for pi, p in enumerate(plan.pipelines):
            lines.append(f"    pipeline {pi}: {plural(p.replicas, 'replica')}, "
                         f"{plural(p.micro_batches, 'micro-batch', 'micro-batches')} of {plan.mbs(p)}")
            for si, s in enumerate(p.stages):
                vendor = cluster.vendor(s.group)
                lines.append(f"      stage {si}: group {s.group} ({vendor}), layers [{s.layers[0]}, {s.layers[1]}), "
                             f"tp {s.tp}")
    else:
        lines.append(f"  actor: the planner's plan on {', '.join(job.actor_groups)}")
    tp = job.rollout_tp
    for g in job.rollout_groups:
        group = cluster.group(g)
        if job.placement.mode == "collocated":
            where = "time-sharing the actor's devices"
        else:
            free = group.num_devices - (plan.devices_by_group().get(g, 0) if plan is not None else 0)
            where = f"{plural(free // tp, 'copy', 'copies')} of the whole model, tp {tp}"
        lines.append(f"  rollout: group {g} ({cluster.vendor(g)}, {group.num_devices} devices): {where}")
    lines.append(f"sizes: {job.steps} steps x {job.prompts_per_step} prompts x {job.group_size} completions = "
                 f"{job.samples_per_step} samples a step; at most {job.max_new_tokens} new tokens, "
                 f"temperature {job.temperature:g}, stop {job.stop!r}")
    lines.append(f"prompts: {len(job.prompt_records)} ({job.prompts}); eval: {len(job.eval_records)}"
                 + (f" ({job.eval_prompts})" if job.eval_prompts else ""))
    lines.append(f"reward: {job.reward}; lr {job.lr:g}, clip {job.clip:g}, kl_coef {job.kl_coef:g}, "
                 f"staleness {job.staleness}, seed {job.seed}")
    return "\n".join(lines)
