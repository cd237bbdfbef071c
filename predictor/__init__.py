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
from .api import PipelinePrediction, Prediction, StagePrediction, cost_model_for, predict
from .costs import StageCostModel
from .factors import CalibrationFactors

__all__ = ["CalibrationFactors", "PipelinePrediction", "Prediction", "StageCostModel", "StagePrediction",
           "cost_model_for", "predict"]
