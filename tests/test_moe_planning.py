"""Mixture of experts in the plan, the predictor and the planner: the plan's expert_parallel field,
expert time from token counts, the all-to-all's bytes per link, memory with the experts under the
worst routing skew, and the planner's expert counts in proportion to each device's speed."""
from __future__ import annotations

import pytest

import hetero
from hetero.errors import HeteroError
from hetero.planner.experts import expert_speed, expert_twins, proportional_counts
from hetero.predictor import cost_model_for, moe, predict

pytestmark = pytest.mark.timeout(60)

MOE = {"name": "moe-12", "architecture": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
       "vocab_size": 2048, "seq_length": 128, "dtype": "fp32", "ffn_hidden_size": 512,
       "moe": {"num_experts": 12, "top_k": 2}}


def _cluster(memory: str = "64 GiB"):
    link = {"bandwidth": "1.5 GB/s", "latency": "50 us"}
    return hetero.load_cluster({
        "name": "pair", "devices": {"cpu-emu-a": {"base": "cpu", "vendor": "emu-a", "memory": memory},
                                    "cpu-emu-b": {"base": "cpu", "vendor": "emu-b", "slowdown": 2.0, "memory": memory}},
        "groups": [{"name": "fast", "device": "cpu-emu-a", "nodes": 1, "devices_per_node": 1, "intra_node": link},
                   {"name": "slow", "device": "cpu-emu-b", "nodes": 1, "devices_per_node": 1, "intra_node": link}],
        "network": {"inter_node": link, "cross_group": link}})


def _plan(ep=None, micro_batches=(4, 4)):
    d = {"global_batch_size": sum(micro_batches), "micro_batch_size": 1, "recompute": "full", "pipelines": [
        {"micro_batches": micro_batches[0], "stages": [{"group": "fast", "layers": [0, 4]}]},
        {"micro_batches": micro_batches[1], "stages": [{"group": "slow", "layers": [0, 4]}]}]}
    if ep is not None:
        d["expert_parallel"] = ep
    return d


def test_the_plans_expert_parallel_field_is_read_and_checked():
    model = hetero.load_model(MOE)
    plan = hetero.load_plan(_plan({"degree": 2, "experts": [8, 4]}), _cluster(), model)
    assert plan.expert_parallel.counts(12) == (8, 4) and plan.to_dict()["expert_parallel"] == {"degree": 2, "experts": [8, 4]}
    assert hetero.load_plan(_plan({"degree": 2}), _cluster(), model).expert_parallel.counts(12) == (6, 6)
    bad = [({"degree": 0}, "expert_parallel.degree: must be >= 1"),
           ({"degree": 2, "experts": [8, 4, 0]}, "lists 3 count(s) for degree 2"),
           ({"degree": 2, "experts": [8, 5]}, "counts sum to 13, not moe.num_experts=12"),
           ({"degree": 5}, "12 experts do not split evenly over degree 5"),
           ({"degree": 4, "experts": [3, 3, 3, 3]}, "2 data-parallel rank(s)"),
           ({"degre": 2}, "did you mean 'degree'")]
    for ep, says in bad:
        with pytest.raises(HeteroError, match=says.replace("(", r"\(").replace(")", r"\)")):
            hetero.load_plan(_plan(ep), _cluster(), model)
    with pytest.raises(HeteroError, match="run different micro-batches"):
        hetero.load_plan(_plan({"degree": 2}, (6, 2)), _cluster(), model)
    split = _plan({"degree": 2})
    split["pipelines"][1]["stages"] = [{"group": "slow", "layers": [0, 1]}, {"group": "slow", "layers": [1, 4]}]
    with pytest.raises(HeteroError, match="split the layers differently"):
        hetero.load_plan(split, _cluster(), model)
    with pytest.raises(HeteroError, match="has no moe block"):
        hetero.load_plan(_plan({"degree": 2}), _cluster(), hetero.load_model({**MOE, "moe": None}))


