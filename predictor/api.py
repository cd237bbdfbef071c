"""``predict(cluster, model, plan)``: iteration time, throughput, MFU and memory of a plan.

One step as the hetero runtime runs it (hetero/runtime/engine.py), per device (a physical stage of
a pipeline; the replicas of a pipeline run alike):
1. the simulated pipeline schedule of one replica (:mod:`.schedule`); the device is done when its
   own last op has ended and its last sends have arrived (it waits for them), not when its
   pipeline is;
2. the data-parallel gradient sync: the device's buckets (parameters with one holder set, in an
   order all ranks share) one after another, each an all-reduce that starts when the last of its
   holders -- replicas, and stages of other pipelines holding the same layers -- gets to it
   (:meth:`.placement.SyncPlan.spans`; costs and NIC sharing per the placement). Overlapped with
   the backward as the runtime runs it: a bucket may start as early as its holders' last backward
   pass does, and only its tail (the last 25 MB bucket, the embeddings) waits for the end of the
   backward; ZeRO's parameter all-gather after the optimizer runs under the next step's first
   forwards (:func:`first_forward_floors`; across vendors, and without overlap, it stays in the
   sync), moving bf16 values for a bf16 model (half the fp32 reduce-scatter's bytes,
   :func:`.memory.gathers_in_bf16`); ``dp_sync_exposed_s`` is what remains after the schedule, plus what the all-gather adds to it;
3. the all-reduce of the squared gradient norm over every rank: no optimizer starts before the
   last device has synced;
4. the optimizer step (memory-bound Adam), all devices from that moment, the slowest last;
5. the calibration's per-iteration overhead (largest over the groups used); on a cluster emulated
   by CPU processes of this machine, also the step's two world all-reduces of a few numbers (the
   gradient norm's and the step's results) at the small all-reduce's cost the profile measured
   (:mod:`hetero.measure.loopback`), which also floors every point-to-point hand-over.

Iteration time = (end of the last device's sync) + (slowest optimizer step) + overhead; the trace of
``timeline=True`` is drawn from the same numbers and ends at the iteration time.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from hetero.specs.plan import check_plan
from hetero.specs.units import plural

from . import moe as _moe
from .allocator import reserved_bytes, simulated_caching_bytes
from .costs import StageCostModel
from .memory import forwards_precede_backwards, held_bytes_per_microbatch, held_peak, in_flight_microbatches
from .ops import model_flops_per_token
from .schedule import pipeline_ends, simulate


@dataclass
class StagePrediction:
    """One (virtual) stage of one pipeline: times per micro-batch, memory per device."""

    group: str
    tp: int
    layers: tuple[int, int]
    forward_time_s: float
    """One micro-batch, one replica: compute plus the stage's TP communication."""
    backward_time_s: float
    """Including recomputation."""
    peak_memory_bytes: int
    memory_capacity_bytes: int
    # --- extras (not in the docs/formats.md JSON unless to_dict(extra=True)) ---
    memory_breakdown: object = None
    """A ``MemoryBreakdown``: weights, gradients, optimizer, activations, overhead."""
    allocator: str | None = None
    """The allocator fit is judged by (``caching`` | ``planned``; None: the live peak)."""
    reserved_memory_bytes: int | None = None
    """What that allocator reserves for the peak (:mod:`hetero.predictor.allocator`)."""
    in_flight_microbatches: float = 1.0
    dp_sync_time_s: float = 0.0
    optimizer_time_s: float = 0.0
    p2p_time_s: float = 0.0
    """Sending one micro-batch to the next stage (0 for the last)."""
    layer_dispatch_s: float = 0.0
    """Host time to issue one layer's kernels (forward + backward, one micro-batch)."""
    layer_device_s: float = 0.0
    """Device time of those kernels; below ``layer_dispatch_s`` the stage is launch-bound."""
    schedule_end_s: float = 0.0
    """When this stage's device is done with the pipeline schedule (its last op ended, its last
    sends arrived), from the start of the iteration (virtual stages: their device's)."""
    dp_sync_start_s: float = 0.0
    """When its first gradient all-reduce starts (no earlier than that bucket's last holder)."""
    dp_sync_end_s: float = 0.0
    """When its gradient sync ends; then it waits for the gradient-norm all-reduce over every rank."""
    dp_sync_exposed_s: float = 0.0
    """Of its gradient sync, the seconds after its schedule is done (what the backward did not hide,
    waits for peers included), plus :attr:`param_gather_exposed_s`."""
    dp_sync_in_step_s: float = 0.0
    """Of :attr:`dp_sync_time_s`, what the step's sync lasts at least from its start: less the ZeRO
    parameter all-gathers left to the next forward (its own, and others' on the NICs it shares)."""
    param_gather_s: float = 0.0
    """ZeRO with overlap: seconds of its parameter all-gathers, left from the previous step and run
    from the start of this one under its first forwards (0: gathered in the sync)."""
    param_gather_exposed_s: float = 0.0
    """By how much the step's gathers delay the device's end of the schedule: its first forwards wait
    for its own, and for activations that its pipeline's earlier stages delayed waiting for theirs."""

    @property
    def launch_bound(self) -> bool:
        """Whether the host's kernel dispatch, not the device, paces this stage's layers."""
        return self.layer_dispatch_s > self.layer_device_s > 0

    @property
    def fits(self) -> bool:
        """Whether the predicted peak (with an :attr:`allocator`: what it reserves) fits the device's memory."""
        return self.needed_bytes <= self.memory_capacity_bytes

    @property
    def needed_bytes(self) -> int:
        """The bytes fit is judged by: the allocator's reservation, or the live peak without one."""
        return self.peak_memory_bytes if self.reserved_memory_bytes is None else self.reserved_memory_bytes

    @property
    def memory_shortfall_bytes(self) -> int:
        """Bytes over capacity (0 when it fits)."""
        return max(0, self.needed_bytes - self.memory_capacity_bytes)

    def to_dict(self, extra: bool = False) -> dict:
        """The stage JSON of docs/formats.md; ``extra`` adds the memory breakdown and per-stage times."""
        out = {"group": self.group, "tp": self.tp, "layers": list(self.layers),
               "forward_time_s": self.forward_time_s, "backward_time_s": self.backward_time_s,
               "peak_memory_bytes": self.peak_memory_bytes, "memory_capacity_bytes": self.memory_capacity_bytes}
        if self.allocator is not None:
            out.update(allocator=self.allocator, reserved_memory_bytes=self.reserved_memory_bytes)
        if extra:
            out.update(memory=self.memory_breakdown.to_dict() if self.memory_breakdown else {}, in_flight_microbatches=self.in_flight_microbatches,
                       dp_sync_time_s=self.dp_sync_time_s, optimizer_time_s=self.optimizer_time_s,
                       p2p_time_s=self.p2p_time_s, layer_dispatch_s=self.layer_dispatch_s,
                       layer_device_s=self.layer_device_s, launch_bound=self.launch_bound,
                       schedule_end_s=self.schedule_end_s, dp_sync_start_s=self.dp_sync_start_s,
                       dp_sync_end_s=self.dp_sync_end_s, dp_sync_exposed_s=self.dp_sync_exposed_s,
                       dp_sync_in_step_s=self.dp_sync_in_step_s, param_gather_s=self.param_gather_s,
                       param_gather_exposed_s=self.param_gather_exposed_s)
        return out


