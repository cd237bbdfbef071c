"""Elastic runs (``hetero launch --elastic``): when a device leaves, replan on the devices that remain
and go on training from the survivors' live state.

One attempt is an ordinary launch. When a rank's device is lost (the rank died, was killed, or
``--inject-failure`` ended it), the survivors' next collective with it fails; each writes its live
state (:mod:`hetero.runtime.handoff`) and reports. The launcher then

1. assembles the full tensors from the survivors and writes them as a plan-independent checkpoint
   (a parameter no survivor holds whole ends the run, naming its layers);
2. removes the lost devices from the cluster (:func:`without_devices`) and asks the planner for the
   best plan on what remains, with the same global batch, so the token stream and the losses go on
   as if nothing happened (up to floating-point reduction order);
3. launches the new plan, whose ranks load the state and reshard it for their layers and tp degree,
   and trains the remaining steps.

Devices also come and go on purpose: a change of the ``--cluster`` file while the run trains
(:mod:`hetero.runtime.elastic.watch`) is planned for at once; then every rank pauses at the next
step boundary, hands off its state as above, and the new plan goes on from it.

The run summary lists every reconfiguration (docs/formats.md, ``reconfigurations``): the step (the first one
run under the new plan; the handed-off state is that after the step before it), the reason,
the world sizes, the devices there are now (``devices_left``), added and removed, and
``reshard_time_s``, the time from the failure or the change to the first step under the new plan
(handoff, replanning, restart and load), split into ``handoff_time_s``, ``replan_time_s`` and
``restart_time_s``. For a change the plan is made first, while training goes on, and the handoff
counts from the pause request (finishing the step under way, then writing the state).

What it needs: the native engine and every node slot launched from this machine. With ZeRO
(``zero_stage`` > 0) deliberate changes are taken in (every rank is alive, and the optimizer
slices are gathered whole); after a failure a lost slice has no copy, so the run goes on from the
last ``--save`` checkpoint, or ends. A rank that raises on a working device (a bug, an
out-of-memory error) is not a departed device: the run ends as without ``--elastic``.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import tempfile
import time

from hetero.errors import HeteroError
from hetero.runtime.elastic.policy import MAX_RECONFIGURATIONS, refuse_lost_slices, replan
from hetero.runtime.elastic.report import replanned
from hetero.specs.cluster import without_devices

@dataclasses.dataclass
class _Attempt:
    cluster: object
    plan: object
    options: object
    run_dir: str
    start_step: int = 0
    """The step its state starts at (its ``--load``)."""


def run_elastic(cluster, model, plan, options, *, master_addr: str | None, master_port: int | None = None,
                print_fn=print, run_dir: str | None = None, cluster_path: str | None = None,
                node_rank: int | None = None) -> dict:
    """Train ``options.steps`` steps, replanning after each lost device and, with ``cluster_path``
    (the file ``cluster`` was read from), after each usable change of that file; returns the merged
    summary (docs/formats.md, with ``reconfigurations``) and writes it to ``options.summary`` when set.
    ``master_port``: the first attempt's (later ones take a free port). ``node_rank``: this call
    starts that node slot only, and every machine takes part in one in-process run
    (:func:`run_machine`)."""
    if node_rank is not None:
        return run_machine(cluster, model, plan, options, node_rank, master_addr=master_addr,
                           master_port=master_port, print_fn=print_fn, run_dir=run_dir, cluster_path=cluster_path)
    from hetero.runtime.elastic.live import LiveRun
    from hetero.runtime.elastic.plans import live_applies
    from hetero.runtime.elastic.processes import WorkerStarter
    from hetero.runtime.grads import param_holders
    from hetero.runtime.launcher import RankFailure, prepare, run
    from hetero.specs.io import write_text_atomic

    base = run_dir or tempfile.mkdtemp(prefix="hetero-elastic-")
    os.makedirs(base, exist_ok=True)
    user_summary, user_trace, total = options.summary, options.trace, options.steps
    traces: list[str | None] = []   # each attempt's trace file (--trace), merged at the end
    failed_traces: list[tuple] = []  # (run dir, layout, trace file) of failed attempts: built at the end
    done: list[dict] = []           # step results of the attempts that failed
    reconfigurations: list[dict] = []
    attempt = _Attempt(cluster, plan, options, os.path.join(base, "attempt0"))
    summary = None
    watch = None
    starter = WorkerStarter(base)   # every in-process attempt's workers
    if cluster_path:
        from hetero.runtime.elastic.watch import ClusterWatch

        watch = ClusterWatch(cluster_path, cluster, model, plan, print_fn=print_fn).start()
    try:
        k = failures = 0    # attempts made; device losses (cluster changes are not limited)
        while True:
            trace = os.path.join(attempt.run_dir, "trace.json") if user_trace else None
            traces.append(trace)
            opts = dataclasses.replace(attempt.options, summary=os.path.join(attempt.run_dir, "summary.json"),
                                       trace=trace)
            launch = prepare(attempt.cluster, model, attempt.plan, opts, master_addr=master_addr,
                             master_port=master_port if k == 0 else None, run_dir=attempt.run_dir)
            if k == 0:
                if live_applies(attempt.plan, opts, launch) is None:   # the workers' fork server imports
                    starter.prestart(launch.nodes[0])                  # while the planner loads here
                _import_recovery_modules(cluster, model, plan)
            # which ranks hold each parameter: worked out before the run, not in the downtime after a failure
            holders = param_holders(model, attempt.plan, launch.layout)
            if reconfigurations:
                reconfigurations[-1]["_launched_at"] = time.time()
            if watch:
                watch.attach(attempt.run_dir, attempt.cluster, attempt.plan)
            k += 1
            try:
                why_not_live = live_applies(attempt.plan, opts, launch)
                if why_not_live is None:   # survivors reshard in-process (hetero.runtime.elastic.live)
                    now = LiveRun(launch, attempt.cluster, model, attempt.plan, reconfigurations, print_fn,
                                  on_new_plan=(lambda g: watch.attach(g.run_dir, g.cluster, g.plan)) if watch
                                  else None, watch=watch, starter=starter).run()
                    attempt = dataclasses.replace(attempt, cluster=now.cluster, plan=now.plan, run_dir=now.run_dir)
                    launch.layout = now.layout
                    holders = param_holders(model, now.plan, now.layout)
                else:
                    _import_handoff_modules()
                    if k == 1:
                        print_fn(f"elastic: {why_not_live}: a lost device's state goes through the run directory "
                                 f"and every worker restarts (the in-process reshard needs the native engine "
                                 f"and one launching machine)")
                    run(launch, print_fn=print_fn)
            except RankFailure as failure:
                _close_timing(reconfigurations, attempt.run_dir, launch.layout.world_size)
                if watch:   # a change the running plan absorbed without a pause is the cluster now
                    attempt = dataclasses.replace(attempt, cluster=watch.attach(None))
                failures += 1
                if failures > MAX_RECONFIGURATIONS:
                    raise HeteroError(f"elastic: {failures - 1} devices lost already; giving up: {failure}") from None
                if trace:   # the survivors handed off their events: their part of the trace, after the run
                    failed_traces.append((attempt.run_dir, launch.layout, trace))
                attempt = _recover(failure, launch, attempt, holders, model, done, reconfigurations, total, base,
                                   k, print_fn)
                if attempt is None:     # the failure came after the last step's update
                    break
                continue
            _close_timing(reconfigurations, attempt.run_dir, launch.layout.world_size)
            if watch:
                watch.attach(None)
            if _paused(attempt.run_dir, launch.layout.world_size):
                change = watch.take() if watch else None
                if change is None:   # a pause is asked for only with a change pending
                    raise HeteroError(f"elastic: the ranks paused after a cluster change that is not pending any "
                                      f"more (a bug; the handed-off state is in {attempt.run_dir})")
                attempt = _reconfigure(change, launch, attempt, holders, done, reconfigurations, total, base, k,
                                       print_fn)
                if attempt is None:
                    break
                continue
            if watch and watch.pending:
                print_fn(f"elastic: {cluster_path} changed after the last step began; nothing left to replan")
            with open(opts.summary) as f:
                summary = json.load(f)
            break
        if user_trace:
            from hetero.runtime.trace import LEFT_PART, merge_traces

            for failed in failed_traces:
                _failed_attempt_trace(*failed)
            present = [t if t and os.path.exists(t) else None for t in traces]
            labels = [f"attempt {k}" for k in range(len(present))]
            for attempt_dir in sorted(glob.glob(os.path.join(base, "attempt*"))):
                # processes an in-process reconfiguration left out wrote their events as they left
                for part in sorted(glob.glob(os.path.join(attempt_dir, LEFT_PART.format(gen="*", rank="*")))):
                    gen = os.path.basename(part).split("-")[1][3:]
                    present.append(part)
                    labels.append(f"{os.path.basename(attempt_dir)}, left at reconfiguration {gen}")
            write_text_atomic(user_trace, json.dumps(merge_traces(present, reconfigurations, labels)), "--trace")
        merged = _merge(summary, done, reconfigurations)
        if user_summary:
            write_text_atomic(user_summary, json.dumps(merged, indent=2), "--summary")
        return merged
    finally:
        if watch:
            watch.stop()
        starter.close()
        if not run_dir:
            shutil.rmtree(base, ignore_errors=True)


def _failed_attempt_trace(run_dir: str, layout, path: str) -> None:
    """A failed attempt's trace from the events its survivors handed off (none from lost ranks)."""
    from hetero.runtime.handoff import Survivors
    from hetero.runtime.trace import trace_dict

    with open(path, "w") as f:
        json.dump(trace_dict(layout, Survivors(run_dir, layout).events()), f)


