"""Calibration: fit the predictor's per-device corrections to measured whole-run iteration times.

    cal = calibrate(cluster, "runs.csv")       # run log, SCHEMAS.md
    cal.save("cal.json"); cal = load_calibration("cal.json")
    hetero.predict(cluster, model, plan, calibration=cal)

Each run-log row is one homogeneous Megatron-style run. It becomes a model spec (gpt unless an
``architecture`` column says otherwise), a one-group slice of ``cluster`` (the group holding the
row's device type, ``num_devices / devices_per_node`` nodes; a run smaller than a node gets one
partial node) and a plan (one pipeline shape, ``dp`` replicas, ``pp`` stages of ``tp`` devices,
layers split evenly, ``global_batch / (dp x micro_batch)`` micro-batches), and is predicted by
:func:`hetero.predictor.predict` itself -- the calibration corrects the same code path it will be
applied to.

What is fitted, per device type: :class:`~hetero.predictor.factors.CalibrationFactors`
``theta = (compute, communication, layer_overhead_s, iteration_overhead_s)``. The predictor is a
max-plus network (pipeline schedule) of durations that are each linear in theta, so the predicted
iteration time is positively homogeneous and piecewise linear in theta: ``T(theta) = J(theta) .
theta`` with ``J`` constant on the region where the critical path does not change. We therefore fit
by Gauss-Newton on the exact model: evaluate ``J`` per run by finite differences of real
``predict`` calls at the current theta, solve the (tiny, bounded) least-squares problem in
log space, ``min sum_r (log(J_r . theta) - log T_r)^2 + prior``, and repeat until theta stops
moving (2-4 rounds). The weak prior (``PRIOR_WEIGHT``) pulls each factor towards the identity
(log compute, log communication, overheads / their scale), so a parameter the runs cannot
identify (e.g. communication when no run communicates) stays at its catalog value instead of
drifting.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from hetero.errors import HeteroError

from .factors import CalibrationFactors

FORMAT = "hetero-calibration"
VERSION = 1

REQUIRED = ("device", "devices_per_node", "num_devices", "global_batch_size", "micro_batch_size", "hidden_size",
            "num_attention_heads", "num_layers", "seq_length", "vocab_size", "dtype", "recompute", "tp", "dp",
            "pp", "iteration_time_ms")
INT_COLUMNS = ("devices_per_node", "num_devices", "global_batch_size", "micro_batch_size", "hidden_size",
               "num_attention_heads", "num_layers", "seq_length", "vocab_size", "tp", "dp", "pp")
OPTIONAL_INT = ("ffn_hidden_size", "num_kv_heads", "zero_stage")
CHOICES = {"dtype": ("fp32", "fp16", "bf16"), "recompute": ("none", "selective", "full"),
           "architecture": ("gpt", "llama"), "schedule": ("gpipe", "1f1b", "interleaved")}

PARAMS = ("compute", "communication", "layer_overhead_s", "iteration_overhead_s")
"""The factors every predictor applies (:class:`~hetero.predictor.factors.CalibrationFactors`)."""
EXTRA = ("op_floor_s", "network")
"""Extra structure this module fits (the predictor applies it, see :class:`CalibrationFactors`):
``op_floor_s``: no modelled kernel takes less than this (seconds, after the compute factor): the
host issues kernels at a finite rate, so small kernels are dispatch-bound, and the time of a layer
is a max (device work, host dispatch), not a sum -- an additive overhead cannot express that
small models are launch-bound while large ones are compute-bound.
``network``: multiplies the time of traffic over the inter-node network (on top of
``communication``): NICs and NVLink reach different fractions of their nominal bandwidth."""
ALL = PARAMS + EXTRA
OP_MODELS = ("learned", "roofline")
IDENTITY_THETA = (1.0, 1.0, 0.0, 0.0, 0.0, 1.0)
START_THETA = (1.0, 1.0, 0.0, 0.0, 3e-5, 1.0)
"""Fitting starts with a small floor: at exactly 0 no kernel touches it and its gradient is 0."""
BOUNDS = ((0.05, 1e-3, 0.0, 0.0, 0.0, 0.05), (50.0, 50.0, 0.1, 60.0, 0.01, 50.0))
FD_STEPS = (1e-3, 1e-3, 1e-6, 1e-4, 1e-6, 1e-3)
THETA_SCALE = (1.0, 1.0, 1e-3, 1e-2, 1e-5, 1.0)
PRIOR_WEIGHT = 0.02
"""Weight of each prior residual relative to one run's log error (weak: 0.02 ~ one run at 2%)."""
PRIOR_SCALE = (None, None, 1e-3, 0.1, 1e-4, None)
"""Additive terms are pulled to 0 in units of these scales (1 ms per layer, 100 ms per iteration,
100 us per kernel); the multiplicative ones (None) towards 1 in log space."""


