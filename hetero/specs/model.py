"""Model files: the transformer's shape (gpt or llama), with derived sizes and parameter counts."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from .errors import Problems, join_path
from .io import read_mapping, write_yaml_atomic
from .schema import is_missing, load_dataclass, to_plain

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def llama_ffn_size(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width rule: 2/3 of 4h, rounded up to a multiple of 256 (7B: 11008)."""
    ffn = int(2 * 4 * hidden / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (the model file's optional ``moe:`` block): in an MoE layer the
    dense MLP is replaced by ``num_experts`` routed experts, of which a router picks ``top_k`` per
    token, plus an optional always-on shared expert (Qwen2-MoE). Experts use the dense MLP's
    activation (SwiGLU for llama, gelu / relu for gpt)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int | None = None
    """Each routed expert's MLP width; default the model's ffn_hidden_size."""
    shared_expert_ffn_hidden_size: int = 0
    """An always-on shared expert's width (Qwen2-MoE: gated by a sigmoid of one linear score); 0: none."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate weights to sum to 1 (Mixtral); false keeps the router's values."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    every: int = 1
    """An MoE MLP in every k-th layer: layer l (from 0) is MoE when (l + 1) % every == 0 (Qwen2-MoE's
    decoder_sparse_step); the others are dense."""
    dense_layers: list[int] = ()
    """Layers kept dense whatever ``every`` says (DeepSeek's first dense layers, Qwen2-MoE's mlp_only_layers)."""
    balance: Literal["aux", "bias", "none"] = "aux"
    """aux: the load-balancing loss num_experts * sum_i f_i * P_i (Switch / Mixtral) times aux_loss_coef
    is added to the training loss; bias: aux-loss-free (DeepSeek-V3), a per-expert bias added to the
    scores for the top-k choice alone, moved by bias_update_rate toward the mean load after each step;
    none: nothing."""
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.001
    """balance: bias: how far each expert's bias moves per step (sign(mean load - load) * rate)."""
    capacity_factor: float | None = None
    """null: dropless. A number c: each expert takes at most ceil(c * tokens * top_k / num_experts) token
    assignments per micro-batch and layer; later ones (in token order) are dropped and counted."""

    def _check(self, path: str, problems: Problems) -> None:
        if self.num_experts < 1:
            problems.add(join_path(path, "num_experts"), f"must be >= 1, got {self.num_experts}",
                         "give the routed expert count, e.g. 8")
        if not 1 <= self.top_k <= max(self.num_experts, 1):
            problems.add(join_path(path, "top_k"),
                         f"must be in [1, num_experts ({self.num_experts})], got {self.top_k}",
                         "the experts each token goes to, e.g. 2")
        for name in ("expert_ffn_hidden_size",):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.add(join_path(path, name), f"must be >= 1, got {value}",
                             "give each expert's MLP width, or drop it for the model's ffn_hidden_size")
        if self.shared_expert_ffn_hidden_size < 0:
            problems.add(join_path(path, "shared_expert_ffn_hidden_size"),
                         f"must be >= 0, got {self.shared_expert_ffn_hidden_size}",
                         "the shared expert's MLP width, or 0 for none")
        if self.every < 1:
            problems.add(join_path(path, "every"), f"must be >= 1, got {self.every}",
                         "1 for an MoE MLP in every layer, 2 for every other layer")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            problems.add(join_path(path, "dense_layers"), f"repeats a layer: {list(self.dense_layers)}",
                         "list each dense layer once")
        if self.aux_loss_coef < 0:
            problems.add(join_path(path, "aux_loss_coef"), f"must be >= 0, got {self.aux_loss_coef:g}",
                         "the load-balancing loss's weight, e.g. 0.01")
        if not self.bias_update_rate > 0:
            problems.add(join_path(path, "bias_update_rate"), f"must be positive, got {self.bias_update_rate:g}",
                         "the per-step bias step of balance: bias, e.g. 0.001")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            problems.add(join_path(path, "capacity_factor"), f"must be positive or null, got {self.capacity_factor:g}",
                         "null for dropless routing, or e.g. 1.25")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer ``layer`` (from 0) has the MoE MLP (else the dense one)."""
        return (layer + 1) % self.every == 0 and layer not in self.dense_layers

    def capacity(self, tokens: int) -> int | None:
        """Token assignments each expert takes of ``tokens`` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Optional fields are filled with the architecture's defaults."""

    _file_kind = "model"   # a class attribute, not a field: names plan / cluster fields given here

    # --- identity ---
    name: str
    architecture: Literal["gpt", "llama"]
    """gpt: learned positions, LayerNorm, 4h MLP, biases. llama: RoPE, RMSNorm, SwiGLU, GQA, no biases."""
    # --- shape ---
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); default = num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP width; default 4 x hidden (gpt) or the llama rule (2/3 of 4h rounded to 256)."""
    activation: Literal["gelu", "relu", "swiglu"] | None = None
    """Default gelu (gpt) or swiglu (llama)."""
    # --- numerics ---
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """fp16/bf16 mean mixed precision with fp32 master weights."""
    tie_embeddings: bool | None = None
    """Share the input embedding with the LM head; default true (gpt), false (llama)."""
    dropout: float = 0.0
    attention: Literal["unfused", "fused"] = "unfused"
    """How the attention core runs. unfused: scores, softmax and context as separate kernels, the
    softmax output kept for backward (Megatron without flash attention; what the CPU memory
    validation and the vTrain runs measure). fused: one kernel (FlashAttention, torch's
    scaled_dot_product_attention, which hetero's runtime uses): no s x s tensor reaches device
    memory, and backward recomputes the scores blockwise."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    """Biases on the q, k and v projections alone (Qwen2's llama blocks); gpt has every bias anyway."""
    moe: MoESpec | None = None
    """A mixture of experts in place of the dense MLP of some layers (absent: a dense model)."""

    def _check(self, path: str, problems: Problems) -> None:
        for name, what in (("num_layers", "the number of transformer blocks, e.g. 24"),
                           ("hidden_size", "the model width, e.g. 1024"),
                           ("num_attention_heads", "the attention head count, e.g. 16"),
                           ("vocab_size", "the tokenizer's vocabulary size, e.g. 50257"),
                           ("seq_length", "tokens per sample, e.g. 1024")):
            if getattr(self, name) < 1:
                problems.add(join_path(path, name), f"must be >= 1, got {getattr(self, name)}", f"give {what}")
        if self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads:
            problems.add(join_path(path, "hidden_size"),
                         f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                         f"({self.num_attention_heads})", "choose a head count that divides the hidden size")
        kv = self.num_kv_heads
        if kv is not None and (kv < 1 or self.num_attention_heads % kv):
            problems.add(join_path(path, "num_kv_heads"),
                         f"num_kv_heads ({kv}) must divide num_attention_heads ({self.num_attention_heads})",
                         "use a divisor of the head count (e.g. 8 for 64 heads)")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            problems.add(join_path(path, "ffn_hidden_size"), f"must be >= 1, got {self.ffn_hidden_size}",
                         "give the MLP width (e.g. 4 x hidden_size for gpt), or drop it for the architecture's default")
        if not 0.0 <= self.dropout < 1.0:
            problems.add(join_path(path, "dropout"), f"must be in [0, 1), got {self.dropout}",
                         "a probability: 0 for none, e.g. 0.1")
        if not 0.0 < self.norm_eps < 1.0:
            problems.add(join_path(path, "norm_eps"), f"must be in (0, 1), got {self.norm_eps:g}",
                         "the small positive constant of LayerNorm / RMSNorm, e.g. 1e-5 (or drop it)")
        if not self.rope_theta > 0.0:
            problems.add(join_path(path, "rope_theta"), f"must be positive, got {self.rope_theta:g}",
                         "the rotary embedding base, e.g. 10000 (or drop it)")
        if self.architecture == "gpt" and self.activation == "swiglu":
            problems.add(join_path(path, "activation"), "swiglu belongs to the llama architecture",
                         "use gelu or relu for gpt, or architecture: llama")
        if self.moe is not None:
            bad = [layer for layer in self.moe.dense_layers if not 0 <= layer < self.num_layers]
            if bad:
                problems.add(join_path(path, "moe.dense_layers"), f"layers {bad} are outside 0..{self.num_layers - 1}",
                             "list layer indices of this model (from 0)")
            elif self.num_layers >= 1 and not self.moe_layers():
                problems.add(join_path(path, "moe"), "no layer is an MoE layer (every / dense_layers leave none)",
                             "lower moe.every or shorten moe.dense_layers, or drop the moe block")

    def __post_init__(self) -> None:
        # Fill the architecture's defaults at construction, so every ModelSpec is complete and no
        # caller needs its own fallback (frozen dataclass: set through object.__setattr__).
        is_gpt = self.architecture == "gpt"
        defaults = {
            "num_kv_heads": self.num_attention_heads,
            "ffn_hidden_size": 4 * self.hidden_size if is_gpt else llama_ffn_size(self.hidden_size),
            "activation": "gelu" if is_gpt else "swiglu",
            "tie_embeddings": is_gpt,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.moe is not None and self.moe.expert_ffn_hidden_size is None:
            object.__setattr__(self, "moe", dataclasses.replace(self.moe, expert_ffn_hidden_size=self.ffn_hidden_size))

    # --- derived sizes ---
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "swiglu"

    @property
    def has_bias(self) -> bool:
        return self.architecture == "gpt"

    @property
    def has_qkv_bias(self) -> bool:
        return self.has_bias or self.qkv_bias

    def params_per_layer(self) -> int:
        """Parameters of one transformer block."""
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_dim
        attn = h * h + 2 * h * kv + h * h          # q, k, v, out
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.has_bias:
            attn += h + 2 * kv + h
            mlp += (2 * f if self.gated_mlp else f) + h
            norms = 4 * h                           # two LayerNorms, weight and bias
        else:
            attn += (h + 2 * kv) if self.qkv_bias else 0
            norms = 2 * h                           # two RMSNorms, weight only
        return attn + mlp + norms

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) has the MoE MLP (see :meth:`MoESpec.is_moe_layer`)."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers' indices (empty for a dense model)."""
        return tuple(layer for layer in range(self.num_layers) if self.is_moe_layer(layer))

    def expert_params(self, ffn: int | None = None) -> int:
        """Parameters of one expert MLP of width ``ffn`` (default the routed experts' width)."""
        h, f = self.hidden_size, ffn if ffn is not None else self.moe.expert_ffn_hidden_size
        mlp = (3 if self.gated_mlp else 2) * h * f
        return mlp + ((2 * f if self.gated_mlp else f) + h if self.has_bias else 0)

    def moe_layer_params(self) -> int:
        """Parameters of one MoE block: a dense block's less its MLP, plus the router (h x E), every
        routed expert, and the shared expert with its gate (h x 1) where there is one."""
        moe, h = self.moe, self.hidden_size
        shared = self.expert_params(moe.shared_expert_ffn_hidden_size) + h if moe.shared_expert_ffn_hidden_size else 0
        return (self.params_per_layer() - self.expert_params(self.ffn_hidden_size) + h * moe.num_experts
                + moe.num_experts * self.expert_params() + shared)

    def layer_params(self, layer: int) -> int:
        """Parameters of block ``layer``: :meth:`params_per_layer` (dense) or :meth:`moe_layer_params`."""
        return self.moe_layer_params() if self.is_moe_layer(layer) else self.params_per_layer()

    def tp_replicated_per_layer(self) -> int:
        """Parameters of one block that every tp rank holds whole (Megatron-LM and the runtime):
        the norms, and the biases of the row-parallel (output and down) projections."""
        h = self.hidden_size
        return 4 * h + 2 * h if self.has_bias else 2 * h

    def tp_split_per_layer(self, biases: bool = True) -> dict[int, int]:
        """Parameters of one block that tensor parallelism splits, by the size of the dim it splits
        (the runtime's ``tp_shard_dim``): the column-parallel q, k, v, up (and gate) weights and
        biases along their output width (hidden, kv, ffn), the row-parallel output and down weights
        along their input width (hidden, ffn). Adds up to ``params_per_layer() -
        tp_replicated_per_layer()``; ``biases=False``: the weight matrices alone."""
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_dim
        b = 1 if self.has_bias and biases else 0
        qb = 1 if self.has_qkv_bias and biases else 0
        up = 2 if self.gated_mlp else 1
        out: dict[int, int] = {}
        for size, n in ((h, h * h + qb * h), (kv, 2 * (h * kv + qb * kv)), (h, h * h),   # q; k, v; out
                        (f, up * (h * f + b * f)), (f, f * h)):                          # up (gate); down
            out[size] = out.get(size, 0) + n
        return out

    def position_params(self) -> int:
        """Learned position embeddings (gpt; none for llama's RoPE), whole on every tp rank."""
        return self.seq_length * self.hidden_size if self.architecture == "gpt" else 0

    def final_norm_params(self) -> int:
        """The final norm, whole on every tp rank."""
        return 2 * self.hidden_size if self.has_bias else self.hidden_size

    def embedding_params(self) -> int:
        """Token embedding (plus learned positions for gpt): held by the first stage."""
        return self.vocab_size * self.hidden_size + self.position_params()

    def head_params(self) -> int:
        """Final norm and LM head: held by the last stage (the head is shared when tied)."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return self.final_norm_params() + head

    def total_params(self) -> int:
        blocks = sum(self.layer_params(layer) for layer in range(self.num_layers))
        return blocks + self.embedding_params() + self.head_params()

    def to_dict(self) -> dict:
        return to_plain(self)

    def save(self, path) -> None:
        write_yaml_atomic(path, self.to_dict())


def load_model(path_or_dict, source: str | None = None) -> ModelSpec:
    """Load and validate a model file (a path or a dict); defaults are filled in."""
    data, source = read_mapping(path_or_dict, "model", source)
    problems = Problems(source=source)
    model = load_dataclass(ModelSpec, data, "", problems)
    problems.raise_if_any()
    assert not is_missing(model)
    return model
