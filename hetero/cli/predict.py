"""``hetero predict --cluster C --model M --plan P``: predicted time, throughput and memory of a plan."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    from ._common import add_fit_allocator_argument

    p = sub.add_parser("predict", help="predict iteration time, throughput and memory of a plan",
                       description="Score a plan on a cluster: per-stage forward/backward times and memory, "
                                   "the iteration time (schedule simulation + DP sync + optimizer), tokens/s "
                                   "and MFU, and where every device's numbers come from. Exit status: 0 the plan "
                                   "fits memory, 3 it was predicted but a stage does not fit its devices' memory "
                                   "(the last line says so; --json too: see fits_memory), 1 bad input.")
    p.add_argument("--cluster", required=True, help="cluster file")
    p.add_argument("--model", required=True, help="model file")
    p.add_argument("--plan", required=True, help="plan file")
    p.add_argument("--calibration", help="calibration file written by 'hetero calibrate'")
    p.add_argument("--json", action="store_true", help="print the Prediction JSON only, with the plan's objectives (throughput, indicative cost, memory headroom, energy)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="predict the gradient sync after the schedule, as `hetero launch --no-overlap` runs it "
                        "(default: bucket by bucket under the last backward)")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw the predicted step (every device's schedule, the gradient sync and the optimizer) "
                        "and each stage's peak memory against its capacity as a PNG (needs matplotlib)")
    p.add_argument("--timeline", metavar="OUT.json",
                   help="write a Chrome/Perfetto trace of the iteration (open in ui.perfetto.dev)")
    add_fit_allocator_argument(p)
    p.set_defaults(func=run,  # the files read and written: check_outputs_apart
                   inputs={"--cluster": "cluster", "--model": "model", "--plan": "plan", "--calibration": "calibration"},
                   outputs={"--plot": "plot", "--timeline": "timeline"})


DOES_NOT_FIT = 3
"""Exit status of a prediction whose plan does not fit memory (reported in full, yet not runnable)."""


def _bytes(x: float) -> str:
    """Memory in the unit its size calls for (``7.92 MiB``, ``35.4 GiB``), so a small need is not ``0.00 GiB``."""
    from hetero.specs.units import format_quantity

    return format_quantity(x, "bytes")


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def run(args) -> int:
    from hetero.predictor import predict
    from hetero.specs.units import plural

    from ._common import (check_output, console, host_memory_note, load_calibration_arg, load_inputs, print_json,
                          warn_cross_node_tp, warn_if_cpu_unprofiled, write_output)

    cluster, model, plan = load_inputs(args)
    if args.timeline is not None:   # "" too: an error, not a timeline silently skipped
        check_output(args.timeline, "--timeline")
    if args.plot is not None:
        from hetero.plots import require_matplotlib

        check_output(args.plot, "--plot")
        require_matplotlib("--plot")
    calibration = load_calibration_arg(args.calibration, cluster)
    pred = predict(cluster, model, plan, calibration=calibration, timeline=bool(args.timeline or args.plot),
                   allocator=args.allocator, overlap=args.overlap)
    warn_if_cpu_unprofiled(cluster, pred.provenance)
    warn_cross_node_tp(cluster, plan, args.plan)
    if args.timeline:
        write_output(args.timeline, "--timeline", json.dumps(pred.timeline()))
    if args.plot:
        from hetero.plots import png_bytes, step_figure

        title = (f"{cluster.name} / {model.name}: predicted step {pred.iteration_time_s:.4g} s, "
                 f"{pred.tokens_per_s:,.0f} tokens/s, schedule {plan.schedule}")
        write_output(args.plot, "--plot", png_bytes(step_figure(pred, plan, title)))
    from hetero.predictor.objectives import objectives

    # cost and energy are None (null) for a device without catalog price or power figures
    obj = objectives(cluster, plan, pred)
    if args.json:
        print_json({**pred.to_dict(), "objectives": obj})   # the Prediction JSON plus the objectives
        return 0 if pred.fits_memory else DOES_NOT_FIT

    from rich.table import Table

    out = console()
    bp, bs = pred.bottleneck
    for pi, (p, pp) in enumerate(zip(plan.pipelines, pred.pipelines)):
        t = Table(title=f"pipeline {pi}: {plural(pp.replicas, 'replica')}, each {plural(pp.micro_batches, 'micro-batch', 'micro-batches')} "
                        f"of {plural(pp.micro_batch_size, 'sample')}, schedule {plan.schedule}: {_ms(pp.pipeline_time_s)}",
                  title_justify="left")
        numeric = ("tp", "forward", "backward", "to next", "DP sync")
        memcol = f"memory ({args.allocator} reserves) / capacity" if args.allocator else "memory / capacity"
        for col in ("stage", "group", "tp", "layers", "forward", "backward", "to next", memcol, "DP sync"):
            t.add_column(col, justify="right" if col in numeric else "left")
        for si, s in enumerate(pp.stages):
            memtxt = f"{_bytes(s.peak_memory_bytes)} / {_bytes(s.memory_capacity_bytes)}"
            if s.allocator:
                memtxt = f"{_bytes(s.peak_memory_bytes)} live, {_bytes(s.needed_bytes)} / {_bytes(s.memory_capacity_bytes)}"
            if not s.fits:
                memtxt = f"[red]{memtxt}[/red]"
            # the stage that limits the slowest pipeline (most busy time), as the launch's step line names it
            mark = " [bold yellow](bottleneck)[/bold yellow]" if (pi, si) == (bp, bs) else ""
            # the hand-off of one micro-batch's activation to the next stage (its gradient comes back
            # in the same time): link, host staging across vendors, the tp all-gather
            send = _ms(s.p2p_time_s) if si < len(pp.stages) - 1 else ""
            t.add_row(f"{si}{mark}", s.group, str(s.tp), f"[{s.layers[0]}, {s.layers[1]})", _ms(s.forward_time_s),
                      _ms(s.backward_time_s), send, memtxt,
                      f"{_ms(s.dp_sync_time_s)} ({_ms(s.dp_sync_exposed_s)} exposed)")
        out.print(t)
    gather = max(s.param_gather_exposed_s for s in pred.pipelines[bp].stages)
    out.print(f"[bold]iteration[/bold] {pred.iteration_time_s:.4f} s  (slowest pipeline "
              f"{pred.pipelines[bp].pipeline_time_s:.4f} s"
              + (f", {gather:.4f} s of it waiting for ZeRO's parameter all-gather" if gather > 0 else "")
              + " + DP sync not hidden by the backward "
              f"{pred.dp_sync_time_s:.4f} s + optimizer "
              f"{pred.optimizer_time_s:.4f} s + overhead {pred.overhead_time_s:.4f} s)")
    out.print(f"[bold]throughput[/bold] {pred.tokens_per_s:,.0f} tokens/s, {pred.samples_per_s:,.2f} samples/s, "
              f"MFU {pred.mfu:.1%}")
    parts = [f"cost {obj['cost']:.4g} USD per million tokens (indicative catalog prices)" if obj["cost"] is not None
             else None, f"energy {obj['energy']:.4g} J/token" if obj["energy"] is not None else None,
             f"memory headroom {obj['memory_headroom']:.1%}" if obj["memory_headroom"] is not None else None]
    if any(parts):
        out.print("[bold]objectives[/bold] " + ", ".join(p for p in parts if p))
    if pred.fits_memory:
        out.print("[bold]memory[/bold] [green]fits[/green] on every stage")
    else:
        out.print("[bold]memory[/bold] [red]does not fit[/red]:")
        for pi, si, s in pred.memory_shortfalls():
            out.print(f"  pipeline {pi} stage {si} ({s.group}, tp {s.tp}, layers [{s.layers[0]}, {s.layers[1]})) "
                      f"needs {_bytes(s.needed_bytes)} of {_bytes(s.memory_capacity_bytes)}: "
                      f"{_bytes(s.memory_shortfall_bytes)} ({s.memory_shortfall_bytes:,} bytes) more")
    shown = pred.launch_bound_stages()
    for s, mbs in shown:
        out.print(f"[bold]launch-bound[/bold] {s.group} (tp {s.tp}, micro-batch {mbs}): the host issues a layer's "
                  f"kernels in {_ms(s.layer_dispatch_s)}, the device runs them in {_ms(s.layer_device_s)}; "
                  f"a larger micro-batch" + (", less tensor parallelism" if s.tp > 1 else "")
                  + " or fewer launches (fused kernels, CUDA graphs) would use the device better")
    if shown:
        out.print("  [dim](host dispatch times are those of the machines the operator data was measured on, unless "
                  "`hetero profile` on your device or a calibration on your runs measured them)[/dim]")
    for dev, info in pred.provenance.items():
        out.print(f"[dim]provenance[/dim] {dev} ({', '.join(info['groups'])}): numbers from {info['source']}, "
                  f"operator model {info['op_model']}" + (f";\n  {info['note']}" if info.get("note") else ""))
    for line in _default_links(cluster, plan):
        out.print(f"[dim]provenance[/dim] {line}")
    note = host_memory_note(cluster, plan, pred)
    if note:
        out.print(f"[bold]note[/bold] {note}")
    if model.attention == "unfused":
        # the default describes Megatron's runs (what the vTrain calibration measured), not hetero's
        out.print("[bold]note[/bold] attention: unfused (the default) costs Megatron's separate scores, softmax and "
                  "context kernels and keeps their s x s scores for backward; `hetero launch` runs fused SDPA, "
                  "so write `attention: fused` in the model file to predict hetero's own runs")
    if args.timeline:
        out.print(f"timeline written to {args.timeline}")
    if args.plot:
        out.print(f"plot written to {args.plot}")
    if not pred.fits_memory:   # said last, where it is read, and in the exit status
        n = len(pred.memory_shortfalls())
        out.print(f"[bold red]does not fit[/bold red]: {plural(n, 'stage')} {'needs' if n == 1 else 'need'} more "
                  f"memory than {'its' if n == 1 else 'their'} devices hold "
                  f"(see 'memory' above; `hetero launch` refuses this plan); exit status {DOES_NOT_FIT}")
        return DOES_NOT_FIT
    return 0


def _default_links(cluster, plan) -> list[str]:
    """The network links at their default figures that the plan's traffic can use (between nodes of
    a group: a group of several nodes; between groups: a plan over several groups)."""
    from hetero.specs.cluster import Network

    used = {s.group for p in plan.pipelines for s in p.stages}
    default, net, out = Network(), cluster.network, []
    for name, crossed in (("inter_node", any(cluster.group(g).nodes > 1 for g in used)),
                          ("cross_group", len(used) > 1)):
        link = getattr(net, name)
        if crossed and link == getattr(default, name):
            out.append(f"network.{name}: {link.bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} us, the default "
                       f"(set network.{name} in the cluster file to your fabric's figures)")
    return out
