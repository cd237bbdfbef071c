"""Mixture-of-experts costs: expert compute from token counts, the all-to-all's bytes per link, the
experts' memory under the worst routing skew.

An MoE layer is a dense block whose MLP is replaced by a router (one ``h x E`` linear), the routed
experts and an optional shared expert. With expert parallelism (the plan's ``expert_parallel``)
the routed experts of each MoE layer are spread over groups of ``degree`` data-parallel ranks;
every micro-batch, each rank sends each token's ``top_k`` assignments to the ranks holding those
experts and gets the outputs back (two all-to-alls forward, two backward).

Token counts: a rank's micro-batch has ``T = mbs x seq`` tokens, so ``T x top_k`` assignments. With
balanced routing every expert takes the same share, so rank ``j`` of a group receives
``degree x T x top_k x experts_j / E`` assignments per micro-batch and layer; a stated
``imbalance`` (max / mean expert load, >= 1) multiplies what the busiest rank receives (capped at
``min(top_k, experts_j)`` assignments per token of the group, all a rank's experts can take, and at
the capacity factor's ``experts_j x capacity`` where one is set). Each expert is one MLP over its
assignments (its kernels from the device's op model, one expert after another: the loop a CPU,
A100 or MI250X runs); its backward as a dense MLP's.

The members of a group meet at every MoE layer in the all-to-all, so each waits for the slowest:
a stage's MoE layer costs the slowest member's expert compute plus the exchange
(:func:`layer_delta`: what an MoE layer adds to a dense block's forward and backward).

The all-to-all's bytes (:func:`all_to_all_bytes`): rank ``i`` sends rank ``j`` its assignments for
``j``'s experts, ``T x top_k x experts_j / E`` rows of ``h`` elements (dispatch), and ``j`` sends as
many back (combine); the transfer time is the busiest rank's sent bytes over its link (the
cross-group link where the peer is in another group).

Memory (:func:`expert_state_bytes`, :func:`expert_activation_bytes`): a rank holds its experts'
parameters, gradients and AdamW moments (and the router and shared expert); the activations it keeps
for backward are those of the assignments it receives, at the worst skew (every token of the group
routing to it as far as its experts allow) unless a capacity factor caps them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from hetero.specs.model import ModelSpec

from .ops import DTYPE_BYTES, Op, backward_of, gemm, vec

STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and two AdamW moments, as the runtime keeps every parameter."""


