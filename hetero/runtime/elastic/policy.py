"""What an elastic run decides, apart from how it carries a decision out: what it refuses before it
starts, when it gives up, and the plan it goes on with (the planner's best on the devices there are).

The controller of either path (:mod:`.run`: handoff and restart; :mod:`.live`: in-process) and the
cluster file's watcher (:mod:`.watch`) ask it; it imports neither.
"""
from __future__ import annotations

from hetero.errors import HeteroError

MAX_RECONFIGURATIONS = 8
"""A run that loses devices more often than this ends: something beyond single failures is going on.
Changes of the cluster file are not counted."""


def check_elastic(plan, options, node_rank: int | None) -> str | None:
    """Refuse what an elastic run cannot recover, before anything starts; returns a caveat to print
    (None: none). ``node_rank``: each machine starts its own node slot (``--node-rank``), which the
    in-process path supports for a lost worker or machine, not yet for devices that join."""
    if options.engine != "native":
        raise HeteroError("--elastic with --engine deepspeed: only the native engine hands off its live state "
                          "(fix: --engine native)")
    if plan.zero_stage:
        return (f"elastic with zero_stage {plan.zero_stage}: devices that join or leave through the cluster file "
                f"are taken in, but after a device lost to a failure the run goes on only from a --save "
                f"checkpoint, since ZeRO keeps each slice of the optimizer state on one rank only (a plan with "
                f"zero_stage: 0 survives failures too)")
    return None


def refuse_lost_slices(plan, reason: str) -> None:
    """Raise HeteroError when ``plan`` keeps each optimizer slice on one rank (ZeRO): a lost rank's
    slice has no copy, so the run cannot go on from the survivors' state."""
    if plan.zero_stage:
        raise HeteroError(f"elastic: {reason}; with zero_stage {plan.zero_stage} the lost rank's slice of the "
                          f"optimizer state has no copy, so the run cannot go on (fix: a plan with zero_stage: 0, "
                          f"or restart from a checkpoint written by --save)")


def replan(cluster, model, plan):
    """The planner's best plan on ``cluster`` for ``plan``'s global batch (a
    :class:`hetero.planner.SearchResult`): with ``zero_stage: 0``, so the next failure can be handed
    off too, unless ``plan`` used ZeRO (then any ZeRO stage, whichever the planner predicts best)."""
    from hetero.planner import PlannerError, search

    try:
        return search(cluster, model, global_batch_size=plan.global_batch_size, top_k=1, upper_bound=False,
                      zero_stages=(0,) if not plan.zero_stage else (0, 1, 2))[0]
    except PlannerError as e:
        raise HeteroError(f"elastic: no plan fits the remaining devices ({cluster.num_devices}): {e}") from None
