"""Search over hybrid-parallel plans for a heterogeneous cluster: the public :func:`search`, its
result types and the three steps it chains.

1. Shapes (:mod:`hetero.planner.shapes`), per (recompute, micro-batch size): every group alone and
   every ordered set of groups as one pipeline whose stages span them, each with its min-max layer
   split; memory-infeasible shapes are cut early.
2. Plans (:mod:`hetero.planner.candidates`): the best few shapes of every partition of the groups
   into pipelines (and every subset) are combined, the global batch shared so that all pipelines
   finish together.
3. Scoring (:mod:`hetero.planner.scoring`): the best candidates go through ``predict()``, the single
   source of truth; a short hill climb refines the top few.

With ``upper_bound``, the search also gives a throughput no plan can beat
(:mod:`hetero.planner.bound`: the model's compute shared among the groups at each one's fastest
setting) and searches each group alone: a plan of one group is a plan of the whole cluster too, and
the sum of those best plans alone is a comparison, not a bound (a pipeline across groups lets each
hold only part of the model, so a mixed plan can beat it). When a group cannot hold the model alone
that sum is None (the per-group figures stay in ``alone_by_group``, 0 for that group).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from hetero.errors import HeteroError
from hetero.specs.plan import Plan

from .candidates import Candidate, allocate, candidates_from_shapes, combine
from .options import Options, workers_for
from .scoring import plan_score, Scorer, score_and_refine
from .shapes import enumerate_all, enumerate_blocks
from .space import mbs_options

if TYPE_CHECKING:   # annotations only
    from hetero.predictor import Prediction, StageCostModel
    from hetero.predictor.calibration import Calibration
    from hetero.specs.cluster import Cluster
    from hetero.specs.model import ModelSpec


class PlannerError(HeteroError):
    """No plan fits; the message says which constraint fails and what would fix it."""


@dataclass
class SearchResult:
    """One ranked plan: the plan, its prediction, a one-line description and the reasons."""

    plan: Plan
    prediction: object
    one_line: str
    reasons: list[str] = field(default_factory=list)
    rank: int = 0

    @property
    def tokens_per_s(self) -> float:
        """The predicted throughput."""
        return self.prediction.tokens_per_s

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "prediction": self.prediction.to_dict(),
                "one_line": self.one_line, "reasons": list(self.reasons)}


class SearchResults(list):
    """A list of :class:`SearchResult` (best first) with the search's summary attached."""

    upper_bound_tokens_per_s: float | None = None
    """No plan of the search predicts more (:func:`hetero.planner.bound.upper_bound`); None without ``upper_bound``."""
    upper_bound_by_group: dict
    """Group -> its devices' compute-only tokens/s doing the whole model alone (the bound is at least their sum)."""
    alone_tokens_per_s: float | None = None
    """The sum of each group's best plan alone; None when a group cannot hold the model alone. A
    mixed plan may beat it: each group then holds only part of the model."""
    alone_by_group: dict
    """Group -> the tokens/s of its best plan alone (0 when it cannot hold the model alone)."""
    best_alone: dict
    """Group -> the best plan of that group alone (a plan of the whole cluster too), or None."""
    reasons: list
    stats: dict


def _search_core(cluster, model, B: int, opts: Options, cost_model, scorer: Scorer, progress, calibration):
    """The three steps over one cluster: ``(scored plans best first, candidates, stats)``."""
    stats = {"splits": 0, "shapes": 0, "candidates": 0}
    t0 = time.perf_counter()
    mbs_list = [m for m in mbs_options(B, opts.micro_batch_sizes)]
    tasks = [(rc, mbs) for rc in opts.recompute for mbs in mbs_list]
    enumerated, stats["splits"] = enumerate_all(cluster, model, B, tasks, opts, cost_model, calibration, progress)
    stats["enumerate_s"] = time.perf_counter() - t0
    candidates, stats["shapes"] = candidates_from_shapes(enumerated, cluster, B, mbs_list, opts)
    stats["candidates"] = len(candidates)
    scored = score_and_refine(candidates, B, model.num_layers, opts, scorer, progress)
    stats["predict_calls"] = scorer.calls
    stats["elapsed_s"] = time.perf_counter() - t0
    return scored, candidates, stats