@dataclass
class PipelinePrediction:
    """One pipeline shape of the plan: its replicas, micro-batches and stages."""

    replicas: int
    micro_batches: int
    stages: list[StagePrediction]
    micro_batch_size: int = 1
    pipeline_time_s: float = 0.0
    """Schedule time of one replica's micro-batches (bubbles included; no DP sync / optimizer)."""

    def to_dict(self, extra: bool = False) -> dict:
        """The pipeline JSON of docs/formats.md; ``extra`` adds the micro-batch size and schedule time."""
        out = {"replicas": self.replicas, "micro_batches": self.micro_batches,
               "stages": [s.to_dict(extra) for s in self.stages]}
        if extra:
            out.update(micro_batch_size=self.micro_batch_size, pipeline_time_s=self.pipeline_time_s)
        return out


@dataclass
class Prediction:
    """What :func:`predict` returns: one training iteration of a plan (see the module docstring)."""

    iteration_time_s: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    fits_memory: bool
    pipelines: list[PipelinePrediction]
    upper_bound_tokens_per_s: float | None = None
    # --- extras ---
    dp_sync_time_s: float = 0.0
    """From the end of the slowest pipeline's schedule to the optimizer steps: the gradient sync on
    the critical path (waits for the last holders included), so that iteration = slowest pipeline
    + this + ``optimizer_time_s`` + ``overhead_time_s``."""
    optimizer_time_s: float = 0.0
    """The slowest device's optimizer step (all start together, after the gradient-norm all-reduce)."""
    overhead_time_s: float = 0.0
    bottleneck: tuple[int, int] = (0, 0)
    """(pipeline, stage) of the stage that limits the slowest pipeline (most busy time)."""
    provenance: dict = field(default_factory=dict)
    """Per device type: {device, groups, source: catalog|cluster file|profile|calibration, op_model}."""
    events: list | None = field(default=None, repr=False)
    """Chrome-trace events when predicted with ``timeline=True``."""
    objectives: dict | None = field(default=None, repr=False)
    """``{throughput, cost, memory_headroom, energy}`` (:mod:`.objectives`) where the caller asked
    for them (``hetero.predict`` and ``hetero predict --json`` do); not in :meth:`to_dict`."""

    def to_dict(self, extra: bool = False) -> dict:
        """The Prediction JSON of docs/formats.md (exactly those keys); ``extra`` adds the breakdown."""
        out = {"iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s,
               "samples_per_s": self.samples_per_s, "mfu": self.mfu, "fits_memory": self.fits_memory,
               "upper_bound_tokens_per_s": self.upper_bound_tokens_per_s,
               "pipelines": [p.to_dict(extra) for p in self.pipelines]}
        if extra:
            out.update(dp_sync_time_s=self.dp_sync_time_s, optimizer_time_s=self.optimizer_time_s,
                       overhead_time_s=self.overhead_time_s, bottleneck=list(self.bottleneck),
                       provenance=self.provenance)
        return out

    def stage(self, pipeline: int, stage: int) -> StagePrediction:
        """The prediction of ``stage`` of ``pipeline``."""
        return self.pipelines[pipeline].stages[stage]

    def memory_shortfalls(self) -> list[tuple[int, int, StagePrediction]]:
        """(pipeline, stage, prediction) of every stage that does not fit."""
        return [(pi, si, s) for pi, p in enumerate(self.pipelines) for si, s in enumerate(p.stages) if not s.fits]

    def launch_bound_stages(self) -> list[tuple[StagePrediction, int]]:
        """(stage, micro-batch size) of the launch-bound stages, one per (group, tp, micro-batch
        size): where the host's kernel dispatch, not the device, paces the layers."""
        out, seen = [], set()
        for p in self.pipelines:
            for s in p.stages:
                key = (s.group, s.tp, p.micro_batch_size)
                if s.launch_bound and key not in seen:
                    seen.add(key)
                    out.append((s, p.micro_batch_size))
        return out

    def timeline(self) -> dict:
        """Chrome / Perfetto trace: ``{"traceEvents": [...]}`` (needs ``timeline=True``)."""
        return {"traceEvents": list(self.events or []), "displayTimeUnit": "ms"}


