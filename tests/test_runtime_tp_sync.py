"""Data-parallel gradient sync between replicas of one tp degree (hetero.runtime.grads): each rank
sums its local shards with the holders at its own tp rank only (Megatron's data-parallel group),
instead of gathering full gradients and summing them over every holder."""
from __future__ import annotations

import pytest

import hetero
from hetero.layout import build_layout
from test_runtime import CLUSTER, GPT, LLAMA, _assert_matches, _launch, _plan


def _buckets(plan_dict, model=GPT):
    from hetero.runtime.grads import all_peer_sets, build_buckets, param_holders
    from hetero.runtime.model import stage_param_shapes

    pytest.importorskip("torch")
    plan = hetero.load_plan(plan_dict)
    spec = hetero.load_model(model)
    layout = build_layout(hetero.load_cluster(CLUSTER), plan)
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
    buckets, peer_sets, _ = _buckets(mixed)
    assert peer_sets == [] and all(b.peers is None for bs in buckets.values() for b in bs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_two_tp2_replicas_on_two_vendors_match_the_reference(tmp_path, model):
    """A tp2 pipeline on each vendor: every parameter's shards are summed across the vendors by
    tp rank (tied embedding and head included), and training matches the single-device reference."""
    plan = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                  {"micro_batches": 2, "stages": [{"group": "slow", "tp": 2, "layers": [0, 4]}]}])
    summary, _ = _launch(tmp_path, model, plan)
    _assert_matches(summary, model)
