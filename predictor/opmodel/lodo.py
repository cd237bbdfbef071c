"""Leave-one-device-out evaluation of the op model against two baselines (used by the benchmark
and the accuracy test).

Baselines, fitted on the same training devices:
  roofline   max(flops/peak, bytes/bandwidth) times one factor per op, the median of
             measured/roofline over the training rows (``roofline_raw``: factor 1).
  linreg     per op, ordinary least squares of log(latency) on [log(flops/peak), log(bytes/bw),
             log(roofline)] plus an intercept.
Metrics: APE = |pred - measured| / measured; MAPE (mean) and median APE per op, per family
(gemm: linear+bmm, norm: ln+softmax, elementwise: the other 7) and overall, where family and
overall numbers are the unweighted mean over their ops of the per-op metric (each op counts the
same however many rows it has). ``pooled_*`` are over all rows instead.
"""
from __future__ import annotations

import time
from typing import Iterable, Mapping

import numpy as np

from . import features as F
from .model import OpModel
from .specs import Records

FAMILIES = {"gemm": list(F.GEMM_OPS), "norm": list(F.NORM_OPS), "elementwise": list(F.ELEMENTWISE_OPS)}


def _work(rec: Records, devices: Mapping):
    """flops/peak, bytes/bw, roofline seconds for each row."""
    n = len(rec)
    tc, tm = np.empty(n), np.empty(n)
    d = {k: np.where(np.isnan(v), 1.0, v) for k, v in rec.dims.items()}
    for name in np.unique(rec.device):
        for dt in np.unique(rec.dtype):
            for op in np.unique(rec.op):
                m = (rec.device == name) & (rec.dtype == dt) & (rec.op == op)
                if not m.any():
                    continue
                P, Pv, BW, _, _ = F.device_params(devices[name], dt)
                e = F.dtype_bytes(dt)
                if op in F.GEMM_OPS:
                    _, _, fl, by = F.gemm_work(float(op == "bmm"), d["B"][m], d["M"][m], d["N"][m],
                                               d["K"][m], e)
                    tc[m], tm[m] = fl / P, by / BW
                else:
                    _, fl, by = F.vector_work(F.VEC_INPUTS[op], F.VEC_FLOPS[op], d["B"][m], d["H"][m], e)
                    tc[m], tm[m] = fl / Pv, by / BW
    return tc, tm, np.maximum(tc, tm)


def baseline_predictions(train: Records, test: Records, devices: Mapping) -> dict[str, np.ndarray]:
    from sklearn.linear_model import LinearRegression

    tc_tr, tm_tr, r_tr = _work(train, devices)
    tc, tm, r_te = _work(test, devices)
    y_tr = train.latency_ms * 1e-3
    out = {"roofline_raw": r_te.copy(), "roofline": np.empty(len(test)), "linreg": np.empty(len(test))}
    for op in np.unique(test.op):
        mtr, mte = train.op == op, test.op == op
        factor = float(np.exp(np.median(np.log(y_tr[mtr] / r_tr[mtr]))))
        out["roofline"][mte] = factor * r_te[mte]
        Xtr = np.log(np.column_stack([tc_tr[mtr], tm_tr[mtr], r_tr[mtr]]))
        Xte = np.log(np.column_stack([tc[mte], tm[mte], r_te[mte]]))
        lr = LinearRegression().fit(Xtr, np.log(y_tr[mtr]))
        out["linreg"][mte] = np.exp(lr.predict(Xte))
    return out


def metrics(ops: np.ndarray, pred: np.ndarray, meas: np.ndarray) -> dict:
    ape = np.abs(pred - meas) / meas
    per_op = {op: {"mape": float(np.mean(ape[ops == op])), "medape": float(np.median(ape[ops == op])),
                   "n": int((ops == op).sum())} for op in F.OPS if (ops == op).any()}
    fam = {}
    for name, members in FAMILIES.items():
        ms = [per_op[o] for o in members if o in per_op]
        if ms:
            fam[name] = {"mape": float(np.mean([m["mape"] for m in ms])),
                         "medape": float(np.mean([m["medape"] for m in ms]))}
    overall = {"mape": float(np.mean([m["mape"] for m in per_op.values()])),
               "medape": float(np.mean([m["medape"] for m in per_op.values()])),
               "pooled_mape": float(np.mean(ape)), "pooled_medape": float(np.median(ape)), "n": int(len(ape))}
    return {"overall": overall, "family": fam, "op": per_op}


