"""Scoring and refinement, the planner's last step: the best candidates (plus the even-split,
higher-ZeRO and interleaved twins of the best) go through ``predict()``, the single source of truth;
a short hill climb moves single layers between neighbouring stages and micro-batches between pipelines.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from hetero.specs.plan import Plan, check_plan

from .candidates import Candidate
from .interleave import interleaved_twins
from .options import Options


class _Scorer:
    """Memoised ``predict()`` on plans (keyed by the plan's dict)."""

    def __init__(self, cluster, model, calibration, predict_fn, cost_model=None):
        self.cluster, self.model, self.cal, self.fn = cluster, model, calibration, predict_fn
        self.cache: dict = {}
        self.calls = 0
        self.extra = {}
        if predict_fn is None:  # the real predictor: share the planner's warm cost model
            from hetero.predictor import cost_model_for, predict

            self.fn = predict
            self.extra = {"cost_model": cost_model or cost_model_for(cluster, model, calibration), "check": False,
                          # fit by the fitted ratio: recording every candidate's stages would take seconds each
                          "replay": False}

    def __call__(self, plan: Plan):
        key = repr(plan.to_dict())
        if key not in self.cache:
            self.calls += 1
            try:
                check_plan(plan, self.cluster, self.model, "<planner>")
                self.cache[key] = self.fn(self.cluster, self.model, plan, calibration=self.cal, **self.extra)
            except Exception as e:  # a plan the predictor rejects is not a candidate
                self.cache[key] = e
        res = self.cache[key]
        return None if isinstance(res, Exception) else res


def _score(pred) -> float:
    return pred.tokens_per_s if pred is not None and pred.fits_memory else -1.0


def _neighbours(plan: Plan):
    """Plans that move one layer across one stage boundary, or one micro-batch between pipelines.

    Long pipelines: only boundaries between different groups / tp (inside a run of equal stages the
    min-max split is already balanced)."""
    for pi, p in enumerate(plan.pipelines):
        for si in range(len(p.stages) - 1):
            a, b = p.stages[si], p.stages[si + 1]
            if len(p.stages) > 12 and (a.group, a.tp) == (b.group, b.tp):
                continue
            for d in (-1, 1):
                cut = a.layers[1] + d
                if cut <= a.layers[0] or cut >= b.layers[1]:
                    continue
                stages = list(p.stages)
                stages[si] = dataclasses.replace(a, layers=(a.layers[0], cut))
                stages[si + 1] = dataclasses.replace(b, layers=(cut, b.layers[1]))
                pipes = list(plan.pipelines)
                pipes[pi] = dataclasses.replace(p, stages=stages)
                yield dataclasses.replace(plan, pipelines=pipes)
    n = len(plan.pipelines)
    for i, j in itertools.permutations(range(n), 2):
        pi, pj = plan.pipelines[i], plan.pipelines[j]
        ui, uj = pi.replicas * plan.mbs(pi), pj.replicas * plan.mbs(pj)
        # move lcm samples from i to j
        step = ui * uj // math.gcd(ui, uj)
        di, dj = step // ui, step // uj
        if pi.micro_batches - di < 1:
            continue
        pipes = list(plan.pipelines)
        pipes[i] = dataclasses.replace(pi, micro_batches=pi.micro_batches - di)
        pipes[j] = dataclasses.replace(pj, micro_batches=pj.micro_batches + dj)
        yield dataclasses.replace(plan, pipelines=pipes)


def _structure(plan: Plan) -> tuple:
    """What the hill climb cannot change: the pipelines' stage groups, TP degrees and replicas, the
    micro-batch size and recomputation (it moves layers and micro-batches; ZeRO stages and
    interleaving come as twins, so a plan and its twins are one structure: the physical stages)."""
    return (plan.micro_batch_size, plan.recompute,
            tuple((p.replicas, p.micro_batch_size, tuple((st.group, st.tp) for st in plan.physical_stages(p)))
                  for p in plan.pipelines))


def score_and_refine(candidates: list[Candidate], B: int, L: int, opts: Options, scorer: _Scorer, progress
                     ) -> list[tuple[float, Plan, object, Candidate]]:
    """``(score, plan, prediction, candidate)`` for the predicted and refined plans, best first.

    ``candidates`` come sorted by their ranking key.
    """
    # Pool for predict(): the best overall plus the best of every structure.
    pool: list[Candidate] = []
    per_structure: dict = {}
    for c in candidates:
        n = per_structure.get((c.structure, c.blocks[0].recompute), 0)
        if n < 2:
            pool.append(c)
            per_structure[(c.structure, c.blocks[0].recompute)] = n + 1
    for c in candidates[: opts.max_predictions]:
        if c not in pool:
            pool.append(c)
    scored: list[tuple[float, Plan, object, Candidate]] = []
    total = len(pool)
    for i, c in enumerate(pool):
        plan = c.to_plan(B, L)
        pred = scorer(plan)
        scored.append((_score(pred), plan, pred, c))
        progress("predict", i + 1, total)
    scored.sort(key=lambda x: -x[0])
    # even-split twins of the best (so the tuned split is never worse than the uniform one), and
    # higher ZeRO stages (sharding the optimizer step can pay even where memory does not need it)
    for s, plan, pred, c in list(scored[: max(opts.refine_top, 5)]):
        u = dataclasses.replace(c, uniform=True)
        uplan = u.to_plan(B, L)
        upred = scorer(uplan)
        scored.append((_score(upred), uplan, upred, u))
        for z in opts.zero_stages:
            if z > plan.zero_stage:
                zplan = dataclasses.replace(plan, zero_stage=z)
                zpred = scorer(zplan)
                scored.append((_score(zpred), zplan, zpred, c))
    scored.sort(key=lambda x: -x[0])
    # interleaved twins of the best (more chunks per device: a smaller bubble, more transfers and
    # more activations held), the ZeRO twins among them
    for s, plan, pred, c in list(scored[: max(opts.refine_top, 5)]):
        for iplan in interleaved_twins(plan, opts.interleaves):
            ipred = scorer(iplan)
            scored.append((_score(ipred), iplan, ipred, c))
    scored.sort(key=lambda x: -x[0])
    # hill climb on the best plan of each of the top few structures: the list above holds twins
    # (even-split, higher ZeRO) that would climb to the same place and crowd out a structure whose
    # first split was one layer off (a mixed pipeline ranked third behind two copies of one plan)
    starts, seen = [], set()
    for entry in scored:
        if entry[0] >= 0 and _structure(entry[1]) not in seen:
            seen.add(_structure(entry[1]))
            starts.append(entry)
        if len(starts) == opts.refine_top:
            break
    for idx, (s, plan, pred, c) in enumerate(starts):
        for _ in range(opts.refine_rounds * 8):
            best = (s, plan, pred)
            for nb in _neighbours(plan):
                np_ = scorer(nb)
                if _score(np_) > best[0] * (1 + 1e-9):
                    best = (_score(np_), nb, np_)
            if best[1] is plan:
                break
            s, plan, pred = best
        scored.append((s, plan, pred, c))
        progress("refine", idx + 1, len(starts))
    scored.sort(key=lambda x: -x[0])
    return scored
