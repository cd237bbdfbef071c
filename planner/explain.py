"""Why the planner chose what it chose, in numbers from the predictor; and why nothing fits."""
from __future__ import annotations


def _cost_model(cluster, model, cost_model, calibration):
    if cost_model is not None:
        return cost_model
    from hetero.predictor import cost_model_for  # the search's warm (memoised) one, not a fresh copy

    return cost_model_for(cluster, model, calibration)


def _layers_by_group(plan) -> dict[str, tuple[int, int, int]]:
    """group -> (layers per replica chain, physical stages, tp) over the pipelines that use it."""
    out = {}
    for p in plan.pipelines:
        for s in p.stages:
            n, k, tp = out.get(s.group, (0, 0, s.tp))
            out[s.group] = (n + s.num_layers, k, tp)
        for s in plan.physical_stages(p):
            n, k, tp = out[s.group]
            out[s.group] = (n, k + 1, tp)
    return out


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.1f}"


def explain(cluster, model, B, results, fitting, candidates, scorer, cost_model, calibration) -> list[str]:
    reasons: list[str] = []
    if not results:
        return reasons
    best = results[0]
    cm = _cost_model(cluster, model, cost_model, calibration)
    plan = best.plan
    L = model.num_layers
    # 1. how layers follow device speed
    for p in plan.pipelines:
        groups = []
        for s in p.stages:
            if s.group not in [g for g, _ in groups]:
                groups.append((s.group, s.tp))
        if len(groups) < 2:
            continue
        per_layer = {}
        for g, tp in groups:
            f, b = cm.layer_times(g, tp, plan.mbs(p), plan.recompute)
            per_layer[g] = (f + b, tp)
        fastest = min(per_layer, key=lambda g: per_layer[g][0])
        for g, tp in groups:
            stages = [s for s in plan.physical_stages(p) if s.group == g]
            n = sum(s.num_layers for s in p.stages if s.group == g)
            ratio = per_layer[g][0] / per_layer[fastest][0]
            if g == fastest:
                reasons.append(f"{g} stages get {n} of {L} layers ({len(stages)} stage(s), tp{tp}): fastest per layer "
                               f"({per_layer[g][0] * 1e3:.2f} ms forward+backward per micro-batch)")
            else:
                reasons.append(f"{g} stages get {n} of {L} layers ({len(stages)} stage(s), tp{tp}): "
                               f"{ratio:.1f}x slower per layer than {fastest} at their tp")
    # 2. best vs runner-up
    if len(results) > 1:
        ru = results[1]
        a, b = best.prediction, ru.prediction
        gain = a.tokens_per_s / b.tokens_per_s - 1 if b.tokens_per_s else 0.0
        diff = _diff(best.plan, ru.plan)
        if a.tokens_per_s <= b.tokens_per_s:  # an exact tie (e.g. ZeRO twins over one replica)
            reasons.append(f"best ties with the runner-up ({ru.one_line}) at {_fmt_rate(a.tokens_per_s)} tokens/s "
                           f"(iteration {a.iteration_time_s:.3g} s)" + (f": {diff}" if diff else ""))
        else:
            reasons.append(f"best beats the runner-up ({ru.one_line}) by {gain * 100:.1f}% "
                           f"({_fmt_rate(a.tokens_per_s)} vs {_fmt_rate(b.tokens_per_s)} tokens/s; "
                           f"iteration {a.iteration_time_s:.3g} s vs {b.iteration_time_s:.3g} s)"
                           + (f": {diff}" if diff else ""))
    # 3. TP or PP for the slower GPUs
    tp_pp = _tp_or_pp(cluster, model, B, best, candidates, scorer, cm)
    if tp_pp:
        reasons.append(tp_pp)
    # 4. the schedule: interleaved or not, against its twin on the same devices and layer counts
    schedule = _schedule_reason(best, scorer)
    if schedule:
        reasons.append(schedule)
    # 5. launch-bound stages: where only bigger kernels or fewer launches would help
    for s, mbs in best.prediction.launch_bound_stages():
        reasons.append(f"{s.group} stages (tp{s.tp}, micro-batch {mbs}) are launch-bound: the host issues a "
                       f"layer's kernels in {s.layer_dispatch_s * 1e3:.2f} ms, the device runs them in "
                       f"{s.layer_device_s * 1e3:.2f} ms")
    # 6. an MoE model: its experts spread over data-parallel ranks, or not
    from .experts import expert_reason

    experts = expert_reason(best, scorer) if model.moe is not None else None
    if experts:
        reasons.append(experts)
    # 7. the upper bound, and each group's best plan alone
    reasons.extend(_bound_reasons(best, results))
    return reasons