def _import_recovery_modules(cluster, model, plan) -> None:
    """Import the planner and load the predictor's operator model (one prediction) before training
    starts, so they do not count into the downtime after a failure (docs/elastic.md gives their
    time). The handoff's modules are imported where that path is taken
    (:func:`_import_handoff_modules`): the in-process path never holds a tensor in the launcher,
    and torch.distributed.checkpoint would add 30 MB to its memory for nothing."""
    import hetero
    import hetero.planner  # noqa: F401

    try:
        hetero.predict(cluster, model, plan)
    except Exception:  # noqa: BLE001 - only a warm-up: the replan itself says what is wrong
        pass


def _import_handoff_modules() -> None:
    """What the handoff path assembles checkpoints with (torch.distributed.checkpoint and .tensor),
    imported before the attempt trains, so not in the downtime after a failure."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    from hetero.runtime import handoff  # noqa: F401


def _recover(failure, launch, attempt, holders, model, done, reconfigurations, total, base, k, print_fn):
    """Hand off, replan and prepare the next attempt after ``failure`` (or None when no step is left);
    ``holders``: parameter name -> ranks of the failed attempt's plan."""
    from hetero.runtime.spec import describe_rank

    layout = launch.layout
    lost = [layout.ranks[r] for r in failure.lost]
    who = "; ".join(describe_rank(i) for i in lost)
    reason = f"{who} {failure.reason}"
    print_fn(f"elastic: {reason}")
    refuse_lost_slices(attempt.plan, reason)
    step, ckpt, handed_at = _hand_over(attempt, layout, holders, done, base, k, reason, failure.time, print_fn)
    cluster = without_devices(attempt.cluster, lost)
    result = replan(cluster, model, attempt.plan)
    replanned_at = time.time()
    ranks = sum(result.plan.devices_by_group().values())
    print_fn(f"{replanned(cluster.num_devices, ranks, f'{replanned_at - handed_at:.1f} s')}, "
             f"{result.one_line} (predicted {result.tokens_per_s:,.0f} tokens/s)")
    reconfigurations.append(_record(step, reason, layout, cluster, result, failure.time, handed_at - failure.time,
                                    replanned_at - handed_at, added=0, removed=len(lost)))
    return _next_attempt(attempt, step, ckpt, cluster, result, total, base, k)


