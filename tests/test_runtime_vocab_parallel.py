"""Tensor parallelism splits the word embedding and the LM head over the vocabulary
(hetero.runtime.model.apply_tensor_parallel): each tp rank keeps its rows, the logits stay sharded
and the loss is reduced over the shards, equal to the unsplit stage's loss and gradients."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from _spawn import spawn  # noqa: E402

GPT = {"name": "tiny", "architecture": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
       "vocab_size": 101, "seq_length": 8, "dtype": "fp32", "tie_embeddings": True}
LLAMA = {"name": "tiny-llama", "architecture": "llama", "num_layers": 2, "hidden_size": 32,
         "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 101, "seq_length": 8, "dtype": "fp32"}


def _worker(rank, world, model_dict):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import hetero
    from hetero.runtime.model import apply_tensor_parallel, backward_loss, build_stage, loss_fn, loss_value

    dist.init_process_group("gloo")
    spec = hetero.load_model(model_dict)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=g)
    targets = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=g)
    whole = build_stage(spec, (0, 2), True, True, seed=0)
    ref = loss_fn(whole(tokens), targets)
    ref.backward()
    split = build_stage(spec, (0, 2), True, True, seed=0)
    apply_tensor_parallel(split, init_device_mesh("cpu", (world,)))
    logits = split(tokens)
    loss = loss_fn(logits, targets)
    backward_loss(loss)
    out = {"loss": loss_value(loss), "ref": float(ref), "logits_sharded": isinstance(logits, DTensor)
           and logits.to_local().shape[-1] < spec.vocab_size,
           "rows": {}, "grads_equal": True}
    whole_grads = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        if name in ("wte.weight", "head.weight"):
            out["rows"][name] = p.to_local().shape[0]
            # the gradient is the rank's rows too: no whole vocabulary x hidden tensor per rank
            out.setdefault("grad_rows", {})[name] = (p.grad.placements == p.placements,
                                                     p.grad.to_local().shape == p.to_local().shape)
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if not torch.allclose(full, whole_grads[name].grad, rtol=1e-4, atol=1e-6):
            out["grads_equal"] = False
    dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied-head"])
def test_tp_splits_embedding_and_head_over_the_vocabulary(model):
    results = spawn(_worker, 2, args=(model,), timeout=100)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5)
        assert r["logits_sharded"] and r["grads_equal"]
        assert all(same_layout and same_shape for same_layout, same_shape in r["grad_rows"].values()), r["grad_rows"]
    # 101 rows over 2 ranks: 51 + 50 (torch's uneven Shard(0)), no rank holds the whole vocabulary
    for name in results[0]["rows"]:
        assert sorted(r["rows"][name] for r in results) == [50, 51], name
    assert set(results[0]["rows"]) == ({"wte.weight"} if model is GPT else {"wte.weight", "head.weight"})
