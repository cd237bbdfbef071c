"""Hugging Face mixture-of-experts models in and out (offline: tiny random Mixtral and Qwen2-MoE saved
with save_pretrained): the runtime computes transformers' logits, and import-hf -> export-hf gives
back every expert's tensor under its own key."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.hf import assert_logits_equal_transformers

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

VOCAB = 96


def _randomise(model) -> None:
    """Random weights everywhere (Qwen2-MoE's router starts at zero, which would tie every expert);
    routers scaled up so the top-k choices are far from ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 1.0 if name.endswith("gate.weight") else 0.1)


def _save_mixtral(path: Path) -> None:
    torch.manual_seed(10)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=16, rope_theta=1e6)
    model = transformers.MixtralForCausalLM(cfg)
    _randomise(model)
    model.save_pretrained(path)


def _save_qwen2_moe(path: Path, norm_topk_prob: bool) -> None:
    """A dense first layer (mlp_only_layers), a sigmoid-gated shared expert, q/k/v biases."""
    torch.manual_seed(11)
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                                      max_position_embeddings=16, mlp_only_layers=[0], norm_topk_prob=norm_topk_prob,
                                      tie_word_embeddings=False)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    _randomise(model)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-moe")
    out = {"mixtral": root / "mixtral", "qwen2_moe": root / "qwen2_moe", "qwen2_moe_norm": root / "qwen2_moe_norm"}
    _save_mixtral(out["mixtral"])
    _save_qwen2_moe(out["qwen2_moe"], False)
    _save_qwen2_moe(out["qwen2_moe_norm"], True)
    return out


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen2_moe_norm"])
def test_runtime_logits_equal_transformers(models, kind):
    spec = assert_logits_equal_transformers(models[kind], VOCAB)
    assert spec.moe_layers() == ((0, 1) if kind == "mixtral" else (1, 2))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_import_then_export_gives_back_every_expert(models, tmp_path, kind):
    from hetero.cli import main

    out, back = tmp_path / "imported", tmp_path / "exported"
    assert main(["import-hf", str(models[kind]), "-o", str(out)]) == 0
    assert main(["export-hf", "--model", str(out / "model.yaml"), "--checkpoint", str(out / "checkpoint"),
                 "-o", str(back), "--max-shard-size", "50KB"]) == 0
    original, exported = _tensors(models[kind]), _tensors(back)
    experts = [k for k in original if ".experts." in k]
    assert len(experts) == {"mixtral": 2 * 4 * 3, "qwen2_moe": 2 * 6 * 3}[kind]   # layers x experts x (gate, up, down)
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert torch.equal(t, exported[key]), key
    reloaded = _hf_model(back)
    assert type(reloaded).__name__ == type(_hf_model(models[kind])).__name__
    theirs, ours = _hf_model(models[kind]).state_dict(), reloaded.state_dict()
    assert sorted(theirs) == sorted(ours) and all(torch.equal(t, ours[k]) for k, t in theirs.items())


@pytest.mark.parametrize("moe,says", [
    ({"router": "sigmoid"}, "router sigmoid: Mixtral and Qwen2-MoE route by a softmax"),
    ({"balance": "bias"}, "balance bias: the expert biases"),
    ({"capacity_factor": 1.25}, "a capacity_factor: Mixtral and Qwen2-MoE are dropless"),
    ({"dense_layers": [0]}, "no shared expert, so Mixtral"),
])
def test_an_moe_model_neither_type_describes_is_not_exported(moe, says):
    import hetero
    from hetero.errors import HeteroError
    from hetero.hf.config import hf_config

    spec = hetero.load_model({"name": "m", "architecture": "llama", "num_layers": 2, "hidden_size": 32,
                              "num_attention_heads": 4, "vocab_size": VOCAB, "seq_length": 16,
                              "moe": {"num_experts": 4, "top_k": 2, **moe}})
    with pytest.raises(HeteroError, match="cannot be written as a Hugging Face model: " + says[:20]):
        hf_config(spec)
