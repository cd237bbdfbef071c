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
