"""The predicted iteration and its Chrome trace (``hetero predict --timeline``) are one computation.

The runtime (hetero/runtime/engine.py, hetero/runtime/overlap.py) starts a rank's gradient sync
under its last backward pass (with --no-overlap: when its own schedule is done, its last op and its
pending sends), sums each bucket of gradients with one all-reduce over every rank holding them
(which cannot start before the last holder arrives), then all-reduces the squared gradient norm over
the world before any rank's optimizer step. So: the trace obeys the
schedule's rules (each op after its input, one op at a time per device, the optimizers after every
sync); the iteration is no shorter than any stage's own schedule end + its sync + its optimizer; a
stage's sync cannot end before any stage it shares gradients with is ready. A two-stage step with
round stage times is worked out by hand, event by event, down to the trace's last event ending at
``iteration_time_s``.
"""
from __future__ import annotations

import dataclasses

import pytest
import yaml

import hetero
from hetero.predictor import StageCostModel, predict
from hetero.predictor.placement import SyncPlan

from conftest import CONFIGS
from test_predictor import CLUSTER, GPT, _Cal, plan_dict  # a100 + mi250, gpt2-large, an A100 calibration
from test_syncorder import STAGGERED  # stage boundaries that chain the buckets

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
                   {"replicas": 1, "micro_batches": 16, "stages": [_st("a100", 4, 6 * i, 6 * i + 6) for i in range(6)]}]}


def _events(pred):
    return [e for e in pred.timeline()["traceEvents"] if e["ph"] == "X"]


def _start(e):
    return e["ts"] / 1e6


def _end(e):
    return (e["ts"] + e["dur"]) / 1e6


