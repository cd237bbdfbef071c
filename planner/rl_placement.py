"""Where an RL job's rollout and actor go: the placements weighed, each predicted, the fastest chosen.

For ``placement.mode: auto`` the pool is every group the job names (the actor's and the rollout's).
Candidates:

- **collocated** on every non-empty set of the pool's groups (the actor trains on them; every
  device it uses also generates, from a temporary whole copy);
- **disaggregated** on every split of the pool into an actor set and a rollout set of groups, and,
  in each group of two devices or more, splits of its devices (a quarter, half, three quarters to the
  actor, the rest to the rollout).

Each actor set gets the planner's best plan for the step's batch (:func:`hetero.planner.search` on
the sub-cluster of those devices; a plan file in the job is kept as it is), and each placement the
RL step of :func:`hetero.predictor.rl.rl_step`. The shortest predicted step wins. A job whose mode
is collocated or disaggregated gets its own placement predicted alone.

``predict_rl_step(job, cluster, placement)`` is what a run puts in its summary's ``predicted``.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from hetero.predictor import rl as rlpred

SPLIT_FRACTIONS = (0.25, 0.5, 0.75)
"""Shares of one group's devices that a within-group split gives the actor."""


@dataclass
class Candidate:
    """One placement: the actor's devices and plan, the rollout's devices, the predicted step."""

    mode: str
    actor: dict[str, int]
    """Devices per group the actor's plan may use (the plan may use fewer)."""
    rollout: dict[str, int]
    """Rollout devices per group (collocated: the actor's)."""
    rollout_tp: int = 1
    plan: object = None
    prediction: rlpred.RLStepPrediction | None = None
    problem: str | None = None
    """Why it cannot run (no plan fits, no rollout copy fits), or None."""

    def label(self) -> str:
        def side(d: dict[str, int]) -> str:
            return "+".join(f"{g}:{n}" for g, n in d.items())
        if self.mode == "collocated":
            return f"collocated on {side(self.actor)}"
        return f"actor {side(self.actor)} | rollout {side(self.rollout)}" + \
            (f" (tp {self.rollout_tp})" if self.rollout_tp > 1 else "")

    def to_dict(self) -> dict:
        """One entry of ``hetero rl --predict --json``'s ``placements``."""
        rollout: dict = {"groups": list(self.rollout)}
        if self.rollout_tp != 1:
            rollout["tp"] = self.rollout_tp
        actor = {"groups": list(self.actor), "plan": self.plan.to_dict() if self.plan is not None else {}}
        split = [g for g in self.rollout if g in self.actor] if self.mode == "disaggregated" else []
        if split:   # devices of one group shared out: say how many each side has
            actor["devices"], rollout["devices"] = dict(self.actor), dict(self.rollout)
        out = {"mode": self.mode, "actor": actor, "rollout": rollout,
               "predicted": self.prediction.to_dict() if self.prediction is not None else None}
        if self.problem:
            out["problem"] = self.problem
        return out


@dataclass
class PlacementReport:
    """The placements weighed and the one chosen."""

    placements: list[Candidate]
    chosen: int
    reasons: list[str] = field(default_factory=list)
    sizes: rlpred.RLSizes | None = None

    def to_dict(self) -> dict:
        """``{"placements": [...], "chosen": index}`` (the ``--predict --json`` document)."""
        return {"placements": [c.to_dict() for c in self.placements], "chosen": self.chosen}


# ---------------------------------------------------------------------------- the job's sizes
def job_sizes(job) -> rlpred.RLSizes:
    """The step's sizes of a loaded RL job, the prompts' mean length as its tokenizer encodes them."""
    return rlpred.RLSizes(prompts_per_step=job.prompts_per_step, group_size=job.group_size,
                          prompt_tokens=mean_prompt_tokens(job), max_new_tokens=job.max_new_tokens,
                          staleness=job.staleness)


def mean_prompt_tokens(job) -> float:
    """Mean tokens of the job's prompts (begin token included, as the rollout encodes them: the job's
    :attr:`~hetero.rl.job.RLJob.prompt_lengths`)."""
    lengths = job.prompt_lengths
    return sum(lengths) / len(lengths) if lengths else 1.0


