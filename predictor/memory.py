"""Memory of one pipeline stage on one device: weights, gradients, optimizer, activations.

Model states, as the runtime's native engine holds them: fp32 parameters and gradients whatever
the model's dtype (fp16 / bf16 compute runs under autocast), 4 + 4 bytes per parameter, and
Adam's two fp32 moments (8 bytes): 16 bytes/param, as in the ZeRO paper's mixed-precision
accounting (Rajbhandari et al. 2020: 2 + 2 + 12), split differently. ZeRO-1 shards the moments
over the stage's data-parallel degree, so an fp32 / fp16 stage keeps 8 + 8/k bytes where
Megatron-style fp32 masters would keep 4 + 12/k; a bf16 stage at tp 1 keeps 8 + 12/k: the
all-gather after the optimizer moves bf16 values, so the parameters hold bf16-rounded values and
the slice keeps its exact fp32 copy (:func:`gathers_in_bf16`; the gather's bf16 buffers, live
until the next forward uses them, are checked against the peak in :func:`stage_memory`); ZeRO-2 also the gradients
(:func:`model_state_bytes`); a stage's peak charges ZeRO-2 as
ZeRO-1, since the native engine holds gradients whole through backward (:func:`stage_memory`). As
the runtime shards them (hetero.runtime.zero), every parameter's states are split over all ranks
holding it, in every pipeline shape, replica and tp rank: :func:`zero_degrees` turns those holder
counts into each stage's effective degree.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2 / 3): per layer per micro-batch, with ``e`` bytes per element, ``m`` = 1 byte per
dropout mask element when dropout > 0 (else 0), tensor parallelism ``t`` without sequence
parallelism:

- kept whole on every tp rank: the two norm inputs, the QKV input and the MLP input (4 e sbh),
  plus the two dropout masks after attention and MLP (2 m sbh);
- split by t: Q, K, V (e sb (h + 2 kv)), the out-projection input (e sbh), the MLP intermediates
  (gelu/relu: its input and output, 2 e sbf; SwiGLU, unfused as in eager PyTorch: gate, up,
  silu(gate) and the product, 4 e sbf);
- the attention core, split by t: the softmax output (e a s^2 b) plus, with dropout, its mask and
  output ((m + e) a s^2 b); with ``attention: fused`` (FlashAttention / SDPA) only the kernel's fp32
  row statistics (4 a s b), its output being the out-projection input already counted.

For fp16 gpt with dropout this is exactly s b h (34 + 5 a s / h) at t = 1 (the paper's formula).
Selective recomputation drops the attention-core term; full recomputation keeps only each
layer's input (e sbh). RoPE is taken as fused (Megatron/apex: nothing saved beyond q and k).
Llama has no dropout, so no masks.

The native engine keeps fp32 parameters and a fp32 residual stream under autocast, so an fp16 /
bf16 layer also keeps each weight's model-dtype copy and its norm inputs in fp32, and eager
RMSNorm keeps its normalised product (:func:`engine_bytes_per_layer`, :func:`engine_edge_bytes`).
Its step has two more moments that can make the peak (:func:`stage_memory`): a stage whose
forwards all precede its first backward has no gradients yet while they are held, and after the
backward passes the gradients are summed through one buffer of them (without tensor parallelism
the gradients are views of that buffer from the first backward on: no copy). Checked against the
runtime's own stages recorded at full width (tests/test_memplan.py: -4.9% .. +2.3% over 19 stages)
and the peaks measured on an H100 (+0.7% .. +2.1%).

Per schedule, a stage holds ``in_flight`` micro-batches of activations (1F1B: min(p - i, m) at
stage i of p; GPipe, and interleaved with one chunk per device: m; interleaved: see
:func:`in_flight_microbatches`, and :func:`held_peak` when a device's chunks differ in size).

First stage: token ids (int64). Last stage: final-norm and head inputs and the fp32 log-softmax
the cross-entropy keeps, plus, for the latest micro-batch only, its logits (and their fp32 copy)
in forward or the fp32 logits gradients as backward starts (:func:`loss_transient_bytes`). While
a layer's backward runs, what the layer recomputation rebuilds (full: all but its input;
selective: the attention core) and the gradient of the attention scores are alive too
(:func:`backward_transient_bytes`); the peak takes the larger of the two transients (with full
recomputation of a small-vocabulary model the rebuilt layer is most of the peak: measured in
benchmarks/bench_memory.py).

A fixed framework overhead per device covers the CUDA/HIP/CANN context, cuBLAS/NCCL workspaces and
allocator slack; 0 for CPU processes (measured as live tensor bytes). It is a vendor fact, kept in
the vendor registry (:func:`hetero.backends.registry.framework_overhead`);
:data:`FRAMEWORK_OVERHEAD` is the registry's figures by family.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hetero.backends.registry import VENDORS, framework_overhead
from hetero.specs.model import ModelSpec

from .ops import DTYPE_BYTES
from .schedule import device_orders, executed_order, interleave_group

MiB = 2**20
FRAMEWORK_OVERHEAD = {v.name: v.framework_overhead_bytes for v in VENDORS}
"""Bytes per device outside tensors the model owns (context, library workspaces), by vendor family:
the vendor registry's (:func:`hetero.backends.registry.framework_overhead`)."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one device, by kind (see the module docstring)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead

    def to_dict(self) -> dict:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "overhead": self.overhead, "total": self.total}