def _subcluster(cluster, group: str):
    return dataclasses.replace(cluster, groups=tuple(g for g in cluster.groups if g.name == group),
                               device_types={group: cluster.device_types[group]})


def _dedupe(scored):
    """Drop repeated plans, and ZeRO twins (the same plan at another ``zero_stage``) predicting the
    same tokens/s: only the lowest ZeRO stage of those stays (the predictor charges the higher
    stages no time but they shard state that one replica cannot, and cost real communication the
    predictor leaves out, e.g. ZeRO-2's per-micro-batch reductions), so top-k lists distinct plans."""
    out, seen, twins = [], set(), {}
    for item in scored:
        d = item[1].to_dict()
        key = repr(d)
        if key in seen:
            continue
        seen.add(key)
        d.pop("zero_stage", None)
        same = twins.setdefault(repr(d), [])
        tie = next((j for j in same if item[0] > 0 and math.isclose(out[j][0], item[0], rel_tol=1e-12)), None)
        if tie is None:
            same.append(len(out))
            out.append(item)
        elif item[1].zero_stage < out[tie][1].zero_stage:
            out[tie] = item
    return out


def _with_expert_twins(scored: list, scorer: Scorer, opts: Options) -> list:
    """An MoE model's best plans and their expert-parallel twins (:mod:`.experts`), all predicted,
    best first; a dense model's ``scored`` as it is."""
    cm = scorer.extra.get("cost_model")
    if cm is None or cm.model.moe is None:
        return scored
    from .experts import expert_twins

    twins = [(t, c) for _s, plan, _p, c in scored[: max(1, opts.refine_top)] for t in expert_twins(cm, plan)]
    preds = scorer.predict_many([t for t, _ in twins])
    out = scored + [(plan_score(p), t, p, c) for (t, c), p in zip(twins, preds) if p is not None]
    out.sort(key=lambda x: -x[0])
    return out


def _upper_bound(cluster, model, B: int, opts: Options, cost_model, scorer: Scorer, calibration):
    """:func:`hetero.planner.bound.upper_bound` on the costs the search's predictions use (the
    scorer's cost model; a replaced predictor's plans are bounded by the real predictor's costs)."""
    from hetero.predictor import cost_model_for

    from .bound import upper_bound

    cm = scorer.extra.get("cost_model") or cost_model or cost_model_for(cluster, model, calibration)
    return upper_bound(cm, cluster, model, B, opts.micro_batch_sizes, opts.recompute)


def _with_upper_bound(pred, value):
    if value is None:
        return pred
    try:
        return dataclasses.replace(pred, upper_bound_tokens_per_s=value)
    except (TypeError, ValueError):
        try:
            pred.upper_bound_tokens_per_s = value
        except AttributeError:
            pass
        return pred


