"""Rank 0's run report (hetero.runtime.report): the predicted-vs-measured table explains a large
under-prediction instead of leaving a bare '-80 %'."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("torch")


def _footer(capsys, predicted_s: float) -> str:
    from hetero.runtime.report import Reporter

    rep = Reporter(types.SimpleNamespace(tokens_per_step=1024))
    rank = {"rank": 0, "group": "fast", "pipeline": 0, "replica": 0, "stage": 0, "layers": [0, 4], "tp_rank": 0,
            "tp_size": 1, "forward_time_s": 0.01, "backward_time_s": 0.02}
    rep.footer({"ranks": [rank], "median_iteration_time_s": 0.1, "predicted_iteration_time_s": predicted_s,
                "losses": [6.0, 5.0], "iteration_times_s": [0.1, 0.1]})
    return " ".join(capsys.readouterr().out.split())


def test_a_large_under_prediction_is_explained(capsys):
    text = _footer(capsys, 0.02)
    assert "-80.0 %" in text and "per-step framework overhead" in text and "hetero calibrate" in text
    text = _footer(capsys, 0.09)
    assert "-10.0 %" in text and "framework overhead" not in text


def test_the_note_names_a_stage_whose_compute_the_table_shows_far_above_its_prediction(capsys):
    """When the per-rank table shows a stage computing many times slower than predicted, the note
    says so (naming the rank and both times) instead of blaming per-step framework overhead."""
    import hetero
    from hetero.runtime.report import Reporter

    from conftest import CONFIGS

    ctx = types.SimpleNamespace(cluster=hetero.load_cluster(CONFIGS / "clusters" / "local-cpu.yaml"),
                                model=hetero.load_model(CONFIGS / "models" / "tiny.yaml"),
                                plan=hetero.load_plan(CONFIGS / "plans" / "local-cpu-tiny.yaml"))
    stage = hetero.predict(ctx.cluster, ctx.model, ctx.plan).stage(0, 0)
    rank = {"rank": 1, "group": "fast", "pipeline": 0, "replica": 1, "stage": 0, "layers": [0, 4], "tp_rank": 0,
            "tp_size": 1, "forward_time_s": 20 * stage.forward_time_s, "backward_time_s": 20 * stage.backward_time_s}
    rep = Reporter(types.SimpleNamespace(tokens_per_step=1024, ctx=ctx))
    rep.footer({"ranks": [rank], "median_iteration_time_s": 1.0, "predicted_iteration_time_s": 0.1,
                "losses": [6.0, 5.0], "iteration_times_s": [1.0, 1.0]})
    text = " ".join(capsys.readouterr().out.split())
    assert "the stages compute slower than predicted: rank 1 (fast, tp 1)" in text and "(20x;" in text, text
    assert "framework overhead" not in text