def _bound_reasons(best, results) -> list[str]:
    """Where the best plan stands against the upper bound (:mod:`.bound`; never above it) and
    against the sum of each group's best plan alone (a comparison a mixed plan may beat)."""
    out = []
    tps = best.prediction.tokens_per_s
    ub = getattr(results, "upper_bound_tokens_per_s", None)
    if ub:
        rates = getattr(results, "upper_bound_by_group", None) or {}
        out.append(f"{tps / ub * 100:.1f}% of the upper bound {_fmt_rate(ub)} tokens/s (the model's compute "
                   "shared among the groups at each one's fastest setting, with no memory limit, bubble, "
                   "transfer, gradient sync or optimizer; each group computing alone: "
                   + ", ".join(f"{g} {_fmt_rate(v)}" for g, v in rates.items()) + ")"
                   # below it (by more than rounding): where the step goes, its sync and ZeRO's
                   # gathers under the backward and the next forwards included
                   + (f"; below it: {_step_split(best.plan, best.prediction)}" if tps < ub * 0.9995 else ""))
    alone = getattr(results, "alone_by_group", None) or {}
    listed = ", ".join(f"{g} {_fmt_rate(v)}" for g, v in alone.items())
    cannot = [g for g, v in alone.items() if not v]
    if cannot:
        out.append(f"no sum of the groups alone: {', '.join(cannot)} cannot hold the model alone "
                   f"(each group's best plan alone: {listed} tokens/s)")
    elif alone and len(alone) > 1:
        total = sum(alone.values())
        out.append(f"{tps / total:.3f}x the sum of each group's best plan alone ({_fmt_rate(total)} tokens/s: "
                   f"{listed})" + ("; above it: a pipeline across groups lets each hold only its layers (less "
                                   "recomputation, ZeRO or tensor parallelism to fit) and gives the head and loss "
                                   "to one group" if tps > total * 1.0005 else ""))
    return out


def _step_split(plan, pred) -> str:
    """Where the best plan's step goes: the slowest pipeline's schedule (its busiest device's compute,
    the rest bubble and transfers), the gradient sync after it, the optimizer."""
    pi = pred.bottleneck[0]
    slowest = pred.pipelines[pi]
    phys = len(plan.physical_stages(plan.pipelines[pi]))   # interleaved: a device runs every phys-th stage
    busy = max(slowest.micro_batches * sum(s.forward_time_s + s.backward_time_s for s in slowest.stages[j::phys])
               for j in range(phys))
    t = pred.iteration_time_s or 1.0
    stages = [s for p in pred.pipelines for s in p.stages]
    longest = max(stages, key=lambda s: s.dp_sync_time_s)
    under = max(0.0, getattr(longest, "schedule_end_s", 0.0) - getattr(longest, "dp_sync_start_s", 0.0))
    hidden = (f"; the longest, {longest.group}'s {longest.dp_sync_time_s:.3g} s, runs {under:.3g} s of it under "
              f"its last backward" if under > 0 else "")
    gather = max(stages, key=lambda s: getattr(s, "param_gather_s", 0.0))
    if getattr(gather, "param_gather_s", 0.0) > 0:   # ZeRO with overlap: the all-gather left to the next step
        hidden += (f"; ZeRO's parameter all-gather ({gather.group} {gather.param_gather_s:.3g} s) runs under the "
                   f"next step's first forwards, which it delays by {gather.param_gather_exposed_s:.3g} s")
    return (f"the step's {pred.iteration_time_s:.3g} s are the slowest pipeline's schedule "
            f"{slowest.pipeline_time_s:.3g} s (its busiest device computes {busy:.3g} s of it; the rest is "
            f"bubble and transfers), then what the backward did not hide of the gradient sync over every replica "
            f"of every group {pred.dp_sync_time_s:.3g} s ({pred.dp_sync_time_s / t * 100:.0f}%{hidden}) and the "
            f"optimizer {pred.optimizer_time_s:.3g} s")