# A few recent cost models, so repeated predict() calls on the same inputs share warm caches.
_RECENT: list[tuple] = []


def cost_model_for(cluster, model, calibration=None, allocator: str | None = None) -> StageCostModel:
    """The memoised StageCostModel for these very objects (identity) and ``allocator``, created on
    first use and rebuilt when a device's operator-time source changed (a profile cached meanwhile)."""
    for i, (c, m, cal, cm) in enumerate(_RECENT):
        if c is cluster and m is model and cal is calibration and cm.allocator == allocator:
            if not cm.sources_changed():
                return cm
            del _RECENT[i]
            break
    cm = StageCostModel(cluster, model, calibration, allocator)
    _RECENT.insert(0, (cluster, model, calibration, cm))
    del _RECENT[4:]
    return cm


def _reserved(allocator, br, replay: bool, model, plan, pipeline: int, stage: int) -> int | None:
    """What ``allocator`` reserves for a stage whose predicted peak is ``br``: for ``caching`` (with
    ``replay``) the replay of the stage's requests plus the framework overhead, else the fitted ratio."""
    if allocator is None:
        return None
    if allocator == "caching" and replay:
        tensors = simulated_caching_bytes(model, plan, pipeline, stage)
        if tensors is not None:
            return int(tensors + br.overhead)
    return int(reserved_bytes(allocator, br))


