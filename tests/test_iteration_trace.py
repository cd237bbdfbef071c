"""The predicted iteration and its Chrome trace (``hetero predict --timeline``) are one computation.

The runtime (hetero/runtime/engine.py) starts a rank's gradient sync when its own schedule is done
(its last op and its pending sends), sums each bucket of gradients with one all-reduce over every
rank holding them (which cannot start before the last holder arrives), then all-reduces the
squared gradient norm over the world before any rank's optimizer step. So: the trace's last event
ends at ``iteration_time_s``; the iteration is no shorter than any stage's own schedule end + its
sync + its optimizer; a stage's sync cannot end before any stage it shares gradients with is ready.
"""
from __future__ import annotations

import pytest
import yaml

import hetero
from hetero.predictor import predict

from conftest import CONFIGS
from test_predictor import CLUSTER, GPT, _Cal, plan_dict  # a100 + mi250, gpt2-large, an A100 calibration

EXAMPLES = yaml.safe_load((CONFIGS / "examples.yaml").read_text())["examples"]

LLAMA = {"name": "llama-36", "architecture": "llama", "num_layers": 36, "hidden_size": 2048,
         "num_attention_heads": 16, "num_kv_heads": 4, "vocab_size": 128256, "seq_length": 1024, "dtype": "bf16"}


def _st(group, tp, a, b):
    return {"group": group, "tp": tp, "layers": [a, b]}


# Pipelines of different shapes (stage boundaries that overlap across pipelines) and speeds.
MIXED = plan_dict()  # 2 x (a100 tp2 [0, 20) + mi250 tp2 [20, 36)) and 2 x a100 tp4 [0, 36)
THREE_SHAPES = {"global_batch_size": 64, "micro_batch_size": 1, "pipelines": [
    {"replicas": 1, "micro_batches": 24, "stages": [_st("a100", 2, 0, 12), _st("a100", 2, 12, 36)]},
    {"replicas": 2, "micro_batches": 12, "stages": [_st("mi250", 1, 0, 9), _st("mi250", 1, 9, 21),
                                                    _st("mi250", 1, 21, 36)]},
    {"replicas": 1, "micro_batches": 16, "stages": [_st("a100", 4, 0, 24), _st("a100", 4, 24, 36)]}]}
INTERLEAVED = {"global_batch_size": 48, "micro_batch_size": 1, "schedule": "interleaved", "interleave": 2,
               "pipelines": [
                   {"replicas": 1, "micro_batches": 32, "stages": [_st("a100", 2, 0, 9), _st("mi250", 2, 9, 18),
                                                                   _st("a100", 2, 18, 27), _st("mi250", 2, 27, 36)]},
                   {"replicas": 1, "micro_batches": 16, "stages": [_st("a100", 4, 0, 16), _st("a100", 4, 16, 36)]}]}


def _events(pred):
    return [e for e in pred.timeline()["traceEvents"] if e["ph"] == "X"]