def _reconfigure(change, launch, attempt, holders, done, reconfigurations, total, base, k, print_fn):
    """Every rank paused for a change of the cluster file (:mod:`hetero.runtime.elastic.watch`), with
    its new plan already made: hand off and prepare the next attempt (None when no step is left)."""
    layout = launch.layout
    with open(os.path.join(attempt.run_dir, "rank0.paused")) as f:
        paused = json.load(f)
    if "checkpoint" in paused:   # ZeRO: the ranks wrote the collective checkpoint (worker.py)
        step, ckpt = paused["applied_step"], paused["checkpoint"]
        done.extend(paused["results"][:step - attempt.start_step])
        handed_at = time.time()
        print_fn(f"elastic: {layout.world_size} rank(s) wrote their state after step {step} "
                 f"({handed_at - change.seen_at:.1f} s after the change)")
    else:
        step, ckpt, handed_at = _hand_over(attempt, layout, holders, done, base, k, change.reason, change.seen_at,
                                           print_fn)
    asked_at = change.seen_at + change.replan_time_s    # planned first, while training went on
    reconfigurations.append(_record(step, change.reason, layout, change.cluster, change.result, change.seen_at,
                                    handed_at - asked_at, change.replan_time_s, added=change.added,
                                    removed=change.removed))
    return _next_attempt(attempt, step, ckpt, change.cluster, change.result, total, base, k)


