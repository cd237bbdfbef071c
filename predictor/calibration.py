"""Calibration: fit the predictor's per-device corrections to measured whole-run iteration times.

    cal = calibrate(cluster, "runs.csv")       # run log, docs/formats.md
    cal.save("cal.json"); cal = load_calibration("cal.json")
    hetero.predict(cluster, model, plan, calibration=cal)

Each run-log row is one homogeneous Megatron-style run (:mod:`hetero.predictor.runlog` reads the
log and turns a row into a one-group cluster slice, a model spec and a plan), predicted by
:func:`hetero.predictor.predict` itself -- the calibration corrects the same code path it will be
applied to.

What is fitted, per device type: :class:`~hetero.predictor.factors.CalibrationFactors`
``theta = (compute, communication, layer_overhead_s, iteration_overhead_s)``. The predictor is a
max-plus network (pipeline schedule) of durations that are each linear in theta, so the predicted
iteration time is positively homogeneous and piecewise linear in theta: ``T(theta) = J(theta) .
theta`` with ``J`` constant on the region where the critical path does not change. We therefore fit
by Gauss-Newton on the exact model: evaluate ``J`` per run by finite differences of real
``predict`` calls at the current theta, solve the (tiny, bounded) least-squares problem in
log space, ``min sum_r (log(J_r . theta) - log T_r)^2 + prior``, step towards its solution only as
far as the real objective goes down (backtracking: a full step can cross into pieces where the
linearisation no longer holds), and repeat until theta stops moving. The weak prior
(``PRIOR_WEIGHT``) pulls each factor towards the identity (log compute, log communication,
overheads / their scale), so a parameter the runs cannot identify (e.g. communication when no run
communicates) stays at its catalog value instead of drifting.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .factors import CalibrationFactors
from .runlog import CalibrationError, Run, group_for, read_runs, run_setup

FORMAT = "hetero-calibration"
VERSION = 1

PARAMS = ("compute", "communication", "layer_overhead_s", "iteration_overhead_s")
"""The factors every predictor applies (:class:`~hetero.predictor.factors.CalibrationFactors`)."""
EXTRA = ("op_floor_s", "network", "matrix")
"""Extra structure this module fits (the predictor applies it, see :class:`CalibrationFactors`):
``op_floor_s``: the host's dispatch time per kernel, at least (seconds): the host issues kernels at
a finite rate while the device runs the queued ones, so the time of a layer is a max (device
work, host dispatch), not a sum -- an additive overhead cannot express that small models are
launch-bound while large ones are compute-bound.
``network``: multiplies the time of traffic over the inter-node network (on top of
``communication``): NICs and NVLink reach different fractions of their nominal bandwidth.
``matrix``: multiplies the device time of matrix kernels (on top of ``compute``): the learned
operator model knows fp32 CUDA-core GEMMs; tensor cores reach another fraction of their peak than
the memory system does of its bandwidth, so one compute factor would misweigh GEMMs against the
memory-bound kernels as the hidden size changes (fitted on the vTrain A100 fp16 runs: ~0.85)."""
ALL = PARAMS + EXTRA
OP_MODELS = ("learned", "roofline")
IDENTITY_THETA = (1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0)
START_THETA = (1.0, 1.0, 0.0, 0.0, 3e-5, 1.0, 1.0)
"""Fitting starts with a small floor: at exactly 0 no kernel touches it and its gradient is 0."""
BOUNDS = ((0.05, 1e-3, 0.0, 0.0, 0.0, 0.05, 0.05), (50.0, 50.0, 0.1, 60.0, 0.01, 50.0, 20.0))
FD_STEPS = (1e-3, 1e-3, 1e-6, 1e-4, 1e-6, 1e-3, 1e-3)
THETA_SCALE = (1.0, 1.0, 1e-3, 1e-2, 1e-5, 1.0, 1.0)
PRIOR_WEIGHT = 0.02
"""Weight of each prior residual relative to one run's log error (weak: 0.02 ~ one run at 2%)."""
PRIOR_SCALE = (None, None, 1e-3, 0.1, 1e-4, None, None)
"""Additive terms are pulled to 0 in units of these scales (1 ms per layer, 100 ms per iteration,
100 us per kernel); the multiplicative ones (None) towards 1 in log space."""


