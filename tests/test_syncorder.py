"""Gradient all-reduces run in rounds of disjoint holders (hetero.syncorder), in the runtime and in
the predictor alike, so pipelines with staggered stage boundaries sum their gradients at the same
time instead of one after another."""
from __future__ import annotations

import random

import pytest

import hetero
from hetero.predictor import StageCostModel
from hetero.syncorder import in_sync_order, sync_rounds

from test_predictor import CLUSTER, GPT  # a100 + mi250, gpt2-large (36 layers, tied embeddings)


def _st(group, a, b):
    return {"group": group, "tp": 1, "layers": [a, b]}


# Stage boundaries staggered across the two pipelines: layers [0, 12) are held by (0, 0) and (1, 0),
# [12, 18) by (0, 1) and (1, 0), [18, 24) by (0, 1) and (1, 1), [24, 36) by (0, 2) and (1, 1): a chain.
STAGGERED = {"global_batch_size": 16, "micro_batch_size": 1, "pipelines": [
    {"replicas": 1, "micro_batches": 8, "stages": [_st("a100", 0, 12), _st("a100", 12, 24), _st("a100", 24, 36)]},
    {"replicas": 1, "micro_batches": 8, "stages": [_st("mi250", 0, 18), _st("mi250", 18, 36)]}]}


def test_a_chain_of_buckets_runs_in_two_rounds():
    chain = [{1, 2}, {2, 3}, {3, 4}, {4, 5}, {7}]
    assert sync_rounds(chain) == [0, 1, 0, 1, -1]
    assert in_sync_order(chain) == [4, 0, 2, 1, 3]
    # a set that meets every round so far opens a new one; a later small one fills a gap
    assert sync_rounds([{1, 2}, {3, 4}, {1, 3}, {2, 4}, {5, 6}]) == [0, 0, 1, 1, 0]


@pytest.mark.parametrize("seed", range(20))
def test_ranks_running_their_buckets_in_sync_order_never_wait_on_each_other_forever(seed):
    """Blocking all-reduces, each rank walking its own buckets in the shared order: every bucket
    completes (a bucket runs once all its holders have reached it)."""
    rng = random.Random(seed)
    sets = sorted({tuple(sorted(rng.sample(range(8), rng.randint(1, 4)))) for _ in range(14)})
    order = [sets[i] for i in in_sync_order(sets)]
    queues = {r: [s for s in order if r in s] for r in range(8)}
    done = 0
    while any(queues.values()):
        ready = [s for s in order if all(queues[r] and queues[r][0] == s for r in s)]
        assert ready, f"deadlock with {queues}"
        for s in ready:
            for r in s:
                queues[r].pop(0)
            done += 1
    assert done == len(sets)


def test_the_predictors_staggered_sync_runs_buckets_of_disjoint_stages_together():
    """All stages ready at 0. Buckets: the tied word embedding w over the first and last stages, then
    the chain c1 = {(0,0),(1,0)}, c2 = {(0,1),(1,0)}, c3 = {(0,1),(1,1)}, c4 = {(0,2),(1,1)}. Rounds:
    w; c1 + c3; c2 + c4. So c3 starts right after w (with c1), c2 after both, c4 after c3, and the
    sync ends at tw + max(max(t1, t3) + t2, t3 + t4) -- not tw + t1 + t2 + t3 + t4, the chain that
    the rank-sorted order (w, c1, c2, c3, c4) runs."""
    c, m, p = hetero.load_cluster(CLUSTER), hetero.load_model(GPT), hetero.load_plan(STAGGERED)
    sync = StageCostModel(c, m).dp_sync_plan(p)
    w, c1, c2, c3, c4 = (frozenset({(0, 0), (0, 2), (1, 0), (1, 1)}), frozenset({(0, 0), (1, 0)}),
                         frozenset({(0, 1), (1, 0)}), frozenset({(0, 1), (1, 1)}), frozenset({(0, 2), (1, 1)}))
    sets = [frozenset(sync.stages[i] for i in hs) for hs, _ in sync.buckets]
    assert sets == [w, c1, c3, c2, c4]
    tw, t1, t3, t2, t4 = (t for _, t in sync.buckets)
    assert min(tw, t1, t2, t3, t4) > 0
    _, ends = sync.spans([0.0] * len(sync.stages))
    assert max(ends) == pytest.approx(tw + max(max(t1, t3) + t2, t3 + t4))
    assert max(ends) < tw + t1 + t2 + t3 + t4


def test_the_staggered_plan_is_one_the_plain_sorted_order_would_chain():
    """The runtime runs this plan in another order than the rank-sorted one (that its buckets are
    the predictor's, in the predictor's order, is tests/test_iteration_trace.py's
    test_sync_buckets_are_the_runtimes, which runs this plan too)."""
    pytest.importorskip("torch")
    from hetero.layout import build_layout
    from hetero.runtime.grads import all_holder_sets, build_buckets, param_holders

    c, m, p = hetero.load_cluster(CLUSTER), hetero.load_model(GPT), hetero.load_plan(STAGGERED)
    holders = param_holders(m, p, build_layout(c, p))
    plain = all_holder_sets(holders)
    ran = [b.ranks for b in build_buckets(holders, list(holders), -1)]
    assert sorted(ran) == plain and ran != plain
