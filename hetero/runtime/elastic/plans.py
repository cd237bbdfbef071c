"""The plans of an in-process elastic run: the one the workers run now (:class:`Generation`), one made
for a change (:class:`Ahead`), which survivor takes which rank of it (:func:`assign_ranks`), and
whether the in-process path applies at all (:func:`live_applies`).
"""
from __future__ import annotations

import dataclasses

from hetero.errors import HeteroError


def live_applies(plan, options, launch) -> str | None:
    """None when a lost device is survived in-process; else why not (printed once: the disk
    handoff and a restart are used instead)."""
    if options.engine != "native":
        return f"--engine {options.engine}"
    if not launch.local:
        return "node slots on other machines"
    return None


def keep_devices(old, new, survivors: list[int]) -> dict[int, int]:
    """Old rank -> new rank for the ranks that keep their device: the n-th survivor of a group takes
    the n-th rank the new layout puts on that group (survivors past those are left out)."""
    by_group: dict[str, list[int]] = {}
    for info in new.ranks:
        by_group.setdefault(info.group, []).append(info.rank)
    seen: dict[str, int] = {}
    members = {}
    for r in sorted(survivors):
        g = old.ranks[r].group
        k = seen.get(g, 0)
        seen[g] = k + 1
        if k < len(by_group.get(g, [])):
            members[r] = by_group[g][k]
    return members


def assign_ranks(old, new, survivors: list[int]) -> dict[int, int]:
    """Old rank -> new rank: a survivor keeps its device (:func:`keep_devices`), and every rank of
    the new layout must be a survivor's."""
    members = keep_devices(old, new, survivors)
    if sorted(members.values()) != list(range(len(new.ranks))):
        raise HeteroError(f"elastic: the new plan's {len(new.ranks)} ranks do not map onto the survivors' devices")
    return members


@dataclasses.dataclass
class Generation:
    """The plan the workers run now."""

    cluster: object
    plan: object
    layout: object
    run_dir: str
    procs: dict   # rank -> Popen


@dataclasses.dataclass
class Ahead:
    """A plan made for a change before it happens (or as it happens): the cluster, the planner's
    result and its rank layout."""

    cluster: object
    result: object
    layout: object
    transition: object = None
    """The transition when every other rank survives (made ahead with the plan)."""
    survivors: tuple = ()
    members: dict = dataclasses.field(default_factory=dict)
    """Old rank -> its rank in this plan (the survivors it keeps)."""