def _moe_layers(model, layers) -> int:
    """MoE layers in ``[start, end)`` (0 for a dense model)."""
    if model.moe is None:
        return 0
    return sum(1 for layer in range(*layers) if model.is_moe_layer(layer))


def _with_experts(model, plan, pipeline: int, tp: int, mbs: int, in_flight: float, n_moe: int, br):
    """``(br, routed experts held)``: ``br`` with ``n_moe`` MoE layers' experts (this rank's share under expert parallelism), router and
    shared expert in place of their dense MLPs, and their activations at the worst routing skew
    (:mod:`.moe`)."""
    import dataclasses

    ep = plan.expert_parallel
    degree, experts = 1, model.moe.num_experts
    if ep is not None and ep.degree > 1:   # the most experts any replica of this pipeline holds
        degree = ep.degree
        counts = ep.counts(model.moe.num_experts)
        experts = max(counts[ep.slot(plan, pipeline, r)] for r in range(plan.pipelines[pipeline].replicas))
    states = n_moe * _moe.expert_state_bytes(model, experts, tp)
    acts = n_moe * in_flight * _moe.expert_activation_bytes(model, mbs * model.seq_length, degree, experts, tp)
    return dataclasses.replace(br, weights=br.weights + states / 4, gradients=br.gradients + states / 4,
                               optimizer=br.optimizer + states / 2,
                               activations=max(0.0, br.activations + acts)), experts