# ============================================================================ the calibration object
@dataclass
class Calibration:
    """Per-device-type factors fitted on run logs, plus how well they fit."""

    factors: dict[str, CalibrationFactors] = field(default_factory=dict)
    """Device type name -> the factors every predictor applies."""
    extra: dict[str, dict] = field(default_factory=dict)
    """Device type name -> {op_floor_s, network, matrix} (see ``EXTRA``), handed to the predictor by
    :meth:`factors_for`."""
    op_model: dict[str, str] = field(default_factory=dict)
    """Device type name -> the operator model the factors were fitted with (``learned`` or
    ``roofline``; chosen by fit quality), handed to the predictor by :meth:`factors_for`."""
    standard: dict[str, CalibrationFactors] = field(default_factory=dict)
    """Device type name -> factors fitted with the four standard parameters only (reported next to
    the full fit, to show what the extra structure buys)."""
    meta: dict = field(default_factory=dict)
    """Provenance: cluster, runs file, number of runs, fit statistics, time."""
    runs: list[dict] = field(default_factory=list)
    """In-sample table: row, device, description, measured, uncalibrated and calibrated ms."""

    def _name_for(self, device_name: str, device=None) -> str | None:
        if device_name in self.factors:
            return device_name
        base = getattr(device, "base", None) if device is not None else None
        return base if base in self.factors else None

    def factors_for(self, device_name: str, device=None) -> CalibrationFactors | None:
        """Factors for a device type: by name, else by the type it inherits (``base:``), else None.
        They carry the extras (kernel floor, network) and the operator model of the fit."""
        name = self._name_for(device_name, device)
        if name is None:
            return None
        extra = {k: v for k, v in self.extra.get(name, {}).items() if k in EXTRA}
        return dataclasses.replace(self.factors[name], **extra, op_model=self.op_model.get(name))

    def theta(self, device_name: str) -> tuple:
        """The fitted values of ``device_name`` in the order of ``ALL`` (extras missing: identity)."""
        f, x = self.factors[device_name], self.extra.get(device_name, {})
        return tuple(getattr(f, k) for k in PARAMS) + tuple(x.get(k, d) for k, d in zip(EXTRA, IDENTITY_THETA[4:]))

    def to_dict(self) -> dict:
        out = {}
        for name, f in self.factors.items():
            entry = {k: getattr(f, k) for k in PARAMS}
            entry.update(self.extra.get(name, {}))
            entry["source"] = f.source
            out[name] = entry
        std = {name: {**{k: getattr(f, k) for k in PARAMS}, "source": f.source} for name, f in self.standard.items()}
        return {"format": FORMAT, "version": VERSION, "factors": out, "op_model": self.op_model,
                "standard_factors": std, "meta": self.meta, "runs": self.runs}

    def save(self, path) -> Path:
        """Write JSON atomically (temporary file + rename)."""
        from hetero.specs.io import write_text_atomic

        path = Path(path)
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data, source: str = "<calibration>") -> "Calibration":
        def bad(where, what):
            return CalibrationError(f"{source}: field '{where}': {what}")

        if not isinstance(data, dict):
            raise CalibrationError(f"{source}: expected a JSON object at the top, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise bad("format", f"expected '{FORMAT}', got {data.get('format')!r} (not a calibration file?)")
        if data.get("version") != VERSION:
            raise bad("version", f"expected {VERSION}, got {data.get('version')!r}")
        def table(key, known):
            raw = data.get(key, {} if key == "standard_factors" else None)
            if not isinstance(raw, dict):
                raise bad(key, "expected an object mapping device type -> factors")
            out = {}
            for name, entry in raw.items():
                if not isinstance(entry, dict):
                    raise bad(f"{key}.{name}", f"expected an object, got {type(entry).__name__}")
                unknown = set(entry) - set(known) - {"source"}
                if unknown:
                    raise bad(f"{key}.{name}.{sorted(unknown)[0]}", f"unknown field (known: {', '.join(known)}, source)")
                vals = {}
                for k in known:
                    i = ALL.index(k)
                    v = entry.get(k, IDENTITY_THETA[i])
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        raise bad(f"{key}.{name}.{k}", f"expected a finite number, got {v!r}")
                    if v < 0 or (BOUNDS[0][i] > 0 and v <= 0):
                        raise bad(f"{key}.{name}.{k}", f"must be {'positive' if BOUNDS[0][i] > 0 else '>= 0'}, got {v}")
                    if v > BOUNDS[1][i]:   # calibrate never fits beyond these; far beyond, predictions overflow
                        raise bad(f"{key}.{name}.{k}", f"must be at most {BOUNDS[1][i]:g} (the range `hetero calibrate` "
                                                       f"fits in), got {v:g}")
                    vals[k] = float(v)
                src = entry.get("source", "calibration")
                if not isinstance(src, str):
                    raise bad(f"{key}.{name}.source", f"expected a string, got {src!r}")
                out[name] = (vals, src)
            return out

        factors, extra = {}, {}
        for name, (vals, src) in table("factors", ALL).items():
            factors[name] = CalibrationFactors(**{k: vals[k] for k in PARAMS}, source=src)
            extra[name] = {k: vals[k] for k in EXTRA}
        standard = {name: CalibrationFactors(**vals, source=src)
                    for name, (vals, src) in table("standard_factors", PARAMS).items()}
        op_model = data.get("op_model", {})
        if not isinstance(op_model, dict):
            raise bad("op_model", "expected an object mapping device type -> learned | roofline")
        for name, kind in op_model.items():
            if kind not in OP_MODELS:
                raise bad(f"op_model.{name}", f"expected one of {', '.join(OP_MODELS)}, got {kind!r}")
        meta, runs = data.get("meta", {}), data.get("runs", [])
        if not isinstance(meta, dict):
            raise bad("meta", "expected an object")
        if not isinstance(runs, list):
            raise bad("runs", "expected a list")
        return cls(factors=factors, extra=extra, op_model=dict(op_model), standard=standard, meta=meta, runs=runs)

    def predict(self, cluster, model, plan, **kw):
        """``predict`` with every fitted factor applied, extras included (see :func:`predict_calibrated`)."""
        return predict_calibrated(cluster, model, plan, self, **kw)


def load_calibration(path) -> Calibration:
    """Load a calibration JSON written by :meth:`Calibration.save` (validated; no pickle)."""
    from hetero.specs.io import InputFileError, read_user_text

    path = Path(path)
    try:
        text = read_user_text(path, "calibration")
    except InputFileError as e:
        raise CalibrationError(f"{path}: {e.message} (fix: {e.fix})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return Calibration.from_dict(data, str(path))


# ============================================================================ applying
RUN_PLACEMENT = "megatron"
"""Rank order of run-log rows (Megatron-style runs: tp fastest, then dp, then pp), which decides
which of their transfers cross the network (:mod:`hetero.predictor.placement`)."""


def predict_calibrated(cluster, model, plan, calibration, *, check: bool = True, placement: str = "packed"):
    """``hetero.predictor.predict`` with a calibration: kept as the name the fitting code and
    benchmarks use; the predictor applies every fitted factor itself. Run-log rows are predicted
    with ``placement=RUN_PLACEMENT``."""
    from . import predict

    return predict(cluster, model, plan, calibration=calibration, check=check, placement=placement)


# ============================================================================ fitting
class _Fixed(Calibration):
    """One set of factors for every device (used while fitting)."""

    def __init__(self, theta, op_model: str | None = None):
        super().__init__(factors={"*": CalibrationFactors(**dict(zip(PARAMS, map(float, theta[:4]))))},
                         extra={"*": dict(zip(EXTRA, map(float, theta[4:])))},
                         op_model={"*": op_model} if op_model else {})

    def _name_for(self, device_name, device=None):
        return "*"


class _Problem:
    """The runs of one device type, prepared once (cluster slice, model, plan per run)."""

    def __init__(self, cluster, runs: list[Run], op_model: str | None = None):
        self.op_model = op_model
        self.runs = runs
        self.setups = [run_setup(cluster, r) for r in runs]
        self.measured = [r.iteration_time_s for r in runs]

    def times(self, theta) -> list[float]:
        cal = _Fixed(theta, self.op_model)
        return [predict_calibrated(c, m, p, cal, check=False, placement=RUN_PLACEMENT).iteration_time_s
                for c, m, p in self.setups]

    def jacobian(self, theta, free, base=None):
        """Per run, d T / d theta by forward differences (T is piecewise linear: exact on a piece);
        ``base``: the times at ``theta`` when already known."""
        import numpy as np

        base = np.array(self.times(theta)) if base is None else np.asarray(base)
        J = np.zeros((len(base), len(ALL)))
        for i in np.flatnonzero(free):
            h = FD_STEPS[i] * (max(theta[i], 0.1) if PRIOR_SCALE[i] is None else 1.0)
            t = list(theta)
            t[i] += h
            J[:, i] = (np.array(self.times(t)) - base) / h
        return base, J


def _residuals(times, theta, log_measured, prior: float, idx):
    """What the fit minimises the squares of: log(predicted / measured) per run, then the weak
    prior's pull of each free parameter towards identity."""
    import numpy as np

    t = np.maximum(np.asarray(times, dtype=float), 1e-12)
    pri = [math.log(theta[i]) if PRIOR_SCALE[i] is None else theta[i] / PRIOR_SCALE[i] for i in idx]
    return np.concatenate([np.log(t) - log_measured, prior * np.array(pri)])


STEP_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 0.0625)
"""Backtracking of one Gauss-Newton step: the linearised optimum, then ever shorter steps towards
it, until the real predictor's objective goes down."""


def _fit_linearised(J, T0, theta0, measured, prior: float, free):
    """min sum (log(T0 + J (theta - theta0)) - log measured)^2 + prior terms, bounded."""
    import numpy as np
    from scipy.optimize import least_squares

    y = np.log(measured)
    offset = T0 - J @ theta0
    idx = np.flatnonzero(free)
    lo, hi = np.array(BOUNDS[0])[idx], np.array(BOUNDS[1])[idx]

    def full(x):
        th = np.array(theta0, dtype=float)
        th[idx] = x
        return th

    def resid(x):
        th = full(x)
        return _residuals(offset + J @ th, th, y, prior, idx)

    x0 = np.clip(np.asarray(theta0, dtype=float)[idx], lo + 1e-12, hi - 1e-12)
    res = least_squares(resid, x0, bounds=(lo, hi), x_scale=np.array(THETA_SCALE)[idx], method="trf")
    return full(res.x)


def fit_factors(cluster, runs: list[Run], rounds: int = 10, prior: float = PRIOR_WEIGHT,
                fit: Iterable[str] = ALL, op_model: str | None = None, held_out: bool = True) -> tuple[tuple, dict]:
    """Fit one device type's parameters (``ALL``, or the subset ``fit``; the rest stay at identity)
    on its runs: Gauss-Newton on the real predictor. Returns (theta, info). ``held_out``: also
    estimate the held-out error (:func:`_held_out_times`; one more Jacobian), else its fields are None."""
    import numpy as np

    fit = set(fit)
    unknown = fit - set(ALL)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} (known: {', '.join(ALL)})")
    free = np.array([k in fit for k in ALL])
    prob = _Problem(cluster, runs, op_model)
    measured = np.array(prob.measured)
    theta = np.where(free, START_THETA, IDENTITY_THETA).astype(float)
    idx, y = np.flatnonzero(free), np.log(measured)

    def objective(times, th):
        return float(np.sum(_residuals(times, th, y, prior, idx) ** 2))

    # damped Gauss-Newton: a full step can overshoot where the predictor's pieces change (max over
    # stages, host vs device bound), and factors that trade off (compute x matrix on GEMMs) let it
    # oscillate; each accepted step must lower the real objective, so the fit never ends worse
    # than it started a round
    times = np.array(prob.times(theta))
    best = objective(times, theta)
    J = None  # the Jacobian at the current theta, while it is current
    n = 0
    for n in range(1, rounds + 1):
        _, J = prob.jacobian(theta, free, base=times)
        step = _fit_linearised(J, times, theta, measured, prior, free) - theta
        for frac in STEP_FRACTIONS:
            cand = theta + frac * step
            cand_times = np.array(prob.times(cand))
            value = objective(cand_times, cand)
            if value < best:
                break
        else:
            break                                   # no step lowers it: a (local) optimum
        moved = np.max(np.abs(cand - theta) / np.array(THETA_SCALE))
        theta, times, best, J = cand, cand_times, value, None
        if moved < 1e-3:
            break
    held = None
    if held_out:
        if J is None:
            _, J = prob.jacobian(theta, free, base=times)
        held = _held_out_times(J, times, theta, measured, prior, free)
    mape, rmsle = _errors(times, measured)
    held_mape, held_rmsle = (None, None) if held is None else _errors(held, measured)
    return tuple(float(v) for v in theta), {
        "rounds": n, "mape": mape, "rmsle": rmsle, "held_out_mape": held_mape, "held_out_rmsle": held_rmsle,
        "predicted_s": times.tolist(), "op_model": op_model}