def activation_bytes_per_layer(model: ModelSpec, b: int, s: int, t: int = 1, recompute: str = "none",
                               dtype: str | None = None) -> float:
    """Bytes one transformer layer keeps for backward, one micro-batch, one tp rank."""
    e = DTYPE_BYTES[dtype or model.dtype]
    h, a, kv = model.hidden_size, model.num_attention_heads, model.kv_dim
    f = model.ffn_hidden_size
    sb = s * b
    if recompute == "full":
        return float(e * sb * h)
    mask = 1 if model.dropout > 0 else 0
    replicated = 4 * e * sb * h + 2 * mask * sb * h
    mlp = (4 if model.gated_mlp else 2) * e * sb * f
    split = e * sb * (h + 2 * kv) + e * sb * h + mlp
    total = replicated + split / t
    if model.attention == "fused":  # the kernel keeps its output (counted above) and fp32 row statistics
        total += 4.0 * a * s * b / t
    elif recompute != "selective":
        core = e + (mask + e if model.dropout > 0 else 0)
        total += core * a * s * s * b / t
    return float(total)


def engine_bytes_per_layer(model: ModelSpec, b: int, s: int, t: int = 1, recompute: str = "none") -> float:
    """What the native engine keeps beyond :func:`activation_bytes_per_layer` (Megatron's accounting:
    fused norms, every activation in the model dtype, one copy of each projection input), per layer
    per micro-batch on one tp rank. Measured by recording the runtime's stages
    (hetero.memplan.record): without these terms a bf16 Llama-2-7B stage was predicted 14-24% under
    its recorded peak.

    - Eager RMSNorm (llama) keeps its fp32 normalised product beside its input: 4 sbh per norm, in
      every dtype.
    - fp16 / bf16 run under autocast with fp32 parameters, so every matrix product casts its weight
      to the model dtype and autograd keeps that copy: ``e`` bytes per weight element of the layer's
      matrices (split by t). The residual stream stays fp32: the two norm inputs are kept at 4 bytes,
      not e. Autocast caches casts of parameters only, so q, k and v each cast the norm's output
      (three copies where one is counted), and so do the up and gate projections of a gated MLP.
    - With full recomputation only the layer's input is kept: fp32 under autocast (4 - e more)."""
    e = DTYPE_BYTES[model.dtype]
    sbh = s * b * model.hidden_size
    if recompute == "full":
        return float((4 - e) * sbh)
    extra = 2 * 4 * sbh if model.architecture == "llama" else 0
    if e < 4:
        matrices = sum(model.tp_split_per_layer(biases=False).values())
        extra += e * matrices / t + 2 * (4 - e) * sbh + (2 + int(model.gated_mlp)) * e * sbh
    return float(extra)