def predict(cluster, model, plan, calibration=None, *, cost_model: StageCostModel | None = None,
            timeline: bool = False, check: bool = True, placement: str = "packed",
            allocator: str | None = None, overlap: bool = True, replay: bool = True) -> Prediction:
    """Predict one training iteration of ``plan``; raises SpecError if the plan breaks a rule.

    ``placement``: how ranks map to nodes (:mod:`hetero.predictor.placement`): ``packed``, the
    hetero runtime's layout (default), or ``megatron``, Megatron's tp-dp-pp rank order (the
    runs of a run log). It decides which p2p transfers and gradient rings cross the network and
    how many share a node's NIC.

    ``allocator`` (``caching`` | ``planned``; default: ``cost_model``'s): fit is judged by the bytes
    that allocator reserves for each stage's peak (:mod:`hetero.predictor.allocator`) rather than
    the peak itself. ``overlap``: the runtime reduces gradient
    buckets under the backward (its default); False: after the schedule (``hetero launch --no-overlap``).
    ``replay``: with ``allocator="caching"``, each stage's reservation is the caching allocator's
    replay of the stage's own requests (:func:`.allocator.simulated_caching_bytes`); False: the
    fitted ratio (what the planner screens with: no recording per candidate)."""
    if check:
        check_plan(plan, cluster, model)
    cm = cost_model or cost_model_for(cluster, model, calibration, allocator)
    allocator = allocator if allocator is not None else cm.allocator
    recompute, zs = plan.recompute, plan.zero_stage
    replicas = sum(p.replicas for p in plan.pipelines)       # model copies: > 1, every layer is summed
    no_tp = all(s.tp == 1 for p in plan.pipelines for s in p.stages)
    # the gradient sync, the p2p links and ZeRO's sharding degree of each stage (None without ZeRO)
    sync, links, zero_dp = cm.plan_structure(plan, placement)
    ready: list[float] = []  # per physical stage, in (pipeline, stage) order: schedule done
    hide: list[float] = []   # ... the backward under which its first finished buckets are reduced
    sends_after: list[bool] = []   # ... it sends a gradient after its last backward (not a first stage)
    owners: list[tuple[StagePrediction, int]] = []  # each stage and the number of its device in ready
    gathered: list[float] = []   # ... its ZeRO parameter all-gathers under the first forwards (overlap)
    gather_exposed: list[float] = []   # ... by how much they delay its end of the schedule
    events: list | None = [] if timeline else None
    pipes: list[PipelinePrediction] = []
    slowest, slowest_t = 0, -1.0
    opt_max = 0.0
    moe_sync = 0.0   # an MoE model's expert gradients summed after the schedule (:func:`.moe.expert_sync_time`)
    for pi, p in enumerate(plan.pipelines):
        mbs = plan.mbs(p)
        v = plan.virtual_chunks(p)
        stages = p.stages
        V = len(stages)
        phys = max(1, V // v)
        fwd, bwd, p2p = [], [], []
        for k, s in enumerate(stages):
            f, b = cm.stage_times(s.group, s.tp, mbs, s.layers, recompute, k == 0, k == V - 1)
            n_moe = _moe_layers(model, s.layers)
            if n_moe:   # each MoE layer: its router, experts and all-to-alls in place of the dense MLP
                df, db = _moe.layer_delta(cm, plan, pi, s, mbs)
                f, b = f + n_moe * df, b + n_moe * db
            fwd.append(f)
            bwd.append(b)
            if k < V - 1:
                nxt = stages[k + 1]
                if phys == 1:
                    p2p.append(0.0)
                else:
                    same, streams = links[(pi, k)]
                    p2p.append(cm.p2p_time(s.group, nxt.group, mbs, same and s.group == nxt.group, streams,
                                           s.tp, nxt.tp))
        m = p.micro_batches
        base = len(ready)
        gathers = [sync.gathers[base + i] for i in range(phys)] if overlap else [0.0] * phys
        floors = first_forward_floors(stages, fwd, gathers) if any(gathers) else None
        ptime, dev_ready = pipeline_ends(plan.schedule, fwd, bwd, p2p, m, v, floors)
        dev_gather = [0.0] * len(dev_ready)
        if floors:   # what the gathers add to each device's schedule
            dev_gather = [a - b for a, b in zip(dev_ready, pipeline_ends(plan.schedule, fwd, bwd, p2p, m, v)[1])]
        if len(dev_ready) != phys:  # an unchecked plan whose interleaving cannot apply
            dev_ready = [max(dev_ready[i::phys]) for i in range(phys)]
            dev_gather = [max(dev_gather[i::phys]) for i in range(phys)]
        ready.extend(dev_ready)
        gather_exposed.extend(dev_gather)
        gathered.extend(gathers)
        # a device's last backward pass (its chunk 0's, interleaved): the gradients of its later
        # layers are final from its start, and reduced under the rest of it (hetero.runtime.overlap)
        hide.extend(bwd[i] if overlap else 0.0 for i in range(phys))
        sends_after.extend(i > 0 for i in range(phys))
        # memory and optimizer per physical stage (a device holds all its chunks)
        dev_layers = [0] * phys
        for k, s in enumerate(stages):
            dev_layers[k % phys] += s.num_layers
        stage_preds = []
        for k, s in enumerate(stages):
            i = k % phys
            first = i == 0
            last = i == (V - 1) % phys
            # held micro-batches at the peak; no gradient yet while the warm-up holds every forward
            inflight, grads_while_held = _order_facts(plan.schedule, i, phys, m, v)
            if v > 1 and phys > 1:   # chunks of different sizes: weigh each by its activations
                inflight = _weighted_in_flight(cm.model, stages, i, phys, plan.schedule, m, v, mbs, recompute)
            dp = zero_dp[pi][i] if zero_dp else p.replicas
            br, peak_bytes, capacity, opt, (dispatch, device) = cm.stage_summary(
                s.group, s.tp, mbs, dev_layers[i], recompute, zs, dp, inflight, first, last, grads_while_held,
                replicas, no_tp, placement)
            n_moe = sum(_moe_layers(model, c.layers) for c in stages[i::phys])
            if n_moe:
                br, held = _with_experts(model, plan, pi, s.tp, mbs, inflight, n_moe, br)
                peak_bytes = int(br.total)
                moe_sync = max(moe_sync, _moe.expert_sync_time(cm, plan, n_moe, s.tp, held))
            if opt > opt_max:
                opt_max = opt
            stage_preds.append(StagePrediction(
                group=s.group, tp=s.tp, layers=tuple(s.layers), forward_time_s=fwd[k], backward_time_s=bwd[k],
                peak_memory_bytes=peak_bytes, memory_capacity_bytes=capacity,
                memory_breakdown=br, allocator=allocator,
                reserved_memory_bytes=_reserved(allocator, br, replay, cm.model, plan, pi, i), in_flight_microbatches=inflight, dp_sync_time_s=sync.totals[base + i],
                optimizer_time_s=opt, p2p_time_s=p2p[k] if k < V - 1 else 0.0,
                layer_dispatch_s=dispatch, layer_device_s=device))
            owners.append((stage_preds[-1], base + i))
        pipes.append(PipelinePrediction(replicas=p.replicas, micro_batches=m, stages=stage_preds,
                                        micro_batch_size=mbs, pipeline_time_s=ptime))
        if ptime > slowest_t:
            slowest, slowest_t = pi, ptime
    starts, ends = sync.spans(ready, hide if overlap else None, sends_after)
    synced = max(ends)
    for sp, i in owners:
        sp.schedule_end_s, sp.dp_sync_start_s, sp.dp_sync_end_s = ready[i], starts[i], ends[i]
        sp.param_gather_s, sp.param_gather_exposed_s = gathered[i], gather_exposed[i]
        sp.dp_sync_in_step_s = sync.in_step[i] if overlap else sync.totals[i]
        sp.dp_sync_exposed_s = ends[i] - ready[i] + gather_exposed[i]
    groups_used = {s.group for p in plan.pipelines for s in p.stages}
    overhead = max((cm.factors(g).iteration_overhead_s for g in groups_used), default=0.0)
    if cm.loopback and sum(plan.devices_by_group().values()) > 1:
        # a CPU-emulated cluster: the step's two world all-reduces of a few numbers (the gradient
        # norm's, then the results every rank reports) cost at least what the profile measured
        overhead += 2 * cm.loopback["allreduce_s"]
    it = synced + moe_sync + opt_max + overhead
    samples = plan.global_batch_size
    tokens = samples * model.seq_length
    peak = 0.0
    for p in plan.pipelines:
        for s in plan.physical_stages(p):
            peak += p.replicas * s.tp * cm.peak_flops(s.group)
    mfu = model_flops_per_token(model) * tokens / (it * peak) if it > 0 and peak > 0 else 0.0
    sp = pipes[slowest].stages
    m = pipes[slowest].micro_batches
    busy = [m * (s.forward_time_s + s.backward_time_s) for s in sp]
    bott = (slowest, max(range(len(busy)), key=busy.__getitem__))
    pred = Prediction(iteration_time_s=it, tokens_per_s=tokens / it if it > 0 else 0.0,
                      samples_per_s=samples / it if it > 0 else 0.0, mfu=mfu,
                      fits_memory=all(s.fits for p in pipes for s in p.stages), pipelines=pipes,
                      dp_sync_time_s=synced - slowest_t + moe_sync, optimizer_time_s=opt_max, overhead_time_s=overhead,
                      bottleneck=bott, provenance=cm.provenance())
    if timeline:
        pred.events = _trace(plan, pipes, synced, opt_max, overhead)
    return pred


@functools.lru_cache(maxsize=4096)
def _order_facts(schedule: str, i: int, phys: int, m: int, v: int) -> tuple[float, bool]:
    """(:func:`.memory.in_flight_microbatches`, whether device ``i`` holds gradients while its
    warm-up's activations are held: not :func:`.memory.forwards_precede_backwards`), memoised."""
    return in_flight_microbatches(schedule, i, phys, m, v), not forwards_precede_backwards(schedule, i, phys, m, v)


def first_forward_floors(stages, fwd, gathers) -> list[float]:
    """Per virtual stage, the earliest end of its forward of micro-batch 0 when its device's ZeRO
    parameter all-gathers (``gathers``, per physical stage, seconds from the start of the step) run
    under the first forwards, as the runtime runs them (:mod:`hetero.runtime.zero`): the buckets
    are gathered one after another in forward order (a device's chunks in turn), and a layer waits
    for its parameters when it is first used. So a chunk's first forward ends no earlier than its
    last bucket arrives plus the forward of one layer (its last)."""
    phys = len(gathers)
    floors = []
    for k, s in enumerate(stages):
        i = k % phys
        mine = [st.num_layers for st in stages[i::phys]]
        upto = sum(mine[:k // phys + 1])
        floors.append(gathers[i] * upto / max(1, sum(mine)) + fwd[k] / max(1, s.num_layers))
    return floors


def _weighted_in_flight(model, stages, i: int, phys: int, schedule: str, m: int, v: int, mbs: int,
                       recompute: str) -> float:
    """Interleaved: device ``i``'s peak of held activations (:func:`.memory.held_peak`, each chunk
    weighed by its layers' and its edge's bytes) in units of one micro-batch of all its chunks, the
    unit :func:`.memory.stage_memory` multiplies. Equal chunks give
    :func:`.memory.in_flight_microbatches`; a device whose early chunks are larger holds more."""
    V, s = len(stages), model.seq_length
    weights = []
    for k in range(i, V, phys):
        st = stages[k]
        weights.append(held_bytes_per_microbatch(model, mbs, s, st.tp, recompute, st.num_layers, k == 0, k == V - 1))
    total = sum(weights)
    if total <= 0:
        return in_flight_microbatches(schedule, i, phys, m, v)
    return held_peak(schedule, i, phys, m, v, tuple(weights)) / total


def _trace(plan, pipes, synced: float, opt_max: float, overhead: float) -> list[dict]:
    """Chrome trace events: pid = pipeline, tid = 2 x stage (compute) and 2 x stage + 1 (comm);
    pid = number of pipelines: the step's calibrated overhead. ``synced``: when the last device's
    gradient sync ends (the optimizers start)."""
    out: list[dict] = []
    us = 1e6
    for pi, (p, pp) in enumerate(zip(plan.pipelines, pipes)):
        v = plan.virtual_chunks(p)
        V = len(p.stages)
        phys = max(1, V // v)
        out.append({"ph": "M", "name": "process_name", "pid": pi, "tid": 0,
                    "args": {"name": f"pipeline {pi} ({plural(p.replicas, 'replica')}, "
                                                    f"{plural(p.micro_batches, 'micro-batch', 'micro-batches')})"}})
        for i in range(phys):
            s = p.stages[i]
            out.append({"ph": "M", "name": "thread_name", "pid": pi, "tid": 2 * i,
                        "args": {"name": f"stage {i} {s.group} tp{s.tp}"}})
            out.append({"ph": "M", "name": "thread_name", "pid": pi, "tid": 2 * i + 1,
                        "args": {"name": f"stage {i} comm"}})
        fwd = [s.forward_time_s for s in pp.stages]
        bwd = [s.backward_time_s for s in pp.stages]
        p2p = [s.p2p_time_s for s in pp.stages[:-1]]
        gathers = [s.param_gather_s for s in pp.stages[:phys]]
        floors = first_forward_floors(p.stages, fwd, gathers) if any(gathers) else None
        _, evs = simulate(plan.schedule, fwd, bwd, p2p, p.micro_batches, v, trace=True, floors=floors)
        for d, kind, j, vs, start, end, ready in evs:
            name = f"{kind}{j}" + (f".c{vs // phys}" if v > 1 else "")
            out.append({"ph": "X", "name": name, "cat": "forward" if kind == "F" else "backward",
                        "pid": pi, "tid": 2 * d, "ts": start * us, "dur": (end - start) * us,
                        "args": {"micro_batch": j, "virtual_stage": vs}})
            if ready is not None:
                src = vs - 1 if kind == "F" else vs + 1
                c = p2p[min(vs, src)]
                out.append({"ph": "X", "name": f"recv {'act' if kind == 'F' else 'grad'} {j}", "cat": "p2p",
                            "pid": pi, "tid": 2 * d + 1, "ts": (ready - c) * us, "dur": c * us,
                            "args": {"from_stage": src % phys}})
        for i in range(phys):
            sp = pp.stages[i]
            if sp.param_gather_s > 0:   # ZeRO's all-gather of the previous step, under the first forwards
                out.append({"ph": "X", "name": "param all-gather", "cat": "dp", "pid": pi, "tid": 2 * i + 1,
                            "ts": 0.0, "dur": sp.param_gather_s * us,
                            "args": {"exposed_s": sp.param_gather_exposed_s}})
            spans = (("wait for DP peers", sp.schedule_end_s, sp.dp_sync_start_s),
                     ("dp grad sync", sp.dp_sync_start_s, sp.dp_sync_end_s),
                     ("grad-norm all-reduce", sp.dp_sync_end_s, synced))
            for name, a, b in spans:
                if b > a:   # waiting for slower devices is drawn as waiting, not as a slow all-reduce
                    cat = "dp" if name == "dp grad sync" else "wait"
                    out.append({"ph": "X", "name": name, "cat": cat, "pid": pi, "tid": 2 * i + 1,
                                "ts": a * us, "dur": (b - a) * us,
                                "args": {"transfer_s": sp.dp_sync_time_s} if name == "dp grad sync" else {}})
            out.append({"ph": "X", "name": "optimizer", "cat": "optimizer", "pid": pi, "tid": 2 * i,
                        "ts": synced * us, "dur": sp.optimizer_time_s * us})
    if overhead > 0:
        step = len(pipes)
        out.append({"ph": "M", "name": "process_name", "pid": step, "tid": 0, "args": {"name": "step"}})
        out.append({"ph": "X", "name": "iteration overhead", "cat": "overhead", "pid": step, "tid": 0,
                    "ts": (synced + opt_max) * us, "dur": overhead * us,
                    "args": {"note": "the calibration's per-iteration overhead"}})
    return out


__all__ = ["Prediction", "PipelinePrediction", "StagePrediction", "predict", "cost_model_for"]
