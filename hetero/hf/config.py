"""A Hugging Face ``config.json`` <-> a hetero model file.

Llama, Mistral and Qwen2 (rotary positions, RMSNorm, SwiGLU, grouped-query attention; Qwen2 with
q/k/v biases: ``qkv_bias``) map onto ``architecture: llama``, Mixtral and Qwen2-MoE onto it with a
``moe`` block (:func:`moe_model_type` says which a model exports as); GPT-2 (learned positions, LayerNorm, tanh-GELU MLP, biases) onto ``gpt``.
What the runtime cannot compute the same way (scaled rotary tables, sliding windows shorter than the
sequence, an output-projection bias in llama blocks, other activations) is refused with the
config key that says so, never approximated.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hetero.errors import HeteroError
from hetero.specs.model import MoESpec, ModelSpec

LLAMA_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
SUPPORTED = "llama, mistral, qwen2, mixtral, qwen2_moe and gpt2"
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DEFAULT_SEQ = 4096
"""Training sequence length of a rotary model when --seq-length is not given: its
max_position_embeddings, at most this (a 128k-position model would otherwise train 128k sequences)."""


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face model folder: its config and the model file it maps onto."""

    path: str
    config: dict
    family: str
    """llama (llama, mistral, qwen2) or gpt2: which weight names and layouts apply."""
    spec: ModelSpec

    @property
    def config_file(self) -> str:
        return os.path.join(self.path, "config.json")


