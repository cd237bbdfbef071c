"""Expert parallelism for MoE models: the degree, and expert counts in proportion to each device's speed.

For a plan of an MoE model the search also scores twins of its best plans with the routed experts
spread over groups of ``degree`` data-parallel ranks (every degree that divides the ranks and is at
most the expert count), each rank holding experts in proportion to its expert speed: the
inverse of the predicted seconds one routed expert's forward and backward take on the rank's
device (:func:`hetero.predictor.moe.expert_times`), the slowest device at that place of any
group standing for it (the ranks of a group meet at every MoE layer's all-to-all, so the slowest
sets the pace). A device twice as fast gets about twice the experts. The twins compete with the
plan without expert parallelism in the same ``predict()``: fewer experts a rank (less memory, less
expert compute where the split follows speed) against the all-to-all's transfers.
"""
from __future__ import annotations

import dataclasses

from hetero.specs.plan import ExpertParallel, Plan

from .space import divisors


def rank_devices(plan: Plan) -> list[tuple[str, int]]:
    """(group, tp) of each data-parallel rank in order (pipelines, then replicas): its first MoE stage's."""
    return [(p.stages[0].group, p.stages[0].tp) for p in plan.pipelines for _ in range(p.replicas)]


def expert_speed(cm, group: str, tp: int, mbs: int) -> float:
    """1 / seconds of one routed expert's forward and backward over one micro-batch's balanced share
    of assignments on a device of ``group``."""
    from hetero.predictor.moe import expert_times, received_assignments

    model = cm.model
    rows = received_assignments(model, mbs * model.seq_length, model.moe.num_experts, 1)
    f, b = expert_times(cm, group, tp, rows, 1)
    return 1.0 / (f + b) if f + b > 0 else 0.0


def proportional_counts(speeds: list[float], num_experts: int) -> list[int]:
    """Expert counts summing to ``num_experts`` in proportion to ``speeds`` (largest remainders
    rounded up), at least 1 each (taken from the largest counts)."""
    k = len(speeds)
    if k > num_experts:
        raise ValueError(f"{k} ranks cannot each hold one of {num_experts} experts")
    total = sum(speeds)
    shares = [num_experts * s / total for s in speeds] if total > 0 else [num_experts / k] * k
    counts = [int(x) for x in shares]
    for i in sorted(range(k), key=lambda i: -(shares[i] - counts[i]))[: num_experts - sum(counts)]:
        counts[i] += 1
    for i in range(k):
        if counts[i] == 0:
            counts[i] = 1
            counts[max(range(k), key=counts.__getitem__)] -= 1
    return counts


def even_batches(plan: Plan) -> Plan | None:
    """``plan`` with every data-parallel rank running the same micro-batches (the global batch over
    the ranks at each pipeline's micro-batch size), as expert parallelism needs; None where the batch
    does not divide so."""
    ranks = sum(p.replicas for p in plan.pipelines)
    per, rest = divmod(plan.global_batch_size, ranks)
    mbs = {plan.mbs(p) for p in plan.pipelines}
    if rest or len(mbs) > 1 or per % next(iter(mbs)):
        return None
    m = per // next(iter(mbs))
    return dataclasses.replace(plan, pipelines=[dataclasses.replace(p, micro_batches=m) for p in plan.pipelines])


def expert_twins(cm, plan: Plan) -> list[Plan]:
    """``plan`` with expert parallelism of every degree that applies, experts in proportion to speed
    (and the even split where it differs and divides), its ranks running the same micro-batches
    (:func:`even_batches`; none where the batch does not divide so), and ``plan`` without it."""
    model = cm.model
    if model.moe is None:
        return []
    ranks = rank_devices(plan)
    E = model.moe.num_experts
    out = [dataclasses.replace(plan, expert_parallel=None)] if plan.expert_parallel is not None else []
    even = even_batches(plan)
    if even is None:
        return out
    # the runtime runs expert parallelism without ZeRO (each rank's experts are its own)
    plan, original = dataclasses.replace(even, zero_stage=0), plan
    splits = [tuple(tuple(s.layers) for s in p.stages) for p in plan.pipelines for _ in range(p.replicas)]
    for degree in divisors(len(ranks)):
        if degree < 2 or degree > E or any(len(set(splits[g:g + degree])) > 1 for g in range(0, len(ranks), degree)):
            continue   # a group's ranks must hold the same layers
        slots = [min(expert_speed(cm, *ranks[g + i], plan.micro_batch_size) for g in range(0, len(ranks), degree))
                 for i in range(degree)]
        counts = proportional_counts(slots, E)
        out.append(dataclasses.replace(plan, expert_parallel=ExpertParallel(degree, tuple(counts))))
        if E % degree == 0 and counts != [E // degree] * degree:
            out.append(dataclasses.replace(plan, expert_parallel=ExpertParallel(degree)))
    return [p for p in out if p.to_dict() != original.to_dict()]


def expert_reason(best, scorer) -> str | None:
    """Why the best plan of an MoE model does or does not spread its experts: against its twins
    (:func:`expert_twins`), each predicted by ``scorer``."""
    cm = scorer.extra.get("cost_model")
    if cm is None or cm.model.moe is None:
        return None
    plan, tps = best.plan, best.prediction.tokens_per_s
    twins = [(t, scorer(t)) for t in expert_twins(cm, plan)]
    twins = [(t, p) for t, p in twins if p is not None]
    ep = plan.expert_parallel

    def name(p: Plan) -> str:
        e = p.expert_parallel
        if e is None:
            return "no expert parallelism"
        return f"degree {e.degree}, experts {list(e.counts(cm.model.moe.num_experts))}"

    others = "; ".join(f"{name(t)}: {p.tokens_per_s:,.0f} tokens/s" + ("" if p.fits_memory else " (does not fit)")
                       for t, p in twins)
    if ep is None or ep.degree < 2:
        return (f"experts on every rank (no expert parallelism): {tps:,.0f} tokens/s"
                + (f"; spread instead: {others}" if others else ""))
    speeds = {g: expert_speed(cm, g, tp, plan.micro_batch_size) for g, tp in rank_devices(plan)[: ep.degree]}
    fastest = max(speeds.values())
    rel = ", ".join(f"{g} {v / fastest:.2f}x" for g, v in speeds.items())
    return (f"expert parallelism over {ep.degree} data-parallel ranks, experts {list(ep.counts(cm.model.moe.num_experts))} "
            f"in proportion to each device's expert speed ({rel} of the fastest): {tps:,.0f} tokens/s"
            + (f"; {others}" if others else ""))


__all__ = ["expert_twins", "expert_reason", "proportional_counts", "expert_speed", "rank_devices"]
