"""hetero: train large models on clusters that mix accelerator types and vendors.

The public Python API (SCHEMAS.md)::

    cluster = hetero.load_cluster(path_or_dict)
    model = hetero.load_model(path_or_dict)
    plan = hetero.load_plan(path_or_dict)
    pred = hetero.predict(cluster, model, plan, calibration=None)
    cal = hetero.calibrate(cluster, "runs.csv"); cal.save(path)
    cal = hetero.load_calibration(path)
    results = hetero.search(cluster, model, global_batch_size=512, top_k=5)

Heavy parts (torch, scikit-learn) are imported lazily, so ``import hetero`` stays fast on a
login node and the predict path never imports torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import HeteroError
from .specs.cluster import Cluster, Group, Link, load_cluster
from .specs.device import DeviceType, load_catalog
from .specs.errors import SpecError
from .specs.model import ModelSpec, load_model
from .specs.plan import Pipeline, Plan, Stage, check_plan, load_plan


def predict(cluster, model, plan, calibration=None):
    """Predict iteration time, throughput and memory of ``plan`` (see :mod:`hetero.predictor`)."""
    from .predictor import predict as _predict

    return _predict(cluster, model, plan, calibration=calibration)


def calibrate(cluster, runs):
    """Fit the predictor to measured whole-run iteration times (a run-log CSV)."""
    from .predictor.calibration import calibrate as _calibrate

    return _calibrate(cluster, runs)


def load_calibration(path):
    """Load a calibration written by ``calibrate(...).save(path)``."""
    from .predictor.calibration import load_calibration as _load

    return _load(path)


def search(cluster, model, global_batch_size: int, top_k: int = 5, **options):
    """Search plans for the highest predicted throughput that fits; returns ranked results."""
    from .planner import search as _search

    return _search(cluster, model, global_batch_size=global_batch_size, top_k=top_k, **options)


__all__ = [
    "Cluster", "DeviceType", "Group", "HeteroError", "Link", "ModelSpec", "Pipeline", "Plan",
    "SpecError", "Stage", "__version__", "calibrate", "check_plan", "load_calibration",
    "load_catalog", "load_cluster", "load_model", "load_plan", "predict", "search",
]
