"""GPT and Llama blocks, and the part of the model one pipeline stage holds.

A stage builds only its own layers: the token (and, for gpt, position) embedding on the first
stage, the final norm and LM head on the last. Parameter names are global: ``layers.<l>.<tensor>``
with ``l`` the model-wide layer index, ``wte.weight``, ``wpe.weight``, ``final_norm.*``,
``head.weight``. With tied embeddings the last stage keeps its own copy of ``wte.weight`` (as
Megatron does); its gradient is summed with the first stage's by the gradient synchroniser, so
the copies never drift.

Initialisation is a function of (seed, parameter name) only, on the full (unsharded) tensor, so
any split of the model, any tp degree, gives the weights of the single-device model.
"""
from __future__ import annotations

import contextlib
import math
import sys
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetero.runtime.batch import IGNORE_INDEX
from hetero.specs.model import ModelSpec


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor. torch.distributed.tensor (with the compiler stack it imports, 50 MB)
    is imported only where tensor parallelism is applied, so a process that only works out shapes
    (the launcher: parameter holders, transitions) never loads it; no DTensor exists before it is."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)

# ---------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """x: (B, T, H, D) at positions ``offset .. offset + T - 1``; rotate pairs (even, odd) of the head dimension."""
    T = x.shape[1]
    c, s = cos[offset:offset + T].view(1, T, 1, -1), sin[offset:offset + T].view(1, T, 1, -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention. Head counts are read from the projections' output widths, so the
    same code runs unsharded and with column-parallel q/k/v (local heads only)."""

    def __init__(self, spec: ModelSpec, rope: bool):
        super().__init__()
        h, kv, bias = spec.hidden_size, spec.kv_dim, spec.has_bias
        self.head_dim = spec.head_dim
        self.rope = rope
        self.recompute_core = False
        self.wq = nn.Linear(h, h, bias=spec.has_qkv_bias)
        self.wk = nn.Linear(h, kv, bias=spec.has_qkv_bias)
        self.wv = nn.Linear(h, kv, bias=spec.has_qkv_bias)
        self.wo = nn.Linear(h, h, bias=bias)
        if rope:
            cos, sin = rope_tables(spec.seq_length, spec.head_dim, spec.rope_theta)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, cache=None):
        """``cache``: generation's key/value cache of this layer (:class:`hetero.rl.kv_cache.LayerCache`):
        ``x`` holds the tokens after the ``cache.length`` cached ones, whose keys and values it appends."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        offset = 0 if cache is None else cache.length
        if self.rope:
            q, k = apply_rope(q, self.cos, self.sin, offset), apply_rope(k, self.cos, self.sin, offset)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        # grouped-query attention: SDPA pairs each k/v head with its group of query heads itself, so
        # backward keeps k and v at kv width (expanding them first kept both widths: 1.6x the saved
        # bytes of a 4:1 group on the CPU kernel)
        gqa = q.shape[1] != k.shape[1]
        if self.recompute_core and torch.is_grad_enabled():
            # selective recomputation: keep q, k, v; recompute the attention core in backward
            y = checkpoint(_attention_core, q, k, v, gqa, use_reentrant=False)
        else:
            y = _attention_core(q, k, v, gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _attention_core(q, k, v, gqa: bool = False):
    if k.shape[2] != q.shape[2]:   # generation: cached keys come before these queries
        return _cached_attention_core(q, k, v, gqa)
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _cached_attention_core(q, k, v, gqa: bool):
    """Queries at the last ``T`` of ``L`` key positions: each sees the keys up to its own position (one
    query, a decode step, sees them all)."""
    T, L = q.shape[2], k.shape[2]
    mask = None if T == 1 else torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class MLP(nn.Module):
    """The dense MLP (SwiGLU, or gelu / relu); also each expert of an MoE layer, at width ``ffn``."""

    def __init__(self, spec: ModelSpec, ffn: int | None = None):
        super().__init__()
        h, f, bias = spec.hidden_size, ffn or spec.ffn_hidden_size, spec.has_bias
        self.gated = spec.gated_mlp
        self.act = spec.activation
        self.w1 = nn.Linear(h, f, bias=bias)      # up (gate for swiglu)
        if self.gated:
            self.w3 = nn.Linear(h, f, bias=bias)  # up
        self.w2 = nn.Linear(f, h, bias=bias)      # down

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        a = self.w1(x)
        a = F.gelu(a, approximate="tanh") if self.act == "gelu" else F.relu(a)
        return self.w2(a)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0):
        """``layer``: the model-wide index, which tells an MoE layer (:class:`hetero.runtime.moe.MoEMLP`
        as ``mlp``) from a dense one."""
        super().__init__()
        llama = spec.architecture == "llama"
        norm = (lambda: RMSNorm(spec.hidden_size, spec.norm_eps)) if llama else \
            (lambda: nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps))
        self.norm1 = norm()
        self.attn = Attention(spec, rope=llama)
        self.norm2 = norm()
        if spec.is_moe_layer(layer):
            from hetero.runtime.moe import MoEMLP

            self.mlp = MoEMLP(spec, MLP)
        else:
            self.mlp = MLP(spec)

    def forward(self, x, cache=None):
        """``cache``: the layer's key/value cache when generating (see :meth:`Attention.forward`)."""
        x = x + self.attn(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


#: module paths inside a block that are column- / row-parallel under tensor parallelism
COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")
ROWWISE = ("attn.wo", "mlp.w2")


def tp_shard_dim(name: str) -> int | None:
    """The dim of global parameter ``name`` that :func:`apply_tensor_parallel` splits over the tp
    ranks (0: column-parallel weights and biases, the vocabulary-parallel embedding and head; 1:
    row-parallel weights), or None for a tensor every tp rank holds whole (norms, row-parallel
    biases, learned positions)."""
    module, leaf = name.rsplit(".", 1)
    if module in ("wte", "head") or module.endswith(COLWISE):
        return 0
    if module.endswith(ROWWISE):
        return 1 if leaf == "weight" else None
    return None

# ---------------------------------------------------------------------------- one stage


class StageModel(nn.Module):
    """Layers ``[start, end)`` of ``spec``; embedding if ``first``, final norm + head if ``last``.

    With ``chunks`` (an interleaved schedule's model chunks on one rank: layer ranges in pipeline
    order) the rank holds every chunk's layers, ``forward(x, chunk)`` runs one of them, the
    embedding comes before chunk 0 and the head after the last chunk. Parameter names stay global
    (``layers.<l>....``) either way, so gradient sync and checkpoints need not know about chunks."""

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool,
                 chunks: tuple[tuple[int, int], ...] | None = None):
        super().__init__()
        self.spec, self.first, self.last = spec, first, last
        self.chunks = tuple(tuple(c) for c in chunks) if chunks else (tuple(layers),)
        self.start, self.end = self.chunks[0][0], self.chunks[-1][1]
        self.recompute = "none"
        self.before_use = None
        """Called with a submodule's name (``wte``, ``layers.<i>``, ``final_norm``, ``head``) before the
        forward first uses it: ZeRO's parameter all-gathers run under the forward and are waited for
        there (:meth:`hetero.runtime.zero.ShardedAdamW.wait_parameters`). Outside the compiled blocks,
        so no hook enters their graphs."""
        h = spec.hidden_size
        tied = bool(spec.tie_embeddings)
        if first or (last and tied):
            self.wte = nn.Embedding(spec.vocab_size, h)
        if first and spec.architecture == "gpt":
            self.wpe = nn.Embedding(spec.seq_length, h)
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for a, b in self.chunks for i in range(a, b)})
        if last:
            self.final_norm = (RMSNorm(h, spec.norm_eps) if spec.architecture == "llama"
                               else nn.LayerNorm(h, eps=spec.norm_eps))
            if not tied:
                self.head = nn.Linear(h, spec.vocab_size, bias=False)

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation as the plan asks: ``none``, ``selective`` (the attention core
        of every block is recomputed in backward) or ``full`` (every block's forward is)."""
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"unknown recompute mode {mode!r}")
        self.recompute = mode
        for block in self.layers.values():
            block.attn.recompute_core = mode == "selective"

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Tokens (B, T) into the first stage, else hidden states (B, T, h); returns hidden states,
        or logits (B, T, vocab) out of the last stage (under tensor parallelism a DTensor sharded on
        the vocabulary, for :func:`loss_fn`). ``chunk``: which model chunk to run."""
        wait = self.before_use
        if self.first and chunk == 0:
            if wait is not None:
                wait("wte")
                wait("wpe")
            tokens = x
            w = self.wte.weight
            x = vocab_parallel_lookup(tokens, w) if is_dtensor(w) else self.wte(tokens)
            if hasattr(self, "wpe"):
                x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        a, b = self.chunks[chunk]
        for i in range(a, b):
            block = self.layers[str(i)]
            if wait is not None:
                wait(f"layers.{i}")
            if self.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # keep only each block's input
            else:
                x = block(x)
        if self.last and chunk == len(self.chunks) - 1:
            if wait is not None:
                for name in ("final_norm", "head", "wte"):
                    wait(name)
            x = self.final_norm(x)
            if hasattr(self, "head"):
                x = self.head(x)
            else:
                w = self.wte.weight
                if is_dtensor(w):   # vocabulary-parallel: logits sharded on the vocabulary
                    from torch.distributed.tensor import DTensor, Replicate

                    x = DTensor.from_local(x, w.device_mesh, [Replicate()])
                x = F.linear(x, w)
        return x


def compile_blocks(module: StageModel, **options) -> int:
    """Compile every transformer block of ``module`` with ``torch.compile`` in place (regional
    compilation, as torchtitan does): the blocks share one code object, so one compiled graph serves
    every block of every stage whatever their number, and compile time stays that of one block. The
    embedding, head and loss stay eager; so do the collectives between blocks and stages. Parameter
    names, the fp32 parameters and the optimizer are untouched (the module's ``compile`` keeps the
    module; autocast casts inside the graph). Inside a tensor-parallel block dynamo traces the
    DTensor operations and breaks the graph where it cannot (``fullgraph=False``), running those
    parts eagerly. A submodule that sets ``eager_under_compile`` (a mixture-of-experts layer: data-
    dependent shapes and host-side counts) runs eagerly inside its compiled block; it is marked here, not
    with a decorator where it is defined, since ``torch.compiler.disable`` imports dynamo into every
    process that imports the module, the launcher included (docs/testing.md gives the cost). Returns
    the number of blocks compiled."""
    for block in module.layers.values():
        for sub in block.modules():
            if getattr(sub, "eager_under_compile", False):
                sub.forward = torch.compiler.disable(sub.forward)
        block.compile(**options)
    return len(module.layers)


def stage_param_shapes(spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool,
                       chunks: tuple[tuple[int, int], ...] | None = None) -> dict[str, tuple]:
    """Global parameter names and full shapes of a stage, without building it (meta device)."""
    with torch.device("meta"), skip_init():
        m = StageModel(spec, layers, first, last, chunks)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


@contextlib.contextmanager
def skip_init():
    """torch.nn.init's functions as no-ops (for modules built on the meta device, whose values come
    from elsewhere or never exist): random fills of meta tensors run through torch's Python reference
    kernels, whose import loads the compiler stack (50 MB) into a process that never computes, such
    as the launcher, and cost a reshard's rebuild 0.05-0.08 s."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "ones_", "zeros_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_weights(module: StageModel, seed: int) -> None:
    """GPT-2 style init, deterministic per (seed, global parameter name)."""
    spec = module.spec
    std = 0.02
    out_std = std / math.sqrt(2 * spec.num_layers)
    for name, p in module.named_parameters():
        g = torch.Generator().manual_seed(_seed_for(seed, name))
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            p.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            p.zero_()
        else:
            s = out_std if name.endswith(("attn.wo.weight", ".w2.weight")) else std   # MLPs and experts
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * s)