def mlp_forward_ops(model: ModelSpec, rows: int, width: int, t: int = 1) -> list[Op]:
    """Forward kernels of one MLP of ``width`` over ``rows`` tokens on one of ``t`` tp ranks (the
    dense block's own kernels: SwiGLU for llama, gelu / relu for gpt)."""
    e = DTYPE_BYTES[model.dtype]
    h, ft = model.hidden_size, max(1, width // t)
    if model.gated_mlp:
        return [gemm("mlp.gate", "linear", 1, rows, ft, h, e), gemm("mlp.up", "linear", 1, rows, ft, h, e),
                vec("mlp.silu", "gelu", rows, ft, e), vec("mlp.gate_mul", "mul", rows, ft, e),
                gemm("mlp.down", "linear", 1, rows, h, ft, e)]
    act = "relu" if model.activation == "relu" else "gelu"
    return [gemm("mlp.fc1", "linear", 1, rows, ft, h, e), vec("mlp.act", act, rows, ft, e),
            gemm("mlp.fc2", "linear", 1, rows, h, ft, e)]


def _with_backward(model: ModelSpec, fwd: list[Op]) -> tuple[list[Op], list[Op]]:
    e = DTYPE_BYTES[model.dtype]
    bwd: list[Op] = []
    for o in reversed(fwd):
        bwd += backward_of(o, e)
    return fwd, bwd


def received_assignments(model: ModelSpec, tokens: int, degree: int, experts: int, imbalance: float = 1.0) -> float:
    """Token assignments one rank holding ``experts`` routed experts receives per micro-batch and MoE
    layer, when each of the ``degree`` ranks of its group routes ``tokens`` tokens (module docstring)."""
    moe = model.moe
    if experts <= 0:
        return 0.0
    balanced = degree * tokens * moe.top_k * experts / moe.num_experts
    cap = degree * tokens * min(moe.top_k, experts)
    got = min(balanced * max(1.0, imbalance), cap)
    per_expert = moe.capacity(degree * tokens)   # capacity per expert of the group's tokens (None: dropless)
    return min(got, experts * per_expert) if per_expert is not None else got


def expert_times(cm, group: str, tp: int, assignments: float, experts: int) -> tuple[float, float]:
    """(forward, backward) seconds of ``experts`` routed experts on one device of ``group`` taking
    ``assignments`` token assignments between them (an even share each, one after another)."""
    if experts <= 0 or assignments <= 0:
        return 0.0, 0.0
    rows = max(1, round(assignments / experts))
    fwd, bwd = _with_backward(cm.model, mlp_forward_ops(cm.model, rows, cm.model.moe.expert_ffn_hidden_size, tp))
    return experts * cm.kernels_time(group, fwd), experts * cm.kernels_time(group, bwd)


def router_ops(model: ModelSpec, tokens: int) -> tuple[list[Op], list[Op]]:
    """(forward, backward) kernels of the router over ``tokens`` tokens: one ``h x E`` linear, a softmax."""
    e = DTYPE_BYTES[model.dtype]
    return _with_backward(model, [gemm("router", "linear", 1, tokens, model.moe.num_experts, model.hidden_size, e),
                                  vec("router.softmax", "softmax", tokens, model.moe.num_experts, e)])


# ------------------------------------------------------------------ the measured MoE layer (CPU profiles)
_FITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Op model -> architecture -> its :func:`moe_fit` (kept as long as the op model is)."""


def _op_sums(opm, model: ModelSpec, tokens: int, experts: int, assignments: float) -> tuple[float, float]:
    """The op model's raw (forward, backward) seconds of a router over ``tokens`` and ``experts``
    experts sharing ``assignments`` rows: what a measured MoE layer is set against."""
    rows = max(1, round(assignments / max(1, experts)))
    ef, eb = _with_backward(model, mlp_forward_ops(model, rows, model.moe.expert_ffn_hidden_size))
    rf, rb = router_ops(model, tokens)
    t = lambda ops: sum(opm.predict(o.op, o.dims_dict(), o.dtype or "fp32") for o in ops)  # noqa: E731
    return t(rf) + experts * t(ef), t(rb) + experts * t(eb)


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """``measured = fixed + per_expert x experts + k x op sum`` over ``(measured, experts, op sum)``,
    least squares in relative error; a negative fixed or per-expert term is dropped and the rest
    refitted (each is a cost the layer pays, never a saving). None without enough points."""
    import numpy as np

    y = np.array([p[0] for p in points])
    cols = {"fixed": np.ones(len(points)), "per_expert": np.array([p[1] for p in points]),
            "k": np.array([p[2] for p in points])}
    keep = list(cols)
    while keep:
        if len(points) < len(keep):
            return None
        a = np.stack([cols[c] / y for c in keep], axis=1)
        coef = dict(zip(keep, np.linalg.lstsq(a, np.ones(len(points)), rcond=None)[0]))
        negative = [c for c in ("fixed", "per_expert") if c in coef and coef[c] < 0]
        if not negative:
            if coef.get("k", 0.0) <= 0:
                return None
            return coef.get("fixed", 0.0), coef.get("per_expert", 0.0), coef["k"]
        keep.remove(min(negative, key=lambda c: coef[c]))
    return None


def moe_fit(opm, architecture: str) -> tuple[tuple, tuple] | None:
    """The fitted (forward, backward) ``(fixed, per expert, k)`` seconds of the runtime's MoE layer
    from ``opm``'s MoE probes (a CPU profile's ``moe_blocks``) of ``architecture`` (any, where it has
    none): the router, the dispatch and combine and each expert's Python and autograd dispatch,
    which the operator sum does not see. None without probes."""
    from hetero.specs.model import load_model

    from .profiles import moe_probe_model_dict

    probes = getattr(opm, "moe_blocks", None) or []
    if not probes:
        return None
    fits_of = _FITS.setdefault(opm, {})
    if architecture not in fits_of:
        same = [p for p in probes if p.get("architecture") == architecture] or probes
        pts_f, pts_b = [], []
        for p in same:
            try:
                spec = load_model(moe_probe_model_dict(p))
            except Exception:  # noqa: BLE001 - a probe we cannot rebuild is left out
                continue
            tokens = int(p.get("micro_batch_size") or 1) * int(p["seq_length"])
            of, ob = _op_sums(opm, spec, tokens, spec.moe.num_experts, tokens * spec.moe.top_k)
            pts_f.append((p["forward_ms"] * 1e-3, spec.moe.num_experts, of))
            pts_b.append((p["backward_ms"] * 1e-3, spec.moe.num_experts, ob))
        fits = (_fit(pts_f), _fit(pts_b))
        fits_of[architecture] = fits if None not in fits else None
    return fits_of[architecture]


def moe_ratio(cm, group: str, tokens: int, experts: int, assignments: float) -> tuple[float, float]:
    """(forward, backward) multipliers from the operator sum of a rank's router over ``tokens`` and its
    ``experts`` experts over ``assignments`` rows to the runtime's measured MoE layer (:func:`moe_fit`),
    at this shape, on the raw op model (the group's slowdown applies to the sum it multiplies);
    (1, 1) where the op model has no MoE probes."""
    opm = cm.op_model(group)
    opm = getattr(opm, "source_model", opm)   # an emulated device's wrapper: the profile it scales
    fit = moe_fit(opm, cm.model.architecture)
    if fit is None or experts <= 0:
        return 1.0, 1.0
    sums = _op_sums(opm, cm.model, tokens, experts, assignments)
    return tuple((fixed + per * experts + k * s) / s if s > 0 else 1.0
                 for (fixed, per, k), s in zip(fit, sums))


def all_to_all_bytes(model: ModelSpec, tokens: list[int], counts: list[int]) -> list[list[float]]:
    """Bytes rank ``i`` of an expert-parallel group sends rank ``j`` in one all-to-all (dispatch; the
    combine is the transpose) of one MoE layer and micro-batch: its ``tokens[i] x top_k``
    assignments for ``j``'s ``counts[j]`` experts, ``h`` elements each (balanced routing)."""
    moe, e = model.moe, DTYPE_BYTES[model.dtype]
    row = model.hidden_size * e
    return [[0.0 if i == j else tokens[i] * moe.top_k * counts[j] / moe.num_experts * row
             for j in range(len(counts))] for i in range(len(counts))]


def link_bytes(model: ModelSpec, tokens: list[int], counts: list[int], forward: bool = True) -> list[list[float]]:
    """Bytes rank ``i`` of a group sends rank ``j`` in one MoE layer's forward (or backward) for one
    micro-batch, as the runtime's exchange moves them: the dispatch of ``i``'s assignments to ``j``'s
    experts, the combine of ``j``'s assignments computed by ``i``'s experts back to ``j`` and, in the
    forward, the assignment counts first (8 bytes per expert of the receiver). The backward moves the
    two row exchanges again, transposed."""
    d = all_to_all_bytes(model, tokens, counts)
    k = len(counts)
    return [[0.0 if i == j else d[i][j] + d[j][i] + (8 * counts[j] if forward else 0) for j in range(k)]
            for i in range(k)]


@dataclass(frozen=True)
class Member:
    """One rank of an expert-parallel group: where it runs and how many routed experts it holds."""

    group: str
    tp: int
    experts: int


def _members_for(plan, model: ModelSpec, pipeline: int, stage) -> list[Member]:
    """The expert-parallel group of ``pipeline``'s first replica, its members at ``stage``'s layers."""
    ep = plan.expert_parallel
    counts = ep.counts(model.moe.num_experts)
    first = sum(p.replicas for p in plan.pipelines[:pipeline])
    start = first - first % ep.degree
    members, k = [], 0
    for pi, p in enumerate(plan.pipelines):
        for _ in range(p.replicas):
            if start <= k < start + ep.degree:
                at = next((s for s in p.stages if s.layers[0] <= stage.layers[0] < s.layers[1]), p.stages[0])
                members.append(Member(at.group, at.tp, counts[k - start]))
            k += 1
    return members


def layer_delta(cm, plan, pipeline: int, stage, mbs: int, imbalance: float = 1.0) -> tuple[float, float]:
    """What one MoE layer of ``stage`` (of ``pipeline``) adds to a dense block's (forward, backward)
    per micro-batch: the router, the shared expert, the slowest group member's routed experts and the
    all-to-all, less the dense MLP it replaces. Without expert parallelism a rank runs all ``E``
    experts on its own assignments and exchanges nothing."""
    ep = plan.expert_parallel
    members = tuple(_members_for(plan, cm.model, pipeline, stage)) if ep is not None and ep.degree > 1 else ()
    return cm.memoised(("moe", stage.group, stage.tp, mbs, imbalance, members),
                       lambda: _layer_delta(cm, stage, mbs, imbalance, list(members)))


def _layer_delta(cm, stage, mbs: int, imbalance: float, members: list[Member]) -> tuple[float, float]:
    model = cm.model
    moe, tp, T = model.moe, stage.tp, mbs * model.seq_length
    f_dense, b_dense = (cm.kernels_time(stage.group, o) for o in
                        _with_backward(model, mlp_forward_ops(model, T, model.ffn_hidden_size, tp)))
    shared_f = shared_b = 0.0
    if moe.shared_expert_ffn_hidden_size:
        shared_f, shared_b = (cm.kernels_time(stage.group, o) for o in
                              _with_backward(model, mlp_forward_ops(model, T, moe.shared_expert_ffn_hidden_size, tp)))

    def routed(group: str, member_tp: int, degree: int, experts: int) -> tuple[float, float]:
        """The router over this rank's tokens and its experts over what it receives, as measured
        where the profile has MoE probes (:func:`moe_ratio`)."""
        got = received_assignments(model, T, degree, experts, imbalance)
        rf, rb = (cm.kernels_time(group, o) for o in router_ops(model, T))
        ef, eb = expert_times(cm, group, member_tp, got, experts)
        kf, kb = moe_ratio(cm, group, T, experts, got)
        return kf * (rf + ef), kb * (rb + eb)

    if not members:
        f, b = routed(stage.group, tp, 1, moe.num_experts)
        return f + shared_f - f_dense, b + shared_b - b_dense
    times = [routed(m.group, m.tp, len(members), m.experts) for m in members]
    f, b = max(t[0] for t in times), max(t[1] for t in times)
    comm_f, comm_b = all_to_all_time(cm, model, members, T, True), all_to_all_time(cm, model, members, T, False)
    return f + shared_f + comm_f - f_dense, b + shared_b + comm_b - b_dense


EXCHANGES = {True: 3, False: 2}
"""All-to-alls of one MoE layer per micro-batch: forward the counts, the dispatch and the combine;
backward the two row exchanges again (:class:`hetero.runtime.expert_parallel.ExpertGroup`)."""


def all_to_all_time(cm, model: ModelSpec, members: list[Member], tokens: int, forward: bool = True) -> float:
    """One MoE layer's exchanges of a group, forward or backward (:func:`link_bytes`): the busiest
    member's sent bytes, each peer over the link between their groups (same group: its intra-node
    link), and each exchange (:data:`EXCHANGES`) pays each peer's link latency: they are separate
    collectives, one after another, each waiting for the last."""
    sent = link_bytes(model, [tokens] * len(members), [m.experts for m in members], forward)
    worst = 0.0
    for i, a in enumerate(members):
        t = 0.0
        for j, b in enumerate(members):
            if i != j and sent[i][j] > 0:
                link = cm.cluster.link_between(a.group, b.group)
                t += link.transfer_time(sent[i][j]) + (EXCHANGES[forward] - 1) * link.latency
        worst = max(worst, t)
    return worst * max(cm.factors(m.group).communication for m in members)


def expert_sync_time(cm, plan, n_moe: int, tp: int, experts: int) -> float:
    """Seconds to sum one rank's gradients of ``n_moe`` MoE layers' experts, router and shared expert
    (beyond the dense MLP the dense sync already counts) over the ranks that hold the same experts:
    every data-parallel rank without expert parallelism, one rank per expert-parallel group with it
    (none where one group holds them all). A ring all-reduce of fp32 gradients over the slowest link
    among the holders' groups (the cross-group link where they span groups), after the schedule."""
    from . import comm

    ep = plan.expert_parallel
    ranks = sum(p.replicas for p in plan.pipelines)
    holders = ranks if ep is None or ep.degree <= 1 else ranks // ep.degree
    if holders <= 1 or n_moe == 0:
        return 0.0
    nbytes = n_moe * expert_state_bytes(cm.model, experts, tp) / STATE_BYTES_PER_PARAM * 4
    if nbytes <= 0:
        return 0.0
    groups = {p.stages[0].group for p in plan.pipelines}
    if len(groups) > 1:
        link = cm.cluster.network.cross_group
    else:
        g = cm.cluster.group(next(iter(groups)))
        link = g.intra_node if ranks * tp <= g.devices_per_node else cm.cluster.network.inter_node
    f = max(cm.factors(g).communication for g in groups)
    return comm.allreduce(nbytes, holders, link.bandwidth, link.latency) * f


def expert_state_bytes(model: ModelSpec, experts: int, tp: int = 1) -> float:
    """Model states (fp32 parameter, gradient, AdamW moments) one rank holds for one MoE layer beyond a
    dense block's: its routed experts, the router and the shared expert, less the dense MLP."""
    moe, h = model.moe, model.hidden_size
    shared = model.expert_params(moe.shared_expert_ffn_hidden_size) + h if moe.shared_expert_ffn_hidden_size else 0
    extra = experts * model.expert_params() + h * moe.num_experts + shared - model.expert_params(model.ffn_hidden_size)
    return extra / tp * STATE_BYTES_PER_PARAM


def expert_activation_bytes(model: ModelSpec, tokens: int, degree: int, experts: int, tp: int = 1) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch on a rank holding ``experts`` routed
    experts beyond the dense MLP's, at the worst routing skew (:func:`received_assignments` at the
    largest imbalance the experts and the capacity allow): each assignment keeps its input row, the
    expert's hidden activations (two of the width for a gated MLP) and its output."""
    e = DTYPE_BYTES[model.dtype]
    f = model.moe.expert_ffn_hidden_size // tp
    worst = received_assignments(model, tokens, degree, experts, imbalance=float("inf"))
    per_row = (2 * model.hidden_size + (3 if model.gated_mlp else 2) * f) * e
    dense = tokens * (2 * model.hidden_size + (3 if model.gated_mlp else 2) * (model.ffn_hidden_size // tp)) * e
    return worst * per_row - dense


__all__ = ["EXCHANGES", "mlp_forward_ops", "received_assignments", "expert_times", "all_to_all_bytes", "link_bytes", "all_to_all_time",
           "layer_delta", "expert_state_bytes", "expert_activation_bytes", "expert_sync_time", "Member"]