def _errors(predicted, measured) -> tuple[float, float]:
    """(MAPE, RMS log error) of predicted against measured times."""
    import numpy as np

    ratio = np.asarray(predicted) / np.asarray(measured)
    return float(np.mean(np.abs(ratio - 1))), float(np.sqrt(np.mean(np.log(ratio) ** 2)))


CV_FOLDS = 5


def _held_out_times(J, T0, theta, measured, prior: float, free, folds: int = CV_FOLDS, seed: int = 0):
    """Each run's time predicted by a fit that did not see it (``folds``-fold, fixed ``seed``), or
    None with fewer than two runs per fold. The folds are refitted on the model linearised at the
    full fit, ``T0 + J (theta' - theta)`` (the predictor is piecewise linear in theta, so this is
    exact while the critical paths hold), not on real predictions: it costs no predictor calls.
    An in-sample error flatters whichever model bends furthest towards the runs it was given; this
    estimates the error on runs like them that were not."""
    import numpy as np

    n = len(measured)
    if n < 2 * folds:
        return None
    order = np.random.default_rng(seed).permutation(n)
    out = np.empty(n)
    for k in range(folds):
        held = order[k::folds]
        train = np.setdiff1d(order, held)
        th = _fit_linearised(J[train], T0[train], theta, measured[train], prior, free)
        out[held] = np.maximum(T0[held] + J[held] @ (th - theta), 1e-12)
    return out


