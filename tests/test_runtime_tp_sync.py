"""Data-parallel gradient sync between replicas of one tp degree (hetero.runtime.grads): each rank
sums its local shards with the holders at its own tp rank only (Megatron's data-parallel group),
instead of gathering full gradients and summing them over every holder."""
from __future__ import annotations

import pytest

import hetero
from hetero.layout import build_layout
from helpers import CLUSTER, GPT, LLAMA, local_cluster
from helpers import assert_matches_reference as _assert_matches, launch as _launch, plan_dict as _plan


def _buckets(plan_dict, model=GPT, cluster=CLUSTER):
    from hetero.runtime.grads import all_peer_sets, build_buckets, param_holders
    from hetero.runtime.model import stage_param_shapes

    pytest.importorskip("torch")
    plan = hetero.load_plan(plan_dict)
    spec = hetero.load_model(model)
    layout = build_layout(hetero.load_cluster(cluster), plan)
    holders = param_holders(spec, plan, layout)
    out = {}
    for r in layout.ranks:
        names = list(stage_param_shapes(spec, r.layers, *r.holds_ends(plan)))
        out[r.rank] = build_buckets(holders, names, r.rank, layout)
    return out, all_peer_sets(holders, layout), layout


def test_peers_are_the_holders_at_the_same_tp_rank_only_when_tp_degrees_agree():
    same = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                  {"micro_batches": 2, "stages": [{"group": "slow", "tp": 2, "layers": [0, 4]}]}])
    buckets, peer_sets, layout = _buckets(same)
    tp_rank = {r.rank: r.tp_rank for r in layout.ranks}
    for rank, bs in buckets.items():
        for b in bs:
            assert b.peers is not None and rank in b.peers and len(b.peers) == 2
            assert {tp_rank[r] for r in b.peers} == {tp_rank[rank]} and set(b.peers) < set(b.ranks)
    assert len(peer_sets) == 2   # one per tp rank: {fast tp0, slow tp0}, {fast tp1, slow tp1}
    mixed = _plan([{"micro_batches": 1, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                   {"micro_batches": 3, "stages": [{"group": "slow", "layers": [0, 2]},
                                                   {"group": "slow", "layers": [2, 4]}]}])
    buckets, peer_sets, layout = _buckets(mixed)
    assert all(b.peers is None for bs in buckets.values() for b in bs)
    # tp2 beside tp1: 2 chunks, each summed by one tp2 rank and the tp1 rank holding that layer
    info = {r.rank: r for r in layout.ranks}
    assert peer_sets   # chunk sets: a layer's (tp2 rank, tp1 rank); the tied embedding's add the last stage
    for rank, bs in buckets.items():
        for b in bs:
            assert b.num_chunks == 2
            held = [c for c, _ in b.chunks]
            assert held == ([info[rank].tp_rank] if info[rank].tp_size == 2 else [0, 1])
            for c, ranks in b.chunks:
                assert rank in ranks and set(ranks) <= set(b.ranks) and tuple(ranks) in peer_sets
                assert [info[r].tp_rank for r in ranks if info[r].tp_size == 2] == [c]   # one of the tp2 group


# 4 + 2 CPU devices: a tp4 pipeline beside a tp2 one
WIDE = local_cluster(devices=(4, 2))
TP4_BESIDE_TP2 = [{"micro_batches": 1, "stages": [{"group": "fast", "tp": 4, "layers": [0, 4]}]},
                  {"micro_batches": 3, "stages": [{"group": "slow", "tp": 2, "layers": [0, 4]}]}]


def test_chunks_of_tp4_beside_tp2_are_quarters_a_tp2_rank_sums_two():
    buckets, _, layout = _buckets(_plan(TP4_BESIDE_TP2), cluster=WIDE)
    info = {r.rank: r for r in layout.ranks}
    for rank, bs in buckets.items():
        r = info[rank]
        for b in bs:
            assert b.num_chunks == 4
            assert [c for c, _ in b.chunks] == list(range(r.tp_rank * 4 // r.tp_size, (r.tp_rank + 1) * 4 // r.tp_size))
            assert all(len(ranks) == 2 for _, ranks in b.chunks)   # one rank of each pipeline


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp4_beside_tp2_sums_chunks_and_matches_the_reference(tmp_path):
    """Pipelines of different tp degrees hold every parameter: split tensors are summed chunk by
    chunk (quarters; a tp2 rank sums two), and the word embedding, whose 510 rows do not split into
    4 equal chunks, with the norms and row-parallel biases as full tensors; training matches the
    single-device reference."""
    model = {**GPT, "name": "tiny-v510", "vocab_size": 510}
    summary, _ = _launch(tmp_path, model, _plan(TP4_BESIDE_TP2), cluster=WIDE)
    _assert_matches(summary, model)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_two_tp2_replicas_on_two_vendors_match_the_reference(tmp_path, model):
    """A tp2 pipeline on each vendor: every parameter's shards are summed across the vendors by
    tp rank (tied embedding and head included), and training matches the single-device reference."""
    plan = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                  {"micro_batches": 2, "stages": [{"group": "slow", "tp": 2, "layers": [0, 4]}]}])
    summary, _ = _launch(tmp_path, model, plan)
    _assert_matches(summary, model)