def stratified_sample(rec: Records, per_group: int, seed: int) -> np.ndarray:
    """Indices of at most ``per_group`` rows of each (op, device) group (fixed seed)."""
    rng = np.random.default_rng(seed)
    groups = np.char.add(np.char.add(rec.op, "|"), rec.device)
    keep = []
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        keep.append(idx if len(idx) <= per_group else rng.choice(idx, per_group, replace=False))
    return np.sort(np.concatenate(keep))


def run_lodo(rec: Records, devices: Mapping, holdouts: Iterable[str] | None = None,
             train_rows_per_group: int | None = 4000, test_rows_per_group: int | None = None,
             seed: int = 0, model_kwargs: Mapping | None = None, log=print, baselines: bool = True,
             designs: Mapping[str, str] | None = None, probes: bool = False) -> dict:
    """Train on all but one device, evaluate on it, for each device. Training uses at most
    ``train_rows_per_group`` rows per (op, device) (fixed seed); evaluation uses every held-out row
    unless ``test_rows_per_group`` is given.

    ``probes``: also score the "probed" protocol: the fitted model calibrated to the held-out device
    by the ~20 probe measurements of :mod:`.probes` taken from its rows (:func:`.probes.calibrate`);
    those rows are then removed from the test set of every method, so all are scored on the same rows."""
    measured = sorted(set(rec.device.tolist()) & set(devices))
    holdouts = list(holdouts) if holdouts else measured
    results = {}
    for dev in holdouts:
        t0 = time.time()
        train = rec.subset(rec.device != dev)
        if train_rows_per_group:
            train = train.subset(stratified_sample(train, train_rows_per_group, seed))
        test = rec.subset(rec.device == dev)
        probe_set = None
        if probes:  # taken from all of the device's rows, then kept out of every method's test set
            from .probes import probe_rows

            used = np.array(sorted(probe_rows(test).values()), dtype=np.int64)
            probe_set = test.subset(used)
            test = test.subset(np.setdiff1d(np.arange(len(test)), used))
        if test_rows_per_group:
            test = test.subset(stratified_sample(test, test_rows_per_group, seed + 1))
        kw = dict(model_kwargs or {})
        if designs and dev in designs:
            kw["design"] = designs[dev]
        model = OpModel().fit(train, devices, seed=seed, **kw)
        calibration = None
        if probe_set is not None:
            from .probes import ProbedOpModel, calibrate

            calibration = calibrate(model, devices[dev], probe_set)
        preds = {"learned": model.predict_records(test, devices)}
        meas = test.latency_ms * 1e-3
        attribution = {}
        if calibration is not None:
            preds["probed"] = ProbedOpModel(model, devices[dev], calibration).predict_records(test)
            for name, part in partial_calibrations(calibration).items():
                got = metrics(test.op, ProbedOpModel(model, devices[dev], part).predict_records(test), meas)
                attribution[name] = {"mape": got["overall"]["mape"], "medape": got["overall"]["medape"]}
        if baselines:
            preds.update(baseline_predictions(train, test, devices))
        results[dev] = {k: metrics(test.op, p, meas) for k, p in preds.items()}
        results[dev]["n_train"] = len(train)
        results[dev]["seconds"] = time.time() - t0
        results[dev]["design"] = model.design
        if calibration is not None:
            results[dev]["calibration"] = calibration.to_dict()
            results[dev]["attribution"] = attribution
            results[dev]["probe_rows"] = [{"op": str(probe_set.op[i]), **{k: float(v[i]) for k, v in probe_set.dims.items()
                                           if np.isfinite(v[i])}, "latency_ms": float(probe_set.latency_ms[i])}
                                          for i in range(len(probe_set))]
        if log and baselines:
            r = results[dev]
            pr = (f" | probed {r['probed']['overall']['mape']:.3f} med {r['probed']['overall']['medape']:.3f}"
                  if "probed" in r else "")
            log(f"{dev:24s} learned MAPE {r['learned']['overall']['mape']:.3f} med {r['learned']['overall']['medape']:.3f}{pr}"
                f" | roofline {r['roofline']['overall']['mape']:.3f} | linreg {r['linreg']['overall']['mape']:.3f}"
                f"  ({r['seconds']:.0f}s)")
    return results


