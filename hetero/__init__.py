"""hetero: train large models on clusters that mix accelerator types and vendors.

The public Python API (docs/architecture.md)::

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

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:   # for annotations only: the predict path imports none of these eagerly
    import os

    from .planner import SearchResults
    from .predictor import Prediction
    from .predictor.calibration import Calibration
    from .predictor.runlog import Run

__version__ = "0.1.0"


def _from_a_checkout() -> None:
    """Run from a source checkout that was never installed (``python -m hetero`` in the repository):
    the folders that setup.py maps into this package (predictor/, planner/, backends/, configs/)
    sit beside it, so they are looked up there. An install (editable or not) finds them itself."""
    import importlib.util
    import os

    if importlib.util.find_spec(__name__ + ".predictor") is not None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "predictor", "__init__.py")):
        __path__.append(root)


_from_a_checkout()

from .errors import HeteroError  # noqa: E402
from .specs.cluster import Cluster, Group, Link, load_cluster  # noqa: E402
from .specs.device import DeviceType, load_catalog  # noqa: E402
from .specs.errors import SpecError  # noqa: E402
from .specs.model import ModelSpec, load_model  # noqa: E402
from .specs.plan import Pipeline, Plan, Stage, check_plan, load_plan  # noqa: E402


def _record_stage(*args, **kwargs):
    """The runtime's stage recorder (:func:`hetero.memplan.record.record_stage`: the runtime's model
    on fake tensors), imported at its first use. The predictor replays it for ``allocator="caching"``
    through :class:`hetero.predictor.allocator.StageRecorder`, an interface it owns, so that the
    predictor itself never imports the runtime or torch."""
    from .memplan.record import record_stage

    return record_stage(*args, **kwargs)


from .predictor.allocator import register_stage_recorder  # noqa: E402

register_stage_recorder(_record_stage)


def predict(cluster: Cluster, model: ModelSpec, plan: Plan, calibration: Calibration | None = None,
            allocator: Literal["caching", "planned"] | None = None) -> Prediction:
    """Predict iteration time, throughput and memory of ``plan`` (see :mod:`hetero.predictor`);
    ``allocator`` (``caching`` | ``planned``): judge fit by what that allocator reserves. The
    result's ``objectives`` holds throughput, cost, memory headroom and energy
    (:mod:`hetero.predictor.objectives`)."""
    from .predictor import predict as _predict
    from .predictor.objectives import objectives

    pred = _predict(cluster, model, plan, calibration=calibration, allocator=allocator)
    pred.objectives = objectives(cluster, plan, pred)
    return pred


def calibrate(cluster: Cluster, runs: str | os.PathLike[str] | list[Run]) -> Calibration:
    """Fit the predictor to measured whole-run iteration times (a run-log CSV, or its parsed runs)."""
    from .predictor.calibration import calibrate as _calibrate

    return _calibrate(cluster, runs)


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Load a calibration written by ``calibrate(...).save(path)``."""
    from .predictor.calibration import load_calibration as _load

    return _load(path)


def search(cluster: Cluster, model: ModelSpec, global_batch_size: int, top_k: int = 5,
           **options: Any) -> SearchResults:
    """Search plans for the highest predicted throughput that fits; returns ranked results."""
    from .planner import search as _search

    return _search(cluster, model, global_batch_size=global_batch_size, top_k=top_k, **options)


__all__ = [
    "Cluster", "DeviceType", "Group", "HeteroError", "Link", "ModelSpec", "Pipeline", "Plan",
    "SpecError", "Stage", "__version__", "calibrate", "check_plan", "load_calibration",
    "load_catalog", "load_cluster", "load_model", "load_plan", "predict", "search",
]
