"""Search over hybrid-parallel plans for a heterogeneous cluster.

1. Shapes, per (recompute, micro-batch size): every group alone (tp x stages x replicas) and every
   ordered set of groups as one pipeline whose stages span them (tp per group from that group's best
   shapes alone, stages per group = devices / (replicas x tp)). Each shape gets its min-max layer
   split from the predictor's per-layer costs; memory-infeasible shapes are cut as soon as a stage
   cannot hold its layers (ZeRO 0, then 1, then 2). Tasks run in a process pool when it pays.
2. Plans: for every partition of the groups into pipelines (and every subset, so a slow group may
   also be left idle), the best few shapes of each part are combined and the global batch is shared
   so that all pipelines finish together (sum replicas x micro_batches x mbs == global batch).
3. Scoring: the best candidates (plus the even-split twin of each) go through ``predict()``, the
   single source of truth; a short hill climb moves single layers between neighbouring stages.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.specs.plan import Pipeline, Plan, Stage, check_plan

from .blocks import Block, BlockEvaluator
from .space import RECOMPUTE, Segment, group_orders, mbs_options, replica_options, set_partitions, tp_options
from .split import uniform_split


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
        return self.prediction.tokens_per_s

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "prediction": self.prediction.to_dict(),
                "one_line": self.one_line, "reasons": list(self.reasons)}


class SearchResults(list):
    """A list of :class:`SearchResult` (best first) with the search's summary attached."""

    upper_bound_tokens_per_s: float | None = None
    upper_bound_by_group: dict
    reasons: list
    stats: dict


@dataclass(frozen=True)
class Options:
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = RECOMPUTE
    zero_stages: tuple[int, ...] = (0, 1, 2)
    keep_per_block: int = 6
    """Shapes kept per group set (by the ranking key) for the combination step."""
    combos_per_block: int = 3
    combos_budget: int | None = None
    """Shape combinations tried per set of pipelines (the best ``budget ** (1/k)`` of each of k parts)."""
    max_predictions: int = 64
    """Plans sent to ``predict()`` before refinement."""
    refine_top: int = 3
    refine_rounds: int = 2
    workers: int | None = None
    """Processes for the shape enumeration (None: 2 on big clusters, else 1)."""
    mixed: bool = True
    """Consider pipelines whose stages span several groups."""


# ----------------------------------------------------------------------------- shapes
def _units(B: int, mbs: int) -> int:
    return B // mbs


