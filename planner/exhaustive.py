"""Brute force over the planner's search space, every plan scored by ``predict()``.

For small clusters and models only (tests): every way to form pipelines from the groups (each group
in at most one pipeline shape, groups of one shape in every order), every tp per group, every stage
count and replica count that fits, every layer split, every micro-batch size, recompute and ZeRO
setting allowed, and every exact sharing of the global batch between the shapes.
"""
from __future__ import annotations

import itertools

from hetero.specs.plan import Pipeline, Plan, Stage

from .space import mbs_options, set_partitions, tp_options


def _compositions(L: int, S: int):
    """All ways to write L as an ordered sum of S positive parts."""
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0,) + cuts + (L,)
        yield [bounds[i + 1] - bounds[i] for i in range(S)]


def _shapes(cluster, model, groups: tuple[str, ...]):
    """(segments [(group, tp, stages)], replicas) for one ordered tuple of groups."""
    L = model.num_layers
    per_group = []
    for g in groups:
        n = cluster.group(g).num_devices
        per_group.append([(g, tp, s) for tp in tp_options(cluster, model, g) for s in range(1, n // tp + 1)])
    for segs in itertools.product(*per_group):
        if sum(s for _, _, s in segs) > L:
            continue
        r_max = min(cluster.group(g).num_devices // (tp * s) for g, tp, s in segs)
        for r in range(1, r_max + 1):
            yield segs, r


def _pipelines(cluster, model, groups, mbs_list):
    """Every (stages, replicas, mbs) of one block over ``groups`` (all orders, all layer splits)."""
    L = model.num_layers
    seen = set()
    for order in itertools.permutations(groups):
        for segs, r in _shapes(cluster, model, order):
            stage_list = [(g, tp) for g, tp, s in segs for _ in range(s)]
            for counts in _compositions(L, len(stage_list)):
                stages, a = [], 0
                for (g, tp), n in zip(stage_list, counts):
                    stages.append(Stage(group=g, layers=(a, a + n), tp=tp))
                    a += n
                key = (tuple(stages), r)
                if key in seen:
                    continue
                seen.add(key)
                for mbs in mbs_list:
                    yield stages, r, mbs


def _allocations(units: list[int], B: int):
    """Every m >= 1 (one per block) with sum(units * m) == B."""
    if len(units) == 1:
        if B % units[0] == 0 and B >= units[0]:
            yield [B // units[0]]
        return
    u = units[0]
    for m in range(1, (B - sum(units[1:])) // u + 1):
        for rest in _allocations(units[1:], B - u * m):
            yield [m] + rest


def enumerate_plans(cluster, model, global_batch_size: int, micro_batch_sizes=(1, 2, 4, 8),
                    recompute=("none", "selective", "full"), zero_stages=(0, 1, 2)):
    """Yield every plan of the space (may be very many: small inputs only)."""
    B = global_batch_size
    mbs_list = mbs_options(B, micro_batch_sizes)
    names = [g.name for g in cluster.groups]
    block_cache: dict = {}
    for part in set_partitions(names):
        for k in range(1, len(part) + 1):
            for subset in itertools.combinations(part, k):
                lists = []
                for blk in subset:
                    key = tuple(sorted(blk))
                    if key not in block_cache:
                        block_cache[key] = list(_pipelines(cluster, model, key, mbs_list))
                    lists.append(block_cache[key])
                for combo in itertools.product(*lists):
                    units = [r * mbs for _, r, mbs in combo]
                    for ms in _allocations(units, B):
                        pipes = [Pipeline(micro_batches=m, stages=list(stages), replicas=r,
                                          micro_batch_size=mbs) for (stages, r, mbs), m in zip(combo, ms)]
                        for rc in recompute:
                            for z in zero_stages:
                                yield Plan(global_batch_size=B, micro_batch_size=combo[0][2], pipelines=pipes,
                                           schedule="1f1b", recompute=rc, zero_stage=z)


def exhaustive_best(cluster, model, global_batch_size: int, predict_fn=None, calibration=None, **space):
    """(best plan, its prediction, plans scored) by brute force; (None, None, n) if nothing fits."""
    if predict_fn is None:
        from hetero.predictor import predict as predict_fn
    best, best_pred, n = None, None, 0
    for plan in enumerate_plans(cluster, model, global_batch_size, **space):
        n += 1
        pred = predict_fn(cluster, model, plan, calibration=calibration)
        if pred.fits_memory and (best_pred is None or pred.tokens_per_s > best_pred.tokens_per_s):
            best, best_pred = plan, pred
    return best, best_pred, n


def count_plans(cluster, model, global_batch_size: int, **space) -> int:
    """How many plans :func:`enumerate_plans` yields."""
    return sum(1 for _ in enumerate_plans(cluster, model, global_batch_size, **space))


__all__ = ["enumerate_plans", "exhaustive_best", "count_plans"]