def _schedule_reason(best, scorer) -> str | None:
    """Interleaved best: what 1F1B on the same devices would predict. A 1F1B best of several stages:
    what its best interleaved twin predicts (it was scored, and lost or did not fit)."""
    from .interleave import interleaved_twins, one_chunk_twin
    from .options import Options

    plan, pred = best.plan, best.prediction
    if plan.schedule == "interleaved":
        alt = scorer(one_chunk_twin(plan))
        if alt is None:
            return None
        gain = pred.tokens_per_s / alt.tokens_per_s - 1 if alt.tokens_per_s else 0.0
        return (f"interleaved 1F1B with {plan.interleave} model chunks per device: the pipeline bubble shrinks "
                f"{plan.interleave}x for {plan.interleave}x the stage-to-stage transfers; "
                f"{_fmt_rate(pred.tokens_per_s)} vs {_fmt_rate(alt.tokens_per_s)} tokens/s with plain 1F1B on the "
                f"same devices and layer counts ({gain * 100:+.1f}%)"
                + ("" if alt.fits_memory else "; plain 1F1B would not fit memory"))
    if plan.schedule != "1f1b" or all(len(p.stages) < 2 for p in plan.pipelines):
        return None
    twins = [(t, scorer(t)) for t in interleaved_twins(plan, Options.interleaves)]   # the search's default
    twins = [(t, p) for t, p in twins if p is not None]
    if not twins:
        return None
    t, p = max(twins, key=lambda x: (x[1].fits_memory, x[1].tokens_per_s))
    verdict = ("does not fit memory" if not p.fits_memory else
               f"{(p.tokens_per_s / pred.tokens_per_s - 1) * 100:+.1f}%" if p.tokens_per_s <= pred.tokens_per_s else "")
    if not verdict:
        return None   # a better twin the search did not keep (--no-interleave): nothing to explain
    return (f"1F1B: interleaving {t.interleave} model chunks per device predicts {_fmt_rate(p.tokens_per_s)} "
            f"tokens/s ({verdict})")


def _diff(a, b) -> str:
    out = []
    if (a.schedule, a.interleave if a.schedule == "interleaved" else 0) != \
            (b.schedule, b.interleave if b.schedule == "interleaved" else 0):
        out.append(f"{_schedule_name(a)} vs {_schedule_name(b)}")
    if a.recompute != b.recompute:
        out.append(f"recompute {a.recompute} vs {b.recompute}")
    if a.zero_stage != b.zero_stage:
        out.append(f"zero_stage {a.zero_stage} vs {b.zero_stage}")
    if a.micro_batch_size != b.micro_batch_size:
        out.append(f"micro-batch size {a.micro_batch_size} vs {b.micro_batch_size}")
    sa, sb = _layers_by_group(a), _layers_by_group(b)
    for g in sorted(set(sa) | set(sb)):
        x, y = sa.get(g), sb.get(g)
        if x is None or y is None:
            out.append(f"{g} {'used' if x else 'idle'} vs {'used' if y else 'idle'}")
        elif x != y:
            parts = []
            if x[2] != y[2]:
                parts.append(f"tp{x[2]} vs tp{y[2]}")
            if x[1] != y[1]:
                parts.append(f"{x[1]} vs {y[1]} stages")
            if x[0] != y[0]:
                parts.append(f"{x[0]} vs {y[0]} layers")
            out.append(f"{g} " + ", ".join(parts))
    def order(plan):
        out = []
        for p in plan.pipelines:
            groups = []
            for s in p.stages:
                if not groups or groups[-1] != s.group:
                    groups.append(s.group)
            out.append(" > ".join(groups))
        return out

    if len(a.pipelines) == len(b.pipelines) and order(a) != order(b) and sorted(sa) == sorted(sb):
        out.append(f"stage order {', '.join(order(a))} vs {', '.join(order(b))} (embedding on the first "
                   f"stage, LM head on the last, cross-group hops)")
    if len(a.pipelines) != len(b.pipelines):
        out.append(f"{len(a.pipelines)} vs {len(b.pipelines)} pipeline shapes")
    return "; ".join(out)


def _schedule_name(plan) -> str:
    return f"interleaved x{plan.interleave}" if plan.schedule == "interleaved" else plan.schedule