def check_trace_is_the_prediction(pred):
    it = pred.iteration_time_s
    xs = _events(pred)
    last = max(e["ts"] + e["dur"] for e in xs) / 1e6
    assert last == pytest.approx(it, rel=1e-9, abs=0)
    eps = it * 1e-12
    for pi, pp in enumerate(pred.pipelines):
        phys = {(e["tid"] // 2) for e in xs if e["pid"] == pi and e["cat"] in ("forward", "backward")}
        ends = {}
        for i in phys:
            ends[i] = max(e["ts"] + e["dur"] for e in xs
                          if e["pid"] == pi and e["tid"] == 2 * i and e["cat"] in ("forward", "backward")) / 1e6
            s = pp.stages[i]
            # the stage's own schedule end, its own sync, its own optimizer
            assert it + eps >= ends[i] + s.dp_sync_time_s + s.optimizer_time_s + pred.overhead_time_s
            assert s.schedule_end_s >= ends[i] - eps
            assert s.dp_sync_start_s >= s.schedule_end_s - eps
            assert s.dp_sync_end_s >= s.dp_sync_start_s + s.dp_sync_time_s - eps
        # the pipeline's schedule end plus the sync + optimizer of the stage that ends it
        assert max(ends.values()) == pytest.approx(pp.pipeline_time_s, rel=1e-12)
        for i, e in ends.items():
            if e == max(ends.values()):
                s = pp.stages[i]
                assert it + eps >= pp.pipeline_time_s + s.dp_sync_time_s + s.optimizer_time_s + pred.overhead_time_s
    # breakdown used by `hetero predict`: slowest pipeline + DP sync + optimizer + overhead
    slowest = max(p.pipeline_time_s for p in pred.pipelines)
    assert it == pytest.approx(slowest + pred.dp_sync_time_s + pred.optimizer_time_s + pred.overhead_time_s,
                               rel=1e-12)


def check_collectives_wait_for_the_last_holder(pred):
    """A stage's sync ends no earlier than every stage it shares a layer's gradient with is ready."""
    stages = [(pi, i, s) for pi, pp in enumerate(pred.pipelines) for i, s in enumerate(pp.stages)]
    for pa, ia, a in stages:
        for pb, ib, b in stages:
            if (pa, ia) == (pb, ib) or a.layers[1] <= b.layers[0] or b.layers[1] <= a.layers[0]:
                continue
            if a.dp_sync_time_s > 0:
                assert a.dp_sync_end_s >= b.schedule_end_s, (pa, ia, pb, ib)


def _paths(ex):
    return (CONFIGS / "clusters" / f"{ex['cluster']}.yaml", CONFIGS / "models" / f"{ex['model']}.yaml",
            CONFIGS / "plans" / f"{ex['plan']}.yaml")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e["plan"])
def test_shipped_example_trace_ends_at_the_iteration_time(example):
    cluster, model, plan = (f(p) for f, p in zip((hetero.load_cluster, hetero.load_model, hetero.load_plan),
                                                  _paths(example)))
    pred = predict(cluster, model, plan, timeline=True)
    check_trace_is_the_prediction(pred)
    check_collectives_wait_for_the_last_holder(pred)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
@pytest.mark.parametrize("plan", [MIXED, THREE_SHAPES, INTERLEAVED], ids=["two-shapes", "three-shapes", "interleaved"])
@pytest.mark.parametrize("cal", [None, {"communication": 4.0, "iteration_overhead_s": 0.01}],
                         ids=["plain", "calibrated"])
def test_mixed_shapes_trace_ends_at_the_iteration_time(model, plan, cal):
    c, m, p = hetero.load_cluster(CLUSTER), hetero.load_model(model), hetero.load_plan(plan)
    pred = predict(c, m, p, calibration=_Cal(**cal) if cal else None, timeline=True)
    check_trace_is_the_prediction(pred)
    check_collectives_wait_for_the_last_holder(pred)
    assert len({round(pp.pipeline_time_s, 9) for pp in pred.pipelines}) == len(pred.pipelines)  # different speeds


def test_a_fast_pipeline_waits_for_the_slow_one_it_shares_layers_with():
    """Two pipelines holding the same layers, one much slower: the fast one's sync cannot finish
    before the slow one is ready, so the iteration is the slow schedule + the sync + the optimizer."""
    c, m = hetero.load_cluster(CLUSTER), hetero.load_model(GPT)
    plan = hetero.load_plan({"global_batch_size": 40, "micro_batch_size": 1, "pipelines": [
        {"replicas": 1, "micro_batches": 32, "stages": [_st("a100", 4, 0, 36)]},
        {"replicas": 1, "micro_batches": 8, "stages": [_st("mi250", 1, 0, 36)]}]})
    pred = predict(c, m, plan, timeline=True)
    fast, slow = pred.pipelines[0].stages[0], pred.pipelines[1].stages[0]
    assert fast.schedule_end_s != slow.schedule_end_s
    late = max(fast.schedule_end_s, slow.schedule_end_s)
    assert fast.dp_sync_start_s == slow.dp_sync_start_s == late
    assert pred.iteration_time_s == pytest.approx(
        late + max(fast.dp_sync_time_s, slow.dp_sync_time_s) + max(fast.optimizer_time_s, slow.optimizer_time_s))
    check_trace_is_the_prediction(pred)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
@pytest.mark.parametrize("plan", [MIXED, THREE_SHAPES, INTERLEAVED], ids=["two-shapes", "three-shapes", "interleaved"])
def test_sync_buckets_are_the_runtimes(model, plan):
    """The predictor's all-reduces are the runtime's buckets (parameters grouped by holder set), in
    the order each rank runs them."""
    pytest.importorskip("torch")
    from hetero.layout import build_layout
    from hetero.predictor import StageCostModel
    from hetero.runtime.grads import build_buckets, param_holders
    from hetero.runtime.model import stage_param_shapes

    c, m, p = hetero.load_cluster(CLUSTER), hetero.load_model(model), hetero.load_plan(plan)
    layout = build_layout(c, p)
    holders = param_holders(m, p, layout)
    stage_of = {r.rank: (r.pipeline, r.stage) for r in layout.ranks}
    sync = StageCostModel(c, m).dp_sync_plan(p)
    sets = [frozenset(sync.stages[i] for i in hs) for hs, _ in sync.buckets]
    runtime_sets = {frozenset(stage_of[x] for x in ranks) for ranks in holders.values()}
    assert {s for s in sets if len(s) > 1} == {s for s in runtime_sets if len(s) > 1}
    shapes: dict = {}
    for r in layout.ranks:
        key = (r.layers, r.holds_ends(p), r.chunk_layers(p))
        names = shapes.get(key) or shapes.setdefault(key, stage_param_shapes(m, key[0], *key[1], key[2]))
        ran = [frozenset(stage_of[x] for x in b.ranks) for b in build_buckets(holders, list(names), r.rank)]
        mine = [s for s in sets if (r.pipeline, r.stage) in s]
        assert [s for s in ran if s in mine] == mine, r


def test_megatron_order_sums_the_tied_embedding_after_the_data_parallel_all_reduces():
    """Megatron-LM (the runs of a run log) all-reduces each stage over its replicas, then the word
    embedding between the first and last stages; the hetero runtime's rank order puts that bucket first."""
    from hetero.predictor import StageCostModel

    c, m = hetero.load_cluster(CLUSTER), hetero.load_model(GPT)
    plan = hetero.load_plan({"global_batch_size": 32, "micro_batch_size": 2, "pipelines": [
        {"replicas": 2, "micro_batches": 8, "stages": [_st("a100", 2, 0, 12), _st("a100", 2, 12, 24),
                                                       _st("a100", 2, 24, 36)]}]})
    cm = StageCostModel(c, m)
    for placement, at in (("megatron", -1), ("packed", 0)):
        sync = cm.dp_sync_plan(plan, placement)
        sets = [{sync.stages[i] for i in hs} for hs, _ in sync.buckets]
        assert sets[at] == {(0, 0), (0, 2)}, placement
        assert sorted(map(len, sets)) == [1, 1, 1, 2]
        check_trace_is_the_prediction(predict(c, m, plan, timeline=True, placement=placement))