def read_hf_config(path: str, name: str | None = None, seq_length: int | None = None) -> HFModel:
    """Read ``path/config.json`` and map it onto a model spec (``seq_length``: the training sequence
    length; default the model's own, see :data:`DEFAULT_SEQ`). Errors name the file and the fix."""
    where = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise HeteroError(f"{path}: not a directory (fix: give a Hugging Face model folder, the one "
                          f"save_pretrained writes, with config.json and *.safetensors)")
    if not os.path.isfile(where):
        raise HeteroError(f"{where}: not found (fix: give the folder save_pretrained wrote; it holds "
                          f"config.json beside the *.safetensors weights)")
    try:
        with open(where, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise HeteroError(f"{where}: not valid JSON ({e}) (fix: restore the file save_pretrained wrote)") from None
    if not isinstance(cfg, dict):
        raise HeteroError(f"{where}: holds a {type(cfg).__name__}, not a JSON object (fix: restore the file "
                          f"save_pretrained wrote)")
    kind = cfg.get("model_type")
    name = name or os.path.basename(os.path.normpath(path)) or "hf-model"
    if kind in LLAMA_TYPES:
        spec = _llama_spec(cfg, where, name, seq_length)
        family = "llama"
    elif kind == "gpt2":
        spec = _gpt2_spec(cfg, where, name, seq_length)
        family = "gpt2"
    else:
        raise HeteroError(f"{where}: model_type {kind!r} is not supported (fix: hetero converts {SUPPORTED} "
                          f"models; convert this one with its own tools)")
    return HFModel(path=path, config=cfg, family=family, spec=spec)


class _Config:
    """Typed reads of one config.json, each error naming the file and the key."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where

    def fail(self, key: str, what: str, fix: str) -> HeteroError:
        return HeteroError(f"{self.where}: {key} {what} (fix: {fix})")

    def int(self, key: str, default=None, minimum: int = 1) -> int:
        value = self.cfg.get(key)
        value = default if value is None else value
        if value is None:
            raise self.fail(key, "is missing", f"give {key} as save_pretrained writes it")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"is {value!r}, not an integer >= {minimum}", f"correct {key}")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.cfg.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.fail(key, f"is {value!r}, not a positive number", f"correct {key}")
        return float(value)

    def refuse_if(self, bad: bool, key: str, what: str) -> None:
        if bad:
            raise self.fail(key, what, f"hetero converts {SUPPORTED} models whose math its runtime computes "
                                       f"exactly; this one it would only approximate")

    def dtype(self) -> str:
        value = self.cfg.get("dtype") or self.cfg.get("torch_dtype") or "float32"
        if value not in DTYPES:
            raise self.fail("dtype", f"is {value!r}", f"use one of {', '.join(DTYPES)}")
        return DTYPES[value]


def _seq(c: _Config, given: int | None, positions: int, fixed: bool) -> int:
    if given is None:
        return positions if fixed else min(positions, DEFAULT_SEQ)
    if given < 1 or given > positions or (fixed and given != positions):
        rule = f"exactly {positions} (its learned position table)" if fixed else f"1 .. {positions}"
        raise HeteroError(f"--seq-length {given}: the model in {c.where} takes {rule} (fix: give a length in "
                          f"that range, or leave --seq-length out)")
    return given


def _llama_spec(cfg: dict, where: str, name: str, seq_length: int | None) -> ModelSpec:
    c = _Config(cfg, where)
    kind = cfg["model_type"]
    h, heads = c.int("hidden_size"), c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    if h % heads or (cfg.get("head_dim") not in (None, h // heads)):
        raise c.fail("head_dim", f"is {cfg.get('head_dim')} with hidden_size {h} and {heads} heads",
                     "hetero's runtime needs head_dim = hidden_size / num_attention_heads")
    if heads % kv:
        raise c.fail("num_key_value_heads", f"({kv}) does not divide num_attention_heads ({heads})",
                     "correct the head counts")
    c.refuse_if(cfg.get("hidden_act", "silu") != "silu", "hidden_act", f"is {cfg.get('hidden_act')!r}, not silu")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    c.refuse_if(rope_type not in (None, "default"), "rope_scaling",
                f"asks for {rope_type!r} rotary scaling; the runtime computes plain rotary tables")
    theta = cfg.get("rope_theta")   # transformers 5 keeps it in rope_parameters
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    theta = _Config({"rope_theta": theta}, where).float("rope_theta", 10000.0)
    c.refuse_if(kind not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias")), "attention_bias",
                "is true: biases on the output projection too, which the runtime's llama blocks do not have "
                "(they take q/k/v biases alone, as Qwen2 has them)")
    c.refuse_if(bool(cfg.get("mlp_bias")), "mlp_bias", "is true; the runtime's SwiGLU has no biases")
    positions = c.int("max_position_embeddings", 2048)
    seq = _seq(c, seq_length, positions, fixed=False)
    window = cfg.get("sliding_window")
    if kind in ("qwen2", "qwen2_moe") and not cfg.get("use_sliding_window"):
        window = None
    c.refuse_if(window is not None and window < seq, "sliding_window",
                f"is {window}, shorter than the sequence ({seq}); the runtime attends to the whole sequence "
                f"(a --seq-length of at most {window} makes them the same)")
    layers = c.int("num_hidden_layers")
    return ModelSpec(name=name, architecture="llama", num_layers=layers, hidden_size=h,
                     num_attention_heads=heads, num_kv_heads=kv, ffn_hidden_size=c.int("intermediate_size"),
                     vocab_size=c.int("vocab_size"), seq_length=seq, dtype=c.dtype(),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     norm_eps=c.float("rms_norm_eps", 1e-6), rope_theta=theta,
                     qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias", True) is not False),
                     moe=_moe_spec(c, kind, layers))


def _moe_spec(c: _Config, kind: str, layers: int) -> MoESpec | None:
    """The ``moe:`` block of a Mixtral (every layer: softmax top-k renormalised) or Qwen2-MoE (every
    ``decoder_sparse_step``-th layer but ``mlp_only_layers``, a sigmoid-gated shared expert) config."""
    if kind == "mixtral":
        c.refuse_if(bool(c.cfg.get("router_jitter_noise")), "router_jitter_noise",
                    "is not 0: the router's inputs are scaled by noise in training")
        experts = c.int("num_local_experts")
        return MoESpec(num_experts=experts, top_k=_top_k(c, experts), expert_ffn_hidden_size=c.int("intermediate_size"),
                       norm_topk_prob=True, aux_loss_coef=c.float("router_aux_loss_coef", 0.01))
    if kind != "qwen2_moe":
        return None
    experts = c.int("num_experts")
    dense = c.cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise c.fail("mlp_only_layers", f"is {dense!r}", f"list layer indices in 0 .. {layers - 1}")
    return MoESpec(num_experts=experts, top_k=_top_k(c, experts), expert_ffn_hidden_size=c.int("moe_intermediate_size"),
                   shared_expert_ffn_hidden_size=c.int("shared_expert_intermediate_size"),
                   norm_topk_prob=bool(c.cfg.get("norm_topk_prob", False)), every=c.int("decoder_sparse_step", 1),
                   dense_layers=tuple(sorted(set(dense))), aux_loss_coef=c.float("router_aux_loss_coef", 0.001))


def _top_k(c: _Config, experts: int) -> int:
    k = c.int("num_experts_per_tok")
    if k > experts:
        raise c.fail("num_experts_per_tok", f"({k}) exceeds the expert count ({experts})", "correct the counts")
    return k


def moe_model_type(spec: ModelSpec) -> str:
    """The Hugging Face model_type of a llama-architecture MoE model: ``qwen2_moe`` with a shared expert,
    else ``mixtral``; refused where neither computes what the runtime does."""
    moe = spec.moe
    kind = "qwen2_moe" if moe.shared_expert_ffn_hidden_size else "mixtral"
    why = None
    if moe.router != "softmax":
        why = f"router {moe.router}: Mixtral and Qwen2-MoE route by a softmax"
    elif moe.balance == "bias":
        why = "balance bias: the expert biases that steer the top-k choice have no place in Mixtral or Qwen2-MoE"
    elif moe.capacity_factor is not None:
        why = "a capacity_factor: Mixtral and Qwen2-MoE are dropless"
    elif kind == "mixtral" and (spec.qkv_bias or not moe.norm_topk_prob or len(spec.moe_layers()) != spec.num_layers):
        why = ("no shared expert, so Mixtral, which has no q/k/v biases, renormalises the top-k weights and makes "
               "every layer an MoE layer")
    if why:
        raise HeteroError(f"model {spec.name}: cannot be written as a Hugging Face model: {why} (fix: export a "
                          f"model whose moe block Mixtral or Qwen2-MoE describes)")
    return kind


GPT2_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""GPT-2 activations that are the tanh approximation of GELU, as the runtime computes it."""


def _gpt2_spec(cfg: dict, where: str, name: str, seq_length: int | None) -> ModelSpec:
    c = _Config(cfg, where)
    act = cfg.get("activation_function", "gelu_new")
    c.refuse_if(act not in GPT2_GELU + ("relu",), "activation_function",
                f"is {act!r}; the runtime's gpt MLP computes tanh-GELU ({', '.join(GPT2_GELU)}) or relu")
    c.refuse_if(not cfg.get("scale_attn_weights", True), "scale_attn_weights", "is false (unscaled attention)")
    c.refuse_if(bool(cfg.get("scale_attn_by_inverse_layer_idx")), "scale_attn_by_inverse_layer_idx", "is true")
    c.refuse_if(bool(cfg.get("add_cross_attention")), "add_cross_attention", "is true (an encoder-decoder)")
    h, heads = c.int("n_embd"), c.int("n_head")
    if h % heads:
        raise c.fail("n_head", f"({heads}) does not divide n_embd ({h})", "correct the head count")
    positions = c.int("n_positions", 1024)
    return ModelSpec(name=name, architecture="gpt", num_layers=c.int("n_layer"), hidden_size=h,
                     num_attention_heads=heads, ffn_hidden_size=c.int("n_inner", 4 * h),
                     activation="relu" if act == "relu" else "gelu", vocab_size=c.int("vocab_size"),
                     seq_length=_seq(c, seq_length, positions, fixed=True), dtype=c.dtype(),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                     norm_eps=c.float("layer_norm_epsilon", 1e-5))


TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def hf_config(spec: ModelSpec, base: dict | None = None) -> dict:
    """The ``config.json`` of ``spec`` for transformers (LlamaForCausalLM or GPT2LMHeadModel). ``base``:
    a config to start from (the imported model's: keeps its model_type, token ids and position count),
    whose shape fields are overwritten with the spec's."""
    dtype = TORCH_DTYPES[spec.dtype]
    if spec.architecture == "llama":
        # q/k/v biases without an output bias: Qwen2's layout (Llama's attention_bias adds all four)
        base_kind = (base or {}).get("model_type")
        kind = "qwen2" if spec.qkv_bias else base_kind if base_kind in ("llama", "mistral") else "llama"
        if spec.moe is not None:
            kind = moe_model_type(spec)
        keep = base if base and base.get("model_type") == kind else {}
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[kind]
        out = {"architectures": [arch], "model_type": kind, **keep,
               "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
               "num_attention_heads": spec.num_attention_heads, "num_hidden_layers": spec.num_layers,
               "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
               "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta, "hidden_act": "silu",
               "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": bool(spec.tie_embeddings)}
        out["max_position_embeddings"] = max(int(keep.get("max_position_embeddings") or 0), spec.seq_length)
        if isinstance(out.get("rope_parameters"), dict):
            out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": spec.rope_theta}
        out.pop("rope_scaling", None)
        out.update(_moe_config(spec, kind))
    else:
        keep = base if base and base.get("model_type") == "gpt2" else {}
        out = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **keep,
               "n_embd": spec.hidden_size, "n_head": spec.num_attention_heads, "n_layer": spec.num_layers,
               "n_inner": spec.ffn_hidden_size, "n_positions": spec.seq_length, "vocab_size": spec.vocab_size,
               "layer_norm_epsilon": spec.norm_eps, "tie_word_embeddings": bool(spec.tie_embeddings),
               "activation_function": "relu" if spec.activation == "relu" else "gelu_new"}
    out.update(dtype=dtype, torch_dtype=dtype)
    return out


