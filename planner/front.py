"""Pareto fronts of plans: :func:`search_front` trades throughput against cost, memory headroom,
energy and resilience with MaOEA-CS (:mod:`.maoea_cs`) over the plan encoding (:mod:`.encoding`).

The population is seeded with the single-objective planner's best plans and each group's best plan
alone (:func:`hetero.planner.search`); every plan evaluated is kept, and the front returned is the
non-dominated set of all of them (thinned by the angle-based selection when it holds more than
``max_front`` plans, the corner solutions always kept).

``resilience`` (fronts only): the fraction of its throughput a plan keeps after losing the worst
single node it uses, the replanner's best plan on the cluster less that node standing in for it
(capped at 1: a plan that leaves the lost node's group idle keeps everything). Nodes of one group
are alike, so the replanner runs once per group (and ZeRO or not), cached.
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass

import numpy as np

from hetero.errors import HeteroError
from hetero.predictor.objectives import MAXIMISE, OBJECTIVES, missing_data, missing_message, objectives

from .encoding import PlanEncoding
from .maoea_cs import angle_select, corner_indices, maoea_cs, non_dominated
from .options import Options
from .scoring import Scorer
from .search import SearchProgress, search

ALL_OBJECTIVES = OBJECTIVES + ("resilience",)


class ObjectiveError(HeteroError):
    """An objective that does not exist or lacks catalog data; the message names the fix."""


def parse_objectives(text: str, cluster=None) -> tuple[str, ...]:
    """``"throughput,cost"`` -> ``("throughput", "cost")``; raises ObjectiveError on an unknown or
    repeated name, fewer than two, or (given ``cluster``) a device without the figures one needs."""
    from hetero.specs.errors import did_you_mean

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in ALL_OBJECTIVES:
            hint = did_you_mean(n, ALL_OBJECTIVES)
            raise ObjectiveError(f"--objectives: unknown objective '{n}'" + (f" ({hint})" if hint else "")
                                 + f"; choose from {', '.join(ALL_OBJECTIVES)}")
    if len(set(names)) != len(names):
        raise ObjectiveError("--objectives: an objective is named twice")
    if len(names) < 2:
        raise ObjectiveError("--objectives: name at least two objectives, e.g. throughput,cost")
    if cluster is not None:
        lacking = missing_data(cluster, names)
        if lacking:
            raise ObjectiveError(missing_message(lacking))
    return names


@dataclass
class FrontPlan:
    """One plan of a front: the plan, its prediction and its objectives."""

    plan: object
    prediction: object
    objectives: dict

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "objectives": dict(self.objectives)}


class Resilience:
    """Throughput kept after the worst single node loss, via the replanner (cached per group)."""

    def __init__(self, cluster, model, global_batch_size: int, calibration=None):
        self.cluster, self.model, self.B, self.cal = cluster, model, global_batch_size, calibration
        self.cache: dict = {}

    def replanned(self, group: str, zero: bool) -> float:
        """Tokens/s of the replanner's best plan on the cluster less one node of ``group``."""
        key = (group, zero)
        if key not in self.cache:
            from hetero.specs.cluster import without_devices

            g = self.cluster.group(group)
            lost = [types.SimpleNamespace(group=group, node=0)] * g.devices_per_node
            try:
                rest = without_devices(self.cluster, lost)
                # as hetero.runtime.elastic.policy.replan asks the planner (ZeRO only if the plan used it),
                # with this search's calibration
                best = search(rest, self.model, global_batch_size=self.B, top_k=1, upper_bound=False,
                              calibration=self.cal, zero_stages=(0, 1, 2) if zero else (0,))[0]
                self.cache[key] = best.prediction.tokens_per_s
            except HeteroError:   # nothing fits on what is left (PlannerError is one)
                self.cache[key] = 0.0
        return self.cache[key]

    def __call__(self, plan, tokens_per_s: float) -> float:
        if tokens_per_s <= 0:
            return 0.0
        kept = [self.replanned(g, bool(plan.zero_stage)) / tokens_per_s for g in plan.devices_by_group()]
        return min(1.0, min(kept, default=1.0))


