"""The learned operator-latency model.

Design "floor" (format v2; "floor_min", the default, differs only in the floor of an unseen device):

    latency = (floor[op, device] + roofline(op, dims, dtype, device)) * exp(g(features))

where g is a gradient-boosted tree ensemble per op family (GEMM: linear/bmm; vector: ln, softmax
and elementwise ops) fitted on log(measured / (floor + roofline)), and the roofline-time feature is
log(roofline / floor). floor[op, device] is the launch floor: on a training device (recognised by
bandwidth, compute units, L2 and clock), the 1% quantile of the op's measured latency there (a
host/driver constant: 25-42 us for one elementwise op on the NeuSight machines, not explained by
any GPU spec); on any other device, an aggregate of the training devices' floors: the geometric
mean (design "floor"), the median ("floor_median") or the minimum ("floor_min": assume the host
dispatches as fast as the fastest host seen; on the NeuSight machines three of five GPUs share a
26 us floor, the other two sit at 32 and 42 us). A floor is mostly host dispatch, which a
training step overlaps with earlier kernels: :meth:`OpModel.host_overhead` says how much, and the
cost model composes a layer with it (``hetero.predictor.optime.stream_time``). Normalising by each training device's own
floor keeps the trees from learning the floor as a function of device-identifying spec ratios
(which made an unseen GPU inherit the floor of its nearest training neighbour). Design "ratio"
(format v1, the previous model) is latency = roofline * exp(g); "floor_power" is "floor" plus
log2(peak/tdp) and log2(tdp) as GEMM features. The design is chosen by one rule: the lowest mean
leave-one-device-out MAPE over the training devices (scripts/fit_opmodel.py --design auto; nested
in benchmarks/bench_opmodel.py); on all five NeuSight GPUs, and in every nested fold, that is
"floor_min", the default.
Features are dimensionless (see ``features.py``), so a device enters only through spec ratios and
the model can be applied to devices it never saw.

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
VERSION = 2
READABLE_VERSIONS = (1, 2)
DESIGNS = ("ratio", "floor", "floor_power", "floor_median", "floor_min")
FLOOR_DESIGNS = ("floor", "floor_power", "floor_median", "floor_min")
FLOOR_AGGREGATE = {"floor": "gmean", "floor_power": "gmean", "floor_median": "median", "floor_min": "min"}
"""How a device not trained on gets its launch floor from the training devices' floors."""
DEFAULT_DESIGN = "floor_min"  # the design selected on all five NeuSight GPUs (scripts/fit_opmodel.py)
TARGETS = {
    "ratio": "log(measured / roofline), roofline = max(flops/peak, bytes/bandwidth)",
    "floor": "log(measured / (floor[op, device] + roofline)); floor = 1% quantile of the op's latency on a "
             "training device, geometric mean over training devices for a device not trained on",
}
TARGETS["floor_power"] = TARGETS["floor"] + "; GEMM features add log2(peak/tdp) and log2(tdp)"
TARGETS["floor_median"] = TARGETS["floor"].replace("geometric mean", "median")
TARGETS["floor_min"] = TARGETS["floor"].replace("geometric mean", "minimum")
FLOOR_QUANTILE = 0.01
KERNEL_MIN_S = 2e-6
"""Device time of the smallest kernel (a tiny elementwise kernel runs for about 2 us on these GPUs).
A launch floor minus this is host time: NeuSight times one call between two CUDA events on an idle
GPU (sitar-lab/NeuSight, neusight/Tracing/trace.py, ``measure_cuda_kernel``), so each record is host
dispatch + kernel. Fixed beforehand, not fitted; see :meth:`OpModel.host_overhead`."""
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "opmodel.json"

HGB_PARAMS = dict(max_iter=200, learning_rate=0.08, max_leaf_nodes=31, min_samples_leaf=40,
                  l2_regularization=1.0, early_stopping=False)