class CalibrationError(HeteroError):
    """Bad run log or calibration file: the message names the file, row / field and column."""


# ============================================================================ run log
@dataclass(frozen=True)
class Run:
    """One row of a run log (a homogeneous Megatron-style run)."""

    device: str
    devices_per_node: int
    num_devices: int
    global_batch_size: int
    micro_batch_size: int
    hidden_size: int
    num_attention_heads: int
    num_layers: int
    seq_length: int
    vocab_size: int
    dtype: str
    recompute: str
    tp: int
    dp: int
    pp: int
    iteration_time_ms: float
    architecture: str = "gpt"
    ffn_hidden_size: int | None = None
    num_kv_heads: int | None = None
    schedule: str = "1f1b"
    zero_stage: int = 0
    dropout: float = 0.0
    """Optional column: Megatron's hidden / attention dropout (adds the dropout kernels)."""
    row: int = 0
    """Line number in the CSV (header = 1)."""
    source: str = "<runs>"

    @property
    def where(self) -> str:
        return f"{self.source}, row {self.row}"

    @property
    def micro_batches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def iteration_time_s(self) -> float:
        return self.iteration_time_ms * 1e-3

    def describe(self) -> str:
        return (f"{self.num_devices}x{self.device} h{self.hidden_size} L{self.num_layers} s{self.seq_length} "
                f"gbs{self.global_batch_size} mbs{self.micro_batch_size} tp{self.tp} dp{self.dp} pp{self.pp}")


def read_runs(path) -> list[Run]:
    """Read and validate a run-log CSV; errors name the file, the row and the column."""
    path = Path(path)
    source = str(path)
    try:
        fh = open(path, newline="")
    except FileNotFoundError:
        raise CalibrationError(f"{source}: run log not found") from None
    except OSError as e:
        raise CalibrationError(f"{source}: cannot read run log: {e.strerror}") from None
    with fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise CalibrationError(f"{source}: missing column{'s' if len(missing) > 1 else ''} "
                                   f"{', '.join(repr(c) for c in missing)} (a run log needs: {', '.join(REQUIRED)})")
        runs = []
        for i, raw in enumerate(reader, start=2):
            row = {(k or "").strip(): (v or "").strip() if isinstance(v, str) else v for k, v in raw.items()}
            if not any(row.values()):
                continue
            runs.append(_parse_run(row, i, source))
    if not runs:
        raise CalibrationError(f"{source}: no runs (the file has a header but no rows)")
    return runs


def _parse_run(row: Mapping, i: int, source: str) -> Run:
    def where(col):
        return f"{source}, row {i}, column '{col}'"

    def integer(col, value):
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise CalibrationError(f"{where(col)}: '{value}' is not a number") from None
        if f != int(f) or f < (0 if col == "zero_stage" else 1):
            raise CalibrationError(f"{where(col)}: expected a positive whole number, got '{value}'")
        return int(f)

    vals: dict = {}
    for col in INT_COLUMNS:
        vals[col] = integer(col, row.get(col))
    for col in OPTIONAL_INT:
        if row.get(col):
            vals[col] = integer(col, row[col])
    t = row.get("iteration_time_ms")
    try:
        vals["iteration_time_ms"] = float(t)
    except (TypeError, ValueError):
        raise CalibrationError(f"{where('iteration_time_ms')}: '{t}' is not a number") from None
    if not (vals["iteration_time_ms"] > 0 and math.isfinite(vals["iteration_time_ms"])):
        raise CalibrationError(f"{where('iteration_time_ms')}: must be a positive time in ms, got '{t}'")
    if row.get("dropout"):
        try:
            vals["dropout"] = float(row["dropout"])
        except ValueError:
            raise CalibrationError(f"{where('dropout')}: '{row['dropout']}' is not a number") from None
    vals["device"] = row.get("device") or ""
    if not vals["device"]:
        raise CalibrationError(f"{where('device')}: empty (name a device type of the cluster)")
    for col, choices in CHOICES.items():
        value = row.get(col)
        if value in (None, ""):
            if col in REQUIRED:
                raise CalibrationError(f"{where(col)}: empty (one of {', '.join(choices)})")
            continue
        if value not in choices:
            raise CalibrationError(f"{where(col)}: '{value}' is not one of {', '.join(choices)}")
        vals[col] = value
    run = Run(row=i, source=source, **vals)
    if run.tp * run.dp * run.pp != run.num_devices:
        raise CalibrationError(f"{where('num_devices')}: tp x dp x pp = {run.tp}x{run.dp}x{run.pp} = "
                               f"{run.tp * run.dp * run.pp}, not num_devices={run.num_devices}")
    if run.global_batch_size % (run.dp * run.micro_batch_size):
        raise CalibrationError(f"{where('global_batch_size')}: {run.global_batch_size} is not a multiple of "
                               f"dp x micro_batch_size = {run.dp * run.micro_batch_size}")
    if run.num_layers < run.pp:
        raise CalibrationError(f"{where('pp')}: {run.pp} stages for {run.num_layers} layers")
    return run


