"""Where each runtime parameter lives in a Hugging Face model's safetensors files, and reading
exactly the part of it one rank holds.

The runtime's names and layouts (see :mod:`hetero.runtime.model`) differ from transformers' in
three ways, each undone here both ways:

- names: ``layers.3.attn.wq.weight`` is ``model.layers.3.self_attn.q_proj.weight`` (Llama) or a
  third of ``transformer.h.3.attn.c_attn.weight`` (GPT-2, whose q, k and v are one fused tensor);
- GPT-2's ``Conv1D`` stores weights as (in, out), ``nn.Linear`` as (out, in): transposed;
- rotary order: transformers rotates the two halves of each head's dims (dim ``i`` with
  ``i + d/2``), the runtime rotates interleaved pairs (``2i`` with ``2i + 1``), both at frequency
  ``theta^(-2i/d)``. Runtime row ``h*d + 2i + s`` of q and k is therefore Hugging Face row
  ``h*d + i + s*d/2``; permuting the rows of both keeps every q.k product, so the attention and
  the loss are the same.

A rank reads through :class:`SafetensorsFolder` (safetensors' lazy ``get_slice``): for each of its
parameters only the rows (or columns) of its tensor-parallel shard, so no process holds more of
the model than the plan gives it; the folder counts the bytes it hands out.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from hetero.errors import HeteroError
from hetero.hf import require
from hetero.specs.model import ModelSpec

IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers older files carry beside the weights (GPT-2's causal mask, Llama's rotary frequencies)."""


@dataclass(frozen=True)
class Source:
    """Where one runtime parameter comes from in the Hugging Face files."""

    key: str
    """The Hugging Face tensor's name."""
    hf_shape: tuple[int, ...]
    """Its full shape, as config.json implies it."""
    transpose: bool = False
    """GPT-2 Conv1D: Hugging Face stores (in, out)."""
    offset: int = 0
    """Where this parameter's output rows start in the Hugging Face tensor (q, k, v of GPT-2's fused c_attn)."""
    rope_head_dim: int = 0
    """q and k of rotary models: rows reordered within each head of this size (halves -> pairs)."""

    def hf_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Hugging Face output indices of runtime output rows ``rows``."""
        d = self.rope_head_dim
        if d:
            head, within = rows // d, rows % d
            rows = head * d + within // 2 + (within % 2) * (d // 2)
        return rows + self.offset

    def hf_index(self, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Per Hugging Face dim, the indices that runtime ``ranges`` (start, stop per runtime dim) read."""
        rows = self.hf_rows(torch.arange(*ranges[0]))
        if len(ranges) == 1:
            return [rows]
        cols = torch.arange(*ranges[1])
        return [cols, rows] if self.transpose else [rows, cols]


def sources(spec: ModelSpec, family: str, prefix: str = "") -> dict[str, Source]:
    """Every runtime parameter name of the whole model -> its :class:`Source`. ``prefix``: GPT-2's
    key prefix (``transformer.`` as save_pretrained writes it, or none in older files)."""
    h, f, kv, d, v = spec.hidden_size, spec.ffn_hidden_size, spec.kv_dim, spec.head_dim, spec.vocab_size
    out: dict[str, Source] = {}
    if family == "llama":
        out["wte.weight"] = Source("model.embed_tokens.weight", (v, h))
        for i in range(spec.num_layers):
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            out[rt + "norm1.weight"] = Source(hf + "input_layernorm.weight", (h,))
            out[rt + "norm2.weight"] = Source(hf + "post_attention_layernorm.weight", (h,))
            out[rt + "attn.wq.weight"] = Source(hf + "self_attn.q_proj.weight", (h, h), rope_head_dim=d)
            out[rt + "attn.wk.weight"] = Source(hf + "self_attn.k_proj.weight", (kv, h), rope_head_dim=d)
            out[rt + "attn.wv.weight"] = Source(hf + "self_attn.v_proj.weight", (kv, h))
            if spec.qkv_bias:   # Qwen2: added before the rotation, so q and k biases take the same row order
                out[rt + "attn.wq.bias"] = Source(hf + "self_attn.q_proj.bias", (h,), rope_head_dim=d)
                out[rt + "attn.wk.bias"] = Source(hf + "self_attn.k_proj.bias", (kv,), rope_head_dim=d)
                out[rt + "attn.wv.bias"] = Source(hf + "self_attn.v_proj.bias", (kv,))
            out[rt + "attn.wo.weight"] = Source(hf + "self_attn.o_proj.weight", (h, h))
            if spec.is_moe_layer(i):
                out.update(_moe_sources(spec, rt + "mlp.", hf))
            else:
                out.update(_mlp_sources(rt + "mlp.", hf + "mlp.", ("gate_proj", "up_proj", "down_proj"), h, f))
        out["final_norm.weight"] = Source("model.norm.weight", (h,))
        if not spec.tie_embeddings:
            out["head.weight"] = Source("lm_head.weight", (v, h))
        return out
    p = prefix
    out["wte.weight"] = Source(p + "wte.weight", (v, h))
    out["wpe.weight"] = Source(p + "wpe.weight", (spec.seq_length, h))
    for i in range(spec.num_layers):
        hf, rt = f"{p}h.{i}.", f"layers.{i}."
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[rt + norm + ".weight"] = Source(hf + ln + ".weight", (h,))
            out[rt + norm + ".bias"] = Source(hf + ln + ".bias", (h,))
        for k, name in enumerate(("wq", "wk", "wv")):   # fused c_attn: columns [q | k | v]
            out[rt + f"attn.{name}.weight"] = Source(hf + "attn.c_attn.weight", (h, 3 * h), True, k * h)
            out[rt + f"attn.{name}.bias"] = Source(hf + "attn.c_attn.bias", (3 * h,), offset=k * h)
        for rt_name, hf_name, shape in (("attn.wo", "attn.c_proj", (h, h)), ("mlp.w1", "mlp.c_fc", (h, f)),
                                        ("mlp.w2", "mlp.c_proj", (f, h))):
            out[rt + rt_name + ".weight"] = Source(hf + hf_name + ".weight", shape, True)
            out[rt + rt_name + ".bias"] = Source(hf + hf_name + ".bias", (shape[1],))
    out["final_norm.weight"] = Source(p + "ln_f.weight", (h,))
    out["final_norm.bias"] = Source(p + "ln_f.bias", (h,))
    if not spec.tie_embeddings:
        out["head.weight"] = Source("lm_head.weight", (v, h))
    return out


