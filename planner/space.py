"""The search space: tp degrees, micro-batch sizes, pipeline shapes, and how groups combine.

A *block* is one pipeline shape: an ordered tuple of segments ``(group, tp, stages)`` (a segment is
a run of consecutive stages on one group), replicated ``replicas`` times. A plan is one or more
blocks over disjoint sets of groups, sharing the global batch. Pipelines are only ever cut at group
boundaries (each group appears once in a block, groups of one vendor next to each other), and a tp
block stays inside one node.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class Segment:
    """``stages`` consecutive pipeline stages, each on ``tp`` devices of ``group``."""

    group: str
    tp: int
    stages: int


def tp_options(cluster, model, group: str) -> list[int]:
    """Tensor-parallel degrees for a group: divide the heads, the kv heads and the node size."""
    g = cluster.group(group)
    heads = model.num_attention_heads
    kv = model.num_kv_heads
    return [t for t in range(1, g.devices_per_node + 1)
            if g.devices_per_node % t == 0 and heads % t == 0 and kv % t == 0]


def mbs_options(global_batch_size: int, allowed=(1, 2, 4, 8)) -> list[int]:
    """The allowed micro-batch sizes that divide the global batch ([1] if none does)."""
    return [m for m in allowed if m <= global_batch_size and global_batch_size % m == 0] or [1]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def replica_options(devices_per_replica: dict[str, int], sizes: dict[str, int], units: int,
                    max_stages: int) -> list[int]:
    """Replica counts worth trying for a shape whose stage counts follow from the replica count.

    For every distinct tuple of stage counts ``N_g // (r * tp_g)`` the largest ``r`` (most devices
    busy), plus every ``r`` that divides ``units`` (so a single block can take the batch exactly).
    """
    r_max = min(sizes[g] // d for g, d in devices_per_replica.items())
    best: dict[tuple, int] = {}
    for r in range(1, r_max + 1):
        shape = tuple(sizes[g] // (r * d) for g, d in devices_per_replica.items())
        if sum(shape) > max_stages:
            continue
        best[shape] = r
    out = set(best.values())
    for r in divisors(units):
        if r <= r_max:
            shape = tuple(sizes[g] // (r * d) for g, d in devices_per_replica.items())
            if sum(shape) <= max_stages:
                out.add(r)
    return sorted(out)


def group_orders(cluster, groups: tuple[str, ...], limit: int = 12) -> list[tuple[str, ...]]:
    """Orders of the groups in one pipeline, same-vendor groups adjacent first."""
    orders = []
    for perm in itertools.permutations(groups):
        vendors = [cluster.vendor(g) for g in perm]
        runs = sum(1 for i in range(len(vendors)) if i == 0 or vendors[i] != vendors[i - 1])
        orders.append((runs, perm))
    fewest = min(r for r, _ in orders)
    return [p for r, p in orders if r == fewest][:limit]


def set_partitions(items: list):
    """All partitions of ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


__all__ = ["Segment", "RECOMPUTE", "ZERO_STAGES", "tp_options", "mbs_options", "replica_options",
           "group_orders", "set_partitions", "divisors"]
