"""Plan files: data-parallel pipelines of possibly different shapes, each a list of uneven stages.

A plan is data: the planner writes it, a person may edit it, the predictor scores it and the
launcher runs it. :func:`check_plan` enforces the rules of docs/formats.md against a cluster and a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetero.backends.registry import TAGLESS_P2P, library_of

from .cluster import Cluster, model_problems
from .errors import Problems, SpecError, did_you_mean, join_path
from .io import read_mapping, write_yaml_atomic
from .model import ModelSpec
from .schema import is_missing, load_dataclass, to_plain


MAX_GLOBAL_BATCH = 65536
"""Samples per optimizer step accepted in a plan (or asked of the planner): schedules are simulated
per micro-batch, and a count of tokens given by mistake would otherwise run for hours."""


def global_batch_problem(global_batch_size: int) -> tuple[str, str] | None:
    """``(message, fix)`` when a global batch size is out of range (plan files and the planner)."""
    if global_batch_size < 1:
        return f"must be >= 1, got {global_batch_size}", "the number of samples (sequences) per optimizer step"
    if global_batch_size > MAX_GLOBAL_BATCH:
        return (f"{global_batch_size:,} samples per step is more than {MAX_GLOBAL_BATCH:,} (the schedule is "
                f"simulated micro-batch by micro-batch)", "give it in samples (sequences), not tokens")
    return None


@dataclass(frozen=True)
class Stage:
    """A contiguous range of transformer blocks on ``tp`` devices of one group."""

    # --- where it runs and what ---
    group: str
    """The cluster group whose devices run this stage."""
    layers: tuple[int, int]
    """[start, end) over transformer blocks; the embedding rides on the first stage, final norm and LM head
    on the last."""
    tp: int = 1
    """Tensor-parallel degree inside one node: the stage's devices (1: none; else a divisor of the head count)."""

    def _check(self, path: str, problems: Problems) -> None:
        bad = layer_range_problem(*self.layers)
        if bad:
            problems.add(join_path(path, "layers"), *bad)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


def layer_range_problem(start: int, end: int, num_layers: int | None = None) -> tuple[str, str] | None:
    """``(message, fix)`` when a stage's ``[start, end)`` is not a range of the model's blocks on its own
    (without a model: only its start and order are checked)."""
    if start < 0:
        return f"[{start}, {end}]: the start must be >= 0", "transformer blocks are counted from 0"
    if end <= start:
        return f"[{start}, {end}] is empty or reversed", "layers are [start, end) with end > start"
    if num_layers is not None and end > num_layers:
        return (f"[{start}, {end}] runs to layer {end} but the model has only {num_layers} layers",
                f"end this stage at {num_layers} or before")
    return None