def _mlp_sources(rt: str, hf: str, names: tuple[str, str, str], h: int, f: int) -> dict[str, Source]:
    """A SwiGLU MLP's w1 (gate), w3 (up) and w2 (down) under runtime prefix ``rt``, Hugging Face ``hf``."""
    gate, up, down = names
    return {rt + "w1.weight": Source(hf + gate + ".weight", (f, h)), rt + "w3.weight": Source(hf + up + ".weight", (f, h)),
            rt + "w2.weight": Source(hf + down + ".weight", (h, f))}


def _moe_sources(spec: ModelSpec, rt: str, hf: str) -> dict[str, Source]:
    """An MoE layer's router and experts, one Hugging Face tensor per expert as the files keep them:
    Mixtral's ``block_sparse_moe.gate`` and ``experts.{e}.w1/w3/w2``; Qwen2-MoE's ``mlp.gate``,
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``
    (transformers fuses the experts in memory, not on disk)."""
    from hetero.hf.config import moe_model_type

    moe, h = spec.moe, spec.hidden_size
    f = moe.expert_ffn_hidden_size
    if moe_model_type(spec) == "mixtral":
        hf, names = hf + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        hf, names = hf + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out = {rt + "router.weight": Source(hf + "gate.weight", (moe.num_experts, h))}
    for e in range(moe.num_experts):
        out.update(_mlp_sources(f"{rt}experts.{e}.", f"{hf}experts.{e}.", names, h, f))
    if moe.shared_expert_ffn_hidden_size:
        out.update(_mlp_sources(rt + "shared_expert.", hf + "shared_expert.", names, h,
                                moe.shared_expert_ffn_hidden_size))
        out[rt + "shared_expert_gate.weight"] = Source(hf + "shared_expert_gate.weight", (1, h))
    return out