def build_stage(spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool, seed: int,
                chunks: tuple[tuple[int, int], ...] | None = None) -> StageModel:
    """A stage (or a rank's interleaved chunks) with its deterministic initial weights."""
    m = StageModel(spec, tuple(layers), first, last, chunks)
    init_weights(m, seed)
    return m


def apply_tensor_parallel(module: StageModel, mesh, src_data_rank: int | None = 0) -> None:
    """Shard every block's attention and MLP, the word embedding and the LM head Megatron-style
    over ``mesh`` (a 1-D DeviceMesh).

    q/k/v and the MLP up projections are column-parallel (heads / ffn columns split), the output
    and down projections row-parallel (an all-reduce at their output). The word embedding and the
    head are vocabulary-parallel: each tp rank keeps its rows of the vocabulary (the embedding's
    lookups are summed over the tp group; a tied head multiplies by the same rows), the logits
    stay sharded on the vocabulary and :func:`loss_fn` computes the cross-entropy over the shards
    (torch's loss_parallel), so no rank holds the full logits. Norms and the learned positions stay
    replicated, so the residual stream between blocks and stages is replicated.
    """
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if any(module.spec.is_moe_layer(int(i)) for i in module.layers):
        from hetero.errors import HeteroError

        raise HeteroError(f"model {module.spec.name}: tensor parallelism (tp > 1) of mixture-of-experts layers is "
                          f"not supported; give the stages holding MoE layers tp: 1")
    if hasattr(module, "wte"):   # rows split over the vocabulary; looked up by vocab_parallel_lookup
        module.wte.weight = nn.Parameter(distribute_tensor(module.wte.weight.detach(), mesh, [Shard(0)],
                                                           src_data_rank=src_data_rank))
    if hasattr(module, "head"):
        parallelize_module(module.head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
                           src_data_rank=src_data_rank)
    for block in module.layers.values():
        plan = {}
        for path in COLWISE:
            if _has(block, path):
                plan[path] = ColwiseParallel()
        for path in ROWWISE:
            plan[path] = RowwiseParallel()
        parallelize_module(block, mesh, plan, src_data_rank=src_data_rank)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def vocab_parallel_lookup(tokens: torch.Tensor, weight) -> torch.Tensor:
    """Embedding lookup with ``weight`` split over the vocabulary (a DTensor sharded on rows), as
    Megatron-LM's VocabParallelEmbedding: each tp rank looks up the tokens in its rows (zeros
    elsewhere) and the partial results are summed over the tp group. Backward passes the
    (replicated) output gradient straight to each rank's rows, so the weight's gradient is its shard,
    never a whole vocabulary x hidden tensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = weight.device_mesh
    local = weight.to_local()
    rows = -(-weight.shape[0] // mesh.size())   # torch's Shard(0): the first ranks take ceil(V / t)
    start = mesh.get_local_rank() * rows
    outside = (tokens < start) | (tokens >= start + local.shape[0])
    out = F.embedding((tokens - start).masked_fill(outside, 0), local)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()


def vocab_parallel(t: torch.Tensor):
    """torch's loss_parallel context for a DTensor sharded on the vocabulary (forward and backward of
    the cross-entropy), else nothing."""
    if is_dtensor(t):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy of one micro-batch (fp32) over the targets that carry loss (not
    :data:`~hetero.runtime.batch.IGNORE_INDEX`): their mean, or with ``reduction="sum"`` their sum
    (:func:`loss_sum`). Logits sharded on the vocabulary (a DTensor, tensor parallelism) are reduced
    over the shards; the loss is then a replicated DTensor, whose backward must run under
    :func:`backward_loss`."""
    with vocab_parallel(logits):
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction=reduction)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy of one micro-batch: what the engines divide by the step's loss
    tokens (``source.loss_tokens``, :mod:`hetero.runtime.data`) so the step's loss is the mean over
    the global batch's loss tokens, whatever the plan's split of it."""
    return loss_fn(logits, targets, "sum")


def loss_value(loss: torch.Tensor) -> float:
    """The loss as a Python float (a replicated DTensor's local value)."""
    loss = loss.detach()
    return float(loss.to_local() if is_dtensor(loss) else loss)


def backward_loss(loss: torch.Tensor) -> None:
    """``loss.backward()``; a vocabulary-parallel loss backpropagates under loss_parallel."""
    with vocab_parallel(loss):
        loss.backward()
