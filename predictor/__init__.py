"""Performance predictor (imported as ``hetero.predictor``): pure functions of (cluster, model,
plan) to times and bytes. No torch on this path.

    pred = hetero.predictor.predict(cluster, model, plan, calibration=None)
    pred.to_dict()                       # the Prediction JSON of docs/formats.md
    cm = hetero.predictor.costs.StageCostModel(cluster, model)   # the planner's cost API

Modules: ``ops`` (operator decomposition), ``optime`` (operator latency: learned model or
roofline), ``comm`` (collectives and links), ``memory`` (per-stage bytes), ``schedule``
(pipeline simulation), ``costs`` (memoised StageCostModel), ``api`` (predict, Prediction),
``factors`` (CalibrationFactors).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import PipelinePrediction, Prediction, StagePrediction, cost_model_for, predict
    from .costs import StageCostModel
    from .factors import CalibrationFactors

_HOME = {"PipelinePrediction": "api", "Prediction": "api", "StagePrediction": "api", "cost_model_for": "api",
         "predict": "api", "StageCostModel": "costs", "CalibrationFactors": "factors"}


def __getattr__(name: str):
    # imported at first use: ``import hetero`` registers the stage recorder with .allocator, which
    # must not cost the predictor's whole import (PEP 562)
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


__all__ = ["CalibrationFactors", "PipelinePrediction", "Prediction", "StageCostModel", "StagePrediction",
           "cost_model_for", "predict"]