class OpModel:
    """Per-operator latency predictor (seconds). ``fit`` needs scikit-learn; prediction only numpy."""

    def __init__(self, cache_size: int = 1 << 16):
        self.ensembles: dict[str, dict] = {}
        self.meta: dict = {}
        self.design = "ratio"
        self.floors: dict = {"global": {}, "devices": []}
        self._floor_tables: list = []
        self._packed: dict[str, PackedTrees] = {}
        self._scalar: dict = {}
        self._dev: dict = {}
        self._cached = functools.lru_cache(maxsize=cache_size)(self._predict_key)

    # ------------------------------------------------------------------ fitting
    def fit(self, records, devices: Mapping, exclude_devices: Iterable[str] = (),
            max_rows_per_family: int | None = None, seed: int = 0, hgb_params: Mapping | None = None,
            design: str = DEFAULT_DESIGN) -> "OpModel":
        """Fit on profile records (``Records``, list of dict rows, or a dict of columns).

        ``devices`` maps the record's device names to ``DeviceType``; rows of unknown devices, of
        ``exclude_devices``, of unknown ops or without a positive latency are skipped. Each
        (op, device) group gets the same total weight. ``max_rows_per_family`` subsamples
        (uniformly, fixed ``seed``) for speed. ``design``: one of ``DESIGNS`` (see the module doc).
        """
        if design not in DESIGNS:
            raise ValueError(f"unknown design '{design}' (known: {', '.join(DESIGNS)})")
        from sklearn.ensemble import HistGradientBoostingRegressor

        rec = as_records(records)
        excluded = set(exclude_devices)
        keep = (np.isin(rec.device, [d for d in devices if d not in excluded])
                & np.isin(rec.op, F.OPS) & (rec.latency_ms > 0))
        rec = rec.subset(keep)
        self.design = design
        self.floors = _estimate_floors(rec, devices, FLOOR_AGGREGATE[design]) if design in FLOOR_DESIGNS else {"global": {}, "devices": []}
        self._prepare_floors()
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
            X, base = self._matrix(family, sub.op, sub.dims, sub.dtype, [devices[d] for d in sub.device])
            y = np.log(sub.latency_ms * 1e-3 / base)
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
            "design": design,
            "target": TARGETS[design],
            "feature_names": {"gemm": F.GEMM_FEATURE_NAMES, "vector": F.VECTOR_FEATURE_NAMES},
            "dtype_assumption": "fitted on fp32 (no TF32); other dtypes use their own peak and "
                                "bytes/element with the same utilisation shape",
        }
        self._prepare()
        return self

    # ------------------------------------------------------------------ prediction
    def _prepare(self) -> None:
        self._prepare_floors()
        self.ensembles = {k: validate(v) for k, v in self.ensembles.items()}
        self._packed = {k: PackedTrees(v) for k, v in self.ensembles.items()}
        self._scalar = {k: compile_scalar(v) for k, v in self.ensembles.items()}
        self._dev.clear()
        self._cached.cache_clear()

    def _prepare_floors(self) -> None:
        """Floor tables as tuples indexed like ``F.OPS``: [0] global, [1 + i] trained device i."""
        fl = self.floors
        g = fl.get("global", {})
        self._floor_tables = [tuple(float(g.get(o, F.OVERHEAD_SCALE)) for o in F.OPS)]
        self._floor_keys = []
        for entry in fl.get("devices", []):
            own = entry["floors"]
            self._floor_tables.append(tuple(float(own.get(o, g.get(o, F.OVERHEAD_SCALE))) for o in F.OPS))
            self._floor_keys.append(tuple(float(v) for v in entry["key"]))
        for t in self._floor_tables:
            if not all(math.isfinite(v) and v > 0 for v in t):
                raise ValueError("floors must be positive and finite")

    def _floor_index(self, device) -> int:
        """1 + index of the trained device with the same (bandwidth, units, L2, clock), else 0."""
        if self.design not in FLOOR_DESIGNS:
            return -1
        k = device_key(device)
        for i, key in enumerate(self._floor_keys):
            if all(abs(a - b) <= 0.01 * max(abs(a), abs(b)) for a, b in zip(k, key)):
                return i + 1
        return 0

    def _device_params(self, device, dtype: str) -> tuple:
        key = (id(device), dtype)
        hit = self._dev.get(key)
        if hit is None or hit[0] is not device:
            if len(self._dev) > 4096:
                self._dev.clear()
            tdp = float(device.tdp) if getattr(device, "tdp", None) else float("nan")
            hit = (device, F.device_params(device, dtype) + (self._floor_index(device), tdp))
            self._dev[key] = hit
        return hit[1]

    def accuracy_note(self, device) -> str:
        """What the model knows of ``device``, for the predictor's provenance: whether it was fitted
        on this GPU's own measurements, else the leave-one-GPU-out error stored with the model
        (``meta.design_selection``, measured by scripts/fit_opmodel.py on the training GPUs)."""
        i = self._floor_index(device)
        if i > 0:
            name = self.floors["devices"][i - 1].get("name", "a GPU")
            return f"fitted on measurements of {name}, whose specs this device shares"
        sel = self.meta.get("design_selection", {}).get("inner_mean_mape", {})
        err = sel.get(self.design)
        tail = f"; leave-one-GPU-out operator MAPE {err:.0%} on the training GPUs" if err else ""
        add = self.floors.get("global", {}).get("add")
        if add and self.design in FLOOR_DESIGNS:
            how = {"gmean": "geometric mean", "median": "median", "min": "quickest"}[FLOOR_AGGREGATE[self.design]]
            tail += f"; launch floor assumed: the training hosts' {how} ({add * 1e6:.0f} us per elementwise call)"
        what = "a GPU" if getattr(device, "family", "nvidia") in ("nvidia", "amd") else "a device"
        return f"{what} it was not fitted on: from its specs{tail} (`hetero profile` on it narrows this)"

    def host_overhead(self, op: str, dtype: str, device) -> float:
        """Seconds of host dispatch inside :meth:`predict`'s latency of ``op`` on ``device``.

        A latency here is what an isolated call measures: host dispatch + kernel. Inside a training
        step the host queues kernels ahead of the GPU, so the dispatch overlaps the previous kernels
        (:func:`hetero.predictor.optime.stream_time`). It is the op's launch floor (measured on a
        training device, else the floors' aggregate) minus :data:`KERNEL_MIN_S`; 0 for the
        ``ratio`` design, which has no floor."""
        fi = self._device_params(device, dtype)[5]
        if fi < 0:
            return 0.0
        return max(self._floor_tables[int(fi)][F.OP_POS[op]] - KERNEL_MIN_S, 0.0)

    def predict(self, op: str, dims: Mapping[str, float], dtype: str, device) -> float:
        """Latency in seconds of ``op`` with ``dims`` (B, M, N, K for linear/bmm; B, H otherwise)."""
        g = dims.get
        params = self._device_params(device, dtype)
        if params[0] != params[0] and F.FAMILY.get(op) == "gemm":   # no matrix peak in this dtype
            F.require_matrix_peak(device, dtype)
        key = (op, g("B"), g("M"), g("N"), g("K"), g("H"), dtype, params)
        return self._cached(key)

    def _predict_key(self, key) -> float:
        op, B, M, N, K, H, dtype, (P, Pv, BW, SM, L2, fi, tdp) = key
        e = F.dtype_bytes(dtype)
        family = F.FAMILY.get(op)
        if family is None:
            raise ValueError(f"unknown op '{op}' (known: {', '.join(F.OPS)})")
        if family not in self._scalar:
            raise ValueError(f"model has no '{family}' ensemble")
        floor = F.OVERHEAD_SCALE if fi < 0 else self._floor_tables[fi][F.OP_POS[op]]
        if family == "gemm":
            B, M, N, K = (float(v) if v else 1.0 for v in (B, M, N, K))
            f, troof = F.gemm_features(F.SCALAR, 1.0 if op == "bmm" else 0.0, B, M, N, K, e, P, BW, SM, L2, floor)
            if self.design == "floor_power":
                f = f + [math.log2(P / tdp), math.log2(tdp)]
        else:
            B, H = (float(v) if v else 1.0 for v in (B, H))
            oh = [0.0] * len(F.VECTOR_OPS)
            oh[F.OP_INDEX[op]] = 1.0
            f, troof = F.vector_features(F.SCALAR, oh, F.VEC_INPUTS[op], F.VEC_FLOPS[op], B, H, e, Pv, BW, SM, L2, floor)
        if fi >= 0:
            troof = troof + floor
        return troof * math.exp(self._scalar[family](f))

    def _matrix(self, family, ops, dims, dtypes, devices):
        """Features + base time (roofline, plus the floor in the "floor" design) for rows;
        ``dtypes``/``devices`` are per-row sequences."""
        n = len(ops)
        cols = {k: np.empty(n) for k in ("e", "P", "Pv", "BW", "SM", "L2", "fi", "tdp")}
        keys = {}
        for i, (dt, dev) in enumerate(zip(dtypes, devices)):
            k = (dt, id(dev))
            if k not in keys:
                keys[k] = (F.dtype_bytes(dt),) + self._device_params(dev, dt)
                if family == "gemm" and keys[k][1] != keys[k][1]:   # no matrix peak in this dtype
                    F.require_matrix_peak(dev, dt)
            for name, v in zip(("e", "P", "Pv", "BW", "SM", "L2", "fi", "tdp"), keys[k]):
                cols[name][i] = v
        if self.design in FLOOR_DESIGNS:
            table = np.array(self._floor_tables)
            pos = np.array([F.OP_POS[o] for o in np.asarray(ops)], dtype=np.int64)
            floor = table[cols["fi"].astype(np.int64), pos]
        else:
            floor = F.OVERHEAD_SCALE
        X, troof = F.build_matrix(family, ops, dims, cols["e"], cols["P"], cols["Pv"], cols["BW"], cols["SM"],
                                  cols["L2"], floor)
        if self.design == "floor_power" and family == "gemm":
            X = np.column_stack([X, np.log2(cols["P"] / cols["tdp"]), np.log2(cols["tdp"])])
        return X, (troof + floor if self.design in FLOOR_DESIGNS else troof)

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

    def with_device_floors(self, device, floors: Mapping[str, float]) -> "OpModel":
        """A light copy (sharing the fitted trees) that uses ``floors`` (op -> seconds, e.g. measured
        on the device by :mod:`.probes`) as the launch floors of ``device``; ops not in ``floors``
        keep what this model would use. The ``ratio`` design has no floors: returns ``self``."""
        if self.design not in FLOOR_DESIGNS:
            return self
        m = OpModel()
        m.ensembles, m.meta, m.design = self.ensembles, self.meta, self.design
        m._packed, m._scalar = self._packed, self._scalar
        fi = self._floor_index(device)
        known = self._floor_tables[fi]
        own = {o: float(floors.get(o, known[F.OP_POS[o]])) for o in F.OPS}
        m.floors = {"global": dict(self.floors.get("global", {})),
                    "devices": [{"name": "<measured>", "key": list(device_key(device)), "floors": own}]
                    + list(self.floors.get("devices", []))}
        m._prepare_floors()
        return m

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "design": self.design, "floors": self.floors,
                "meta": self.meta, "ensembles": self.ensembles}

    @classmethod
    def from_dict(cls, data: Mapping) -> "OpModel":
        if data.get("format") != FORMAT or int(data.get("version", -1)) not in READABLE_VERSIONS:
            raise ValueError(f"not a {FORMAT} v{'/'.join(map(str, READABLE_VERSIONS))} file")
        m = cls()
        m.design = str(data.get("design", "ratio"))
        if m.design not in DESIGNS:
            raise ValueError(f"unknown design '{m.design}'")
        fl = data.get("floors") or {"global": {}, "devices": []}
        m.floors = {"global": {str(o): float(v) for o, v in fl.get("global", {}).items()},
                    "devices": [{"name": str(e.get("name", "")), "key": [float(v) for v in e["key"]],
                                 "floors": {str(o): float(v) for o, v in e["floors"].items()}}
                                for e in fl.get("devices", [])]}
        m.meta = dict(data.get("meta", {}))
        m.ensembles = dict(data["ensembles"])
        m._prepare()
        return m

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OpModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


