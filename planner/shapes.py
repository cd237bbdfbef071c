"""Shape enumeration, the planner's first step: evaluated pipeline shapes (building blocks) per group
and per ordered set of groups whose stages span them.

Per (recompute, micro-batch size): every group alone (tp x stages x replicas) and every ordered set
of groups as one pipeline whose stages span them (tp per group from that group's best shapes alone,
stages per group = devices / (replicas x tp)). Each shape gets its min-max layer split from the
predictor's per-layer costs; memory-infeasible shapes are cut as soon as a stage cannot hold its
layers (ZeRO 0, then 1, then 2). Tasks run in a process pool when it pays.
"""
from __future__ import annotations

import itertools
from concurrent.futures import ProcessPoolExecutor

from .blocks import Block, BlockEvaluator
from .options import Options, workers_for
from .space import Segment, group_orders, replica_options, tp_options


def _units(B: int, mbs: int) -> int:
    return B // mbs


def enumerate_blocks(cluster, model, ev: BlockEvaluator, B: int, rc: str, mbs: int, opts: Options) -> dict:
    """Evaluated shapes for one (recompute, micro-batch size): {tuple of groups: [Block, ...]}."""
    L = model.num_layers
    sizes = {g.name: g.num_devices for g in cluster.groups}
    total = sum(sizes.values())
    out: dict[tuple[str, ...], list[Block]] = {}
    units = _units(B, mbs)
    # A shape whose replicas take more samples per micro-batch step than the whole global batch can
    # never be fed (``blk.units > B``): it is not kept, or it would crowd out the shapes that can.

    def key(block: Block, share: float) -> float:
        # samples/s of this block on its share of the batch (share by device count)
        m = max(1, round(B * share / block.units))
        return block.units * m / block.time(m)

    best_tp: dict[str, list[int]] = {}
    for g in sizes:
        cands: list[Block] = []
        share = sizes[g] / total
        for tp in tp_options(cluster, model, g):
            for r in replica_options({g: tp}, sizes, units, L):
                s = sizes[g] // (r * tp)
                blk = ev.evaluate((Segment(g, tp, s),), r, mbs, rc, opts.zero_stages)
                if blk is not None and blk.units <= B:
                    cands.append(blk)
        cands.sort(key=lambda b: -key(b, share))
        kept = _keep(cands, opts.keep_per_block, B)
        if kept:
            out[(g,)] = kept
        tps: list[int] = []
        for b in cands:
            if b.segments[0].tp not in tps:
                tps.append(b.segments[0].tp)
        best_tp[g] = tps[:2] if tps else tp_options(cluster, model, g)[:2]

    if opts.mixed and len(sizes) > 1:
        names = list(sizes)
        for k in range(2, len(names) + 1):
            for subset in itertools.combinations(names, k):
                share = sum(sizes[g] for g in subset) / total
                # A group's best tp alone need not be its best inside a spanning pipeline (there
                # pipeline depth and memory come from the other groups too): pairs try every tp.
                per_tp = [tp_options(cluster, model, g) if k <= 2 else best_tp[g][:1] for g in subset]
                cands = []
                orders = group_orders(cluster, subset)
                # A pair is tried both ways round: which group holds the LM head (last stage) or the
                # embedding changes the split enough to reorder close shapes. Larger sets try their
                # other orders only for the best few shapes of the first order.
                tried = orders if k <= 2 else orders[:1]
                for tps in itertools.product(*per_tp):
                    tp_of = dict(zip(subset, tps))
                    for r in replica_options(tp_of, sizes, units, L):
                        for order in tried:
                            segs = tuple(Segment(g, tp_of[g], sizes[g] // (r * tp_of[g])) for g in order)
                            blk = ev.evaluate(segs, r, mbs, rc, opts.zero_stages)
                            if blk is not None and blk.units <= B:
                                cands.append(blk)
                cands.sort(key=lambda b: -key(b, share))
                extra = []
                for blk in cands[:3] if k > 2 else ():
                    seg_of = {s.group: s for s in blk.segments}
                    for order in orders[1:]:
                        alt = ev.evaluate(tuple(seg_of[g] for g in order), blk.replicas, mbs, rc, opts.zero_stages)
                        if alt is not None:
                            extra.append(alt)
                cands = sorted(cands + extra, key=lambda b: -key(b, share))
                kept = _keep(cands, opts.keep_per_block, B)
                if kept:
                    out[tuple(sorted(subset))] = kept
    return out


def _keep(cands: list[Block], n: int, B: int) -> list[Block]:
    """The best ``n`` shapes, plus the best of every tp signature (for the TP-or-PP explanation),
    plus the best shape that can take the whole global batch alone (``B % units == 0``): without it
    a batch such as a prime number could be shared by no kept shape, though one exists."""
    kept, seen = [], set()
    for b in cands:
        sig = tuple((s.group, s.tp) for s in b.segments)
        if len(kept) < n or sig not in seen:
            if b not in kept:
                kept.append(b)
            seen.add(sig)
    if not any(B % b.units == 0 for b in kept):
        exact = next((b for b in cands if B % b.units == 0), None)
        if exact is not None:
            kept.append(exact)
    return kept


def _enumerate_task(args):
    """Process-pool entry: build a cost model in the worker and enumerate one (rc, mbs)."""
    cluster, model, calibration, B, rc, mbs, opts = args
    from hetero.predictor.costs import StageCostModel

    ev = BlockEvaluator(cluster, model, StageCostModel(cluster, model, calibration=calibration))
    return rc, mbs, enumerate_blocks(cluster, model, ev, B, rc, mbs, opts), ev.splits_computed


def enumerate_all(cluster, model, B: int, tasks: list[tuple[str, int]], opts: Options, cost_model, calibration,
                  progress) -> tuple[dict[tuple[str, int], dict], int]:
    """:func:`enumerate_blocks` for every (recompute, micro-batch size) of ``tasks``.

    Returns ``({(rc, mbs): shapes}, layer splits computed)``. A process pool is used when the
    options (or a big cluster) ask for workers and no cost model is imposed.
    """
    splits = 0
    workers = workers_for(opts, cluster)
    enumerated: dict[tuple[str, int], dict] = {}
    if cost_model is None and workers > 1 and len(tasks) > 1:
        try:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                args = [(cluster, model, calibration, B, rc, mbs, opts) for rc, mbs in tasks]
                for i, (rc, mbs, res, n) in enumerate(pool.map(_enumerate_task, args)):
                    enumerated[(rc, mbs)] = res
                    splits += n
                    progress("shapes", i + 1, len(tasks))
        except Exception:  # no processes here (sandbox, pickling): do it in this process
            enumerated.clear()
    if not enumerated:
        cm = cost_model if cost_model is not None else _default_cost_model(cluster, model, calibration)
        ev = BlockEvaluator(cluster, model, cm)
        for i, (rc, mbs) in enumerate(tasks):
            enumerated[(rc, mbs)] = enumerate_blocks(cluster, model, ev, B, rc, mbs, opts)
            progress("shapes", i + 1, len(tasks))
        splits = ev.splits_computed
    return enumerated, splits


def _default_cost_model(cluster, model, calibration):
    from hetero.predictor import cost_model_for

    return cost_model_for(cluster, model, calibration)
