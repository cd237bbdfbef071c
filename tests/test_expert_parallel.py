"""Expert parallelism: expert ranges, holder sets, the bytes of the exchanges, and an MoE layer whose
experts are spread unevenly over two emulated vendors computing what one device computes."""
import pytest
import torch

import hetero
from hetero.errors import HeteroError
from hetero.runtime.expert_parallel import (ExpertPlacement, exchange_bytes, expert_holders, split_experts)
from helpers import with_communicator

MODEL = {"name": "m", "architecture": "llama", "num_layers": 2, "hidden_size": 16,
         "num_attention_heads": 2, "vocab_size": 32, "seq_length": 8,
         "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 24, "shared_expert_ffn_hidden_size": 8}}


def test_expert_ranges_even_uneven_and_errors():
    assert split_experts(8, 2) == [(0, 4), (4, 8)]
    assert split_experts(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert split_experts(8, 2, [6, 2]) == [(0, 6), (6, 8)]
    for bad in ([7, 2], [8, 0], [8]):
        with pytest.raises(HeteroError, match="expert_parallel: experts"):
            split_experts(8, 2, bad)


def test_expert_holder_sets_are_the_same_place_in_every_group():
    placement = ExpertPlacement({0: [(0, 1), (2, 3)]}, ((0, 6), (6, 8)))
    holders = {"layers.0.mlp.experts.5.w1.weight": (0, 1, 2, 3), "layers.0.mlp.experts.7.w2.weight": (0, 1, 2, 3),
               "layers.0.mlp.router.weight": (0, 1, 2, 3)}
    out = expert_holders(holders, placement)
    assert out == {"layers.0.mlp.experts.5.w1.weight": (0, 2), "layers.0.mlp.experts.7.w2.weight": (1, 3),
                   "layers.0.mlp.router.weight": (0, 1, 2, 3)}
    assert placement.held(3) == {0: 2} and placement.experts_of(0, 2) == (0, 6)


def test_exchange_bytes_matrix():
    counts = torch.tensor([[1, 2, 0, 3], [4, 0, 1, 1]])   # rank i's assignments per expert
    b = exchange_bytes(counts, [(0, 3), (3, 4)], row_bytes=10)
    # rank 0 sends 3 rows to rank 1 (expert 3) and gets back their outputs; rank 1 sends 5 rows to rank 0
    assert b.tolist() == [[0, 8 * 1 + 10 * (3 + 5)], [8 * 3 + 10 * (5 + 3), 0]]


# ----------------------------------------------------------------------------- two emulated vendors
def _layer(spec):
    from hetero.runtime.model import MLP
    from hetero.runtime.moe import MoEMLP

    torch.manual_seed(0)
    m = MoEMLP(spec, MLP)
    m.expert_compute = "loop"
    m.aux_scale = 0.5 * spec.moe.aux_loss_coef
    return m


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(3, 5, 16, generator=g).requires_grad_() for _ in range(2)]


def _ep_rank(comm, model, experts):
    """One rank: its experts only, two micro-batches of its own tokens; returns its output, the sums the
    data-parallel step would make (router and shared expert over both ranks) and its experts' grads."""
    from hetero.runtime.expert_parallel import ExpertGroup, shard_moe

    spec = hetero.load_model(model)
    m = _layer(spec)
    group = comm.new_group([0, 1])
    ranges = split_experts(8, 2, experts)
    eg = ExpertGroup(lambda o, i, os, ins: comm.all_to_all_single(o, i, os, ins, group=group), ranges, comm.rank)
    shard_moe(m, eg)
    comm.stats.reset()
    outs, counts, inputs = [], [], _inputs(comm.rank)
    for x in inputs:
        y = m(x)
        outs.append(y.detach())
        (y * y).sum().backward()
        index, _, _ = m.route(x.reshape(-1, 16))
        counts.append(torch.bincount(index.reshape(-1), minlength=8))
    sent = comm.stats.to_dict()
    grads = {}
    for name, p in m.named_parameters():
        g = p.grad.clone()
        if not name.startswith("experts."):   # replicated: the data-parallel sum
            comm.all_reduce(g)
        grads[name] = g
    return {"outs": outs, "grads": grads, "input_grads": [x.grad for x in inputs], "aux": m.aux_losses, "sent": sent, "counts": counts,
            "names": sorted(n for n, _ in m.named_parameters() if n.startswith("experts."))}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_experts_across_two_vendors_match_one_device():
    model = {**MODEL, "moe": {**MODEL["moe"], "balance": "aux", "aux_loss_coef": 0.02}}
    results = with_communicator(_ep_rank, ["emu-a", "emu-b"], args=(model, [6, 2]), timeout=100)
    spec = hetero.load_model(model)
    ref = _layer(spec)
    ref_outs, ref_inputs = [], _inputs(0) + _inputs(1)
    for x in ref_inputs:
        y = ref(x)
        ref_outs.append(y.detach())
        (y * y).sum().backward()
    assert [r["names"][0].split(".")[1] for r in results] == ["0", "6"]   # experts keep their model-wide names
    assert {n.split(".")[1] for n in results[0]["names"]} == {str(e) for e in range(6)}
    assert {n.split(".")[1] for n in results[1]["names"]} == {"6", "7"}
    torch.testing.assert_close(torch.cat(results[0]["outs"] + results[1]["outs"]), torch.cat(ref_outs),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["input_grads"] + results[1]["input_grads"],
                               [x.grad for x in ref_inputs], rtol=1e-5, atol=1e-6)
    assert results[0]["aux"] + results[1]["aux"] == pytest.approx(ref.aux_losses, rel=1e-6)
    want = dict(ref.named_parameters())
    for r in results:
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, want[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    # what the communicator recorded sending = the bytes the exchange counts, forward and backward
    for rank, r in enumerate(results):
        counts = [torch.stack([results[0]["counts"][mb], results[1]["counts"][mb]]) for mb in range(2)]
        per_mb = [exchange_bytes(c, split_experts(8, 2, [6, 2]), row_bytes=16 * 4) for c in counts]
        rows = [exchange_bytes(c, split_experts(8, 2, [6, 2]), row_bytes=16 * 4)
                - exchange_bytes(c, split_experts(8, 2, [6, 2]), row_bytes=0) for c in counts]
        want_bytes = sum(int(b[rank].sum()) + int(d[rank].sum()) for b, d in zip(per_mb, rows))   # + backward rows
        sent = r["sent"]
        assert sent["bridge_bytes"] == want_bytes, (rank, sent["bridge_bytes"], want_bytes)
        assert sent["vendor_bytes"] == {}
