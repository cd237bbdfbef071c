"""The predictor and planner judge fit by what the chosen allocator reserves (--allocator)."""
from __future__ import annotations

import math

import pytest

import hetero
from hetero.predictor.allocator import DATA, coefficients, fit_errors, held_out_errors, reserved_bytes
from hetero.predictor.memory import MemoryBreakdown

from test_planned_allocator import CLUSTER, GPT, PLAN, tight_cluster


def test_no_allocator_keeps_the_live_peak_and_the_default_predictions():
    cluster, model, plan = hetero.load_cluster(CLUSTER), hetero.load_model(GPT), hetero.load_plan(PLAN)
    default = hetero.predict(cluster, model, plan)
    for s in (s for p in default.pipelines for s in p.stages):
        assert s.allocator is None and s.reserved_memory_bytes is None and s.needed_bytes == s.peak_memory_bytes
        assert "reserved_memory_bytes" not in s.to_dict()
    for kind in ("caching", "planned"):
        other = hetero.predict(cluster, model, plan, allocator=kind)
        assert other.iteration_time_s == default.iteration_time_s
        for a, b in zip(default.pipelines[0].stages, other.pipelines[0].stages):
            assert b.peak_memory_bytes == a.peak_memory_bytes
            assert b.reserved_memory_bytes == int(reserved_bytes(kind, b.memory_breakdown))
            assert b.to_dict()["allocator"] == kind


def test_the_reservation_models_are_fitted_on_the_replays():
    # fragmentation only adds: both models reserve at least the live bytes (a, b >= 1) on the
    # recorded stages' data; the arena holds less than the caching allocator
    (ca, cb), (pa, pb) = coefficients("caching"), coefficients("planned")
    assert ca >= 1 and cb >= 1 and pa * pb > 0
    br = MemoryBreakdown(4e9, 2e9, 8e9, 6e9, 1e9)
    assert br.total < reserved_bytes("planned", br) < reserved_bytes("caching", br)
    errors = fit_errors("caching")
    assert len(errors) >= 20 and all(math.isfinite(e["error"]) for e in errors)
    with pytest.raises(ValueError):
        coefficients("buddy")


def _median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def test_the_caching_model_beats_the_live_peak_on_stages_it_was_not_fitted_on():
    # each stage predicted with (a, b) fitted on the other stages only: the model must be closer to
    # the replay than the live peak alone (no fragmentation counted), by median and by stages within 5%
    import json

    rows = json.loads(DATA.read_text())["stages"]
    live = [abs(r["predicted_live_bytes"] / r["caching_reserved_bytes"] - 1) for r in rows]
    held = [abs(e["error"]) for e in held_out_errors("caching")]
    assert len(held) == len(rows) >= 20
    assert _median(held) < _median(live)
    assert sum(e <= 0.05 for e in held) > sum(e <= 0.05 for e in live)
    # what the replay reserves when the live bytes first peak lies between the peak and the end's
    assert all(r["lower_bound_bytes"] <= r["caching_reserved_at_live_peak_bytes"] <= r["caching_reserved_bytes"]
               for r in rows)


@pytest.mark.xfail(strict=True, reason="the caching allocator's fragmentation depends on the order of "
                   "the step's requests, which the aggregate model does not see (docs/memory-planning.md)")
def test_the_predicted_caching_reservation_is_within_5_percent_of_the_replay_on_every_stage():
    # held out: each stage with the coefficients fitted on the other stages
    worst = max(held_out_errors("caching"), key=lambda e: abs(e["error"]))
    assert abs(worst["error"]) <= 0.05, worst


def test_the_planner_spends_what_the_arena_saves():
    from hetero.planner import search

    spec = tight_cluster("planned", "caching")
    cluster, model = hetero.load_cluster(spec), hetero.load_model(GPT)
    kw = dict(global_batch_size=8, top_k=1, upper_bound=False, micro_batch_sizes=(1, 2, 4),
              recompute=("none", "selective", "full"))
    planned = search(cluster, model, allocator="planned", **kw)[0]
    try:
        caching = search(cluster, model, allocator="caching", **kw)[0]
    except Exception:  # noqa: BLE001 - nothing fits once fragmentation is counted: the arena wins outright
        caching = None
    assert planned.prediction.fits_memory
    assert all(s.allocator == "planned" for p in planned.prediction.pipelines for s in p.stages)
    # the caching allocator's fragmentation rules out the faster plans the arena admits
    assert caching is None or planned.prediction.tokens_per_s > caching.prediction.tokens_per_s