def check_trace_follows_the_rules(pred):
    """What any correct step obeys, whatever its numbers (:mod:`hetero.predictor.schedule`): every
    micro-batch goes forward and backward once through every (virtual) stage; a device runs one op
    at a time; an op starts once its input is there (the previous stage's op plus the p2p transfer;
    the last stage's backward after its own forward); a stage's sync starts no earlier than its last
    backward pass (when it is done, without overlap), ends no earlier than its schedule and lasts at
    least its own transfer time; the optimizers start together, after every op and every sync;
    the iteration holds each stage's schedule, sync and optimizer. The exact numbers are checked by
    hand in :func:`test_a_two_stage_step_is_the_schedule_worked_by_hand`."""
    it = pred.iteration_time_s
    xs = _events(pred)
    eps = it * 1e-9
    for pi, pp in enumerate(pred.pipelines):
        ops = [e for e in xs if e["pid"] == pi and e["cat"] in ("forward", "backward")]
        V, m = len(pp.stages), pp.micro_batches
        by = {(e["cat"][0].upper(), e["args"]["micro_batch"], e["args"]["virtual_stage"]): e for e in ops}
        assert len(by) == len(ops) == 2 * V * m, (pi, len(by), len(ops))
        for tid in {e["tid"] for e in ops}:
            mine = sorted((e for e in ops if e["tid"] == tid), key=_start)
            for a, b in zip(mine, mine[1:]):
                assert _start(b) >= _end(a) - eps, (pi, tid, a["name"], b["name"])
        for (kind, j, vs), e in by.items():
            if kind == "F" and vs > 0:
                need = _end(by["F", j, vs - 1]) + pp.stages[vs - 1].p2p_time_s
            elif kind == "B" and vs < V - 1:
                need = _end(by["B", j, vs + 1]) + pp.stages[vs].p2p_time_s
            elif kind == "B":
                need = _end(by["F", j, vs])
            else:
                continue
            assert _start(e) >= need - eps, (pi, kind, j, vs)
        for i in {e["tid"] // 2 for e in ops}:
            done = max(_end(e) for e in ops if e["tid"] == 2 * i)
            s = pp.stages[i]
            assert s.schedule_end_s >= done - eps
            assert s.dp_sync_start_s >= s.schedule_end_s - s.backward_time_s - eps
            # ZeRO under overlap: the parameter all-gathers run under the next step's forwards instead
            assert 0 <= s.dp_sync_in_step_s <= s.dp_sync_time_s + eps
            assert s.dp_sync_end_s >= max(s.schedule_end_s, s.dp_sync_start_s + s.dp_sync_in_step_s) - eps
            assert it + eps >= s.dp_sync_end_s + s.optimizer_time_s + pred.overhead_time_s
    opt = [e for e in xs if e["cat"] == "optimizer"]
    assert len(opt) == sum(len({e["tid"] for e in xs if e["pid"] == pi and e["cat"] == "forward"})
                           for pi in range(len(pred.pipelines)))
    begin = _start(opt[0])
    assert all(_start(e) == pytest.approx(begin, rel=1e-12) for e in opt)
    assert begin >= max(_end(e) for e in xs if e["cat"] in ("forward", "backward", "p2p", "dp", "wait")) - eps
    assert it + eps >= begin + max(e["dur"] for e in opt) / 1e6 + pred.overhead_time_s


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
def test_shipped_example_trace_follows_the_rules(example):
    cluster, model, plan = (f(p) for f, p in zip((hetero.load_cluster, hetero.load_model, hetero.load_plan),
                                                  _paths(example)))
    pred = predict(cluster, model, plan, timeline=True)
    check_trace_follows_the_rules(pred)
    check_collectives_wait_for_the_last_holder(pred)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
@pytest.mark.parametrize("plan", [MIXED, THREE_SHAPES, INTERLEAVED], ids=["two-shapes", "three-shapes", "interleaved"])
@pytest.mark.parametrize("cal", [None, {"communication": 4.0, "iteration_overhead_s": 0.01}],
                         ids=["plain", "calibrated"])
def test_mixed_shapes_trace_follows_the_rules(model, plan, cal):
    c, m, p = hetero.load_cluster(CLUSTER), hetero.load_model(model), hetero.load_plan(plan)
    pred = predict(c, m, p, calibration=_Cal(**cal) if cal else None, timeline=True)
    check_trace_follows_the_rules(pred)
    check_collectives_wait_for_the_last_holder(pred)
    assert len({round(pp.pipeline_time_s, 9) for pp in pred.pipelines}) == len(pred.pipelines)  # different speeds


class _HandCosts(StageCostModel):
    """The real cost model with round, known numbers: forward / backward 1 / 2 s on stage 0 and
    2 / 3 s on stage 1, 0.5 s per p2p transfer, optimizer 0.125 / 0.375 s, 0.0625 s of overhead, and a
    sync of three all-reduces in this order: one shared by both stages (a tied embedding, 0.5 s),
    then stage 0's own (0.25 s), then stage 1's (0.75 s); stage 1's sync lasts 1.5 s in all (its
    NIC is shared), stage 0's 0.75 s."""

    def stage_times(self, group, tp, mbs, layers, recompute="none", first=False, last=False):
        return (1.0, 2.0) if first else (2.0, 3.0)

    def p2p_time(self, *args, **kwargs):
        return 0.5

    def optimizer_time(self, group, tp, layers, first, last, zero_stage=0, dp=1, placement="packed"):
        return 0.125 if first else 0.375

    def dp_sync_plan(self, plan, placement="packed"):
        return SyncPlan({(0, 0): 0.75, (0, 1): 1.5}, [(frozenset({(0, 0), (0, 1)}), 0.5),
                                                      (frozenset({(0, 0)}), 0.25), (frozenset({(0, 1)}), 0.75)])

    def factors(self, group):
        return dataclasses.replace(super().factors(group), iteration_overhead_s=0.0625)


def test_a_two_stage_step_is_the_schedule_worked_by_hand():
    """One pipeline of two stages, three micro-batches, 1F1B, timed by hand from the rules of
    :mod:`hetero.predictor.schedule` and :mod:`hetero.predictor.api` (stage 0: F0 F1 B0 F2 B1 B2,
    one warm-up forward; stage 1: F0 B0 F1 B1 F2 B2). Stage 1's forward of j waits for stage 0's
    forward + 0.5 s, stage 0's backward of j for stage 1's backward + 0.5 s:

    stage 0: F0 0-1, F1 1-2, B0 7-9 (B0 on 1 ends 6.5, +0.5), F2 9-10, B1 12-14, B2 17-19
    stage 1: F0 1.5-3.5, B0 3.5-6.5, F1 6.5-8.5, B1 8.5-11.5, F2 11.5-13.5, B2 13.5-16.5

    The pipeline takes 19 s. Stage 1 is done at 17 (its last op ends at 16.5, its gradient for B2
    arrives at 17), stage 0 at 19. The shared all-reduce waits for stage 0: 19-19.5; then stage 0's
    own 19.5-19.75 and stage 1's 19.5-20.25, but stage 1's sync lasts 1.5 s from 19: 20.5. The
    optimizers start at 20.5 (0.125 and 0.375 s), the overhead runs 20.875-20.9375: the step. Without
    overlap (``--no-overlap``), the rule these hand times follow."""
    c, m = hetero.load_cluster(CLUSTER), hetero.load_model(GPT)
    plan = hetero.load_plan({"global_batch_size": 6, "micro_batch_size": 1, "pipelines": [
        {"replicas": 2, "micro_batches": 3, "stages": [_st("a100", 1, 0, 18), _st("a100", 1, 18, 36)]}]})
    pred = predict(c, m, plan, cost_model=_HandCosts(c, m), timeline=True, overlap=False)

    assert pred.iteration_time_s == pytest.approx(20.9375, rel=1e-12)
    assert pred.pipelines[0].pipeline_time_s == pytest.approx(19.0, rel=1e-12)
    assert (pred.dp_sync_time_s, pred.optimizer_time_s, pred.overhead_time_s) == pytest.approx((1.5, 0.375, 0.0625))
    s0, s1 = pred.pipelines[0].stages
    assert (s0.schedule_end_s, s0.dp_sync_start_s, s0.dp_sync_end_s) == pytest.approx((19.0, 19.0, 19.75))
    assert (s1.schedule_end_s, s1.dp_sync_start_s, s1.dp_sync_end_s) == pytest.approx((17.0, 19.0, 20.5))

    hand = {  # (pid, tid, name): (start, end); tid 2 i = stage i's device, 2 i + 1 its communication
        (0, 0, "F0"): (0, 1), (0, 0, "F1"): (1, 2), (0, 0, "B0"): (7, 9), (0, 0, "F2"): (9, 10),
        (0, 0, "B1"): (12, 14), (0, 0, "B2"): (17, 19), (0, 0, "optimizer"): (20.5, 20.625),
        (0, 1, "recv grad 0"): (6.5, 7), (0, 1, "recv grad 1"): (11.5, 12), (0, 1, "recv grad 2"): (16.5, 17),
        (0, 1, "dp grad sync"): (19, 19.75), (0, 1, "grad-norm all-reduce"): (19.75, 20.5),
        (0, 2, "F0"): (1.5, 3.5), (0, 2, "B0"): (3.5, 6.5), (0, 2, "F1"): (6.5, 8.5), (0, 2, "B1"): (8.5, 11.5),
        (0, 2, "F2"): (11.5, 13.5), (0, 2, "B2"): (13.5, 16.5), (0, 2, "optimizer"): (20.5, 20.875),
        (0, 3, "recv act 0"): (1, 1.5), (0, 3, "recv act 1"): (2, 2.5), (0, 3, "recv act 2"): (10, 10.5),
        (0, 3, "wait for DP peers"): (17, 19), (0, 3, "dp grad sync"): (19, 20.5),
        (1, 0, "iteration overhead"): (20.875, 20.9375),
    }
    got = {(e["pid"], e["tid"], e["name"]): (_start(e), _end(e)) for e in _events(pred)}
    assert len(got) == len(_events(pred))   # no two events of one thread share a name
    assert got.keys() == hand.keys()
    for key, (a, b) in hand.items():
        assert got[key] == pytest.approx((a, b), abs=1e-9), key
    check_trace_follows_the_rules(pred)


def test_a_fast_pipeline_waits_for_the_slow_one_it_shares_layers_with():
    """Two pipelines holding the same layers, one much slower: the fast one's sync cannot finish
    before the slow one is ready, so the iteration is the slow schedule + the sync + the optimizer."""
    c, m = hetero.load_cluster(CLUSTER), hetero.load_model(GPT)
    plan = hetero.load_plan({"global_batch_size": 40, "micro_batch_size": 1, "pipelines": [
        {"replicas": 1, "micro_batches": 32, "stages": [_st("a100", 4, 0, 36)]},
        {"replicas": 1, "micro_batches": 8, "stages": [_st("mi250", 1, 0, 36)]}]})
    pred = predict(c, m, plan, timeline=True, overlap=False)   # with overlap: one backward pass earlier
    fast, slow = pred.pipelines[0].stages[0], pred.pipelines[1].stages[0]
    assert fast.schedule_end_s != slow.schedule_end_s
    late = max(fast.schedule_end_s, slow.schedule_end_s)
    assert fast.dp_sync_start_s == slow.dp_sync_start_s == late
    assert pred.iteration_time_s == pytest.approx(
        late + max(fast.dp_sync_time_s, slow.dp_sync_time_s) + max(fast.optimizer_time_s, slow.optimizer_time_s))
    check_trace_follows_the_rules(pred)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
@pytest.mark.parametrize("plan", [MIXED, THREE_SHAPES, INTERLEAVED, STAGGERED],
                         ids=["two-shapes", "three-shapes", "interleaved", "staggered"])
def test_sync_buckets_are_the_runtimes(model, plan):
    """The predictor's all-reduces are the runtime's buckets (parameters grouped by holder set), in
    the order each rank runs them."""
    pytest.importorskip("torch")
    from hetero.layout import build_layout
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
        check_trace_follows_the_rules(predict(c, m, plan, timeline=True, placement=placement))