def _check_top_k(top_k) -> None:
    """``top_k`` counts plans to return: an int >= 1 (not a bool, not a float), as ``--top-k`` requires."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")


def search(cluster: Cluster, model: ModelSpec, global_batch_size: int, top_k: int = 5,
           calibration: Calibration | None = None, progress: bool | Callable[[str, int, int], None] = False,
           upper_bound: bool = True, cost_model: StageCostModel | None = None,
           predict_fn: Callable[..., Prediction] | None = None, allocator: Literal["caching", "planned"] | None = None,
           **options: Any) -> SearchResults:
    """Search plans; return the ``top_k`` that fit, best predicted tokens/s first.

    ``options`` override :class:`Options` fields (``micro_batch_sizes``, ``recompute``,
    ``zero_stages``, ``max_predictions``, ``workers``, ``mixed``, ...). ``progress`` is False,
    True (a rich progress bar on stderr) or a callable ``(phase, done, total)``.
    ``cost_model`` / ``predict_fn`` replace the predictor (tests).
    ``allocator`` (``caching`` | ``planned``): fit is judged by what that allocator reserves
    (:mod:`hetero.predictor.allocator`), so the search spends what a planned arena saves on larger
    micro-batches or less recomputation where that predicts faster (the shapes are then enumerated in
    one process).
    Raises :class:`PlannerError` when nothing fits, saying which constraint fails and the fix, and
    ``ValueError`` when ``top_k`` is not a positive integer.
    """
    from .explain import explain, infeasible_message

    _check_top_k(top_k)

    opts = Options(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()})
    B = int(global_batch_size)
    from hetero.specs.plan import global_batch_problem

    bad_batch = global_batch_problem(B)
    if bad_batch:
        raise PlannerError(f"global_batch_size: {bad_batch[0]} (fix: {bad_batch[1]})")
    if allocator is not None and cost_model is None and predict_fn is None:
        from hetero.predictor import cost_model_for

        cost_model = cost_model_for(cluster, model, calibration, allocator)
    with SearchProgress(progress) as report:
        scorer = Scorer(cluster, model, calibration, predict_fn, cost_model if allocator else None,
                         workers_for(opts, cluster))
        scored, candidates, stats = _search_core(cluster, model, B, opts, cost_model, scorer, report, calibration)
        scored = _dedupe(_with_expert_twins(scored, scorer, opts))
        ub, ub_by_group, best_alone, alone, alone_by_group = None, {}, {}, None, {}
        if upper_bound:
            ub, ub_by_group = _upper_bound(cluster, model, B, opts, cost_model, scorer, calibration)
            alone = 0.0
            for g in cluster.groups:
                if len(cluster.groups) == 1:
                    best = scored[0] if scored and scored[0][0] > 0 else None
                else:
                    sub = _subcluster(cluster, g.name)
                    sub_cm = None if cost_model is None else type(cost_model)(sub, model)
                    sub_scorer = Scorer(sub, model, calibration, predict_fn, workers=workers_for(opts, sub))
                    s2, _, _ = _search_core(sub, model, B, opts, sub_cm, sub_scorer, report, calibration)
                    best = s2[0] if s2 and s2[0][0] > 0 else None
                    if best is not None:
                        # a plan of one group is a plan of the whole cluster too
                        pred_full = scorer(best[1])
                        scored.append((plan_score(pred_full), best[1], pred_full, best[3]))
                alone_by_group[g.name] = best[0] if best else 0.0
                best_alone[g.name] = best[1] if best else None
                alone += alone_by_group[g.name]
            scored.sort(key=lambda x: -x[0])
            scored = _dedupe(scored)
            if any(v <= 0 for v in alone_by_group.values()):
                alone = None   # a group that cannot hold the model alone adds 0: the sum compares with nothing
    fitting = [x for x in scored if x[0] > 0]
    if allocator == "caching" and predict_fn is None:
        fitting = _confirm_by_replay(cluster, model, calibration, cost_model, fitting, top_k)
    if not fitting:
        raise PlannerError(infeasible_message(cluster, model, B, opts, cost_model, calibration))
    results = SearchResults()
    for rank, (s, plan, pred, c) in enumerate(fitting[:top_k]):
        results.append(SearchResult(plan=plan, prediction=_with_upper_bound(pred, ub),
                                    one_line=describe(plan, cluster), rank=rank))
    results.upper_bound_tokens_per_s = ub
    results.upper_bound_by_group = ub_by_group
    results.alone_tokens_per_s = alone
    results.alone_by_group = alone_by_group
    results.best_alone = best_alone
    results.stats = stats
    try:
        results.reasons = explain(cluster, model, B, results, fitting, candidates, scorer, cost_model, calibration)
    except Exception as e:  # explanations must never cost the user the plan
        results.reasons = [f"(no explanation: {type(e).__name__}: {e})"]
    if results:
        results[0].reasons = list(results.reasons)
    return results


REPLAY_CHECKS = 4
"""With ``--allocator caching`` the search screens by the fitted ratio and replays the stages of at
most this many times ``top_k`` of its best plans (:func:`_confirm_by_replay`)."""

REPLAY_BUDGET = 256
"""A plan is confirmed by replay only where each of its stages records at most this many layer
passes per step (:func:`hetero.predictor.allocator.replay_layer_passes`); beyond, the ratio's
verdict stands: the replay would take minutes."""


def _confirm_by_replay(cluster, model, calibration, cost_model, fitting: list, top_k: int) -> list:
    """The best plans the ratio admits, each predicted again with its stages' caching reservation
    replayed from their own requests (:func:`hetero.predictor.allocator.simulated_caching_bytes`,
    seconds per new stage signature: too slow for every candidate), kept where they still fit, until
    ``top_k`` are confirmed or ``REPLAY_CHECKS * top_k`` were tried. A plan whose stages would
    record more than :data:`REPLAY_BUDGET` layer passes keeps the ratio's prediction."""
    from hetero.predictor import predict
    from hetero.predictor.allocator import replay_layer_passes

    out = []
    for _s, plan, pred, c in fitting[: REPLAY_CHECKS * top_k]:
        if all(replay_layer_passes(plan, pi, i) <= REPLAY_BUDGET for pi, p in enumerate(plan.pipelines)
               for i in range(len(plan.physical_stages(p)))):
            pred = predict(cluster, model, plan, calibration, cost_model=cost_model, check=False, replay=True)
        if pred.fits_memory:
            out.append((plan_score(pred), plan, pred, c))
            if len(out) == top_k:
                break
    out.sort(key=lambda x: -x[0])
    return out