def enumerate_blocks(cluster, model, ev: BlockEvaluator, B: int, rc: str, mbs: int, opts: Options) -> dict:
    """Evaluated shapes for one (recompute, micro-batch size): {tuple of groups: [Block, ...]}."""
    L = model.num_layers
    sizes = {g.name: g.num_devices for g in cluster.groups}
    total = sum(sizes.values())
    out: dict[tuple[str, ...], list[Block]] = {}
    units = _units(B, mbs)

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
                if blk is not None:
                    cands.append(blk)
        cands.sort(key=lambda b: -key(b, share))
        kept = _keep(cands, opts.keep_per_block)
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
                # pipeline depth comes from the other groups too): pairs also try the smallest tp.
                per_tp = [list(dict.fromkeys(best_tp[g][:2] + tp_options(cluster, model, g)[:1])) if k <= 2
                          else best_tp[g][:1] for g in subset]
                cands = []
                orders = group_orders(cluster, subset)
                first_order = orders[0]
                for tps in itertools.product(*per_tp):
                    tp_of = dict(zip(subset, tps))
                    for r in replica_options(tp_of, sizes, units, L):
                        segs = tuple(Segment(g, tp_of[g], sizes[g] // (r * tp_of[g])) for g in first_order)
                        blk = ev.evaluate(segs, r, mbs, rc, opts.zero_stages)
                        if blk is not None:
                            cands.append(blk)
                cands.sort(key=lambda b: -key(b, share))
                # other orders only for the best few shapes
                extra = []
                for blk in cands[:3]:
                    seg_of = {s.group: s for s in blk.segments}
                    for order in orders[1:]:
                        alt = ev.evaluate(tuple(seg_of[g] for g in order), blk.replicas, mbs, rc, opts.zero_stages)
                        if alt is not None:
                            extra.append(alt)
                cands = sorted(cands + extra, key=lambda b: -key(b, share))
                kept = _keep(cands, opts.keep_per_block)
                if kept:
                    out[tuple(sorted(subset))] = kept
    return out


def _keep(cands: list[Block], n: int) -> list[Block]:
    """The best ``n`` shapes, plus the best of every tp signature (for the TP-or-PP explanation)."""
    kept, seen = [], set()
    for b in cands:
        sig = tuple((s.group, s.tp) for s in b.segments)
        if len(kept) < n or sig not in seen:
            if b not in kept:
                kept.append(b)
            seen.add(sig)
    return kept


def _enumerate_task(args):
    """Process-pool entry: build a cost model in the worker and enumerate one (rc, mbs)."""
    cluster, model, calibration, B, rc, mbs, opts = args
    from hetero.predictor.costs import StageCostModel

    ev = BlockEvaluator(cluster, model, StageCostModel(cluster, model, calibration=calibration))
    return rc, mbs, enumerate_blocks(cluster, model, ev, B, rc, mbs, opts), ev.splits_computed


# ----------------------------------------------------------------------------- combining
def allocate(blocks: list[Block], B: int) -> tuple[list[int], float] | None:
    """Micro-batches per replica for each block: sum(units x m) == B exactly, min max time."""
    k = len(blocks)
    if k == 1:
        b = blocks[0]
        if B % b.units:
            return None
        m = B // b.units
        return [m], b.time(m)
    # continuous balance: find tau with sum(units * m_b(tau)) ~ B
    lo, hi = 0.0, max(b.time(B // b.units + 1) for b in blocks)

    def ms(tau):
        return [max(1, int((tau - b.fill) / b.bottleneck) + 1) if tau > b.fill else 1 for b in blocks]

    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(b.units * m for b, m in zip(blocks, ms(mid))) <= B:
            lo = mid
        else:
            hi = mid
    base = ms(lo)
    best = None
    window = range(-2, 4) if k <= 3 else range(-1, 3)
    for deltas in itertools.product(window, repeat=k - 1):
        m = [base[i] + deltas[i] for i in range(k - 1)]
        if min(m) < 1:
            continue
        rest = B - sum(b.units * mi for b, mi in zip(blocks, m))
        last = blocks[-1]
        if rest < last.units or rest % last.units:
            continue
        m.append(rest // last.units)
        t = max(b.time(mi) for b, mi in zip(blocks, m))
        if best is None or t < best[1]:
            best = (m, t)
    return best


@dataclass(frozen=True)
class Candidate:
    blocks: tuple[Block, ...]
    micro_batches: tuple[int, ...]
    time: float
    """Ranking key (seconds); the prediction decides."""
    uniform: bool = False

    @property
    def structure(self) -> tuple:
        return tuple(b.groups for b in self.blocks)

    def to_plan(self, B: int, L: int) -> Plan:
        rc = self.blocks[0].recompute
        zero = max(b.zero for b in self.blocks)
        default_mbs = self.blocks[0].mbs
        pipes = []
        for b, m in zip(self.blocks, self.micro_batches):
            counts = uniform_split(b.num_stages, L) if self.uniform else b.counts
            stages, a = [], 0
            for (g, tp), n in zip(b.stages, counts):
                stages.append(Stage(group=g, layers=(a, a + n), tp=tp))
                a += n
            pipes.append(Pipeline(micro_batches=m, stages=stages, replicas=b.replicas,
                                  micro_batch_size=None if b.mbs == default_mbs else b.mbs))
        return Plan(global_batch_size=B, micro_batch_size=default_mbs, pipelines=pipes, schedule="1f1b",
                    recompute=rc, zero_stage=zero)


def combine(by_key: dict, groups: list[str], B: int, opts: Options) -> list[Candidate]:
    """Plans from shapes: every partition of the groups into pipelines, every non-empty subset."""
    out: list[Candidate] = []
    seen = set()
    for part in set_partitions(groups):
        parts = [tuple(sorted(p)) for p in part]
        for r in range(1, len(parts) + 1):
            for subset in itertools.combinations(parts, r):
                lists = [by_key.get(p) for p in subset]
                if any(not x for x in lists):
                    continue
                budget = opts.combos_budget or (300 if len(groups) <= 2 else 64)
                c = max(opts.combos_per_block, int(budget ** (1 / len(subset))))
                for blocks in itertools.product(*[x[:c] for x in lists]):
                    sig = tuple(blocks)
                    if sig in seen:
                        continue
                    seen.add(sig)
                    alloc = allocate(list(blocks), B)
                    if alloc is None:
                        continue
                    out.append(Candidate(blocks=tuple(blocks), micro_batches=tuple(alloc[0]), time=alloc[1]))
    return out


# ----------------------------------------------------------------------------- scoring
def _default_cost_model(cluster, model, calibration):
    from hetero.predictor import cost_model_for

    return cost_model_for(cluster, model, calibration)


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
            self.extra = {"cost_model": cost_model or cost_model_for(cluster, model, calibration), "check": False}

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
                a, b = p.stages[si], p.stages[si + 1]
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


# ----------------------------------------------------------------------------- search
def _search_core(cluster, model, B: int, opts: Options, cost_model, scorer: _Scorer, progress, calibration):
    stats = {"splits": 0, "shapes": 0, "candidates": 0}
    t0 = time.perf_counter()
    mbs_list = [m for m in mbs_options(B, opts.micro_batch_sizes)]
    tasks = [(rc, mbs) for rc in opts.recompute for mbs in mbs_list]
    workers = opts.workers
    if workers is None:
        workers = 2 if cluster.num_devices >= 256 and (os.cpu_count() or 1) > 1 else 1
    enumerated: dict[tuple[str, int], dict] = {}
    if cost_model is None and workers > 1 and len(tasks) > 1:
        try:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                args = [(cluster, model, calibration, B, rc, mbs, opts) for rc, mbs in tasks]
                for i, (rc, mbs, res, n) in enumerate(pool.map(_enumerate_task, args)):
                    enumerated[(rc, mbs)] = res
                    stats["splits"] += n
                    progress("shapes", i + 1, len(tasks))
        except Exception:  # no processes here (sandbox, pickling): do it in this process
            enumerated.clear()
    if not enumerated:
        cm = cost_model if cost_model is not None else _default_cost_model(cluster, model, calibration)
        ev = BlockEvaluator(cluster, model, cm)
        for i, (rc, mbs) in enumerate(tasks):
            enumerated[(rc, mbs)] = enumerate_blocks(cluster, model, ev, B, rc, mbs, opts)
            progress("shapes", i + 1, len(tasks))
        stats["splits"] = ev.splits_computed
    stats["enumerate_s"] = time.perf_counter() - t0

    # Combine per recompute setting (recompute is plan-wide; mbs may differ between pipelines).
    groups = [g.name for g in cluster.groups]
    candidates: list[Candidate] = []
    for rc in opts.recompute:
        by_key: dict[tuple, list[Block]] = {}
        for mbs in mbs_list:
            for k, blocks in enumerated.get((rc, mbs), {}).items():
                by_key.setdefault(k, []).extend(blocks)
                stats["shapes"] += len(blocks)
        for k in by_key:
            by_key[k] = _rank_blocks(by_key[k], B, cluster)
        candidates.extend(combine(by_key, groups, B, opts))
    stats["candidates"] = len(candidates)
    candidates.sort(key=lambda c: c.time)

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
    L = model.num_layers
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
    # hill climb on the top few
    for idx in range(min(opts.refine_top, len(scored))):
        s, plan, pred, c = scored[idx]
        if s < 0:
            continue
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
        progress("refine", idx + 1, opts.refine_top)
    scored.sort(key=lambda x: -x[0])
    stats["predict_calls"] = scorer.calls
    stats["elapsed_s"] = time.perf_counter() - t0
    return scored, candidates, stats


def _rank_blocks(blocks: list[Block], B: int, cluster) -> list[Block]:
    def rate(b):
        m = max(1, B // max(1, b.units) // 2)
        return b.units * m / b.time(m)

    blocks = sorted(set(blocks), key=lambda b: -rate(b))
    return blocks


def _subcluster(cluster, group: str):
    return dataclasses.replace(cluster, groups=tuple(g for g in cluster.groups if g.name == group),
                               device_types={group: cluster.device_types[group]})


def _dedupe(scored):
    out, seen = [], set()
    for s, plan, pred, c in scored:
        key = repr(plan.to_dict())
        if key in seen:
            continue
        seen.add(key)
        out.append((s, plan, pred, c))
    return out


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


def search(cluster, model, global_batch_size: int, top_k: int = 5, calibration=None, progress=False,
           upper_bound: bool = True, cost_model=None, predict_fn=None, **options) -> SearchResults:
    """Search plans; return the ``top_k`` that fit, best predicted tokens/s first.

    ``options`` override :class:`Options` fields (``micro_batch_sizes``, ``recompute``,
    ``zero_stages``, ``max_predictions``, ``workers``, ``mixed``, ...). ``progress`` is False,
    True (a rich progress bar on stderr) or a callable ``(phase, done, total)``.
    ``cost_model`` / ``predict_fn`` replace the predictor (tests).
    Raises :class:`PlannerError` when nothing fits, saying which constraint fails and the fix.
    """
    from .explain import explain, infeasible_message

    opts = Options(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()})
    B = int(global_batch_size)
    if B < 1:
        raise PlannerError(f"global_batch_size must be >= 1, got {B}")
    with _progress(progress) as report:
        scorer = _Scorer(cluster, model, calibration, predict_fn)
        scored, candidates, stats = _search_core(cluster, model, B, opts, cost_model, scorer, report, calibration)
        scored = _dedupe(scored)
        ub, ub_by_group, homog = None, {}, {}
        if upper_bound:
            ub = 0.0
            for g in cluster.groups:
                if len(cluster.groups) == 1:
                    best = scored[0] if scored and scored[0][0] > 0 else None
                else:
                    sub = _subcluster(cluster, g.name)
                    sub_cm = None if cost_model is None else type(cost_model)(sub, model)
                    sub_scorer = _Scorer(sub, model, calibration, predict_fn)
                    s2, _, _ = _search_core(sub, model, B, opts, sub_cm, sub_scorer, report, calibration)
                    best = s2[0] if s2 and s2[0][0] > 0 else None
                    if best is not None:
                        # a plan of one group is a plan of the whole cluster too
                        pred_full = scorer(best[1])
                        scored.append((_score(pred_full), best[1], pred_full, best[3]))
                ub_by_group[g.name] = best[0] if best else 0.0
                homog[g.name] = best
                ub += ub_by_group[g.name]
            scored.sort(key=lambda x: -x[0])
            scored = _dedupe(scored)
    fitting = [x for x in scored if x[0] > 0]
    if not fitting:
        raise PlannerError(infeasible_message(cluster, model, B, opts, cost_model, calibration))
    results = SearchResults()
    for rank, (s, plan, pred, c) in enumerate(fitting[:top_k]):
        results.append(SearchResult(plan=plan, prediction=_with_upper_bound(pred, ub),
                                    one_line=describe(plan, cluster), rank=rank))
    results.upper_bound_tokens_per_s = ub
    results.upper_bound_by_group = ub_by_group
    results.stats = stats
    try:
        results.reasons = explain(cluster, model, B, results, fitting, candidates, scorer, cost_model, calibration)
    except Exception as e:  # explanations must never cost the user the plan
        results.reasons = [f"(no explanation: {type(e).__name__}: {e})"]
    if results:
        results[0].reasons = list(results.reasons)
    return results


def describe(plan: Plan, cluster=None) -> str:
    """``A100x16[tp4,L0-19] | MI250x8[tp8,L20-31]``: devices per stage run (over replicas) and layers."""
    parts = []
    for p in plan.pipelines:
        runs = []
        for s in p.stages:
            if runs and runs[-1][0] == s.group and runs[-1][1] == s.tp:
                runs[-1][2] += 1
                runs[-1][4] = s.layers[1]
            else:
                runs.append([s.group, s.tp, 1, s.layers[0], s.layers[1]])
        segs = []
        for g, tp, n, a, b in runs:
            dev = p.replicas * tp * n
            pp = f",pp{n}" if n > 1 else ""
            sep = "-x" if g[-1:].lower() == "x" else "x"
            segs.append(f"{g}{sep}{dev}[tp{tp}{pp},L{a}-{b - 1}]")
        rep = f"{p.replicas}x " if p.replicas > 1 else ""
        parts.append(f"{rep}{' | '.join(segs)} mb{p.micro_batches}x{plan.mbs(p)}")
    tail = []
    if plan.recompute != "none":
        tail.append(f"recompute={plan.recompute}")
    if plan.zero_stage:
        tail.append(f"zero{plan.zero_stage}")
    return " + ".join(parts) + (f" ({', '.join(tail)})" if tail else "")


class _progress:
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

        from hetero.cli._common import console

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
