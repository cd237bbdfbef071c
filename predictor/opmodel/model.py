"""The learned operator-latency model.

latency = roofline(op, dims, dtype, device) * exp(g(features)), where g is a gradient-boosted tree
ensemble per op family (GEMM: linear/bmm; vector: ln, softmax and elementwise ops) fitted on
log(measured / roofline). Features are dimensionless (see ``features.py``), so a device enters only
through spec ratios and the model can be applied to devices it never saw.

Other dtypes: the model was fitted on fp32 (no TF32) measurements. For fp16/bf16/... it is applied
with that dtype's peak (``device.matrix_flops(dtype)``, tensor cores) and bytes per element, i.e.
we ASSUME the shape of utilisation versus (intensity/ridge, waves, size/L2, time/overhead) carries
over from fp32 CUDA-core GEMMs to tensor-core GEMMs. That is unvalidated by this data.
"""
from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from . import features as F
from .specs import Records, as_records
from .trees import PackedTrees, compile_scalar, export_hgb, validate

FORMAT = "hetero-opmodel"
VERSION = 1
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "opmodel.json"

HGB_PARAMS = dict(max_iter=200, learning_rate=0.08, max_leaf_nodes=31, min_samples_leaf=40,
                  l2_regularization=1.0, early_stopping=False)