class SafetensorsFolder:
    """The safetensors weights of a Hugging Face model folder (one file, or shards listed by
    ``model.safetensors.index.json``), read lazily; ``bytes_read`` counts what :meth:`read` returned."""

    def __init__(self, path: str):
        self.path = path
        self.files: dict[str, str] = {}
        """Tensor name -> file name inside the folder."""
        self.bytes_read = 0
        self._open: dict[str, object] = {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                self.files = {str(k): str(v) for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise HeteroError(f"{index}: not a safetensors index ({type(e).__name__}: {e}) (fix: restore the "
                                  f"file save_pretrained wrote)") from None
            missing = sorted({v for v in self.files.values() if not os.path.isfile(os.path.join(path, v))})
            if missing:
                raise HeteroError(f"{index}: lists {missing[0]}, which is not in the folder (fix: copy every "
                                  f"shard the index names)")
            return
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            pickled = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
            what = f"only {pickled[0]} (pickled weights, which hetero does not unpickle)" if pickled else "no weights"
            raise HeteroError(f"{path}: {what}, no *.safetensors (fix: re-save the model with transformers' "
                              f"save_pretrained, which writes safetensors)")
        for name in names:
            for key in self._handle(name).keys():
                self.files[key] = name

    def _handle(self, name: str):
        if name not in self._open:
            safe_open = require("safetensors", "Hugging Face weights").safe_open
            try:
                self._open[name] = safe_open(os.path.join(self.path, name), framework="pt")
            except Exception as e:   # safetensors raises its own error type for a damaged header
                raise HeteroError(f"{os.path.join(self.path, name)}: not a readable safetensors file ({e}) (fix: "
                                  f"restore the file save_pretrained wrote)") from None
        return self._open[name]

    def where(self, key: str) -> str:
        return os.path.join(self.path, self.files[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[key]).get_slice(key).get_shape())

    def read(self, key: str, index: list[torch.Tensor]) -> torch.Tensor:
        """The elements of tensor ``key`` at the cross product of ``index`` (one index tensor per dim):
        the covering slice is read lazily, then narrowed where the indices are not a plain range."""
        box = tuple(slice(int(ix.min()), int(ix.max()) + 1) for ix in index)
        t = self._handle(self.files[key]).get_slice(key)[box]
        self.bytes_read += t.numel() * t.element_size()
        for dim, ix in enumerate(index):
            local = ix - box[dim].start
            if not torch.equal(local, torch.arange(len(local))):
                t = t.index_select(dim, local)
        return t


def read_param(folder: SafetensorsFolder, src: Source, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The runtime parameter's elements in ``ranges`` (start, stop per runtime dim), in runtime layout."""
    t = folder.read(src.key, src.hf_index(ranges))
    return (t.t() if src.transpose and t.dim() == 2 else t).contiguous()


def gpt2_prefix(folder: SafetensorsFolder) -> str:
    """``transformer.`` when the GPT-2 weights carry it (save_pretrained of GPT2LMHeadModel), else ''."""
    return "transformer." if "transformer.wte.weight" in folder.files else ""


def check_tensors(folder: SafetensorsFolder, srcs: dict[str, Source], config_file: str, model_type: str) -> None:
    """Every tensor the model needs is there with the shape config.json implies, and no other
    weights are (they would be dropped silently); errors name the file and the fix."""
    seen: dict[str, tuple] = {}
    for src in srcs.values():
        seen.setdefault(src.key, src.hf_shape)
    for key, shape in seen.items():
        if key not in folder.files:
            raise HeteroError(f"{folder.path}: no tensor {key}, which {config_file} implies (fix: give the folder "
                              f"save_pretrained wrote for this config, all shards included)")
        got = folder.shape(key)
        if got != shape:
            raise HeteroError(f"{folder.where(key)}: tensor {key} is {list(got)}, {config_file} implies "
                              f"{list(shape)} (fix: the config and the weights are of different models; use the "
                              f"config.json saved with these weights)")
    tied_head = "lm_head.weight" if "lm_head.weight" not in seen else None
    extra = sorted(k for k in folder.files if k not in seen and k != tied_head and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise HeteroError(f"{folder.where(extra[0])}: tensor {extra[0]} has no place in a {model_type} model as "
                          f"{config_file} describes it ({len(extra)} such) (fix: hetero converts plain causal-LM "
                          f"checkpoints; check that config.json belongs to these weights)")


def local_ranges(p) -> list[tuple[int, int]]:
    """(start, stop) per dim of the part of global parameter ``p`` this rank holds: all of it, or for a
    DTensor sharded on a dim its chunk there (torch's Shard: the first ranks take ceil(n / t))."""
    from torch.distributed.tensor import DTensor, Shard

    ranges = [(0, n) for n in p.shape]
    if isinstance(p, DTensor):
        for mesh_dim, placement in enumerate(p.placements):
            if isinstance(placement, Shard):
                n, t = p.shape[placement.dim], p.device_mesh.size(mesh_dim)
                size = -(-n // t)
                start = min(p.device_mesh.get_local_rank(mesh_dim) * size, n)
                ranges[placement.dim] = (start, min(start + size, n))
        local = tuple(p.to_local().shape)
        assert tuple(b - a for a, b in ranges) == local, (ranges, local)
    return ranges


def load_stage_weights(hf_dir: str, module, spec: ModelSpec) -> int:
    """Fill this rank's parameters (its layers; of those its tensor-parallel shards) from the model
    folder ``hf_dir``; returns the bytes read from its files."""
    from hetero.hf.config import check_matches, read_hf_config

    hf = read_hf_config(hf_dir, seq_length=spec.seq_length)
    check_matches(hf, spec, f"--load hf:{hf_dir}")
    folder = SafetensorsFolder(hf_dir)
    srcs = sources(spec, hf.family, gpt2_prefix(folder) if hf.family == "gpt2" else "")
    with torch.no_grad():
        for name, p in module.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(read_param(folder, srcs[name], local_ranges(p)))
    return folder.bytes_read