# ---------------------------------------------------------------------------- sub-clusters and plans
def sub_cluster(cluster, devices: dict[str, int]):
    """``cluster`` cut to ``devices`` (per group: all of it, whole nodes of it, or part of its one node)."""
    groups = []
    for g in cluster.groups:
        n = devices.get(g.name)
        if not n:
            continue
        if n == g.num_devices:
            groups.append(g)
        elif g.nodes == 1:
            groups.append(dataclasses.replace(g, devices_per_node=n))
        elif n % g.devices_per_node == 0:
            k = n // g.devices_per_node
            groups.append(dataclasses.replace(g, nodes=k, hosts=g.hosts[:k] if g.hosts else None))
        else:
            raise ValueError(f"group {g.name}: {n} of {g.num_devices} devices is not whole nodes")
    return dataclasses.replace(cluster, groups=tuple(groups),
                               device_types={g.name: cluster.device_types[g.name] for g in groups})


def _splits(group) -> list[int]:
    """Device counts of ``group`` a within-group split may give the actor (the rest: rollout)."""
    n = group.num_devices
    out = []
    for f in SPLIT_FRACTIONS:
        k = int(n * f)
        if 0 < k < n and k == n * f and (group.nodes == 1 or k % group.devices_per_node == 0) and k not in out:
            out.append(k)
    return out


class _Plans:
    """The planner's best actor plan per set of devices, searched once each."""

    def __init__(self, cluster, model, batch: int, search_options: dict | None = None):
        self.cluster, self.model, self.batch = cluster, model, batch
        self.options = search_options or {}
        self.memo: dict = {}

    def __call__(self, devices: dict[str, int]):
        key = tuple(sorted(devices.items()))
        if key not in self.memo:
            from .search import PlannerError, search

            sub = sub_cluster(self.cluster, devices)
            try:
                best = search(sub, self.model, self.batch, top_k=1, upper_bound=False, **self.options)[0]
                self.memo[key] = (best.plan, best.prediction, None)
            except PlannerError as e:
                self.memo[key] = (None, None, str(e).splitlines()[0])
        return self.memo[key]


# ---------------------------------------------------------------------------- candidates
def pool_of(job, cluster) -> dict[str, int]:
    """The groups an auto placement may use (the actor's and the rollout's, cluster order) and their devices."""
    named = set(job.actor_groups) | set(job.rollout_groups)
    return {g.name: g.num_devices for g in cluster.groups if g.name in named}


def candidates(job, cluster) -> list[Candidate]:
    """The placements weighed for ``job`` (module docstring)."""
    mode = job.placement.mode
    tp = job.rollout_tp
    if mode != "auto":
        actor = _actor_devices(job, cluster)
        if mode == "collocated":
            rollout = {g: n for g, n in actor.items() if g in job.rollout_groups} or dict(actor)
            return [Candidate("collocated", actor, rollout, 1, plan=job.actor_plan)]
        rollout = {g: cluster.group(g).num_devices - (actor.get(g, 0) if job.actor_plan is not None else 0)
                   for g in job.rollout_groups}
        return [Candidate("disaggregated", actor, rollout, tp, plan=job.actor_plan)]
    pool = pool_of(job, cluster)
    names = list(pool)
    if job.actor_plan is not None:   # the actor is fixed: where does the rollout go
        used = job.actor_plan.devices_by_group()
        out = [Candidate("collocated", dict(used), dict(used), 1, plan=job.actor_plan)]
        free = {g: pool[g] - used.get(g, 0) for g in names if pool[g] - used.get(g, 0) >= tp}
        for r in _subsets(list(free)):
            out.append(Candidate("disaggregated", dict(used), {g: free[g] for g in r}, tp, plan=job.actor_plan))
        return out
    out = [Candidate("collocated", {g: pool[g] for g in s}, {g: pool[g] for g in s}) for s in _subsets(names)]
    length = round(mean_prompt_tokens(job)) + job.max_new_tokens
    fit = {g: max(tp, copy_tp(cluster, job.model_spec, g, length, job.group_size)) for g in names}
    for a in _subsets(names):
        rest = [g for g in names if g not in a]
        for r in _subsets(rest):
            out.append(Candidate("disaggregated", {g: pool[g] for g in a}, {g: pool[g] for g in r},
                                 max(fit[g] for g in r)))
    for g in names:
        t = fit[g]
        for k in _splits(cluster.group(g)):
            if pool[g] - k >= t:
                out.append(Candidate("disaggregated", {g: k}, {g: pool[g] - k}, t))
    return out


def copy_tp(cluster, model, group: str, length: int, rows: int) -> int:
    """The fewest devices of ``group`` (a power of two within a node, dividing the heads) whose copy
    of ``model`` caches ``rows`` sequences of ``length`` tokens (a prompt group); 1 when none does
    (the candidate then says it does not fit)."""
    from hetero.predictor import generation as gen

    tp = 1
    while tp <= cluster.group(group).devices_per_node and model.num_attention_heads % tp == 0:
        if gen.sequences_fit(cluster, group, model, length, tp) >= rows:
            return tp
        tp *= 2
    return 1