def _hand_over(attempt, layout, holders, done, base, k, reason, since, print_fn):
    """The ranks' handed-off state as one checkpoint; their step results go to ``done``. Returns the
    step the state is at, the checkpoint directory and the time it was complete (``since``: the time
    of the failure or of the change, for the message)."""
    from hetero.runtime.checkpoint import save_assembled_checkpoint
    from hetero.runtime.handoff import Survivors

    survivors = Survivors(attempt.run_dir, layout)
    if not survivors.ranks:
        raise HeteroError(f"elastic: no rank handed off its state after {reason} (fix: restart from a --save "
                          f"checkpoint)")
    step, state = survivors.assemble(holders)
    results = survivors.results()[:step - attempt.start_step]
    done.extend(results)   # this attempt's steps: start_step + 1 ...
    done.extend({"step": s, "loss": None, "time_s": None, "grad_norm": None}   # updated; the step's
                for s in range(attempt.start_step + len(results) + 1, step + 1))  # closing all-reduce lost
    ckpt = os.path.join(base, f"handoff{k}")
    save_assembled_checkpoint(ckpt, state, step, survivors.loss_scale(step))
    handed_at = time.time()
    print_fn(f"elastic: {len(survivors.ranks)} rank(s) handed off their state after step {step} "
             f"({handed_at - since:.1f} s after it)")
    return step, ckpt, handed_at


def _record(step, reason, layout, cluster, result, since, handoff_s, replan_s, *, added, removed) -> dict:
    """One ``reconfigurations`` entry; ``since``: the failure or the change, which reshard_time_s
    counts from (it and the restart time are added by _close_timing)."""
    return {"step": step + 1, "reason": reason, "world_size_before": layout.world_size,
            "world_size_after": sum(result.plan.devices_by_group().values()),
            "devices_left": cluster.num_devices, "devices_added": added, "devices_removed": removed,
            "_failed_at": since, "handoff_time_s": handoff_s, "replan_time_s": replan_s,
            "plan": result.plan.to_dict(), "predicted_tokens_per_s": result.tokens_per_s}


def _next_attempt(attempt, step, ckpt, cluster, result, total, base, k):
    """The attempt that trains the steps after ``step`` on ``result``'s plan from ``ckpt``; None (after
    --save) when every step was done."""
    if step >= total:   # every step's update was applied: what is left is --save
        if attempt.options.save:
            from hetero.runtime.checkpoint import put_in_place, staging_dir

            shutil.rmtree(staging_dir(attempt.options.save), ignore_errors=True)
            shutil.copytree(ckpt, staging_dir(attempt.options.save))
            put_in_place(staging_dir(attempt.options.save), attempt.options.save)
        return None
    # loss_scale None: the handed-off fp16 scale is the one to go on with (an explicit one would win)
    options = dataclasses.replace(attempt.options, load=ckpt, steps=total - step, inject_failure=None,
                                  loss_scale=None)
    return _Attempt(cluster, result.plan, options, os.path.join(base, f"attempt{k}"), start_step=step)


def _paused(run_dir: str, world: int) -> bool:
    """Whether the attempt's ranks paused for a cluster change (rather than finishing every step)."""
    return any(os.path.exists(os.path.join(run_dir, f"rank{r}.paused")) for r in range(world))


def _close_timing(reconfigurations: list[dict], run_dir: str, world: int) -> None:
    """The last reconfiguration's restart time: from the new launch (``run_dir``, the attempt it
    started) to its last rank's state loaded."""
    if not reconfigurations or "restart_time_s" in reconfigurations[-1]:
        return
    rc = reconfigurations[-1]
    loaded = []
    for r in range(world):
        try:
            with open(os.path.join(run_dir, f"rank{r}.training")) as f:
                loaded.append(float(f.read()))
        except (OSError, ValueError):
            pass
    if loaded:
        rc["restart_time_s"] = max(loaded) - rc["_launched_at"]
        rc["reshard_time_s"] = max(loaded) - rc["_failed_at"]


def _merge(summary: dict | None, done: list[dict], reconfigurations: list[dict]) -> dict:
    """The final attempt's summary with the earlier attempts' steps in front and the reconfigurations."""
    out = dict(summary or {"ranks": [], "tokens_per_s": 0.0, "predicted_iteration_time_s": None})
    earlier = {"losses": [r["loss"] for r in done], "iteration_times_s": [r["time_s"] for r in done],
               "grad_norms": [r["grad_norm"] for r in done], "lrs": [r.get("lr") for r in done]}
    for key, values in earlier.items():
        values = [v if v is not None and math.isfinite(v) else None for v in values]   # JSON: no NaN / inf
        out[key] = values + list(out.get(key, []))
    if "loss_scales" in out:   # fp16
        out["loss_scales"] = [r.get("loss_scale") for r in done] + list(out["loss_scales"])
        out["skipped_steps"] = [r["step"] for r in done if r.get("skipped")] + list(out.get("skipped_steps", []))
    out["steps"] = len(out["losses"])
    out["reconfigurations"] = [{k: v for k, v in rc.items() if not k.startswith("_")} for rc in reconfigurations]
    for rc in out["reconfigurations"]:
        rc.setdefault("reshard_time_s", None)
    return out


