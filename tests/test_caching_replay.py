"""The predicted caching reservation: the replay of a stage's own requests, deepened from a
shallower recording (hetero.memplan.expand, hetero.predictor.allocator.simulated_trace)."""
from __future__ import annotations

import pytest

import hetero
from hetero.memplan.caching import simulate_caching_allocator
from hetero.memplan.expand import expand_layers
from hetero.memplan.record import record_stage, stage_of
from hetero.predictor.allocator import REPLAY_DEPTH, simulated_trace


def _model(arch: str, layers: int, **over):
    base = {"gpt": "configs/models/tiny.yaml", "llama": "configs/models/tiny-llama.yaml"}[arch]
    d = hetero.load_model(base).to_dict()
    d.update(num_layers=layers, attention="fused", **over)
    return hetero.load_model(d)


def _plan(layers: int, stages: int, tp=1, m=3, replicas=1, mbs=1, **over):
    cuts = [round(i * layers / stages) for i in range(stages + 1)]
    plan = {"global_batch_size": m * replicas * mbs, "micro_batch_size": mbs, "schedule": "1f1b",
            "pipelines": [{"replicas": replicas, "micro_batches": m,
                           "stages": [{"group": "a100", "layers": [cuts[i], cuts[i + 1]], "tp": tp}
                                      for i in range(stages)]}]}
    plan.update(over)
    return hetero.load_plan(plan)


# every way the runtime's step differs: schedules, recomputation, dtypes, tp, ZeRO on views and
# on copies, the data-parallel sum, gradient buffers or not, interleaved chunks
CASES = {
    "gpt bf16 selective mbs2": ("gpt", 10, {"dtype": "bf16"}, dict(layers=10, stages=2, mbs=2, recompute="selective")),
    "gpt fp16 gpipe": ("gpt", 10, {"dtype": "fp16"}, dict(layers=10, stages=2, schedule="gpipe")),
    "gpt full x2": ("gpt", 10, {}, dict(layers=10, stages=2, replicas=2, recompute="full")),
    "llama bf16 tp2": ("llama", 10, {"dtype": "bf16"}, dict(layers=10, stages=2, tp=2)),
    "llama zero1 x2": ("llama", 5, {"dtype": "bf16"}, dict(layers=5, stages=1, replicas=2, zero_stage=1)),
    "llama zero1 tp2 x2": ("llama", 5, {}, dict(layers=5, stages=1, tp=2, replicas=2, zero_stage=1)),
    "gpt interleaved": ("gpt", 20, {"dtype": "bf16"}, dict(layers=20, stages=4, schedule="interleaved", interleave=2)),
}


# the suite's budget: three variants by default, the rest with the slow tests
SLOW = {"gpt fp16 gpipe", "gpt full x2", "llama zero1 tp2 x2", "gpt interleaved"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_a_deepened_recording_makes_the_requests_of_the_whole_stage(name):
    # a stage of 5 layers per chunk recorded with 4 and deepened: the same requests (sizes, count),
    # the same bytes live at every moment's peak, and the same caching reservation as recording it whole
    arch, layers, over, plan_kw = CASES[name]
    model, plan = _model(arch, layers, **over), _plan(**plan_kw)
    for stage in range(len(plan.physical_stages(plan.pipelines[0]))):
        assert max(b - a for a, b in stage_of(plan, 0, stage)["chunks"]) > REPLAY_DEPTH
        whole, deep = record_stage(model, plan, 0, stage), simulated_trace(model, plan, 0, stage)
        assert sorted(e[2] for e in deep.events) == sorted(e[2] for e in whole.events)
        assert deep.lower_bound_bytes() == whole.lower_bound_bytes()
        assert simulate_caching_allocator(deep).reserved_bytes == simulate_caching_allocator(whole).reserved_bytes


def test_deepening_refuses_what_it_cannot_repeat():
    model, plan = _model("gpt", 12), _plan(12, 2)
    trace = record_stage(model, plan, 0, 0, chunks=[(0, 3)], marks=True)
    with pytest.raises(ValueError, match="4 layers at least"):
        expand_layers(trace.events, [(0, 3)], {0: 6})
    with pytest.raises(ValueError, match="deeper"):
        expand_layers(trace.events, [(0, 3)], {0: 2})
    # plain events, without the layer marks: nothing tells the layers apart
    with pytest.raises(ValueError, match="alike"):
        expand_layers(record_stage(model, plan, 0, 0, chunks=[(0, 4)]).events, [(0, 4)], {0: 6})


@pytest.mark.parametrize("name", ["gpt bf16 selective mbs2", pytest.param("llama zero1 x2", marks=pytest.mark.slow)])
def test_1f1b_stages_reserve_what_their_first_steady_micro_batches_reserve(name):
    # more micro-batches than a 1F1B stage's warm-up and two steady ones repeat the same requests on
    # freed blocks of the same sizes: the replay reserves the same, so the predictor records no more
    from hetero.predictor.allocator import STEADY_MICRO_BATCHES

    arch, layers, over, plan_kw = CASES[name]
    model = _model(arch, layers, **over)
    plan = _plan(**{**plan_kw, "m": 8})
    for stage in range(len(plan.physical_stages(plan.pipelines[0]))):
        assert len(plan.physical_stages(plan.pipelines[0])) - stage + STEADY_MICRO_BATCHES < 8
        whole, steady = record_stage(model, plan, 0, stage), simulated_trace(model, plan, 0, stage)
        assert simulate_caching_allocator(steady).reserved_bytes == simulate_caching_allocator(whole).reserved_bytes
        assert len(steady.events) < len(whole.events)
