"""Mixture of experts: the model file's ``moe:`` block, the MoE MLP (routing, capacity, balancing)
and its place in the model."""
import pytest

import hetero
from hetero.specs.errors import SpecError

MODEL = {"name": "m", "architecture": "llama", "num_layers": 4, "hidden_size": 32,
         "num_attention_heads": 4, "vocab_size": 64, "seq_length": 16}


def moe_model(**moe):
    return hetero.load_model({**MODEL, "moe": {"num_experts": 4, "top_k": 2, **moe}})


def test_moe_block_defaults_and_round_trip(tmp_path):
    m = moe_model()
    assert m.moe.expert_ffn_hidden_size == m.ffn_hidden_size   # default: the dense width
    assert (m.moe.router, m.moe.balance, m.moe.capacity_factor, m.moe.norm_topk_prob) == ("softmax", "aux", None, True)
    assert m.moe_layers() == (0, 1, 2, 3)
    m.save(tmp_path / "m.yaml")
    assert hetero.load_model(tmp_path / "m.yaml") == m
    assert hetero.load_model(MODEL).moe is None and hetero.load_model(MODEL).moe_layers() == ()


def test_which_layers_are_moe():
    assert moe_model(every=2).moe_layers() == (1, 3)           # (l + 1) % every == 0, as Qwen2-MoE
    assert moe_model(dense_layers=[0]).moe_layers() == (1, 2, 3)
    assert moe_model(every=2, dense_layers=[3]).moe_layers() == (1,)


def test_moe_parameter_count():
    m = moe_model(expert_ffn_hidden_size=24, shared_expert_ffn_hidden_size=40, dense_layers=[0])
    h = 32
    attn_norms = m.params_per_layer() - 3 * h * m.ffn_hidden_size
    moe_layer = attn_norms + h * 4 + 4 * 3 * h * 24 + 3 * h * 40 + h
    assert m.moe_layer_params() == moe_layer
    assert m.total_params() == m.params_per_layer() + 3 * moe_layer + m.embedding_params() + m.head_params()


@pytest.mark.parametrize("moe,fragment", [
    ({"top_k": 5}, "moe.top_k: must be in [1, num_experts (4)], got 5"),
    ({"routr": "sigmoid"}, "moe.routr: unknown field 'routr' (fix: did you mean 'router'?)"),
    ({"router": "sigmod"}, "moe.router: 'sigmod' is not one of 'softmax', 'sigmoid' (fix: did you mean 'sigmoid'?)"),
    ({"balance": "bias2"}, "(fix: did you mean 'bias'?)"),
    ({"capacity_factor": 0}, "moe.capacity_factor: must be positive or null, got 0"),
    ({"every": 0}, "moe.every: must be >= 1, got 0"),
    ({"dense_layers": [0, 1, 2, 3]}, "moe: no layer is an MoE layer"),
    ({"dense_layers": [4]}, "moe.dense_layers: layers [4] are outside 0..3"),
    ({"num_experts": 0, "top_k": 1}, "moe.num_experts: must be >= 1, got 0"),
    ({"aux_loss_coef": -1}, "moe.aux_loss_coef: must be >= 0"),
])
def test_moe_block_errors_name_field_and_fix(moe, fragment):
    with pytest.raises(SpecError) as e:
        moe_model(**moe)
    assert any(fragment in str(p) and "(fix: " in str(p) for p in e.value.problems), e.value.problems