def _subsets(names: list[str]) -> list[tuple[str, ...]]:
    return [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]


def _actor_devices(job, cluster) -> dict[str, int]:
    if job.actor_plan is not None:
        return job.actor_plan.devices_by_group()
    return {g: cluster.group(g).num_devices for g in job.actor_groups}


# ---------------------------------------------------------------------------- prediction
def _predict(c: Candidate, cluster, model, sizes: rlpred.RLSizes, plans: _Plans) -> None:
    from hetero.predictor import predict

    train = None
    if c.plan is None:
        c.plan, train, problem = plans(c.actor)
        if c.plan is None:
            c.problem = f"no actor plan fits {c.label().split(' |')[0]}: {problem}"
            return
    if train is None:
        train = predict(sub_cluster(cluster, c.actor), model, c.plan, check=False)
    try:
        c.prediction = rlpred.rl_step(cluster, model, c.plan, sizes, c.mode, rollout=c.rollout,
                                      rollout_tp=c.rollout_tp, train=train)
    except ValueError as e:
        c.problem = str(e)
        return
    if not c.prediction.fits:
        c.problem = "does not fit: " + ("the actor plan's memory" if not train.fits_memory else
                                        "no rollout copy holds a sequence's cache")


def predict_placements(job, cluster, search_options: dict | None = None) -> PlacementReport:
    """Every candidate placement of ``job`` (a loaded :class:`hetero.rl.job.RLJob`) on ``cluster``
    predicted; the chosen one is the shortest predicted step among those that fit."""
    model = job.model_spec
    sizes = job_sizes(job)
    plans = _Plans(cluster, model, job.samples_per_step, search_options)
    cands = candidates(job, cluster)
    for c in cands:
        _predict(c, cluster, model, sizes, plans)
    ok = [i for i, c in enumerate(cands) if c.prediction is not None and not c.problem]
    if not ok:
        from hetero.errors import HeteroError

        why = "; ".join(f"{c.label()}: {c.problem}" for c in cands[:4])
        raise HeteroError(f"{job.source}: no placement of the job fits the cluster ({why}) (fix: more devices, "
                          f"a smaller model or fewer samples a step)")
    chosen = min(ok, key=lambda i: cands[i].prediction.step_s)
    report = PlacementReport(cands, chosen, sizes=sizes)
    report.reasons = explain(report, cluster)
    return report


def predict_rl_step(job, cluster, placement: dict | None = None) -> dict:
    """The predicted ``{"step_s", "rollout_s", "train_s", "sync_s"}`` of ``job`` on ``cluster`` in
    ``placement`` (the summary's ``{"mode", "actor": {"groups", "plan"}, "rollout": {"groups"}}``;
    None: the job's own; mode auto: the chosen one). What a run's summary carries as ``predicted``."""
    from hetero.specs.plan import load_plan

    if placement is None or placement.get("mode") == "auto":
        report = predict_placements(job, cluster)
        return report.placements[report.chosen].prediction.summary()
    mode = placement["mode"]
    plan_dict = (placement.get("actor") or {}).get("plan") or None
    plan = load_plan(plan_dict, cluster, job.model_spec) if plan_dict else job.actor_plan
    actor = plan.devices_by_group() if plan is not None else \
        {g: cluster.group(g).num_devices for g in placement["actor"]["groups"]}
    rollout_groups = (placement.get("rollout") or {}).get("groups") or list(actor)
    tp = (placement.get("rollout") or {}).get("tp", 1)
    given = (placement.get("rollout") or {}).get("devices")
    rollout = {g: actor[g] for g in rollout_groups if g in actor} if mode == "collocated" else \
        {g: (given or {}).get(g, cluster.group(g).num_devices - actor.get(g, 0)) for g in rollout_groups}
    c = Candidate(mode, actor, rollout, tp, plan=plan)
    _predict(c, cluster, job.model_spec, job_sizes(job), _Plans(cluster, job.model_spec, job.samples_per_step))
    if c.prediction is None:
        from hetero.errors import HeteroError

        raise HeteroError(f"{job.source}: cannot predict {c.label()}: {c.problem}")
    return c.prediction.summary()