def _score(info: dict) -> float:
    """How an operator model's fit is judged: held-out RMS log error where there are enough runs,
    else the in-sample one."""
    return info["rmsle"] if info["held_out_rmsle"] is None else info["held_out_rmsle"]


def _op_model_candidates(cluster, device: str, op_models) -> list[str]:
    """Operator models to try for ``device``: the predictor's own choice ("default"), plus the plain
    roofline where the default is the learned model (fitted on fp32 CUDA-core kernels, it may not
    carry over to the dtype / units of the runs; the data decide)."""
    if not op_models:
        return ["default"]
    from .optime import catalog_model, op_model_for

    g = next(g for g in cluster.groups if g.device == device)
    _, prov = op_model_for(g.device, cluster.device_type(g.name))
    if prov == "profile" or catalog_model()[1] != "learned":
        return ["default"]
    return ["default", "roofline"]


def calibrate(cluster, runs, *, prior: float = PRIOR_WEIGHT, fit: Iterable[str] = ALL,
              standard: bool = True, op_models: bool = False, held_out: bool = True) -> Calibration:
    """Fit per-device-type factors to a run log (a CSV path, or a list of :class:`Run`).

    ``cluster`` is a :class:`~hetero.specs.cluster.Cluster` or a cluster file / dict. ``fit`` names
    the parameters to fit (default all of ``ALL``; the others stay at identity). ``standard``: also
    fit the four standard factors alone (see :attr:`Calibration.standard`). ``op_models``: also
    try the roofline operator model where the predictor would use the learned one, and keep the
    better fit (lower held-out RMS log error; :attr:`Calibration.op_model`). Off by default: on the
    vTrain A100 runs the roofline fits runs of the sizes in the log about as well (held-out RMS log
    error 8.8% vs 9.3% over the 200 single-node runs) but extrapolates worse to larger ones (fitted
    on the single-node runs, multi-node MAPE 20.3% vs 17.5%): one factor cannot carry the gain in
    efficiency from small to large GEMMs that the learned model knows, and predicting larger runs
    than were measured is what a calibration is for. ``held_out``: estimate each device's held-out
    error for ``meta["fit"]`` (one more Jacobian per fit; always done when operator models compete,
    since it is what decides between them).
    """
    import numpy as np

    from hetero.specs.cluster import Cluster, load_cluster

    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    source = "<runs>"
    if isinstance(runs, (str, os.PathLike)):
        source = str(runs)
        runs = read_runs(runs)
    runs = list(runs)
    if not runs:
        raise CalibrationError(f"{source}: no runs to calibrate on")
    by_device: dict[str, list[Run]] = {}
    for r in runs:
        group_for(cluster, r)
        by_device.setdefault(r.device, []).append(r)
    cal = Calibration()
    fits, table = {}, []
    for device, rs in by_device.items():
        theta, info = None, None
        kinds = _op_model_candidates(cluster, device, op_models)
        for kind in kinds:
            th, inf = fit_factors(cluster, rs, prior=prior, fit=fit, op_model=None if kind == "default" else kind,
                                  held_out=held_out or len(kinds) > 1)
            if info is None or _score(inf) < _score(info):
                theta, info = th, inf
                info["chosen"] = kind
        if info["chosen"] != "default":
            cal.op_model[device] = info["chosen"]
        src = f"calibration ({len(rs)} runs of {Path(source).name})"
        cal.factors[device] = CalibrationFactors(**dict(zip(PARAMS, theta[:4])), source=src)
        cal.extra[device] = dict(zip(EXTRA, theta[4:]))
        if standard and set(fit) & set(EXTRA):
            std, std_info = fit_factors(cluster, rs, prior=prior, fit=set(fit) & set(PARAMS), held_out=False)
            cal.standard[device] = CalibrationFactors(**dict(zip(PARAMS, std[:4])), source=src)
        else:
            std_info = info
        base = np.array(_Problem(cluster, rs).times(IDENTITY_THETA))
        fits[device] = {"runs": len(rs), "rounds": info["rounds"], "mape": info["mape"],
                        "held_out_mape": info["held_out_mape"],
                        "op_model": "predictor default" if info["chosen"] == "default" else info["chosen"],
                        "mape_standard_factors": std_info["mape"],
                        "mape_uncalibrated": _errors(base, [r.iteration_time_s for r in rs])[0]}
        for r, b, p in zip(rs, base, info["predicted_s"]):
            table.append({"row": r.row, "device": r.device, "run": r.describe(), "num_devices": r.num_devices,
                          "measured_ms": r.iteration_time_ms, "uncalibrated_ms": float(b) * 1e3,
                          "calibrated_ms": float(p) * 1e3})
    table.sort(key=lambda d: d["row"])
    cal.meta = {"cluster": cluster.name, "runs_file": source, "num_runs": len(runs), "fit": fits,
                "fitted": [k for k in ALL if k in set(fit)], "prior_weight": prior,
                "method": "Gauss-Newton on squared log error of hetero.predictor.predict, per device type",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    cal.runs = table
    return cal


def evaluate(cluster, runs: Iterable[Run], calibration=None) -> list[float]:
    """Predicted iteration seconds of ``runs`` (with ``calibration``, extras applied, or the catalog alone)."""
    out = []
    for r in runs:
        c, m, p = run_setup(cluster, r)
        out.append(predict_calibrated(c, m, p, calibration, check=False, placement=RUN_PLACEMENT).iteration_time_s)
    return out


__all__ = ["ALL", "Calibration", "CalibrationError", "EXTRA", "PARAMS", "RUN_PLACEMENT", "Run", "calibrate", "evaluate", "fit_factors",
           "load_calibration", "predict_calibrated", "read_runs", "run_setup"]