@dataclass(frozen=True)
class Pipeline:
    """``replicas`` identical copies of one pipeline shape."""

    # --- its share of the batch, its shape ---
    micro_batches: int
    """Micro-batches per replica per iteration, >= 1."""
    stages: list[Stage]
    """The stages in model order, at least one (interleaved plans: virtual stages, see :class:`Plan`)."""
    replicas: int = 1
    """Identical copies of this pipeline (data-parallel replicas of one shape)."""
    micro_batch_size: int | None = None
    """Samples per micro-batch of this pipeline; None: the plan's ``micro_batch_size``."""

    def _check(self, path: str, problems: Problems) -> None:
        if self.replicas < 1:
            problems.add(join_path(path, "replicas"), f"must be >= 1, got {self.replicas}",
                         "the number of identical copies of this pipeline: 1 or more (drop the pipeline to use none)")
        if self.micro_batches < 1:
            problems.add(join_path(path, "micro_batches"), f"must be >= 1, got {self.micro_batches}",
                         "micro-batches per replica per iteration: 1 or more")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            problems.add(join_path(path, "micro_batch_size"), f"must be >= 1, got {self.micro_batch_size}",
                         "samples per micro-batch: 1 or more, or drop it to use the plan's micro_batch_size")
        if not self.stages:
            problems.add(join_path(path, "stages"), "a pipeline needs at least one stage", "add a stage")
        for i, s in enumerate(self.stages):
            if s.tp < 1:
                problems.add(join_path(join_path(join_path(path, "stages"), i), "tp"), f"must be >= 1, got {s.tp}",
                             "the tensor-parallel degree: 1 for none, else a divisor of the head count")

    @property
    def devices_per_replica(self) -> int:
        return sum(s.tp for s in self.stages)


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism (MoE models): the routed experts of every MoE layer spread over groups of
    ``degree`` data-parallel ranks that hold that layer, taken in order (pipelines, then replicas);
    each rank of a group holds ``experts[i]`` of them (uneven by device speed; default even)."""

    degree: int
    """Data-parallel ranks that share one copy of the experts (1: every rank holds every expert)."""
    experts: list[int] | None = None
    """Routed experts per rank of a group, in group order, summing to ``moe.num_experts``; absent: even."""

    def _check(self, path: str, problems: Problems) -> None:
        if self.degree < 1:
            problems.add(join_path(path, "degree"), f"must be >= 1, got {self.degree}",
                         "data-parallel ranks that share the experts, e.g. 2")
        elif self.experts is not None:
            if len(self.experts) != self.degree:
                problems.add(join_path(path, "experts"), f"lists {len(self.experts)} count(s) for degree {self.degree}",
                             f"give one expert count per rank of a group ({self.degree}), or drop 'experts' for an even split")
            bad = [n for n in self.experts if n < 0]
            if bad:
                problems.add(join_path(path, "experts"), f"counts must be >= 0, got {bad}",
                             "give each rank the number of routed experts it holds")

    def counts(self, num_experts: int) -> tuple[int, ...]:
        """Each rank of a group's routed experts (the even split where ``experts`` is absent)."""
        return tuple(self.experts) if self.experts is not None else (num_experts // self.degree,) * self.degree

    def slot(self, plan: Plan, pipeline: int, replica: int) -> int:
        """The place in its group of data-parallel rank ``(pipeline, replica)`` (pipelines, then replicas)."""
        return (sum(p.replicas for p in plan.pipelines[:pipeline]) + replica) % self.degree


@dataclass(frozen=True)
class Plan:
    """How the model is split: pipelines x replicas x stages, batch sizes, schedule, memory options."""

    _file_kind = "plan"   # a class attribute, not a field: names model / cluster fields given here

    # --- batch ---
    global_batch_size: int
    """Samples (sequences, not tokens) per optimizer step, 1 to :data:`MAX_GLOBAL_BATCH`; the pipelines'
    samples per iteration add up to it."""
    micro_batch_size: int
    """Samples per micro-batch, for every pipeline that does not set its own."""

    # --- data-parallel pipelines ---
    pipelines: list[Pipeline]
    """At least one pipeline; pipelines may differ in shape, micro-batch count and size."""

    # --- schedule and memory ---
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """The pipeline schedule every pipeline runs (docs/parallelism.md)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none; selective (the attention core); full (whole layers)."""
    zero_stage: Literal[0, 1, 2] = 0
    """0, 1 or 2: shard AdamW state (and, at 2, gradients) over the ranks that hold each parameter."""
    interleave: int = 2
    """Interleaved schedule only: model chunks per device. Stages are listed as virtual stages in
    order; stage i runs on the same devices as stage i + len(stages)/interleave."""
    expert_parallel: ExpertParallel | None = None
    """MoE models only: how the routed experts spread over data-parallel ranks (absent: every rank holds all)."""

    def _check(self, path: str, problems: Problems) -> None:
        bad_batch = global_batch_problem(self.global_batch_size)
        if bad_batch:
            problems.add("global_batch_size", *bad_batch)
        if self.micro_batch_size < 1:
            problems.add("micro_batch_size", f"must be >= 1, got {self.micro_batch_size}",
                         "samples per micro-batch: 1 or more")
        if self.interleave < 1:
            problems.add("interleave", f"must be >= 1, got {self.interleave}",
                         "model chunks per device of the interleaved schedule: 2 or more")
        if not self.pipelines:
            problems.add("pipelines", "a plan needs at least one pipeline", "add a pipeline")

    def mbs(self, pipeline: Pipeline) -> int:
        """Micro-batch size of ``pipeline`` (its override or the plan default)."""
        return pipeline.micro_batch_size or self.micro_batch_size

    def samples(self, pipeline: Pipeline) -> int:
        """Samples per iteration of all replicas of ``pipeline``."""
        return pipeline.replicas * pipeline.micro_batches * self.mbs(pipeline)

    def virtual_chunks(self, pipeline: Pipeline) -> int:
        return self.interleave if self.schedule == "interleaved" else 1

    def physical_stages(self, pipeline: Pipeline) -> list[Stage]:
        """The stages that own devices (for interleaved: the first 1/interleave of the list)."""
        v = self.virtual_chunks(pipeline)
        return list(pipeline.stages[: max(1, len(pipeline.stages) // v)])

    def devices_by_group(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for p in self.pipelines:
            for s in self.physical_stages(p):
                used[s.group] = used.get(s.group, 0) + p.replicas * s.tp
        return used

    def to_dict(self) -> dict:
        out = to_plain(self)
        if self.schedule != "interleaved":
            out.pop("interleave", None)
        for p in out["pipelines"]:
            for s in p["stages"]:
                s["layers"] = list(s["layers"])
        return out

    def save(self, path, header: str = "") -> None:
        write_yaml_atomic(path, self.to_dict(), header)

    def one_line(self) -> str:
        """``2x(a100[tp4,L0:20] | mi250[tp8,L20:32]) 8 mb + ...``: a compact description (layers
        half-open, as in the file; micro-batches per replica)."""
        parts = []
        for p in self.pipelines:
            stages = " | ".join(f"{s.group}[tp{s.tp},L{s.layers[0]}:{s.layers[1]}]" for s in p.stages)
            parts.append(f"{p.replicas}x({stages}) {p.micro_batches} mb")
        return " + ".join(parts)


def batch_sum_problem(plan: Plan) -> tuple[str, str] | None:
    """``(message, fix)`` when replicas x micro_batches x micro_batch_size summed over the pipelines
    is not the global batch size, else None."""
    total = sum(plan.samples(p) for p in plan.pipelines)
    if total == plan.global_batch_size:
        return None
    terms = " + ".join(f"{p.replicas}x{p.micro_batches}x{plan.mbs(p)}" for p in plan.pipelines)
    return (f"replicas x micro_batches x micro_batch_size summed over pipelines is {terms} = {total}, "
            f"not global_batch_size={plan.global_batch_size}",
            "change micro_batches or the global batch size so they agree")


def load_plan(path_or_dict, cluster: Cluster | None = None, model: ModelSpec | None = None,
              source: str | None = None) -> Plan:
    """Load a plan and check the rules it can break on its own (stage ranges, batch arithmetic);
    with ``cluster`` and ``model`` also check it against them (all rules)."""
    data, source = read_mapping(path_or_dict, "plan", source)
    problems = Problems(source=source)
    plan = load_dataclass(Plan, data, "", problems)
    if not is_missing(plan) and not problems.blocking():   # fields fine on their own: the rules across them
        if cluster is not None and model is not None:
            try:   # every rule, the batch arithmetic among them, reported together
                check_plan(plan, cluster, model, source)
            except SpecError as e:
                problems.items.extend(e.problems)
        else:   # the batch arithmetic needs no cluster or model: checked on the plan alone
            bad_sum = batch_sum_problem(plan)
            if bad_sum:
                problems.add("global_batch_size", *bad_sum)
        if "interleave" in data and plan.schedule != "interleaved":
            # the other schedules run one model chunk per device: the number would be silently ignored
            problems.add("interleave", f"only the interleaved schedule uses it, and schedule is '{plan.schedule}'",
                         "set 'schedule: interleaved' to run model chunks interleaved, or drop 'interleave'")
    problems.raise_if_any()
    assert not is_missing(plan)
    return plan


def check_plan(plan: Plan, cluster: Cluster, model: ModelSpec, source: str = "<plan>") -> None:
    """Raise SpecError listing every rule of docs/formats.md that ``plan`` breaks for this cluster/model."""
    problems = Problems(source=source)
    names = set(cluster.group_names)
    _model_rules(plan, model, problems, skip=lambda s: s.group not in names)
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            if s.group not in names:
                problems.add(_stage_path(pi, si, "group"), f"unknown group '{s.group}'",
                             did_you_mean(s.group, cluster.group_names))
                continue
            g = cluster.group(s.group)
            if s.tp > g.devices_per_node and not spans_whole_nodes(s.tp, g):
                problems.add(_stage_path(pi, si, "tp"),
                             f"tp={s.tp} exceeds the {g.devices_per_node} devices of one node of group '{g.name}' "
                             f"and is not a whole number of its {g.nodes} node(s)",
                             "tensor parallelism stays inside a node or spans whole nodes: lower tp, use "
                             "pipeline stages, or a multiple of devices_per_node")
        if plan.schedule == "interleaved":
            _check_interleave(plan, p, join_path("pipelines", pi), problems, cluster)
    _check_capacity(plan, cluster, problems)
    bad_sum = batch_sum_problem(plan)
    if bad_sum:
        problems.add("global_batch_size", *bad_sum)
    # the model's dtype on the devices the plan uses (named in the cluster file, where the fix goes)
    problems.items.extend(model_problems(cluster, model, {s.group for p in plan.pipelines for s in p.stages}))
    problems.raise_if_any()


def spans_whole_nodes(tp: int, group) -> bool:
    """A tp group larger than a node that takes whole nodes of ``group`` (Megatron runs tp 16 over
    two 8-device nodes): predicted and validated, its collectives over the inter-node links; the
    runtime and the planner keep tp inside a node."""
    per = group.devices_per_node
    return tp > per and tp % per == 0 and tp // per <= group.nodes


def cross_node_tp(plan: Plan, cluster: Cluster) -> list[tuple[int, int, int, int]]:
    """``(pipeline, stage, tp, nodes)`` of every stage whose tp group spans several whole nodes."""
    out = []
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            if s.group in cluster.group_names and spans_whole_nodes(s.tp, cluster.group(s.group)):
                out.append((pi, si, s.tp, s.tp // cluster.group(s.group).devices_per_node))
    return out


def _stage_path(pipeline: int, stage: int, field: str) -> str:
    """``pipelines[i].stages[j].field``, built only where a problem is reported (a plan is checked
    on every prediction)."""
    return join_path(join_path(join_path(join_path("pipelines", pipeline), "stages"), stage), field)


def check_plan_model(plan: Plan, model: ModelSpec, source: str = "<plan>") -> None:
    """Raise SpecError listing the rules ``plan`` breaks for ``model`` alone, without a cluster:
    stages cover the model's layers, and every tp divides the head counts."""
    problems = Problems(source=source)
    _model_rules(plan, model, problems)
    problems.raise_if_any()


def _expert_rules(plan: Plan, model: ModelSpec, problems: Problems) -> None:
    """``expert_parallel`` against the model's ``moe`` block and the plan's data-parallel ranks."""
    ep = plan.expert_parallel
    if ep is None or ep.degree < 1:
        return
    if model.moe is None:
        problems.add("expert_parallel", f"model '{model.name}' has no moe block, so it has no experts to spread",
                     "drop expert_parallel, or use a model file with a moe block")
        return
    n = model.moe.num_experts
    if ep.experts is None and n % ep.degree:
        problems.add("expert_parallel.degree", f"{n} experts do not split evenly over degree {ep.degree}",
                     f"give 'experts' (one count per rank, summing to {n}) or a degree that divides {n}")
    elif ep.experts is not None and len(ep.experts) == ep.degree and sum(ep.experts) != n:
        problems.add("expert_parallel.experts", f"counts sum to {sum(ep.experts)}, not moe.num_experts={n}",
                     f"give counts that add up to {n}")
    ranks = [(pi, p.micro_batches, plan.mbs(p), tuple(tuple(s.layers) for s in p.stages))
             for pi, p in enumerate(plan.pipelines) for _ in range(p.replicas)]
    if len(ranks) % ep.degree:
        problems.add("expert_parallel.degree", f"the plan's {len(ranks)} data-parallel rank(s) (replicas over every "
                     f"pipeline) do not form groups of {ep.degree}", f"use a degree that divides {len(ranks)}")
        return
    for start in range(0, len(ranks), ep.degree):   # the all-to-all pairs the members' micro-batches
        group = ranks[start:start + ep.degree]
        pis = sorted({r[0] for r in group})
        if len({(m, b) for _, m, b, _ in group}) > 1:
            problems.add("expert_parallel", f"pipelines {pis} share experts but run different micro-batches "
                         f"({', '.join(f'{m} of {b}' for _, m, b, _ in group)}): each MoE layer's all-to-all needs "
                         "every rank of a group at every micro-batch",
                         "give the pipelines of a group the same micro_batches and micro_batch_size, or a degree "
                         "whose groups stay inside pipelines that do")
            break
        if len({r[3] for r in group}) > 1:
            problems.add("expert_parallel", f"pipelines {pis} share experts but split the layers differently: "
                         "each MoE layer's exchange is between the ranks holding it, the same stage of each",
                         "give the pipelines of a group the same stage layer ranges, or a degree whose groups "
                         "stay inside pipelines that do")
            break


def _model_rules(plan: Plan, model: ModelSpec, problems: Problems, skip=lambda s: False) -> None:
    """The rules between a plan and a model (``skip``: stages judged otherwise, e.g. of an unknown group)."""
    _expert_rules(plan, model, problems)
    heads, kv = model.num_attention_heads, model.num_kv_heads
    for pi, p in enumerate(plan.pipelines):
        _check_coverage(p.stages, model.num_layers, join_path(join_path("pipelines", pi), "stages"), problems)
        for si, s in enumerate(p.stages):
            if not skip(s) and (heads % s.tp or kv % s.tp):
                problems.add(_stage_path(pi, si, "tp"),
                             f"tp={s.tp} does not divide num_attention_heads={heads}"
                             + (f" and num_kv_heads={kv}" if kv != heads else ""),
                             f"use a tp that divides {kv if kv != heads else heads}")


def _check_coverage(stages, num_layers: int, path: str, problems: Problems) -> None:
    """Each stage a range of the model's blocks, and together [0, num_layers) without gap or overlap
    (gaps and overlaps are judged only once every range is valid on its own)."""
    bad = [(si, layer_range_problem(*s.layers, num_layers)) for si, s in enumerate(stages)]
    for si, problem in bad:
        if problem:
            problems.add(join_path(join_path(path, si), "layers"), *problem)
    if any(problem for _, problem in bad):
        return
    expected = 0
    for si, s in enumerate(stages):
        start, end = s.layers
        if start != expected:
            lpath = join_path(join_path(path, si), "layers")
        if start > expected:
            problems.add(lpath, f"starts at {start} but the previous stage ends at {expected}: "
                                f"layers {expected}..{start - 1} are in no stage", f"start this stage at {expected}")
        elif start < expected:
            problems.add(lpath, f"starts at {start} but layers up to {expected - 1} are already in an earlier stage "
                                f"(overlap)", f"start this stage at {expected}")
        expected = max(expected, end)
    if stages and expected < num_layers:
        last = join_path(join_path(path, len(stages) - 1), "layers")
        problems.add(last, f"stages end at layer {expected} but the model has {num_layers} layers: "
                           f"layers {expected}..{num_layers - 1} are in no stage", f"end the last stage at {num_layers}")


def _check_interleave(plan: Plan, p: Pipeline, path: str, problems: Problems, cluster: Cluster) -> None:
    """Virtual stages map onto physical ones; interleaving needs two physical stages, and over
    exactly two that share one vendor, a library that keeps message tags (Gloo; not NCCL/RCCL or
    HCCL): three or more physical stages, or two of different vendors, interleave on any library."""
    v, n = plan.interleave, len(p.stages)
    spath = join_path(path, "stages")
    if n % v:
        problems.add(spath, f"{n} virtual stages are not a multiple of interleave={v}",
                     f"list a multiple of {v} stages, or change interleave")
        return
    per, mismatched = n // v, False
    for i in range(per, n):
        a, b = p.stages[i % per], p.stages[i]
        if (a.group, a.tp) != (b.group, b.tp):
            mismatched = True
            problems.add(join_path(spath, i),
                         f"virtual stage {i} runs on the devices of stage {i % per} ({a.group}, tp {a.tp}) "
                         f"but names ({b.group}, tp {b.tp})", "give both the same group and tp")
    if mismatched:
        return
    if v > 1 and per < 2:
        problems.add(spath, "schedule interleaved needs at least 2 physical stages to interleave over, "
                            "this pipeline has 1", f"use schedule 1f1b, or list {2 * v} or more stages")
        return
    # Over exactly two physical stages the same two ranks carry activations (the wrap-around) and
    # gradients in both directions, in orders that differ; the runtime keeps them apart by tag.
    # NCCL / HCCL ignore tags, so an activation could be taken for a gradient of the same shape.
    if v > 1 and per == 2 and all(s.group in cluster.group_names for s in p.stages[:2]):
        vendors = {cluster.vendor(s.group) for s in p.stages[:2]}
        library = library_of(next(iter(vendors))) if len(vendors) == 1 else None
        if library in TAGLESS_P2P:
            problems.add(spath, f"schedule interleaved over 2 physical stages of one {library.upper()} vendor "
                                f"({', '.join(sorted(vendors))}) would mix activations and gradients: "
                                f"{library.upper()} send/recv ignore the tags that keep them apart",
                         "interleave over 3 or more physical stages, or use schedule 1f1b")


def _check_capacity(plan: Plan, cluster: Cluster, problems: Problems) -> None:
    """Devices per group, and whether every stage's tp block fits inside one node (first-fit)."""
    blocks: dict[str, list[int]] = {}
    names = set(cluster.group_names)
    for p in plan.pipelines:
        for s in plan.physical_stages(p):
            if s.group in names:
                blocks.setdefault(s.group, []).extend([s.tp] * p.replicas)
    for name, tps in blocks.items():
        g = cluster.group(name)
        used = sum(tps)
        whole = sum(t // g.devices_per_node for t in tps if spans_whole_nodes(t, g))   # nodes they take
        tps = [t for t in tps if not spans_whole_nodes(t, g)]
        if used > g.num_devices:
            problems.add("pipelines", f"group '{name}' has {g.num_devices} devices "
                                      f"({g.nodes} nodes x {g.devices_per_node}) but the plan uses {used} "
                                      f"(sum over pipelines of replicas x tp per stage)",
                         "use fewer replicas or smaller tp in that group, or add nodes")
        elif whole > g.nodes or pack_blocks(tps, g.nodes - whole, g.devices_per_node) is None:
            problems.add("pipelines", f"the tp blocks {sorted(tps, reverse=True)} of group '{name}' do not fit "
                                      f"into {g.nodes} nodes of {g.devices_per_node} devices (a tp group stays inside one node)",
                         "use tp degrees that divide devices_per_node")


def pack_blocks(sizes: list[int], nodes: int, per_node: int) -> list[int] | None:
    """First-fit decreasing of tp blocks into nodes: node index of each block (input order), or None."""
    free = [per_node] * nodes
    where = [0] * len(sizes)
    for idx in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for n in range(nodes):
            if free[n] >= sizes[idx]:
                free[n] -= sizes[idx]
                where[idx] = n
                break
        else:
            return None
    return where


__all__ = ["Plan", "Pipeline", "Stage", "load_plan", "check_plan", "batch_sum_problem", "pack_blocks", "SpecError"]
