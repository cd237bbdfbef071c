"""Operator decomposition of one transformer block (gpt or llama), forward and backward.

Each op is one kernel in the vocabulary of the operator model (``linear``, ``bmm``, ``ln``,
``softmax``, ``gelu``, ``add``, ``mul``, ...) with its dims, FLOPs and bytes, for one micro-batch of
``b`` sequences of length ``s`` on one tensor-parallel rank of degree ``t`` (Megatron column/row
split: heads / t, ffn / t; the LM head is vocabulary-parallel).

Conventions
- ``linear``: B x M x K @ K x N (B = micro-batch, M = sequence); ``bmm``: B independent M x K @ K x N.
- Vector ops: B rows x H columns.
- Backward of a GEMM is two GEMMs of the same FLOPs: dgrad (grad_out @ W^T) and wgrad
  (x^T @ grad_out). Backward of a vector op is modelled as the same kernel twice (it reads the
  upstream gradient and the saved input and writes the input gradient: about twice the traffic).
- Megatron fuses scale + causal mask + softmax into one kernel; it appears as one ``softmax``.
- RMSNorm is costed as ``ln``; SiLU as ``gelu`` (same elementwise class); RoPE as 2 ``mul`` + 1 ``add``
  on q and k; the embedding lookup as a gather (an ``add``-class pass over b*s*h).
- Biases (gpt) are fused into their GEMM epilogues and not costed separately.
- The loss is Megatron's vocabulary-parallel cross entropy on fp32 logits, kernel by kernel
  (:func:`cross_entropy_forward_ops`): with a 50k vocabulary it moves more bytes than the LM head
  GEMM does FLOPs' worth of time, so one fused softmax would make the last stage look light.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from hetero.specs.model import ModelSpec

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
GEMM_OPS = ("linear", "bmm")
NORM_OPS = ("ln", "softmax")
ELEMENTWISE_OPS = ("add", "mul", "div", "pow", "tanh", "relu", "gelu")
VECTOR_OPS = NORM_OPS + ELEMENTWISE_OPS
"""The operator vocabulary, in the order the learned model's one-hot encodes it (never reorder)."""
# Tensors read per output element and FLOPs per element of vector ops (the one definition: the
# learned op model's features, the profile model and the roofline use these).
VEC_INPUTS = {"ln": 1, "softmax": 1, "add": 2, "mul": 2, "div": 2, "pow": 1, "tanh": 1, "relu": 1, "gelu": 1}
VEC_FLOPS = {"ln": 8, "softmax": 5, "add": 1, "mul": 1, "div": 1, "pow": 1, "tanh": 8, "relu": 1, "gelu": 10}


@dataclass(frozen=True)
class Op:
    """One kernel of one micro-batch on one tensor-parallel rank."""

    name: str
    """What it is in the model, e.g. ``qkv``, ``scores``, ``mlp.fc1.dgrad``."""
    op: str
    """Operator-model op: linear | bmm | ln | softmax | gelu | add | mul | ..."""
    dims: tuple
    """(B, M, N, K) for linear/bmm, (B, H) for vector ops."""
    flops: float
    nbytes: float
    dtype: str | None = None
    """Element type the kernel runs in when it is not the model's (the fp32 loss kernels)."""
    fused: bool = False
    """A GEMM of a fused attention kernel (FlashAttention, SDPA): its s x s operand (scores,
    probabilities or their gradients) lives in on-chip memory, tile by tile, so ``nbytes`` leaves it
    out (:func:`flash_gemm`) and the cost model prices the kernel at that traffic
    (:func:`hetero.predictor.optime.kernel_cost`)."""

    @property
    def is_gemm(self) -> bool:
        return self.op in GEMM_OPS

    def dims_dict(self) -> dict:
        """``dims`` keyed as the operator model expects: B, M, N, K (GEMMs) or B, H."""
        if self.is_gemm:
            return dict(zip("BMNK", self.dims))
        return {"B": self.dims[0], "H": self.dims[1]}


def gemm_work(is_bmm, B, M, N, K, e):
    """(batches, rows per batch, FLOPs, bytes) of a GEMM with ``e`` bytes per element: linear
    (``is_bmm`` 0) is (B*M) x K @ K x N with one weight, bmm (``is_bmm`` 1) is B independent
    M x K @ K x N. Plain arithmetic, so it works on floats and, elementwise, on numpy arrays."""
    Bb = 1 + is_bmm * (B - 1)
    Mr = M * B / Bb
    return Bb, Mr, 2.0 * Bb * Mr * N * K, e * Bb * (Mr * K + K * N + Mr * N)


