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


class Scorer:
    """Memoised ``predict()`` on plans (keyed by the plan's dict); :meth:`predict_many` spreads a
    list of plans over ``workers`` processes."""

    def __init__(self, cluster, model, calibration, predict_fn, cost_model=None, workers: int = 1):
        self.cluster, self.model, self.cal, self.fn = cluster, model, calibration, predict_fn
        self.cache: dict = {}
        self.calls = 0
        self.extra = {}
        # a predictor passed in (tests, spies) runs here, where its caller sees every call
        self.workers = workers if predict_fn is None else 1
        if predict_fn is None:  # the real predictor: share the planner's warm cost model
            from hetero.predictor import cost_model_for, predict

            self.fn = predict
            self.extra = {"cost_model": cost_model or cost_model_for(cluster, model, calibration), "check": False,
                          # fit by the fitted ratio: recording every candidate's stages would take seconds each
                          "replay": False}

    def _predict(self, plan: Plan):
        """The prediction of ``plan``, or the exception that rejected it."""
        try:
            check_plan(plan, self.cluster, self.model, "<planner>")
            return self.fn(self.cluster, self.model, plan, calibration=self.cal, **self.extra)
        except Exception as e:  # a plan the predictor rejects is not a candidate
            return e

    def _cached(self, key: str, plan: Plan):
        """The prediction of ``plan`` (``key``: its dict's repr), made once; None where rejected."""
        if key not in self.cache:
            self.calls += 1
            self.cache[key] = self._predict(plan)
        res = self.cache[key]
        return None if isinstance(res, Exception) else res

    def __call__(self, plan: Plan):
        return self._cached(repr(plan.to_dict()), plan)

    def predict_many(self, plans: list[Plan], progress=None) -> list:
        """``[self(plan) for plan in plans]``, the plans not yet predicted spread over the worker
        processes (forked: they share this process's cost model as it stands) when there are
        enough of them to pay for starting the processes. ``progress(done, total)`` as results come."""
        keys = [repr(p.to_dict()) for p in plans]
        todo = {}
        for key, plan in zip(keys, plans):
            if key not in self.cache:
                todo.setdefault(key, plan)
        parallel = self.workers > 1 and len(todo) >= MIN_PARALLEL_PREDICTIONS
        if parallel:
            for key, res in zip(todo, _predict_in_processes(self, list(todo.values()), progress)):
                self.calls += 1
                self.cache[key] = res
        out = []
        for i, (key, plan) in enumerate(zip(keys, plans)):
            out.append(self._cached(key, plan))
            if progress is not None and not parallel:
                progress(i + 1, len(plans))
        return out


MIN_PARALLEL_PREDICTIONS = 16
"""Fewer plans than this are predicted in the search's own process: forking the workers and
sending the results back costs more than predicting them."""

_worker_scorer: Scorer | None = None


def _adopt_scorer(scorer: Scorer) -> None:
    global _worker_scorer
    _worker_scorer = scorer


def _predict_in_worker(plan: Plan):
    res = _worker_scorer._predict(plan)
    if isinstance(res, Exception):   # only its message travels back (exceptions may not pickle)
        return RuntimeError(f"{type(res).__name__}: {res}")
    return res


def _predict_in_processes(scorer: Scorer, plans: list[Plan], progress) -> list:
    """The predictions (or rejecting exceptions) of ``plans``, in order, from ``scorer.workers``
    forked processes; in this process where processes cannot be forked."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if "fork" in multiprocessing.get_all_start_methods():
        try:
            # fork: the workers inherit the scorer (cluster, model, warm cost model) without pickling it
            with ProcessPoolExecutor(max_workers=scorer.workers, mp_context=multiprocessing.get_context("fork"),
                                     initializer=_adopt_scorer, initargs=(scorer,)) as pool:
                out = []
                for res in pool.map(_predict_in_worker, plans, chunksize=max(1, len(plans) // (8 * scorer.workers))):
                    out.append(res)
                    if progress is not None:
                        progress(len(out), len(plans))
                return out
        except Exception:  # no processes here (sandbox), a broken pool: predict them here
            pass
    return [scorer._predict(p) for p in plans]


def plan_score(pred) -> float:
    """What the search ranks a prediction by: its tokens/s when it fits in memory, else -1."""
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


def _score_all(scorer: Scorer, plans: list[tuple[Plan, Candidate]], scored: list) -> None:
    """Predict ``(plan, candidate)`` pairs together, append them to ``scored`` in order and re-sort it."""
    preds = scorer.predict_many([plan for plan, _ in plans])
    scored += [(plan_score(pred), plan, pred, c) for (plan, c), pred in zip(plans, preds)]
    scored.sort(key=lambda x: -x[0])


def score_and_refine(candidates: list[Candidate], B: int, L: int, opts: Options, scorer: Scorer, progress
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
    plans = [c.to_plan(B, L) for c in pool]
    preds = scorer.predict_many(plans, lambda done, total: progress("predict", done, total))
    scored: list[tuple[float, Plan, object, Candidate]] = [
        (plan_score(pred), plan, pred, c) for plan, pred, c in zip(plans, preds, pool)]
    scored.sort(key=lambda x: -x[0])
    # even-split twins of the best (so the tuned split is never worse than the uniform one), and
    # higher ZeRO stages (sharding the optimizer step can pay even where memory does not need it)
    twins = []
    for s, plan, pred, c in list(scored[: max(opts.refine_top, 5)]):
        u = dataclasses.replace(c, uniform=True)
        twins.append((u.to_plan(B, L), u))
        twins += [(dataclasses.replace(plan, zero_stage=z), c) for z in opts.zero_stages if z > plan.zero_stage]
    _score_all(scorer, twins, scored)
    # interleaved twins of the best (more chunks per device: a smaller bubble, more transfers and
    # more activations held), the ZeRO twins among them
    _score_all(scorer, [(iplan, c) for s, plan, pred, c in list(scored[: max(opts.refine_top, 5)])
                        for iplan in interleaved_twins(plan, opts.interleaves)], scored)
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
            neighbours = list(_neighbours(plan))
            for nb, np_ in zip(neighbours, scorer.predict_many(neighbours)):
                if plan_score(np_) > best[0] * (1 + 1e-9):
                    best = (plan_score(np_), nb, np_)
            if best[1] is plan:
                break
            s, plan, pred = best
        scored.append((s, plan, pred, c))
        progress("refine", idx + 1, len(starts))
    scored.sort(key=lambda x: -x[0])
    return scored
