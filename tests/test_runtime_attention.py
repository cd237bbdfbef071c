"""The runtime's grouped-query attention (hetero.runtime.model.Attention) lets SDPA pair each
key/value head with its query heads, so backward keeps k and v at kv width, as the predictor's
memory model counts them (q, k, v: e s b (h + 2 kv))."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _saved_bytes(module, x) -> int:
    seen, total = set(), [0]

    def pack(t):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum()
    return total[0]


def test_gqa_attention_keeps_kv_at_kv_width_and_equals_expanded_heads():
    import hetero
    from hetero.runtime.model import Attention

    spec = hetero.load_model({"name": "g", "architecture": "llama", "num_layers": 1, "hidden_size": 256,
                              "num_attention_heads": 8, "num_kv_heads": 2, "vocab_size": 64, "seq_length": 128,
                              "dtype": "fp32"})
    torch.manual_seed(0)
    attn = Attention(spec, rope=True)
    x = torch.randn(2, 128, 256, requires_grad=True)
    assert torch.allclose(attn(x), ref_layer(attn, x), atol=1e-5)
    B, T = 2, 128

    # saved for backward: k / v at kv width (2 x B x T x kv x 4 bytes), not at query width
    full_kv, kv_kv = 2 * B * T * spec.hidden_size * 4, 2 * B * T * spec.kv_dim * 4
    expanded = _saved_bytes(lambda t: ref_layer(attn, t), x)
    assert _saved_bytes(attn, x) == expanded - (full_kv - kv_kv)


def ref_layer(attn, x):
    """The layer with k / v expanded before SDPA (what the runtime did)."""
    import torch.nn.functional as F

    from hetero.runtime.model import apply_rope

    B, T, _ = x.shape
    hd = attn.head_dim
    q = attn.wq(x).view(B, T, -1, hd)
    k = attn.wk(x).view(B, T, -1, hd)
    v = attn.wv(x).view(B, T, -1, hd)
    q, k = apply_rope(q, attn.cos, attn.sin), apply_rope(k, attn.cos, attn.sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