def _moe_config(spec: ModelSpec, kind: str) -> dict:
    """The MoE keys of a Mixtral or Qwen2-MoE config.json (none for a dense model)."""
    moe = spec.moe
    if kind == "mixtral":
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": moe.expert_ffn_hidden_size, "router_aux_loss_coef": moe.aux_loss_coef,
                "router_jitter_noise": 0.0, "sliding_window": None}
    if kind == "qwen2_moe":
        return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.expert_ffn_hidden_size,
                "shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
                "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": moe.every,
                "mlp_only_layers": list(moe.dense_layers), "router_aux_loss_coef": moe.aux_loss_coef,
                "qkv_bias": spec.qkv_bias, "use_sliding_window": False}
    return {}


def check_matches(hf: HFModel, spec: ModelSpec, flag: str) -> None:
    """``--load hf:DIR`` with ``--model``: fail unless the folder's config is the model file's shape."""
    fields = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
              "ffn_hidden_size", "vocab_size", "tie_embeddings", "activation", "norm_eps", "rope_theta", "qkv_bias")
    if spec.architecture == "gpt":
        fields += ("seq_length",)   # the learned position table
    diff = [f"{f} {getattr(hf.spec, f)} there, {getattr(spec, f)} in the model file" for f in fields
            if getattr(hf.spec, f) != getattr(spec, f) and not (f == "rope_theta" and spec.architecture == "gpt")]
    if _moe_shape(hf.spec) != _moe_shape(spec):   # the weights and routing; balancing and capacity may differ
        diff.append(f"moe {_moe_shape(hf.spec)} there, {_moe_shape(spec)} in the model file")
    if diff:
        raise HeteroError(f"{flag}: {hf.config_file} describes another model: {'; '.join(diff[:4])} (fix: use the "
                          f"model file hetero import-hf writes for this folder)")


def _moe_shape(spec: ModelSpec) -> str:
    """What of the moe block the weights and the routing depend on (not balancing or capacity), in words."""
    moe = spec.moe
    if moe is None:
        return "none"
    return (f"{moe.num_experts} experts top-{moe.top_k} of width {moe.expert_ffn_hidden_size}, shared "
            f"{moe.shared_expert_ffn_hidden_size}, {moe.router}, renormalised {moe.norm_topk_prob}, "
            f"layers {list(spec.moe_layers())}")