def vector_work(n_in, fpe, B, H, e):
    """(elements, FLOPs, bytes) of a vector op over B x H elements with ``n_in`` inputs and one
    output and ``fpe`` FLOPs per element (floats or numpy arrays)."""
    n = B * H
    return n, fpe * n, e * n * (n_in + 1)


def kernel_work(op: str, dims: Mapping, e: int) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one kernel with ``e`` bytes per element; a dimension missing from
    ``dims`` counts as 1, a vector op not in the tables as 1 FLOP and 1 input per element.
    The one definition behind :func:`gemm`, :func:`vec`, the roofline, the CPU profile model and
    (through :func:`gemm_work` / :func:`vector_work`) the learned model's features."""
    d = lambda k: float(dims.get(k) or 1)  # noqa: E731
    if op in GEMM_OPS:
        _, _, flops, nbytes = gemm_work(float(op == "bmm"), d("B"), d("M"), d("N"), d("K"), e)
    else:
        _, flops, nbytes = vector_work(VEC_INPUTS.get(op, 1), VEC_FLOPS.get(op, 1), d("B"), d("H"), e)
    return float(flops), float(nbytes)


def gemm(name: str, op: str, B: int, M: int, N: int, K: int, e: int) -> Op:
    """A ``linear`` or ``bmm`` kernel with ``e`` bytes per element (conventions: module docstring)."""
    return Op(name, op, (B, M, N, K), *kernel_work(op, {"B": B, "M": M, "N": N, "K": K}, e))


def flash_gemm(name: str, B: int, M: int, N: int, K: int, e: int) -> Op:
    """A ``bmm`` of a fused attention kernel: the largest of its three matrices (the s x s one)
    never reaches device memory, only the others (queries, keys, values, outputs) do."""
    flops, nbytes = kernel_work("bmm", {"B": B, "M": M, "N": N, "K": K}, e)
    return Op(name, "bmm", (B, M, N, K), flops, nbytes - e * B * max(M * K, K * N, M * N), fused=True)


def vec(name: str, op: str, B: int, H: int, e: int) -> Op:
    """A vector kernel over ``B`` rows of ``H`` elements of ``e`` bytes."""
    return Op(name, op, (B, H), *kernel_work(op, {"B": B, "H": H}, e))


def backward_of(f: Op, e: int) -> list[Op]:
    """The backward kernels of forward op ``f``."""
    if f.op == "linear":
        B, M, N, K = f.dims
        return [gemm(f.name + ".dgrad", "linear", B, M, K, N, e),     # dY (BM x N) @ W^T (N x K)
                gemm(f.name + ".wgrad", "linear", 1, K, N, B * M, e)]  # X^T (K x BM) @ dY (BM x N)
    if f.op == "bmm":
        B, M, N, K = f.dims
        if f.fused:   # the fused kernel's backward keeps its s x s gradients on chip too
            return [flash_gemm(f.name + ".dgrad_a", B, M, K, N, e), flash_gemm(f.name + ".dgrad_b", B, K, N, M, e)]
        return [gemm(f.name + ".dgrad_a", "bmm", B, M, K, N, e),
                gemm(f.name + ".dgrad_b", "bmm", B, K, N, M, e)]
    return [Op(f.name + ".grad", f.op, f.dims, f.flops, f.nbytes),
            Op(f.name + ".grad2", f.op, f.dims, f.flops, f.nbytes)]


OPTIMIZER_BYTES_PER_PARAM = 28
"""Adam step traffic per fp32 parameter: read grad (4), read+write parameter, m, v (24). hetero's
runtime keeps fp32 parameters under autocast and updates them in place, nothing more; Megatron-LM's
mixed precision also writes the model-dtype copy of its fp32 master weights (+e, see
:meth:`hetero.predictor.costs.StageCostModel.optimizer_time`)."""
GRAD_NORM_BYTES_PER_PARAM = 4
"""The step's gradient-norm pass (clipping needs the global norm before AdamW runs): one read of
each fp32 gradient."""


# Names of the attention core (what selective recomputation recomputes in backward).
ATTENTION_CORE = ("scores", "softmax", "attn_dropout", "context")