def test_expert_tokens_from_counts_balanced_and_with_an_imbalance_factor():
    model = hetero.load_model({**MOE, "moe": {"num_experts": 12, "top_k": 2}})
    T = 256
    # balanced: each of 2 ranks routes T tokens x top_k; 8 of 12 experts take 8/12 of them
    assert moe.received_assignments(model, T, 2, 8) == pytest.approx(2 * T * 2 * 8 / 12)
    assert moe.received_assignments(model, T, 2, 8, imbalance=1.2) == pytest.approx(1.2 * 2 * T * 2 * 8 / 12)
    # the worst skew: every token's assignments, as far as the rank's experts allow (top_k each)
    assert moe.received_assignments(model, T, 2, 8, imbalance=float("inf")) == 2 * T * 2
    assert moe.received_assignments(model, T, 2, 1, imbalance=float("inf")) == 2 * T * 1
    capped = hetero.load_model({**MOE, "moe": {"num_experts": 12, "top_k": 2, "capacity_factor": 1.25}})
    cap = capped.moe.capacity(2 * T)
    assert moe.received_assignments(capped, T, 2, 8, imbalance=float("inf")) == 8 * cap
    # the expert time follows the assignments: more tokens take longer, more experts for the same tokens too
    cm = cost_model_for(_cluster(), model)
    one, two = moe.expert_times(cm, "fast", 1, 512, 4), moe.expert_times(cm, "fast", 1, 1024, 4)
    assert two[0] > one[0] and two[1] > one[1]
    assert moe.expert_times(cm, "slow", 1, 512, 4)[0] > 1.3 * one[0]   # the 2x slower device (host dispatch kept)


def test_the_all_to_all_bytes_per_link_as_a_matrix():
    model = hetero.load_model(MOE)
    m = moe.all_to_all_bytes(model, [256, 256], [8, 4])
    row = model.hidden_size * 4   # fp32
    assert m == [[0.0, 256 * 2 * 4 / 12 * row], [256 * 2 * 8 / 12 * row, 0.0]]
    three = moe.all_to_all_bytes(model, [100, 200, 300], [6, 4, 2])
    assert all(three[i][i] == 0 for i in range(3))
    # what a rank sends over all its links: its assignments for the experts it does not hold
    assert sum(three[1]) == pytest.approx(200 * 2 * (6 + 2) / 12 * row)


def test_each_exchange_of_an_moe_layer_pays_the_link_latency():
    """Forward: three separate all-to-alls (counts, dispatch, combine), backward two; each pays the
    link's latency to the peer, the bytes its bandwidth once."""
    cluster, model = _cluster(), hetero.load_model(MOE)
    cm = cost_model_for(cluster, model)
    members = [moe.Member("fast", 1, 8), moe.Member("slow", 1, 4)]
    link = cluster.link_between("fast", "slow")
    for forward, exchanges in ((True, 3), (False, 2)):
        sent = moe.link_bytes(model, [256, 256], [8, 4], forward)
        worst = max(sent[0][1], sent[1][0])
        want = exchanges * link.latency + worst / link.bandwidth
        assert moe.all_to_all_time(cm, model, members, 256, forward) == pytest.approx(want * cm.factors("fast").communication)


def test_the_bytes_charged_per_link_are_the_bytes_the_runtimes_exchange_moves():
    """For a balanced routing, the predictor's bytes per link of one MoE layer's forward equal
    hetero.runtime.expert_parallel.exchange_bytes (dispatch, combine and the counts)."""
    torch = pytest.importorskip("torch")
    from hetero.runtime.expert_parallel import exchange_bytes

    model = hetero.load_model(MOE)
    T, counts = 96, [8, 4]
    per_expert = T * model.moe.top_k // model.moe.num_experts   # balanced: every expert the same share
    routing = torch.full((2, 12), per_expert)
    ranges = [(0, 8), (8, 12)]
    runtime = exchange_bytes(routing, ranges, model.hidden_size * 4).tolist()
    assert moe.link_bytes(model, [T, T], counts) == runtime