NOTATION = ("plan notation: '2x' two data-parallel replicas of the pipeline; 'a100:16' group a100, 16 devices "
            "over all replicas; 'tp4' tensor parallelism; 'pp2' two pipeline stages of that group; 'L0:20' "
            "layers 0 to 19 (half-open, as [0, 20) in plan files); '8 mb of 2' 8 micro-batches of 2 samples "
            "per replica and step")
"""What :func:`describe`'s notation means: ``hetero plan`` prints it once under its table."""


def describe(plan: Plan, cluster=None) -> str:
    """``2x a100:16[tp4,L0:20] | mi250:8[tp8,L20:32] 8 mb of 2``: per pipeline its replicas, then per run
    of stages its group, devices (over replicas), parallelism and layers (half-open, as in plan
    files), then micro-batches per replica and their size (:data:`NOTATION`). Interleaved plans count
    each run's layers (its devices hold several ranges): ``a100:16[tp4,pp4,40 layers]``."""
    parts = []
    for p in plan.pipelines:
        v = plan.virtual_chunks(p)
        physical = plan.physical_stages(p)
        held = [sum(s.layers[1] - s.layers[0] for s in p.stages[i::len(physical)]) for i in range(len(physical))]
        runs = []
        for s, n_layers in zip(physical, held):
            if runs and runs[-1][0] == s.group and runs[-1][1] == s.tp:
                runs[-1][2] += 1
                runs[-1][4] = s.layers[1]
                runs[-1][5] += n_layers
            else:
                runs.append([s.group, s.tp, 1, s.layers[0], s.layers[1], n_layers])
        segs = []
        for g, tp, n, a, b, n_layers in runs:
            dev = p.replicas * tp * n
            pp = f",pp{n}" if n > 1 else ""
            where = f"{n_layers} layers" if v > 1 else f"L{a}:{b}"
            segs.append(f"{g}:{dev}[tp{tp}{pp},{where}]")
        rep = f"{p.replicas}x " if p.replicas > 1 else ""
        parts.append(f"{rep}{' | '.join(segs)} {p.micro_batches} mb of {plan.mbs(p)}")
    tail = []
    if plan.schedule != "1f1b":
        tail.append(f"interleaved x{plan.interleave}" if plan.schedule == "interleaved" else plan.schedule)
    if plan.recompute != "none":
        tail.append(f"recompute={plan.recompute}")
    if plan.zero_stage:
        tail.append(f"zero{plan.zero_stage}")
    ep = plan.expert_parallel
    if ep is not None:
        tail.append(f"experts over {ep.degree} ranks" + (f": {'/'.join(map(str, ep.experts))}" if ep.experts else ""))
    return " + ".join(parts) + (f" ({', '.join(tail)})" if tail else "")


class SearchProgress:
    """Context manager turning ``progress`` (False / True / callable) into a report function."""

    def __init__(self, progress):
        self.spec = progress
        self.bar = None
        self.tasks = {}

    def __enter__(self):
        if callable(self.spec):
            return self.spec
        if not self.spec:
            return lambda *a: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from hetero.console import console

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeElapsedColumn(), console=console(stderr=True), transient=True)
        self.bar.__enter__()

        def report(phase, done, total):
            if phase not in self.tasks:
                self.tasks[phase] = self.bar.add_task(phase, total=total)
            self.bar.update(self.tasks[phase], completed=done, total=total)

        return report

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


__all__ = ["search", "SearchResult", "SearchResults", "PlannerError", "Options", "describe", "allocate",
           "enumerate_blocks", "combine", "Candidate"]