def run_machine(cluster, model, plan, options, node_rank: int, *, master_addr: str | None,
                master_port: int | None, print_fn=print, run_dir: str | None = None,
                cluster_path: str | None = None) -> dict:
    """This machine's part of an elastic run over several machines (``--elastic --node-rank R`` on
    each): node slot 0's call runs the in-process controller for every machine
    (:class:`~.live.LiveRun`, hosting the coordinator's store at the rendezvous address, port
    + :data:`~.protocol.COORDINATOR_PORT_OFFSET`); every other call starts and watches its own
    workers (:class:`~.agent.NodeAgent`). With ``cluster_path``, node slot 0's call watches that file
    as on one machine; a call whose node slot the running plan does not have is a machine that joins
    (its agent waits for a change that puts ranks there). Returns the merged summary on node slot
    0's machine (written to ``options.summary``), an empty one elsewhere."""
    from hetero.runtime.elastic.agent import NodeAgent
    from hetero.runtime.elastic.live import LiveRun
    from hetero.runtime.elastic.processes import WorkerStarter
    from hetero.runtime.elastic.protocol import COORDINATOR_PORT_OFFSET
    from hetero.runtime.launcher import check_devices_here, check_node_rank, prepare
    from hetero.specs.io import write_text_atomic

    base = run_dir or tempfile.mkdtemp(prefix="hetero-elastic-")
    opts = dataclasses.replace(options, summary=os.path.join(base, "attempt0", "summary.json"))
    try:
        launch = prepare(cluster, model, plan, opts, master_addr=master_addr, master_port=master_port,
                         run_dir=os.path.join(base, "attempt0"), separate=True)
        port = launch.master_port + COORDINATOR_PORT_OFFSET
        joins = node_rank >= len(launch.nodes)   # a slot the running plan has not: it may join
        if not joins:
            check_node_rank(launch, node_rank)
            check_devices_here(launch, [node_rank])
        if node_rank != 0:
            print_fn(f"elastic: node slot {node_rank} takes part in the run coordinated at "
                     f"{launch.master_addr}:{port}")
            NodeAgent(None if joins else launch, node_rank, launch.master_addr, port, print_fn, options=opts,
                      model=model).run()
            return {"reconfigurations": [], "steps": 0, "losses": []}
        starter = WorkerStarter(launch.spec.options.run_dir)
        starter.prestart(launch.nodes[0])   # the workers' fork server imports while the planner loads here
        _import_recovery_modules(cluster, model, plan)
        reconfigurations: list[dict] = []
        watch = None
        if cluster_path:   # machines that join, devices that come and go: the file is watched here
            from hetero.runtime.elastic.watch import ClusterWatch

            watch = ClusterWatch(cluster_path, cluster, model, plan, print_fn=print_fn).start()
            watch.attach(launch.spec.options.run_dir, cluster, plan)
        live = LiveRun(launch, cluster, model, plan, reconfigurations, print_fn, slots=[0], coordinator_port=port,
                       watch=watch, on_new_plan=(lambda g: watch.attach(g.run_dir, g.cluster, g.plan)) if watch
                       else None, starter=starter)
        try:
            live.run()
        finally:
            if watch:
                watch.stop()
            starter.close()
        summary = live.remote_summary   # rank 0 finished on another machine: its launcher sent the summary
        if os.path.exists(opts.summary):
            with open(opts.summary) as f:
                summary = json.load(f)
        merged = _merge(summary, [], reconfigurations)
        if merged["steps"] < options.steps:
            # the ranks handed off for a change the in-process path could not take (a joiner that ended
            # while starting): a restart from that state is the one-machine path's, not built across machines
            raise HeteroError(f"elastic: the run stopped after {merged['steps']} of {options.steps} steps for a "
                              f"change of the cluster file it could not take in in-process (see the lines above) "
                              f"(fix: restart from a --save checkpoint on the new cluster)")
        if options.summary:
            write_text_atomic(options.summary, json.dumps(merged, indent=2), "--summary")
        return merged
    finally:
        if not run_dir:
            shutil.rmtree(base, ignore_errors=True)