def test_memory_counts_each_ranks_experts_and_the_worst_routing_skew():
    cluster, model = _cluster(), hetero.load_model(MOE)
    uneven = predict(cluster, model, hetero.load_plan(_plan({"degree": 2, "experts": [8, 4]}), cluster, model))
    fast, slow = (p.stages[0] for p in uneven.pipelines)
    # 4 more experts in each of the 4 MoE layers, 16 bytes a parameter (fp32 weights, gradients, moments)
    states = (fast.memory_breakdown.weights + fast.memory_breakdown.gradients + fast.memory_breakdown.optimizer
              - slow.memory_breakdown.weights - slow.memory_breakdown.gradients - slow.memory_breakdown.optimizer)
    assert states == pytest.approx(4 * 4 * model.expert_params() * 16)
    # the worst skew: every token's top_k assignments on one rank, as far as its experts allow
    assert fast.memory_breakdown.activations == slow.memory_breakdown.activations   # 8 and 4 experts both take 2
    T = model.seq_length
    assert moe.expert_activation_bytes(model, T, 2, 1) < moe.expert_activation_bytes(model, T, 2, 4)
    whole = predict(cluster, model, hetero.load_plan(_plan(), cluster, model)).pipelines[0].stages[0]
    assert whole.peak_memory_bytes > fast.peak_memory_bytes   # every expert on every rank
    capped = hetero.load_model({**MOE, "moe": {"num_experts": 12, "top_k": 2, "capacity_factor": 1.0}})
    c_fast = predict(cluster, capped, hetero.load_plan(_plan({"degree": 2, "experts": [8, 4]}), cluster, capped))
    assert c_fast.pipelines[0].stages[0].memory_breakdown.activations < fast.memory_breakdown.activations


def test_expert_counts_follow_device_speed():
    assert proportional_counts([2.0, 1.0], 12) == [8, 4]
    assert proportional_counts([2.0, 1.0], 8) == [5, 3]
    assert proportional_counts([10.0, 1.0, 1.0], 4) == [2, 1, 1]   # at least one each
    cluster, model = _cluster(), hetero.load_model(MOE)
    cm = cost_model_for(cluster, model)
    # the emulated device computes 2x slower; the predictor keeps its host dispatch share (1.7x at mbs 1)
    ratio = expert_speed(cm, "fast", 1, 1) / expert_speed(cm, "slow", 1, 1)
    assert 1.5 < ratio <= 2.0
    twins = expert_twins(cm, hetero.load_plan(_plan(), cluster, model))
    assert [t.expert_parallel.counts(12) for t in twins] == [(8, 4), (6, 6)]


def test_the_planner_spreads_experts_by_speed_where_that_predicts_faster_and_says_why():
    """Devices too small to hold every expert: the best plan spreads them, a 2x faster device taking
    twice the experts, and beats the even split and every plan without expert parallelism."""
    cluster, model = _cluster("330 MiB"), hetero.load_model(MOE)
    results = hetero.search(cluster, model, global_batch_size=8, top_k=3, mixed=False)
    best = results[0]
    assert best.plan.expert_parallel.counts(12) == (8, 4)
    even = predict(cluster, model, hetero.load_plan({**best.plan.to_dict(), "expert_parallel": {"degree": 2}}))
    assert best.tokens_per_s > even.tokens_per_s
    without = [r for r in results if r.plan.expert_parallel is None]   # the best plan keeping every expert
    assert without and all(r.tokens_per_s < best.tokens_per_s for r in without)
    reason = next(r for r in results.reasons if r.startswith("expert parallelism"))
    assert "experts [8, 4] in proportion to each device's expert speed" in reason and "[6, 6]" in reason
    roomy = hetero.search(_cluster(), model, global_batch_size=8, top_k=1, mixed=False)
    assert any(r.startswith(("experts on every rank", "expert parallelism")) for r in roomy.reasons)