# ============================================================================ run -> (cluster, model, plan)
def run_setup(cluster, run: Run):
    """(one-group cluster slice, model spec, plan) that ``run`` describes (see the module docstring).

    Tensor parallelism wider than a node (Megatron allows it; our plans do not) is modelled as a
    group of ``tp``-device "nodes" whose device-to-device link is the inter-node network: that is
    the link such a TP ring is bound by.
    """
    from hetero.specs.cluster import Cluster, Group
    from hetero.specs.errors import SpecError
    from hetero.specs.model import load_model
    from hetero.specs.plan import load_plan

    group = _group_for(cluster, run)
    per, nodes, intra = run.devices_per_node, run.num_devices // run.devices_per_node, group.intra_node
    if run.num_devices < run.devices_per_node:
        per, nodes = run.num_devices, 1
    elif run.num_devices % run.devices_per_node:
        raise CalibrationError(f"{run.where}, column 'num_devices': {run.num_devices} devices are not whole "
                               f"nodes of devices_per_node={run.devices_per_node}")
    if run.tp > per:
        per, nodes, intra = run.tp, run.num_devices // run.tp, cluster.network.inter_node
    g = Group(name=group.name, device=group.device, nodes=nodes, devices_per_node=per, intra_node=intra)
    sliced = Cluster(name=f"{cluster.name}[{run.device}x{run.num_devices}]", groups=(g,), network=cluster.network,
                     devices=cluster.devices, device_types={g.name: cluster.device_type(group.name)},
                     source=cluster.source)
    model_dict = dict(name=f"run-row{run.row}", architecture=run.architecture, num_layers=run.num_layers,
                      hidden_size=run.hidden_size, num_attention_heads=run.num_attention_heads,
                      vocab_size=run.vocab_size, seq_length=run.seq_length, dtype=run.dtype,
                      dropout=run.dropout)
    if run.ffn_hidden_size:
        model_dict["ffn_hidden_size"] = run.ffn_hidden_size
    if run.num_kv_heads:
        model_dict["num_kv_heads"] = run.num_kv_heads
    L, pp = run.num_layers, run.pp
    bounds = [k * L // pp for k in range(pp + 1)]   # even split (remainder spread over the stages)
    stages = [dict(group=g.name, tp=run.tp, layers=[bounds[k], bounds[k + 1]]) for k in range(pp)]
    plan_dict = dict(global_batch_size=run.global_batch_size, micro_batch_size=run.micro_batch_size,
                     schedule=run.schedule, recompute=run.recompute, zero_stage=run.zero_stage,
                     pipelines=[dict(replicas=run.dp, micro_batches=run.micro_batches, stages=stages)])
    try:
        model = load_model(model_dict)
        plan = load_plan(plan_dict, sliced, model)
    except SpecError as e:
        raise CalibrationError(f"{run.where}: this run is not a valid model/plan: "
                               + "; ".join(str(p) for p in e.problems)) from None
    return sliced, model, plan


def _group_for(cluster, run: Run):
    for g in cluster.groups:
        if g.device == run.device:
            return g
    names = sorted({g.device for g in cluster.groups})
    raise CalibrationError(f"{run.where}, column 'device': no group of cluster '{cluster.name}' holds "
                           f"'{run.device}' (its device types: {', '.join(names)})")


# ============================================================================ the calibration object
@dataclass
class Calibration:
    """Per-device-type factors fitted on run logs, plus how well they fit."""

    factors: dict[str, CalibrationFactors] = field(default_factory=dict)
    """Device type name -> the factors every predictor applies."""
    extra: dict[str, dict] = field(default_factory=dict)
    """Device type name -> {op_floor_s, network} (see ``EXTRA``), handed to the predictor by
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

    def op_model_for(self, device_name: str, device=None) -> str | None:
        name = self._name_for(device_name, device)
        return self.op_model.get(name) if name else None

    def extra_for(self, device_name: str, device=None) -> dict:
        name = self._name_for(device_name, device)
        return dict(self.extra.get(name, {})) if name else {}

    def theta(self, device_name: str) -> tuple:
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
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CalibrationError(f"{path}: calibration file not found") from None
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read calibration file: {e.strerror}") from None
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

    def jacobian(self, theta, free):
        """Per run, d T / d theta by forward differences (T is piecewise linear: exact on a piece)."""
        import numpy as np

        base = np.array(self.times(theta))
        J = np.zeros((len(base), len(ALL)))
        for i in np.flatnonzero(free):
            h = FD_STEPS[i] * (max(theta[i], 0.1) if i < 2 or i == 5 else 1.0)
            t = list(theta)
            t[i] += h
            J[:, i] = (np.array(self.times(t)) - base) / h
        return base, J


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
        t = np.maximum(offset + J @ th, 1e-12)
        pri = [math.log(th[i]) if PRIOR_SCALE[i] is None else th[i] / PRIOR_SCALE[i] for i in idx]
        return np.concatenate([np.log(t) - y, prior * np.array(pri)])

    x0 = np.clip(np.asarray(theta0, dtype=float)[idx], lo + 1e-12, hi - 1e-12)
    res = least_squares(resid, x0, bounds=(lo, hi), x_scale=np.array(THETA_SCALE)[idx], method="trf")
    return full(res.x)


def fit_factors(cluster, runs: list[Run], rounds: int = 5, prior: float = PRIOR_WEIGHT,
                fit: Iterable[str] = ALL, op_model: str | None = None) -> tuple[tuple, dict]:
    """Fit one device type's parameters (``ALL``, or the subset ``fit``; the rest stay at identity)
    on its runs: Gauss-Newton on the real predictor. Returns (theta, info)."""
    import numpy as np

    fit = set(fit)
    unknown = fit - set(ALL)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} (known: {', '.join(ALL)})")
    free = np.array([k in fit for k in ALL])
    prob = _Problem(cluster, runs, op_model)
    measured = np.array(prob.measured)
    theta = np.where(free, START_THETA, IDENTITY_THETA).astype(float)
    n = 0
    for n in range(1, rounds + 1):
        T0, J = prob.jacobian(theta, free)
        new = _fit_linearised(J, T0, theta, measured, prior, free)
        moved = np.max(np.abs(new - theta) / np.array(THETA_SCALE))
        theta = new
        if moved < 1e-3:
            break
    final = np.array(prob.times(theta))
    err = np.abs(final / measured - 1)
    rmsle = float(np.sqrt(np.mean(np.log(final / measured) ** 2)))
    return tuple(float(v) for v in theta), {"rounds": n, "mape": float(err.mean()), "rmsle": rmsle,
                                            "predicted_s": final.tolist(), "op_model": op_model}


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
              standard: bool = True, op_models: bool = True) -> Calibration:
    """Fit per-device-type factors to a run log (a CSV path, or a list of :class:`Run`).

    ``cluster`` is a :class:`~hetero.specs.cluster.Cluster` or a cluster file / dict. ``fit`` names
    the parameters to fit (default all of ``ALL``; the others stay at identity). ``standard``: also
    fit the four standard factors alone (see :attr:`Calibration.standard`). ``op_models``: also
    try the roofline operator model where the predictor would use the learned one, and keep the
    better fit (lower RMS log error; :attr:`Calibration.op_model`).
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
        _group_for(cluster, r)
        by_device.setdefault(r.device, []).append(r)
    cal = Calibration()
    fits, table = {}, []
    for device, rs in by_device.items():
        theta, info = None, None
        for kind in _op_model_candidates(cluster, device, op_models):
            th, inf = fit_factors(cluster, rs, prior=prior, fit=fit, op_model=None if kind == "default" else kind)
            if info is None or inf["rmsle"] < info["rmsle"]:
                theta, info = th, inf
                info["chosen"] = kind
        if info["chosen"] != "default":
            cal.op_model[device] = info["chosen"]
        src = f"calibration ({len(rs)} runs of {Path(source).name})"
        cal.factors[device] = CalibrationFactors(**dict(zip(PARAMS, theta[:4])), source=src)
        cal.extra[device] = dict(zip(EXTRA, theta[4:]))
        if standard and set(fit) & set(EXTRA):
            std, std_info = fit_factors(cluster, rs, prior=prior, fit=set(fit) & set(PARAMS))
            cal.standard[device] = CalibrationFactors(**dict(zip(PARAMS, std[:4])), source=src)
        else:
            std_info = info
        base = np.array(_Problem(cluster, rs).times(IDENTITY_THETA))
        measured = np.array([r.iteration_time_s for r in rs])
        fits[device] = {"runs": len(rs), "rounds": info["rounds"], "mape": info["mape"],
                        "op_model": "predictor default" if info["chosen"] == "default" else info["chosen"],
                        "mape_standard_factors": std_info["mape"],
                        "mape_uncalibrated": float(np.mean(np.abs(base / measured - 1)))}
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