def device_key(device) -> tuple:
    """Identity of a device for its trained floors: (bandwidth, compute units, L2, clock)."""
    return (float(device.effective_memory_bandwidth), float(device.compute_units or 0),
            float(device.l2_cache or 0), float(device.clock or 0))


_AGGREGATES = {"gmean": lambda v: np.exp(np.mean(np.log(v))), "median": np.median, "min": np.min}


def _estimate_floors(rec: Records, devices: Mapping, aggregate: str = "gmean") -> dict:
    """Per (op, device) launch floor: the ``FLOOR_QUANTILE`` quantile of the measured latency
    (seconds); global per-op floor (for devices not trained on): the ``aggregate`` ("gmean",
    "median" or "min") over the devices that have the op."""
    per_dev = []
    for name in sorted(set(rec.device.tolist())):
        m = rec.device == name
        own = {op: float(np.quantile(rec.latency_ms[m & (rec.op == op)], FLOOR_QUANTILE)) * 1e-3
               for op in F.OPS if (m & (rec.op == op)).any()}
        per_dev.append({"name": name, "key": list(device_key(devices[name])), "floors": own})
    glob = {}
    for op in F.OPS:
        vals = [e["floors"][op] for e in per_dev if op in e["floors"]]
        if vals:
            glob[op] = float(_AGGREGATES[aggregate](vals))
    return {"global": glob, "devices": per_dev}


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