def _tp_or_pp(cluster, model, B, best, candidates, scorer, cm) -> str | None:
    """Predict the best plan whose slowest used group has another tp; report the numbers (and whether
    the chosen plan gives that group TP, pipeline stages or plain data parallelism)."""
    plan = best.plan
    used = {s.group: s.tp for p in plan.pipelines for s in p.stages}
    if not used:
        return None
    mbs = plan.micro_batch_size

    def per_device_speed(g):
        f, b = cm.layer_times(g, 1, mbs, plan.recompute)
        return f + b

    slow = max(used, key=per_device_speed)
    chosen_tp = used[slow]
    alts: dict[int, object] = {}
    for c in sorted(candidates, key=lambda c: c.time):
        if c.blocks[0].recompute != plan.recompute:
            continue
        tps = {s.tp for blk in c.blocks for s in blk.segments if s.group == slow}
        if len(tps) != 1:
            continue
        tp = tps.pop()
        if tp == chosen_tp or tp in alts:
            continue
        alts[tp] = c
        if len(alts) >= 2:
            break
    if not alts:
        return None
    parts = []
    f1, b1 = cm.layer_times(slow, chosen_tp, mbs, plan.recompute)
    for tp, c in sorted(alts.items()):
        p2 = c.to_plan(B, model.num_layers)
        pred = scorer(p2)
        if pred is None:
            continue
        f2, b2 = cm.layer_times(slow, tp, mbs, plan.recompute)
        word = "more tensor parallelism" if tp > chosen_tp else "more pipeline stages"
        speed = (f2 + b2) / (f1 + b1)
        note = "" if pred.fits_memory else " (does not fit memory)"
        parts.append(f"tp{tp} ({word}: {speed:.2f}x the per-layer time of tp{chosen_tp}) predicts "
                     f"{_fmt_rate(pred.tokens_per_s)} tokens/s{note}")
    if not parts:
        return None
    # tp1 in one-stage pipelines is plain data parallelism; an idle group may be slower still
    staged = any(len(p.stages) > 1 for p in plan.pipelines if any(s.group == slow for s in p.stages))
    kind = "TP" if chosen_tp > 1 else "PP" if staged else "DP"
    which = "slowest group" if len(used) == len(cluster.groups) else "slowest group in use"
    return (f"{slow} ({which}) gets {kind}: tp{chosen_tp} predicts {_fmt_rate(best.prediction.tokens_per_s)} "
            f"tokens/s; " + "; ".join(parts))


def infeasible_message(cluster, model, B, opts, cost_model, calibration) -> str:
    """Which constraint fails, by how much, and what would fix it."""
    cm = _cost_model(cluster, model, cost_model, calibration)
    L = model.num_layers
    gb = 1e9
    total_mem = sum(cm.capacity(g.name) * g.num_devices for g in cluster.groups)
    # model states: the whole model on one device, micro-batch 1, full recompute, no ZeRO
    g0 = cluster.groups[0].name
    states = cm.stage_memory(g0, 1, 1, (0, L), "full", 0, 1, 1, True, True)
    lines = [f"{model.name} needs >= {states / gb:,.0f} GB for weights, gradients and Adam states "
             f"(plus activations); the cluster has {total_mem / gb:,.0f} GB of device memory in all"]
    if states > total_mem:
        lines.append("fix: add devices (about {:.0f} more of {}), or a smaller model".format(
            (states - total_mem) / cm.capacity(g0) + 1, cluster.groups[0].device))
        return "; ".join(lines)
    # per group: the deepest pipeline at the largest tp, ZeRO 2, full recompute, micro-batch 1
    worst = []
    from .space import tp_options

    for g in cluster.groups:
        tp = max(tp_options(cluster, model, g.name))
        S = max(1, min(L, g.num_devices // tp))
        per = -(-L // S)
        need = cm.stage_memory(g.name, tp, 1, (0, per), "full", max(opts.zero_stages), 1, S, True, S == 1)
        cap = cm.capacity(g.name)
        worst.append((need - cap, g.name, tp, S, per, need, cap))
    worst.sort()
    best_case = worst[0]
    over, name, tp, S, per, need, cap = best_case
    if over <= 0:
        # memory is not what fails: say so instead of reporting a negative shortfall
        lines.append(f"memory is not the limit (group '{name}' at tp{tp} x {S} stages needs {need / gb:.1f} "
                     f"of {cap / gb:.1f} GB per device), but no shape found could share a global batch "
                     f"of {B} between its pipelines")
        return "; ".join(lines) + "; fix: try a global batch size with more divisors (e.g. a multiple of 8)"
    lines.append(f"no plan fits: even the most memory-frugal shape of group '{name}' "
                 f"(tp{tp} x {S} stages of {per} layers, micro-batch 1, full recompute, "
                 f"zero_stage {max(opts.zero_stages)}) needs {need / gb:.1f} GB on its first stage, "
                 f"{over / gb:.1f} GB more than the {cap / gb:.1f} GB a device has")
    fixes = []
    if max(opts.zero_stages) < 1:   # zero_stage 2 peaks as 1 does (gradients whole through backward)
        fixes.append("allow zero_stage 1")
    if "full" not in opts.recompute:
        fixes.append("allow recompute full")
    fixes.append("add devices or use devices with more memory, or a shorter seq_length")
    return "; ".join(lines) + "; fix: " + ", ".join(fixes)


__all__ = ["explain", "infeasible_message"]
