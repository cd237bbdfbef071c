"""``run_rl``: an RL job as one multi-process run, started by the training launcher.

The launcher's run file and commands are those of the actor plan (``hetero launch``'s own
:func:`~hetero.runtime.launcher.prepare`); a disaggregated placement adds one node slot per node of
the rollout groups, whose ranks follow the actor's (every device of those groups a whole copy).
Every process gets the RL description (``rl.json`` beside the run file, :data:`~hetero.rl.worker.RL_ENV`),
and :mod:`hetero.runtime.worker` hands such a run to :mod:`hetero.rl.worker`. The launcher watches
every rank as for any run: one that fails ends the job with its message.
"""
from __future__ import annotations

import dataclasses
import json
import os

from hetero.errors import HeteroError

JOB_FIELDS = ("steps", "prompts_per_step", "group_size", "max_new_tokens", "stop", "temperature", "lr", "clip",
              "kl_coef", "staleness", "seed", "tokenizer")


def run_rl(job, cluster, options=None) -> dict:
    """Run ``job`` (a loaded :class:`hetero.rl.job.RLJob`) on ``cluster``; returns the run summary.
    ``options``: an object with any of ``steps`` (overrides the job's), ``summary``, ``save``,
    ``load`` (overrides the job's), ``quiet``, ``timeout_s``, ``threads``, ``run_dir``, ``print_fn``."""
    from hetero.rl.worker import RL_ENV
    from hetero.runtime.launcher import prepare, run
    from hetero.runtime.options import RunOptions
    from hetero.specs.io import write_text_atomic

    opt = lambda name, default=None: getattr(options, name, default) if options is not None else default  # noqa: E731
    rollout_devices = None
    if job.placement.mode == "auto":
        job, rollout_devices = choose_placement(job, cluster, opt("print_fn", print), bool(opt("quiet", False)))
    mode = job.placement.mode
    plan = job.actor_plan if job.actor_plan is not None else plan_actor(job, cluster)
    if job.rollout_tp != 1:
        raise HeteroError(f"{job.source}: placement.rollout.tp {job.rollout_tp}: rollout ranks hold a whole copy "
                          f"each for now (fix: tp: 1)")
    if plan.global_batch_size != job.samples_per_step:
        raise HeteroError(f"{job.source}: the actor plan trains {plan.global_batch_size} samples a step, the job "
                          f"makes {job.samples_per_step} (fix: make them equal)")
    steps = opt("steps") or job.steps
    load = opt("load") or job.load
    run_opts = RunOptions(steps=steps, seed=job.seed, lr=job.lr, load=load, timeout_s=opt("timeout_s", 120.0),
                          quiet=bool(opt("quiet", False)), threads=opt("threads", 1))
    launch = prepare(cluster, job.model_spec, plan, run_opts, run_dir=opt("run_dir"))
    try:
        rollout = []
        if mode == "disaggregated":
            rollout = add_rollout_slots(launch, cluster, job.model_spec, job.rollout_groups, rollout_devices)
            if not rollout:
                raise HeteroError(f"{job.source}: placement.rollout.groups {job.rollout_groups}: the actor plan uses "
                                  f"every device of them (fix: rollout groups with devices the actor leaves free, or "
                                  f"mode: collocated)")
        run_dir = run_opts.run_dir
        placement = job.placement_dict()
        placement["actor"]["plan"] = plan.to_dict()
        cfg = {"job": {k: getattr(job, k) for k in JOB_FIELDS}, "steps": steps, "rollout": rollout, "rollout_groups": job.rollout_groups,
               "prompts": [_record(r) for r in job.prompt_records], "prompt_lengths": list(job.prompt_lengths),
               "eval_prompts": [_record(r) for r in job.eval_records],
               "reward": dataclasses.asdict(job.reward_ref), "placement": placement,
               "summary_path": os.path.join(run_dir, "rl-summary.json"), "save": opt("save"),
               "quiet": bool(opt("quiet", False)), "reward_workers": opt("reward_workers", 1)}
        cfg_path = os.path.join(run_dir, "rl.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        for cmd in launch.nodes:
            cmd.env[RL_ENV] = cfg_path
        run(launch, print_fn=opt("print_fn", print))
        with open(cfg["summary_path"]) as f:
            summary = json.load(f)
        summary["predicted"] = predicted(job, cluster, summary["placement"])
        if opt("summary"):
            write_text_atomic(opt("summary"), json.dumps(summary, indent=2), "--summary")
        return summary
    finally:
        launch.remove_run_dir()


def choose_placement(job, cluster, print_fn, quiet: bool):
    """``placement.mode: auto``: the job in the placement the predictor chose
    (:func:`hetero.planner.rl_placement.predict_placements`), and its rollout devices per group."""
    from hetero.planner.rl_placement import predict_placements
    from hetero.rl.job import ActorPlacement, Placement, RolloutPlacement

    report = predict_placements(job, cluster)
    chosen = report.placements[report.chosen]
    if chosen.prediction is None or chosen.plan is None:
        raise HeteroError(f"{job.source}: placement.mode auto: no placement can run ({chosen.problem}) (fix: a "
                          f"cluster with more devices, or a smaller model or batch)")
    if not quiet:
        print_fn(f"placement (auto): {chosen.label()}, predicted step {chosen.prediction.step_s:.3g} s")
    placement = Placement(actor=ActorPlacement(groups=list(chosen.actor)), mode=chosen.mode,
                          rollout=RolloutPlacement(groups=list(chosen.rollout), tp=chosen.rollout_tp))
    picked = job.replace(placement=placement)
    object.__setattr__(picked, "actor_plan", chosen.plan)
    return picked, (dict(chosen.rollout) if chosen.mode == "disaggregated" else None)


def predicted(job, cluster, placement: dict) -> dict | None:
    """The predictor's step, rollout, train and sync seconds of the placement that ran, or None where
    the predictor is not installed or cannot say (a run is never failed by it)."""
    try:
        from hetero.planner.rl_placement import predict_rl_step

        return predict_rl_step(job, cluster, placement)
    except Exception:  # noqa: BLE001 - a missing or failing predictor must not fail the run
        return None


def plan_actor(job, cluster):
    """``placement.actor.groups``: the planner's best plan of the model on those groups alone, for the
    step's samples (prompts_per_step x group_size) as the global batch."""
    import hetero

    data = cluster.to_dict()
    data["groups"] = [g for g in data["groups"] if g["name"] in job.actor_groups]
    results = hetero.search(hetero.load_cluster(data), job.model_spec, global_batch_size=job.samples_per_step,
                            top_k=1)
    if not len(results):
        raise HeteroError(f"{job.source}: placement.actor.groups {job.actor_groups}: the planner found no plan of "
                          f"the model for {job.samples_per_step} samples a step on them (fix: more groups, or "
                          f"give placement.actor.plan)")
    return results[0].plan


def _record(r) -> list:
    return [r.prompt, r.fields, r.line, r.source]


def add_rollout_slots(launch, cluster, model, groups: list[str], devices: dict[str, int] | None = None) -> list[dict]:
    """Add a node slot for every node of ``groups`` with devices the actor leaves free to ``launch``
    (ranks after the actor's, one whole model copy per device; on a node the actor shares, the devices
    after its own) and to its run file; returns the rollout ranks (``{"rank", "group", "vendor",
    "node"}`` each). ``devices``: at most this many per group (default: every free one)."""
    from hetero.backends import registry
    from hetero.layout import NodeSlot, RankInfo, RankLayout
    from hetero.runtime.launcher import NodeCommand
    from hetero.runtime.spec import SLOT_ENV
    from hetero.runtime.torchrun_loopback import FORK_ENV

    ranks, slots, infos, offsets = [], [], [], []
    first = len(launch.layout.ranks)
    for name in groups:
        g = cluster.group(name)
        vendor = cluster.vendor(name)
        left = (devices or {}).get(name, g.nodes * g.devices_per_node)
        for node in range(g.nodes):
            taken = sum(n.num_ranks for n in launch.layout.nodes if (n.group, n.node) == (name, node))
            count = min(g.devices_per_node - taken, left)
            if count <= 0:
                continue
            left -= count
            slots.append(NodeSlot(group=name, node=node, host=g.hosts[node] if g.hosts else None,
                                  first_rank=first, num_ranks=count))
            offsets.append(taken)
            for local in range(count):
                ranks.append({"rank": first, "group": name, "vendor": vendor, "node": node})
                infos.append(RankInfo(rank=first, group=name, vendor=vendor, node=node, local_rank=local,
                                      pipeline=0, replica=len(infos), stage=0, tp_rank=0, tp_size=1,
                                      layers=(0, model.num_layers)))
                first += 1
    template = launch.nodes[0]
    nnodes = len(launch.nodes) + len(slots)
    for slot, offset in zip(slots, offsets):
        family = cluster.device_type(slot.group).family
        env = {k: v for k, v in template.env.items() if k != FORK_ENV}
        env[SLOT_ENV] = str(len(launch.nodes))
        if family == "cpu":
            env[FORK_ENV] = template.env.get(FORK_ENV, "fork")
        var = registry.visible_devices_env(family)
        if var:
            env[var] = ",".join(str(offset + i) for i in range(slot.num_ranks))
        launch.nodes.append(NodeCommand(slot=len(launch.nodes), group=slot.group, node=slot.node, host=slot.host,
                                        first_rank=slot.first_rank, num_ranks=slot.num_ranks, env=env,
                                        torchrun_args=list(template.torchrun_args), family=family,
                                        machine=slot.host or template.machine))
    for cmd in launch.nodes:
        cmd.torchrun_args = [_torchrun_arg(a, cmd, nnodes) for a in cmd.torchrun_args]
    launch.layout = RankLayout(ranks=launch.layout.ranks + tuple(infos), nodes=launch.layout.nodes + tuple(slots))
    launch.spec.nodes = launch.spec.nodes + [dataclasses.asdict(s) for s in slots]
    launch.spec.save(launch.spec_path)
    return ranks


def _torchrun_arg(arg: str, cmd, nnodes: int) -> str:
    for flag, value in (("--nnodes=", nnodes), ("--node-rank=", cmd.slot), ("--nproc-per-node=", cmd.num_ranks)):
        if arg.startswith(flag):
            return f"{flag}{value}"
    return arg