class OpModel:
    """Per-operator latency predictor (seconds). ``fit`` needs scikit-learn; prediction only numpy."""

    def __init__(self, cache_size: int = 1 << 16):
        self.ensembles: dict[str, dict] = {}
        self.meta: dict = {}
        self._packed: dict[str, PackedTrees] = {}
        self._scalar: dict = {}
        self._dev: dict = {}
        self._cached = functools.lru_cache(maxsize=cache_size)(self._predict_key)

    # ------------------------------------------------------------------ fitting
    def fit(self, records, devices: Mapping, exclude_devices: Iterable[str] = (),
            max_rows_per_family: int | None = None, seed: int = 0, hgb_params: Mapping | None = None) -> "OpModel":
        """Fit on profile records (``Records``, list of dict rows, or a dict of columns).

        ``devices`` maps the record's device names to ``DeviceType``; rows of unknown devices, of
        ``exclude_devices``, of unknown ops or without a positive latency are skipped. Each
        (op, device) group gets the same total weight. ``max_rows_per_family`` subsamples
        (uniformly, fixed ``seed``) for speed.
        """
        from sklearn.ensemble import HistGradientBoostingRegressor

        rec = as_records(records)
        excluded = set(exclude_devices)
        keep = (np.isin(rec.device, [d for d in devices if d not in excluded])
                & np.isin(rec.op, F.OPS) & (rec.latency_ms > 0))
        rec = rec.subset(keep)
        rng = np.random.default_rng(seed)
        params = {**HGB_PARAMS, **(hgb_params or {})}
        fam = np.array([F.FAMILY[o] for o in rec.op])
        self.ensembles, counts = {}, {}
        for family in ("gemm", "vector"):
            idx = np.flatnonzero(fam == family)
            if len(idx) == 0:
                continue
            if max_rows_per_family and len(idx) > max_rows_per_family:
                idx = np.sort(rng.choice(idx, max_rows_per_family, replace=False))
            sub = rec.subset(idx)
            X, troof = self._matrix(family, sub.op, sub.dims, sub.dtype, [devices[d] for d in sub.device])
            y = np.log(sub.latency_ms * 1e-3 / troof)
            groups = np.char.add(np.char.add(sub.op, "|"), sub.device)
            _, inv, cnt = np.unique(groups, return_inverse=True, return_counts=True)
            w = 1.0 / cnt[inv]
            w *= len(w) / w.sum()
            model = HistGradientBoostingRegressor(random_state=seed, **params).fit(X, y, sample_weight=w)
            self.ensembles[family] = export_hgb(model)
            counts[family] = int(len(idx))
        self.meta = {
            "trained_devices": sorted(set(rec.device.tolist())),
            "excluded_devices": sorted(excluded),
            "rows": counts,
            "hgb_params": params,
            "target": "log(measured / roofline), roofline = max(flops/peak, bytes/bandwidth)",
            "feature_names": {"gemm": F.GEMM_FEATURE_NAMES, "vector": F.VECTOR_FEATURE_NAMES},
            "dtype_assumption": "fitted on fp32 (no TF32); other dtypes use their own peak and "
                                "bytes/element with the same utilisation shape",
        }
        self._prepare()
        return self

    # ------------------------------------------------------------------ prediction
    def _prepare(self) -> None:
        self.ensembles = {k: validate(v) for k, v in self.ensembles.items()}
        self._packed = {k: PackedTrees(v) for k, v in self.ensembles.items()}
        self._scalar = {k: compile_scalar(v) for k, v in self.ensembles.items()}
        self._dev.clear()
        self._cached.cache_clear()

    def _device_params(self, device, dtype: str) -> tuple:
        key = (id(device), dtype)
        hit = self._dev.get(key)
        if hit is None or hit[0] is not device:
            if len(self._dev) > 4096:
                self._dev.clear()
            hit = (device, F.device_params(device, dtype))
            self._dev[key] = hit
        return hit[1]

    def predict(self, op: str, dims: Mapping[str, float], dtype: str, device) -> float:
        """Latency in seconds of ``op`` with ``dims`` (B, M, N, K for linear/bmm; B, H otherwise)."""
        g = dims.get
        key = (op, g("B"), g("M"), g("N"), g("K"), g("H"), dtype, self._device_params(device, dtype))
        return self._cached(key)

    def _predict_key(self, key) -> float:
        op, B, M, N, K, H, dtype, (P, Pv, BW, SM, L2) = key
        e = F.dtype_bytes(dtype)
        family = F.FAMILY.get(op)
        if family is None:
            raise ValueError(f"unknown op '{op}' (known: {', '.join(F.OPS)})")
        if family not in self._scalar:
            raise ValueError(f"model has no '{family}' ensemble")
        if family == "gemm":
            B, M, N, K = (float(v) if v else 1.0 for v in (B, M, N, K))
            f, troof = F.gemm_features(F.SCALAR, 1.0 if op == "bmm" else 0.0, B, M, N, K, e, P, BW, SM, L2)
        else:
            B, H = (float(v) if v else 1.0 for v in (B, H))
            oh = [0.0] * len(F.VECTOR_OPS)
            oh[F.OP_INDEX[op]] = 1.0
            f, troof = F.vector_features(F.SCALAR, oh, F.VEC_INPUTS[op], F.VEC_FLOPS[op], B, H, e, Pv, BW, SM, L2)
        return troof * math.exp(self._scalar[family](f))

    def _matrix(self, family, ops, dims, dtypes, devices):
        """Features + roofline for rows; ``dtypes``/``devices`` are per-row sequences."""
        n = len(ops)
        cols = {k: np.empty(n) for k in ("e", "P", "Pv", "BW", "SM", "L2")}
        keys = {}
        for i, (dt, dev) in enumerate(zip(dtypes, devices)):
            k = (dt, id(dev))
            if k not in keys:
                keys[k] = (F.dtype_bytes(dt),) + self._device_params(dev, dt)
            for name, v in zip(("e", "P", "Pv", "BW", "SM", "L2"), keys[k]):
                cols[name][i] = v
        return F.build_matrix(family, ops, dims, cols["e"], cols["P"], cols["Pv"], cols["BW"], cols["SM"], cols["L2"])

    def predict_many(self, op, dims: Mapping[str, Sequence[float]], dtype, device) -> np.ndarray:
        """Vectorised ``predict``: ``op``/``dtype``/``device`` are one value or one per row; ``dims``
        maps B/M/N/K/H to arrays (NaN or missing where a dimension does not apply). Seconds."""
        lengths = [len(np.atleast_1d(v)) for v in dims.values()]
        if not isinstance(op, str):
            lengths.append(len(op))
        n = max(lengths) if lengths else 1
        ops = np.full(n, op) if isinstance(op, str) else np.asarray(op).astype(str)
        dts = [dtype] * n if isinstance(dtype, str) else list(dtype)
        devs = list(device) if isinstance(device, (list, tuple, np.ndarray)) else [device] * n
        D = {k: np.broadcast_to(np.asarray(v, dtype=float), (n,)) for k, v in dims.items()}
        out = np.full(n, np.nan)
        fam = np.array([F.FAMILY.get(o, "") for o in ops])
        if (fam == "").any():
            raise ValueError(f"unknown op(s) {sorted(set(ops[fam == '']))}")
        for family in np.unique(fam):
            idx = np.flatnonzero(fam == family)
            X, troof = self._matrix(family, ops[idx], {k: v[idx] for k, v in D.items()},
                                    [dts[i] for i in idx], [devs[i] for i in idx])
            out[idx] = troof * np.exp(self._packed[family].predict(X))
        return out

    def predict_records(self, records, devices: Mapping) -> np.ndarray:
        rec = as_records(records)
        return self.predict_many(rec.op, rec.dims, list(rec.dtype), [devices[d] for d in rec.device])

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta, "ensembles": self.ensembles}

    @classmethod
    def from_dict(cls, data: Mapping) -> "OpModel":
        if data.get("format") != FORMAT or int(data.get("version", -1)) != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} file")
        m = cls()
        m.meta = dict(data.get("meta", {}))
        m.ensembles = dict(data["ensembles"])
        m._prepare()
        return m

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OpModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


SHIPPED = {None: "opmodel.json", "Tesla V100-PCIE-32GB": "opmodel_no_v100.json"}


@functools.lru_cache(maxsize=4)
def default_model(without: str | None = None) -> OpModel:
    """The shipped model (``predictor/data/opmodel.json``), fitted on all five NeuSight GPUs.

    ``without="Tesla V100-PCIE-32GB"`` loads the variant fitted without any V100 rows
    (``opmodel_no_v100.json``), for honest end-to-end checks against the V100 step times.
    """
    if without not in SHIPPED:
        raise ValueError(f"no shipped model without '{without}' (have: {[k for k in SHIPPED if k]}); "
                         f"fit one with OpModel().fit(..., exclude_devices=[...])")
    return OpModel.load(DEFAULT_PATH.parent / SHIPPED[without])