# ---------------------------------------------------------------------------- explanation
def explain(report: PlacementReport, cluster) -> list[str]:
    """Why the chosen placement wins, in a few sentences (as ``hetero plan`` explains its plan)."""
    cands = report.placements
    best = cands[report.chosen]
    p = best.prediction
    lines = []
    ranked = sorted((c for c in cands if c.prediction is not None and not c.problem and c is not best),
                    key=lambda c: c.prediction.step_s)
    if ranked:
        nxt = ranked[0]
        lines.append(f"it predicts the shortest step, {p.step_s:.4g} s ({p.samples_per_s:.4g} samples/s), "
                     f"{(1 - p.step_s / nxt.prediction.step_s):.1%} shorter than the next best, {nxt.label()} "
                     f"({nxt.prediction.step_s:.4g} s)")
    if p.overlapped:
        actor, rollout = p.sync_send_s + p.train_s, p.sync_s - p.sync_send_s + p.rollout_s
        what = "rollout's" if rollout >= actor else "actor's"
        lines.append(f"staleness {report.sizes.staleness} lets the rollout of the next step run during training: the "
                     f"step is the longer path, here the {what} ({max(actor, rollout):.4g} s; rollout: receiving "
                     f"the weights {p.sync_s - p.sync_send_s:.4g} s + generating {p.rollout_s:.4g} s; actor: "
                     f"sending {p.sync_send_s:.4g} s + training {p.train_s:.4g} s)")
    else:
        lines.append(f"its phases follow each other: sync {p.sync_s:.4g} s + rollout {p.rollout_s:.4g} s + "
                     f"train {p.train_s:.4g} s")
    # generation per group: which device decodes a prompt group fastest, and why
    per: dict[str, float] = {}
    for c in cands:
        if c.prediction is not None:
            for g, s in c.prediction.rollout_by_group.items():
                per[g] = min(per.get(g, s), s)
    if len(per) > 1:
        fast = min(per, key=per.get)
        others = ", ".join(f"{per[g]:.4g} s on {g}" for g in per if g != fast)
        d = cluster.device_type(fast)
        lines.append(f"one prompt group ({report.sizes.group_size} rows, {report.sizes.max_new_tokens} new tokens) "
                     f"is generated in {per[fast]:.4g} s on a copy in {fast} against {others}: decoding reads "
                     f"every weight and the whole cache each token ({fast}: "
                     f"{d.effective_memory_bandwidth / 1e12:.3g} TB/s)")
    train: dict[str, float] = {}
    for c in cands:
        if c.prediction is not None and len(c.actor) == 1:
            (g, n), = c.actor.items()
            if n == cluster.group(g).num_devices:
                train[g] = c.prediction.train_s
    if len(train) > 1:
        fast = min(train, key=train.get)
        others = ", ".join(f"{train[g] / train[fast]:.3g}x longer on {g}" for g in train if g != fast)
        lines.append(f"training a step alone takes {train[fast]:.4g} s on {fast} ({others}): training is bound "
                     f"by compute")
    return lines


def format_report(report: PlacementReport) -> str:
    """The placements weighed (predicted seconds per step) and why the chosen one wins, as text."""
    s = report.sizes
    lines = [f"RL step: {s.prompts_per_step} prompts x {s.group_size} completions, prompts of "
             f"{s.prompt_tokens:.1f} tokens on average, at most {s.max_new_tokens} new tokens, staleness {s.staleness}",
             f"{'':3}{'placement':<44}{'step s':>10}{'rollout s':>11}{'train s':>10}{'sync s':>10}{'samples/s':>11}"]
    for i, c in enumerate(report.placements):
        mark = "*" if i == report.chosen else " "
        if c.prediction is None or c.problem:
            lines.append(f"{mark}{i:<3}{c.label():<43}  {c.problem}")
            continue
        p = c.prediction
        lines.append(f"{mark}{i:<3}{c.label():<43}{p.step_s:>10.4g}{p.rollout_s:>11.4g}{p.train_s:>10.4g}"
                     f"{p.sync_s:>10.4g}{p.samples_per_s:>11.4g}")
    best = report.placements[report.chosen]
    lines.append(f"chosen: {report.chosen} ({best.mode}: {best.label()})")
    from .search import describe

    if best.plan is not None:
        lines.append(f"  actor plan: {describe(best.plan)}")
    lines += [f"  - {r}" for r in report.reasons]
    return "\n".join(lines)


__all__ = ["Candidate", "PlacementReport", "candidates", "predict_placements", "predict_rl_step", "format_report",
           "job_sizes", "sub_cluster"]