def layer_forward_ops(model: ModelSpec, b: int, s: int, t: int, dtype: str | None = None) -> list[Op]:
    """Forward kernels of one transformer block on one of ``t`` tensor-parallel ranks."""
    e = DTYPE_BYTES[dtype or model.dtype]
    h, a = model.hidden_size, model.num_attention_heads
    kv = model.kv_dim
    f = model.ffn_hidden_size
    d = h // a
    rows = b * s
    at = a // t
    ops = [vec("ln1", "ln", rows, h, e),
           gemm("qkv", "linear", b, s, (h + 2 * kv) // t, h, e)]
    if model.architecture == "llama":  # RoPE on q and k: x*cos + rotate(x)*sin
        rh = (h + kv) // t
        ops += [vec("rope.mul_cos", "mul", rows, rh, e), vec("rope.mul_sin", "mul", rows, rh, e),
                vec("rope.add", "add", rows, rh, e)]
    fused = model.attention == "fused"
    ops += [flash_gemm("scores", b * at, s, s, d, e) if fused else gemm("scores", "bmm", b * at, s, s, d, e)]
    if not fused:
        ops.append(vec("softmax", "softmax", b * at * s, s, e))   # fused scale + mask + softmax
        if model.dropout > 0:
            ops.append(vec("attn_dropout", "mul", b * at * s, s, e))
    # fused attention is costed as its two GEMMs (softmax and dropout run inside the kernel, on
    # tiles in on-chip memory), each moving its queries, keys, values and outputs but not the s x s
    # tile it holds on chip (:func:`flash_gemm`)
    ops += [flash_gemm("context", b * at, s, d, s, e) if fused else gemm("context", "bmm", b * at, s, d, s, e),
            gemm("out_proj", "linear", b, s, h, h // t, e)]
    if model.dropout > 0:
        ops.append(vec("attn_out_dropout", "mul", rows, h, e))
    ops += [vec("residual1", "add", rows, h, e), vec("ln2", "ln", rows, h, e)]
    ft = f // t
    if model.gated_mlp:
        ops += [gemm("mlp.gate", "linear", b, s, ft, h, e), gemm("mlp.up", "linear", b, s, ft, h, e),
                vec("mlp.silu", "gelu", rows, ft, e), vec("mlp.gate_mul", "mul", rows, ft, e),
                gemm("mlp.down", "linear", b, s, h, ft, e)]
    else:
        act = "relu" if model.activation == "relu" else "gelu"
        ops += [gemm("mlp.fc1", "linear", b, s, ft, h, e), vec("mlp.act", act, rows, ft, e),
                gemm("mlp.fc2", "linear", b, s, h, ft, e)]
    if model.dropout > 0:
        ops.append(vec("mlp_dropout", "mul", rows, h, e))
    ops.append(vec("residual2", "add", rows, h, e))
    return ops


def layer_backward_ops(model: ModelSpec, b: int, s: int, t: int, recompute: str = "none",
                       dtype: str | None = None) -> list[Op]:
    """Backward kernels of one block, including recomputation (selective: the attention core
    again; full: the whole forward again)."""
    e = DTYPE_BYTES[dtype or model.dtype]
    fwd = layer_forward_ops(model, b, s, t, dtype)
    ops: list[Op] = []
    if recompute == "full":
        ops += [replace(o, name="recompute." + o.name) for o in fwd]
    elif recompute == "selective":  # fused: the kernel's forward (its two GEMMs) runs again
        ops += [replace(o, name="recompute." + o.name) for o in fwd if o.name in ATTENTION_CORE]
    if model.attention == "fused":  # a flash backward recomputes the scores tile by tile
        ops += [replace(o, name="attention.rescores") for o in fwd if o.name == "scores"]
    for o in reversed(fwd):
        ops += backward_of(o, e)
    return ops


def embedding_forward_ops(model: ModelSpec, b: int, s: int, t: int, dtype: str | None = None) -> list[Op]:
    """First stage: token lookup (vocabulary-parallel, a gather over b*s*h) plus learned positions (gpt)."""
    e = DTYPE_BYTES[dtype or model.dtype]
    ops = [Op("embedding.lookup", "add", (b * s, model.hidden_size), 0.0, float(2 * e * b * s * model.hidden_size))]
    if model.architecture == "gpt":
        ops.append(vec("embedding.positions", "add", b * s, model.hidden_size, e))
    return ops


def embedding_backward_ops(model: ModelSpec, b: int, s: int, t: int, dtype: str | None = None) -> list[Op]:
    """Backward of :func:`embedding_forward_ops`: one gradient pass per forward op."""
    e = DTYPE_BYTES[dtype or model.dtype]
    ops = []
    for o in embedding_forward_ops(model, b, s, t, dtype):
        ops += backward_of(o, e)[:1]  # scatter-add of the gradient rows
    return ops


def _fp32_pass(name: str, op: str, rows: int, cols: int, bytes_per_element: float) -> Op:
    """A memory-bound fp32 kernel over ``rows`` x ``cols`` elements that moves ``bytes_per_element``
    bytes per element, as the operator model's one-input ``op`` over the columns that move the same
    bytes (a row reduction reads 4 bytes per element: half the columns of a read + write pass)."""
    width = max(1, round(cols * bytes_per_element / 8))
    return Op(name, op, (rows, width), *kernel_work(op, {"B": rows, "H": width}, 4), dtype="fp32")


def cross_entropy_forward_ops(b: int, s: int, Vt: int, e: int) -> list[Op]:
    """Megatron's vocabulary-parallel cross entropy, forward, on b*s rows of ``Vt`` logits:
    ``vocab_parallel_cross_entropy(logits.float(), labels)`` runs the cast to fp32, a row max, the
    subtraction of the max, exp in place, a row sum and the division in place (the fp32 softmax it
    keeps for backward): about 38 bytes per logit, against 4 for one fused fp16 softmax pass."""
    n = b * s
    ops = [_fp32_pass("loss.cast", "relu", n, Vt, e + 4)] if e < 4 else []
    return ops + [_fp32_pass("loss.max", "relu", n, Vt, 4),
                  _fp32_pass("loss.sub_max", "relu", n, Vt, 8),
                  _fp32_pass("loss.exp", "tanh", n, Vt, 8),
                  _fp32_pass("loss.sum", "relu", n, Vt, 4),
                  _fp32_pass("loss.normalise", "relu", n, Vt, 8)]


def cross_entropy_backward_ops(b: int, s: int, Vt: int, e: int) -> list[Op]:
    """Backward of :func:`cross_entropy_forward_ops`: the saved softmax times the loss gradient in
    place, then the cast of the logits gradient back to the model dtype."""
    n = b * s
    return ([_fp32_pass("loss.grad", "relu", n, Vt, 8)]
            + ([_fp32_pass("loss.grad_cast", "relu", n, Vt, 4 + e)] if e < 4 else []))


def _head_ops(model: ModelSpec, b: int, s: int, t: int, e: int) -> list[Op]:
    """The last stage's final norm and LM head GEMM (vocabulary-parallel), before the loss."""
    return [vec("final_norm", "ln", b * s, model.hidden_size, e),
            gemm("lm_head", "linear", b, s, _vocab_shard(model, t), model.hidden_size, e)]


def _vocab_shard(model: ModelSpec, t: int) -> int:
    """Logits per row on one of ``t`` tensor-parallel ranks."""
    return -(-model.vocab_size // t)


def head_forward_ops(model: ModelSpec, b: int, s: int, t: int, dtype: str | None = None) -> list[Op]:
    """Last stage: final norm, LM head GEMM (vocabulary-parallel) and the cross entropy."""
    e = DTYPE_BYTES[dtype or model.dtype]
    return _head_ops(model, b, s, t, e) + cross_entropy_forward_ops(b, s, _vocab_shard(model, t), e)


def head_backward_ops(model: ModelSpec, b: int, s: int, t: int, dtype: str | None = None) -> list[Op]:
    """Backward of :func:`head_forward_ops`, in reverse order."""
    e = DTYPE_BYTES[dtype or model.dtype]
    ops = cross_entropy_backward_ops(b, s, _vocab_shard(model, t), e)
    for o in reversed(_head_ops(model, b, s, t, e)):
        ops += backward_of(o, e)
    return ops


def total_flops(ops) -> float:
    """FLOPs of ``ops``."""
    return sum(o.flops for o in ops)


def gemm_flops(ops) -> float:
    """FLOPs of the GEMMs among ``ops``."""
    return sum(o.flops for o in ops if o.is_gemm)


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token: 6 x (matmul parameters: blocks + LM head) + attention (12 L h s).

    The attention term counts the two s x s GEMMs (scores and context), forward and backward
    (PaLM's 6N + 12 L H Q T, with causal masking not discounted, as Megatron reports it).
    """
    n = model.num_layers * model.params_per_layer() + model.vocab_size * model.hidden_size
    return 6.0 * n + 12.0 * model.num_layers * model.hidden_size * model.seq_length


__all__ = ["Op", "DTYPE_BYTES", "ATTENTION_CORE", "gemm_work", "vector_work", "kernel_work", "layer_forward_ops", "layer_backward_ops",
           "embedding_forward_ops", "embedding_backward_ops", "head_forward_ops", "head_backward_ops",
           "backward_of", "total_flops", "gemm_flops", "model_flops_per_token"]