class PlanProblem:
    """Vectors -> minimised objective rows, every evaluated plan recorded (the front's source)."""

    def __init__(self, cluster, model, global_batch_size: int, names, calibration=None, opts: Options | None = None,
                 fallback=None):
        from hetero.predictor import cost_model_for

        self.cluster, self.model, self.names = cluster, model, tuple(names)
        cm = cost_model_for(cluster, model, calibration)
        self.enc = PlanEncoding(cluster, model, global_batch_size, cm, opts)
        self.scorer = Scorer(cluster, model, calibration, None, cm)
        self.resilience = Resilience(cluster, model, global_batch_size, calibration) if "resilience" in names else None
        self.sign = np.array([-1.0 if n in MAXIMISE else 1.0 for n in self.names])
        self.fallback = fallback
        self.records: list[FrontPlan] = []
        self._by_key: dict = {}
        self._record_of: dict = {}
        self.evaluations = 0
        self.n_var = self.enc.n_var

    def evaluate_plan(self, plan) -> np.ndarray | None:
        """The minimised objective row of ``plan`` (recorded), or None when it does not fit."""
        key = repr(plan.to_dict())
        hit = self._by_key.get(key)
        if hit is not None:
            return hit
        pred = self.scorer(plan)
        if pred is None or not pred.fits_memory:
            return None
        obj = objectives(self.cluster, plan, pred)
        if self.resilience is not None:
            obj["resilience"] = self.resilience(plan, pred.tokens_per_s)
        obj = {n: obj[n] for n in self.names}
        row = self.sign * np.array([obj[n] for n in self.names], dtype=float)
        self.records.append(FrontPlan(plan, pred, obj))
        self._by_key[key] = row
        self._record_of[key] = self.records[-1]
        return row

    def record(self, plan) -> FrontPlan | None:
        """The record of an evaluated ``plan`` (None if it was not evaluated or did not fit)."""
        return self._record_of.get(repr(plan.to_dict()))

    def evaluate_x(self, x) -> np.ndarray:
        self.evaluations += 1
        plan, decoded = self.enc.decode(x)
        row = self.evaluate_plan(plan) if plan is not None else None
        if row is None and decoded is not None:
            self.enc.repairs += 1
            row = self.evaluate_plan(self.enc.plain(decoded))
        if row is None and self.fallback is not None:
            self.enc.repairs += 1
            row = self.evaluate_plan(self.fallback)
        if row is None:   # no fallback plan fits either: the worst row seen, so selection drops it
            rows = np.array([self._by_key[k] for k in self._by_key]) if self._by_key else np.zeros((1, len(self.names)))
            row = rows.max(0) + 1.0
        return row

    def evaluate(self, X) -> np.ndarray:
        """Rows of minimised objectives for the vectors ``X`` (one evaluation each)."""
        return np.array([self.evaluate_x(x) for x in np.asarray(X, dtype=float)])

    def front(self, max_front: int | None = None) -> list[FrontPlan]:
        """The non-dominated plans of every evaluation (one per objective vector), best throughput first."""
        if not self.records:
            return []
        F = np.array([self.sign * np.array([r.objectives[n] for n in self.names]) for r in self.records])
        nd = non_dominated(F)
        uniq: dict = {}
        for i in nd:   # plans with equal objectives: the first evaluated (seeds come first)
            uniq.setdefault(tuple(np.round(F[i], 12)), int(i))
        idx = np.array(sorted(uniq.values()))
        if max_front and len(idx) > max_front:
            G = F[idx]
            span = np.where(G.max(0) - G.min(0) > 1e-12, G.max(0) - G.min(0), 1.0)
            Gn = (G - G.min(0)) / span
            idx = idx[angle_select(Gn, max_front, corner_indices(Gn))]
        out = [self.records[i] for i in idx]
        key = self.names[0]
        out.sort(key=lambda r: -r.objectives[key] if key in MAXIMISE else r.objectives[key])
        return out


@dataclass
class FrontResult:
    """What :func:`search_front` returns."""

    front: list
    evaluations: int
    seconds: float
    seeds: dict
    """``fastest`` and each ``alone:<group>`` seed plan's objectives."""
    repairs: int = 0
    nondominated: list | None = None
    """Every non-dominated plan before thinning to ``max_front`` (rules pick from these)."""

    def to_dict(self) -> dict:
        return {"front": [p.to_dict() for p in self.front], "evaluations": self.evaluations,
                "seconds": self.seconds}


def seed_plans(cluster, model, global_batch_size: int, calibration=None, progress=False, **options) -> dict:
    """``{"fastest": plan, "top<k>": plan..., "alone:<group>": plan}`` from the single-objective planner."""
    res = search(cluster, model, global_batch_size=global_batch_size, top_k=5, calibration=calibration,
                 progress=progress, **options)
    out = {"fastest": res[0].plan}
    for k, r in enumerate(res[1:], 1):
        out[f"top{k}"] = r.plan
    for g, plan in (res.best_alone or {}).items():
        if plan is not None:
            out[f"alone:{g}"] = plan
    return out


def search_front(cluster, model, global_batch_size: int, objectives=("throughput", "cost", "memory_headroom", "energy"),
                 calibration=None, budget: int = 600, pop_size: int = 40, seed: int = 0, max_front: int = 30,
                 progress=False, seeds: dict | None = None, **options) -> FrontResult:
    """The Pareto front of plans over ``objectives`` by MaOEA-CS within ``budget`` evaluations.

    ``options`` are the planner's (:class:`Options`). Raises ObjectiveError on a bad objective list
    and :class:`~.search.PlannerError` when no plan fits."""
    names = parse_objectives(",".join(objectives), cluster)
    t0 = time.perf_counter()
    opts = Options(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()})
    if seeds is None:
        seeds = seed_plans(cluster, model, global_batch_size, calibration, progress, **options)
    problem = PlanProblem(cluster, model, global_batch_size, names, calibration, opts, fallback=seeds["fastest"])
    seed_obj = {}
    for name, plan in seeds.items():
        if problem.evaluate_plan(plan) is not None:
            seed_obj[name] = dict(problem.record(plan).objectives)
    X0 = [problem.enc.encode(p) for p in seeds.values()]
    with SearchProgress(progress) as report:
        maoea_cs(problem.evaluate, problem.n_var, budget, pop_size=pop_size, X0=X0, seed=seed,
                 log=lambda phase, used: report(f"MaOEA-CS phase {phase}", used, budget))
    front = problem.front(max_front)
    return FrontResult(front=front, evaluations=problem.evaluations, seconds=time.perf_counter() - t0,
                       seeds=seed_obj, repairs=problem.enc.repairs, nondominated=problem.front())


__all__ = ["search_front", "seed_plans", "parse_objectives", "PlanProblem", "Resilience", "FrontPlan", "FrontResult",
           "ObjectiveError", "ALL_OBJECTIVES"]