def engine_edge_bytes(model: ModelSpec, b: int, s: int, tp: int, last: bool) -> float:
    """The last stage's share of :func:`engine_bytes_per_layer`, per micro-batch: the final norm's
    fp32 input (autocast) and normalised product (eager RMSNorm), and the head's (or the tied
    embedding's) weight copy in the model dtype."""
    if not last:
        return 0.0
    e = DTYPE_BYTES[model.dtype]
    sbh = s * b * model.hidden_size
    extra = 4 * sbh if model.architecture == "llama" else 0
    if e < 4:
        extra += e * -(-model.vocab_size // tp) * model.hidden_size + (4 - e) * sbh
    return float(extra)


def held_bytes_per_microbatch(model: ModelSpec, b: int, s: int, tp: int, recompute: str, num_layers: int,
                              first: bool, last: bool) -> float:
    """What one micro-batch in flight keeps on one tp rank of a stage (or model chunk) of
    ``num_layers`` layers until its backward: the layers' activations (and what the engine keeps
    beside them), and the embedding's or head's."""
    per_layer, edge, engine_edge = _held_terms(model, b, s, tp, recompute, first, last)
    return num_layers * per_layer + edge + engine_edge


@functools.lru_cache(maxsize=4096)
def _held_terms(model: ModelSpec, b: int, s: int, tp: int, recompute: str, first: bool,
                last: bool) -> tuple[float, float, float]:
    """:func:`held_bytes_per_microbatch`'s terms that do not depend on the layer count, computed
    once per shape: the planner's capacity search asks for the same ones hundreds of thousands of
    times at a 1024-device scale."""
    return (activation_bytes_per_layer(model, b, s, tp, recompute) + engine_bytes_per_layer(model, b, s, tp, recompute),
            edge_activation_bytes(model, b, s, tp, first, last), engine_edge_bytes(model, b, s, tp, last))


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """The paper's fp16 formula (eq. 2/3, no sequence parallelism): s b h (10 + 24/t + 5 a s/(h t))."""
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def stage_params(model: ModelSpec, num_layers: int, tp: int, first: bool, last: bool) -> float:
    """Parameters one tp rank of a stage holds: the matrices split over tp (word embedding and head
    vocabulary-parallel); norms, row-parallel biases and learned positions whole on every tp rank,
    as Megatron-LM and the runtime keep them."""
    per_layer, edges = _params_terms(model, tp, first, last)
    p = num_layers * per_layer
    for extra in edges:
        p += extra
    return p


@functools.lru_cache(maxsize=4096)
def _params_terms(model: ModelSpec, tp: int, first: bool, last: bool) -> tuple[float, tuple[float, ...]]:
    """:func:`stage_params`' parameters per layer and what the stage's ends add, in the order they
    are added (so the sum is the same to the last bit), computed once per (model, tp, ends)."""
    rep = model.tp_replicated_per_layer()
    edges = []
    if first:
        edges.append(model.vocab_size * model.hidden_size / tp + model.position_params())
    if last:
        norm = model.final_norm_params()
        edges.append(norm + (model.head_params() - norm) / tp)
        if model.tie_embeddings and not first:  # the head keeps its own copy of the word embedding
            edges.append(model.vocab_size * model.hidden_size / tp)
    return (model.params_per_layer() - rep) / tp + rep, tuple(edges)


def gathers_in_bf16(dtype: str, zero_stage: int) -> bool:
    """Whether ZeRO's parameter all-gather moves bf16 values (2 bytes a parameter, not 4): a bf16
    model, at every tp degree and across vendors (hetero.runtime.zero, as Megatron-LM's
    distributed optimizer gathers its bf16 parameters). What it costs besides differs by tp: at
    tp 1 the slice gets an fp32 master copy of its own, which a tp rank's slice has anyway."""
    return zero_stage >= 1 and dtype == "bf16"


def model_state_bytes(params: float, dtype: str, zero_stage: int = 0, dp: float = 1,
                      tp: int = 1) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of ``params`` parameters (one tp rank's of ``tp``), as
    the native engine holds them (module docstring): fp32 parameters and gradients for every
    ``dtype`` (``dtype`` is checked, not used: autocast computes in it)."""
    DTYPE_BYTES[dtype]   # an unknown dtype is an error here as everywhere
    e = 4
    dp = max(1, dp)
    # Adam m, v, and under ZeRO a fp32 master copy of the slice: on a tp rank (its DTensor shards
    # cannot be re-bound to views of a flat buffer), and at tp 1 under bf16, where the parameters
    # take the bf16-rounded values of the all-gather (hetero.runtime.zero, :func:`gathers_in_bf16`).
    master = zero_stage >= 1 and (tp > 1 or (gathers_in_bf16(dtype, zero_stage) and dp > 1))
    opt_per_param = 8 + (4 if master else 0)
    weights = params * e
    grads = params * e / (dp if zero_stage >= 2 else 1)
    optim = params * opt_per_param / (dp if zero_stage >= 1 else 1)
    return weights, grads, optim


def edge_activation_bytes(model: ModelSpec, b: int, s: int, tp: int, first: bool, last: bool,
                          dtype: str | None = None) -> float:
    """Activations of the embedding (first stage) and head + loss (last stage), one micro-batch."""
    e = DTYPE_BYTES[dtype or model.dtype]
    out = 0.0
    if first:
        out += 8 * b * s  # int64 token ids kept by the embedding backward
        if model.dropout > 0:
            out += b * s * model.hidden_size
    if last:
        Vt = -(-model.vocab_size // tp)
        out += 2 * e * b * s * model.hidden_size       # final-norm input, head input
        out += 4 * b * s * Vt                           # the fp32 log-softmax the loss keeps
    return out


def loss_transient_bytes(model: ModelSpec, b: int, s: int, tp: int) -> float:
    """On top of the micro-batches held, around the loss of the latest one: in forward its logits
    in the model dtype and their fp32 copy until the log-softmax is taken (nothing keeps the logits
    for backward, so they are not held with the micro-batch), at the start of backward the nll
    gradient and the log-softmax gradient, both fp32: at most 8 bytes per logit. Counting the
    logits with every held micro-batch instead over-predicted GPipe's last stage by 13.7% (four
    held; recorded with hetero.memplan.record)."""
    return 8.0 * b * s * -(-model.vocab_size // tp)


@functools.lru_cache(maxsize=4096)
def backward_transient_bytes(model: ModelSpec, b: int, s: int, tp: int, recompute: str,
                             dtype: str | None = None) -> float:
    """Bytes alive on top of the kept activations while one layer's backward runs, one micro-batch:
    what recomputation rebuilds of that layer (full: all it would have kept but its input, which is
    kept already; selective: the attention core), plus the gradient of the attention scores
    (e a s^2 b / t, as large as the softmax output it is computed from)."""
    e = DTYPE_BYTES[dtype or model.dtype]
    rebuilt = activation_bytes_per_layer(model, b, s, tp, "none", dtype) - \
        activation_bytes_per_layer(model, b, s, tp, recompute, dtype)
    if dtype is None:   # the engine's own copies of the rebuilt layer (its weight casts, fp32 norm inputs)
        rebuilt += engine_bytes_per_layer(model, b, s, tp, "none") - engine_bytes_per_layer(model, b, s, tp, recompute)
    if model.attention == "fused":  # a flash backward accumulates dQ in fp32; no s x s gradient
        return rebuilt + 4.0 * s * b * model.hidden_size / tp
    return rebuilt + e * model.num_attention_heads * s * s * b / tp


def stage_memory(model: ModelSpec, family: str, tp: int, mbs: int, num_layers: int, recompute: str,
                 zero_stage: int, dp: int, in_flight: float, first: bool, last: bool,
                 grads_while_held: bool = True, summed_params: float = 0.0,
                 grad_buffer: bool = False) -> MemoryBreakdown:
    """Peak memory of one device of a stage of ``num_layers`` layers: model states (ZeRO-sharded
    over ``dp``), ``in_flight`` micro-batches of activations, the larger of the loss transient (last
    stage) and a layer's backward transient, and the framework overhead of the vendor ``family``.

    ``grads_while_held=False``: every micro-batch's forward comes before the stage's first backward
    (GPipe; 1F1B with no more micro-batches than are in flight; a single micro-batch), so no
    gradient exists while all of them are held (the runtime sets gradients to None at the start of
    a step); the gradients appear as the first backward frees its micro-batch. The peak is then
    the larger of the two moments, and the activations term is net of ``min(gradients, one
    micro-batch's held bytes)``. Without it one-micro-batch steps on an H100 were over-predicted by
    up to 25% (gradients counted at a forward peak that has none).

    ``summed_params``: the parameters of this rank's largest set of gradients summed with other
    ranks (a replica's or another pipeline's copies of its layers, tp peers, or the tied embedding
    alone between a single pipeline's ends): after the backward passes the runtime sums each set
    through one fp32 buffer of its gradients laid end to end (hetero.runtime.grads; under ZeRO the
    reduce-scatter's input and the shards' outputs), so with the activations gone the step's other
    peak is the model states plus that buffer (:func:`summed_params`).

    ``grad_buffer``: the summed gradients are views of that buffer from the first backward on
    (:func:`uses_gradient_buffers`: no tensor parallelism in the plan, and a
    stage that does not run every forward first), so the sum makes no copy of them; under ZeRO
    only the reduce-scatter's output slice comes on top."""
    s = model.seq_length
    params = stage_params(model, num_layers, tp, first, last)
    # ZeRO-2's gradient sharding is left out of the peak: the peak comes in backward, and the
    # runtime's native engine holds a stage's gradients whole until the step's backward passes
    # are done (it frees them once reduced, after the peak). Only DeepSpeed's bucketed ZeRO-2
    # (--engine deepspeed, one-stage tp1 plans) frees them during backward, so this is on the
    # safe side there.
    w, g, o = model_state_bytes(params, model.dtype, min(zero_stage, 1), dp, tp)
    held = held_bytes_per_microbatch(model, mbs, s, tp, recompute, num_layers, first, last)
    act = in_flight * held
    # Two transients that do not coincide; the peak carries the larger. The loss transient is
    # alive at the start of the last stage's backward. A layer's backward transient comes after the
    # head's backward has freed that micro-batch's head activations (on the last stage).
    layer_peak = backward_transient_bytes(model, mbs, s, tp, recompute) if num_layers else 0.0
    if last:
        layer_peak -= edge_activation_bytes(model, mbs, s, tp, False, True)
    act += max(loss_transient_bytes(model, mbs, s, tp) if last else 0.0, layer_peak)
    if not grads_while_held:
        act -= min(g, held)
    if summed_params:   # the gradient sum's buffer, after the activations are freed
        buffer = 4.0 * summed_params
        if grad_buffer:   # the gradients are the buffer: only ZeRO's output slice is new
            act = max(act, buffer / max(1, dp) if zero_stage >= 1 else 0.0)
        else:
            act = max(act, buffer * (1 + 1 / max(1, dp)) if zero_stage >= 1 else buffer)
        if tp == 1 and gathers_in_bf16(model.dtype, zero_stage) and dp > 1:
            # the all-gather's bf16 buffers (2 bytes a summed parameter), from the optimizer step
            # until the next forward first uses each: with the model states, the slices' gradients
            # (4 / k) and no activations, the full gradients freed. Against the w + g + o the peak
            # charges (g: full fp32 gradients) this is 2 P_summed + 4 P / k - 4 P < 0 for k >= 2,
            # so it does not raise the peak; it is kept as the moment it is.
            act = max(act, 2.0 * summed_params + 4.0 * params / dp - g)
    return MemoryBreakdown(w, g, o, act, float(framework_overhead(family)))


def summed_gradients(model: ModelSpec, tp: int, first: bool, last: bool, replicas: int) -> str | None:
    """Which gradients of a stage the runtime sums with other ranks (:mod:`hetero.runtime.grads`):
    ``"all"`` when the layers have other holders (``replicas``: model replicas over every pipeline of
    the plan) or tp peers, else ``"wte"`` (the tied word embedding alone) when one pipeline's first
    and last stages both hold it, else None."""
    if replicas > 1 or tp > 1:
        return "all"
    if model.tie_embeddings and first != last:
        return "wte"
    return None


def summed_params(model: ModelSpec, num_layers: int, tp: int, first: bool, last: bool, replicas: int) -> float:
    """The parameters of a stage's tp rank whose gradients the runtime sums with other ranks in one
    buffer (:func:`stage_memory`), by :func:`summed_gradients`."""
    which = summed_gradients(model, tp, first, last, replicas)
    if which == "all":
        return stage_params(model, num_layers, tp, first, last)
    if which == "wte":
        return model.vocab_size * model.hidden_size / tp
    return 0.0


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, micro_batches: int,
                           interleave: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's whole
    layer range.

    1F1B: stage i of p holds min(p - i, m). GPipe: all m, and so does ``interleaved`` with one
    chunk per device (it runs the GPipe order, :mod:`hetero.predictor.schedule`). Interleaved (v
    chunks per device):
    device i runs (p - i - 1) * 2 + (v - 1) * G warm-up chunk-forwards, G the largest micro-batch
    group of the order (:func:`~hetero.predictor.schedule.interleave_group`: p when p divides m),
    plus the one in flight, each holding 1/v of the device's layers: min(that + 1, m v) / v.
    Each is the peak count of the order :mod:`hetero.predictor.schedule` simulates (tested).
    """
    p, m, i = num_stages, micro_batches, stage
    kind, v = executed_order(schedule, p * interleave, interleave)
    if kind == "gpipe":
        return float(m)
    if kind == "interleaved":
        chunks = min((p - i - 1) * 2 + (v - 1) * interleave_group(p, m) + 1, m * v)
        return chunks / v
    return float(min(p - i, m))


@functools.lru_cache(maxsize=1024)
def forwards_precede_backwards(schedule: str, stage: int, num_stages: int, micro_batches: int,
                               interleave: int = 1) -> bool:
    """Whether device ``stage`` runs every forward of the step (each micro-batch through each of its
    chunks) before its first backward, in the order :mod:`hetero.predictor.schedule` simulates and
    the runtime executes: then no gradient exists while the warm-up's activations are all held
    (``grads_while_held=False`` of :func:`stage_memory`). GPipe; 1F1B with no more micro-batches
    than are in flight; interleaved when the micro-batches fit in the warm-up (e.g. the first of
    three devices with two chunks and four micro-batches)."""
    kind, v = executed_order(schedule, num_stages * interleave, interleave)
    if v == 1:   # closed forms: the planner asks this for thousands of (stage, micro-batches) pairs
        return kind == "gpipe" or num_stages - stage >= micro_batches
    return _forwards_first(kind, num_stages, micro_batches, v)[stage]


def uses_gradient_buffers(plan, stage: int, num_stages: int, micro_batches: int, interleave: int = 1) -> bool:
    """Whether the runtime binds a rank's summed gradients to one buffer per holder set
    (:func:`hetero.runtime.grads.bind_gradient_buffers`): no stage of the plan runs tensor
    parallelism (every bucket then sums plain tensors), and device ``stage`` does not run every
    forward before its first backward (there the gradients, made one by one as the first backward
    frees its activations, stay below the warm-up's peak; a buffer would not). The runtime, memplan's
    recorder and :func:`stage_memory` (``grad_buffer``, from the same two parts) follow it."""
    return (all(s.tp == 1 for p in plan.pipelines for s in p.stages)
            and not forwards_precede_backwards(plan.schedule, stage, num_stages, micro_batches, interleave))


@functools.lru_cache(maxsize=1024)
def _forwards_first(kind: str, num_stages: int, micro_batches: int, v: int) -> tuple[bool, ...]:
    out = []
    for order in device_orders(kind, num_stages * v, micro_batches, v):
        first_b = next((i for i, (k, _, _) in enumerate(order) if k == "B"), len(order))
        out.append(first_b == len(order) // 2)
    return tuple(out)


def held_peak(schedule: str, stage: int, num_stages: int, micro_batches: int, interleave: int,
              weights: tuple) -> float:
    """The largest sum of ``weights[c]`` over the (micro-batch, chunk c) activations device
    ``stage`` holds at once in the order :mod:`hetero.predictor.schedule` simulates (and the
    runtime executes): a chunk's activations live from its forward to the end of its backward.
    ``weights``: one per chunk of the device, in chunk order (e.g. its layers' bytes plus the
    embedding's on chunk 0 of device 0 and the head's on the last chunk of the last device).

    With equal weights this is :func:`in_flight_microbatches` x the device's total; with chunks of
    different sizes it is not: the warm-up holds more early chunks than late ones."""
    p, v = num_stages, interleave
    held = peak = 0.0
    for kind, _, vs in device_orders(schedule, p * v, micro_batches, v)[stage]:
        if kind == "F":
            held += weights[vs // p]
            peak = max(peak, held)
        else:
            held -= weights[vs // p]
    return peak


__all__ = ["FRAMEWORK_OVERHEAD", "MemoryBreakdown", "activation_bytes_per_layer", "korthikanti_bytes",
           "stage_params", "gathers_in_bf16", "model_state_bytes", "edge_activation_bytes", "stage_memory",
           "in_flight_microbatches", "held_peak", "forwards_precede_backwards", "uses_gradient_buffers",
           "engine_bytes_per_layer", "engine_edge_bytes",
           "held_bytes_per_microbatch", "summed_params", "loss_transient_bytes", "backward_transient_bytes"]


def zero_degrees(model: ModelSpec, plan) -> list[list[float]]:
    """Per pipeline, per physical stage: the degree ``dp`` such that ``stage_params(...) / dp`` is
    what one of its tp ranks keeps of the ZeRO-sharded states.

    Every parameter is sharded over its holders (hetero.runtime.zero): a layer over the replicas x
    tp of every pipeline's stage holding it, the word embedding over the first stages (and the last
    ones, tied), the final norm and head over the last stages. A tp rank keeps ``full count /
    holders`` of a tensor split over tp; of a tensor every tp rank holds whole (norms, row-parallel
    biases, positions), ``t x full / holders`` when all its holders run at one tp degree ``t`` (each
    tp rank shards its own copy over its peers), else ``full / holders`` (full tensors sharded over
    every holder). One pipeline shape with R replicas gives R for every stage (the textbook
    data-parallel degree)."""
    split, rep = model.params_per_layer() - model.tp_replicated_per_layer(), model.tp_replicated_per_layer()
    # Layer ranges between any two stage boundaries share their holders: cost them once per range
    # (the planner scores thousands of plans; a per-layer walk was a quarter of a prediction).
    cuts = sorted({0, model.num_layers} | {b for p in plan.pipelines for s in p.stages for b in s.layers})
    at = {c: i for i, c in enumerate(cuts)}
    holders = [0] * (len(cuts) - 1)
    degrees: list[set] = [set() for _ in holders]
    firsts = lasts = wte = 0
    first_tp, last_tp = set(), set()
    for p in plan.pipelines:
        st = p.stages
        for s in st:
            for j in range(at[s.layers[0]], at[s.layers[1]]):
                holders[j] += p.replicas * s.tp
                degrees[j].add(s.tp)
        firsts += p.replicas * st[0].tp
        lasts += p.replicas * st[-1].tp
        first_tp.add(st[0].tp)
        last_tp.add(st[-1].tp)
        # tied: the last stage's copy has holders of its own unless it runs on the first stage's
        # devices (interleaved chunks over one physical stage: one copy)
        own_copy = model.tie_embeddings and (len(st) - 1) % len(plan.physical_stages(p)) != 0
        wte += p.replicas * (st[0].tp + (st[-1].tp if own_copy else 0))

    def whole(tps: set) -> int:   # the t of a tensor every tp rank holds whole (see the docstring)
        return next(iter(tps)) if len(tps) == 1 else 1

    # kept per layer range, summed up to each cut
    upto = [0.0]
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        upto.append(upto[-1] + (b - a) * (split + rep * whole(degrees[j])) / holders[j])
    vh = model.vocab_size * model.hidden_size
    norm = model.final_norm_params()
    out = []
    for p in plan.pipelines:
        st = p.stages
        devices = plan.physical_stages(p)
        phys = len(devices)
        kept = [0.0] * phys
        layers = [0] * phys
        for k, s in enumerate(st):
            i = k % phys
            kept[i] += upto[at[s.layers[1]]] - upto[at[s.layers[0]]]
            layers[i] += s.num_layers
        kept[0] += vh / wte + model.position_params() * whole(first_tp) / firsts
        last = (len(st) - 1) % phys
        kept[last] += ((model.head_params() - norm + norm * whole(last_tp)) / lasts
                       + (vh / wte if model.tie_embeddings and last != 0 else 0.0))
        out.append([stage_params(model, layers[i], s.tp, i == 0, i == last) / kept[i]
                    for i, s in enumerate(devices)])
    return out
