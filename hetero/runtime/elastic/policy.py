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
        return (f"elastic with zero_stage {plan.zero_stage}: each rank's optimizer slices are copied to a peer's "
                f"host memory after every update, so a lost rank's are rebuilt in-process; a loss the copies "
                f"cannot cover (a rank lost with the peer holding its copy, or before its copy of an update "
                f"arrived): then the run goes on only from a --save checkpoint")
    return None


def refuse_lost_slices(plan, reason: str, why: str = "the lost rank's slice of the optimizer state has no copy") -> None:
    """Raise HeteroError when ``plan`` keeps each optimizer slice on one rank (ZeRO) and the lost rank's
    slices cannot be rebuilt (``why``, in words), so the run cannot go on from the survivors' state."""
    if plan.zero_stage:
        raise HeteroError(f"elastic: {reason}; with zero_stage {plan.zero_stage} {why}, so the run cannot go on "
                          f"(fix: a plan with zero_stage: 0, or restart from a checkpoint written by --save)")


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