def partial_calibrations(calibration) -> dict:
    """The probed protocol one kind of measurement at a time: the specs-only model given the held-out
    GPU's launch floors alone, its bandwidth scale alone, or its GEMM peak scales alone. Where a
    specs-only miss comes from (the same split as the V100 step's in bench_e2e_v100.py)."""
    from .probes import DeviceCalibration

    c = calibration
    return {"+ measured floors": DeviceCalibration(c.floors, 1.0, {}, 0),
            "+ bandwidth scale": DeviceCalibration({}, c.bandwidth_scale, {}, 0),
            "+ GEMM peak scales": DeviceCalibration({}, 1.0, c.compute_scale, 0),
            "+ floors and bandwidth": DeviceCalibration(c.floors, c.bandwidth_scale, {}, 0)}


def nested_select(rec: Records, devices: Mapping, candidates: Iterable[str], outer: Iterable[str] | None = None,
                  train_rows_per_group: int = 400, test_rows_per_group: int = 500, max_iter: int = 80,
                  seed: int = 0, log=print) -> dict:
    """Nested leave-one-device-out selection of the model design.

    For each outer held-out device, run an inner LODO over the REMAINING devices only (train on
    all but one of them, test on that one) for every candidate design, and pick the candidate with
    the lowest mean inner overall MAPE (unweighted mean over ops, as in ``metrics``). The outer
    device's rows are never used. Inner fits are cheap (subsampled rows, ``max_iter`` rounds).
    Returns {outer device: {"chosen": design, "inner": {design: {inner device: (mape, medape)}}}}.
    """
    measured = sorted(set(rec.device.tolist()) & set(devices))
    outer = list(outer) if outer else measured
    out = {}
    for dev in outer:
        out[dev] = select_design(rec.subset(rec.device != dev), devices, candidates, train_rows_per_group,
                                 test_rows_per_group, max_iter, seed)
        chosen, mean = out[dev]["chosen"], out[dev]["inner_mean_mape"]
        if log:
            log(f"outer {dev:24s} inner mean MAPE " + ", ".join(f"{c} {m:.3f}" for c, m in mean.items())
                + f" -> {chosen}")
    return out


def select_design(rec: Records, devices: Mapping, candidates: Iterable[str], train_rows_per_group: int = 400,
                  test_rows_per_group: int = 500, max_iter: int = 80, seed: int = 0) -> dict:
    """The selection rule used everywhere: the candidate design with the lowest mean LODO overall
    MAPE over the devices of ``rec`` (cheap fits). Ties go to the earlier candidate.
    Returns {"chosen": design, "inner_mean_mape": {design: mean}, "inner": {design: {device: (mape, medape)}}}."""
    candidates = list(candidates)
    scores = {}
    for cand in candidates:
        res = run_lodo(rec, devices, train_rows_per_group=train_rows_per_group,
                       test_rows_per_group=test_rows_per_group, seed=seed, log=None, baselines=False,
                       model_kwargs={"design": cand, "hgb_params": {"max_iter": max_iter}})
        scores[cand] = {d: (r["learned"]["overall"]["mape"], r["learned"]["overall"]["medape"])
                        for d, r in res.items()}
    mean = {c: float(np.mean([v[0] for v in sc.values()])) for c, sc in scores.items()}
    chosen = min(candidates, key=lambda c: (mean[c], candidates.index(c)))
    return {"chosen": chosen, "inner_mean_mape": mean, "inner": scores}
