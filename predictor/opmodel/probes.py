"""Device probes: calibrate the learned op model to one real device from about 20 micro-benchmarks.

Why. Leave-one-GPU-out on the NeuSight data shows that part of an operator's latency is a property
of the machine that no spec-sheet field explains (benchmarks/results/opmodel_lodo.json):
  - the launch floor of a tiny kernel is host + driver + framework dispatch, and differs per op and
    per machine (relu 31 us on the A100 host, 54 us on the P100 host, while gelu is 30 us on both);
  - the sustained fraction of the fp32 peak reached by large GEMMs ranges from 0.16 (P4, power
    limited) to 0.86 (V100), with no monotone relation to peak, TDP or bandwidth per FLOP.
Even the same GEMM shapes measured on the best-matching sibling GPU and scaled by the peak ratio
miss by 11-32% (linear). So a device you can touch is measured briefly, and the model, fitted on
other devices, is pinned to it by a handful of numbers, while the shape dependence (waves, tiles,
intensity, cache) still comes from the learned trees.

The probe set (:data:`PROBES`, fixed once; never chosen on a held-out device's errors):
  floor      each op at its smallest shape: the device's launch floor for that op;
  bandwidth  ``add`` over 2^24, 2^25 and 2^26 elements: one scale on the memory bandwidth;
  compute    linear cubes 512 / 1024 / 2048 and bmm (64 x) cubes 128 / 256 / 512: one scale on the
             matrix peak per GEMM op (linear and bmm use different kernels and differ per device).
Each scale is solved so that the median log error over its probes is zero (bisection; the model's
prediction decreases monotonically in the scale). ``hetero profile`` on an accelerator measures
the probe shapes along with its grid; :func:`calibrate` turns any profile records that hold them
(the nearest record to each probe shape) into a :class:`DeviceCalibration`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from . import features as F
from .model import OpModel, device_key
from .specs import as_records

FLOOR_SHAPES = {**{op: {"B": 1, "M": 16, "N": 16, "K": 16} for op in F.GEMM_OPS},
                **{op: {"B": 1, "H": 256} for op in F.VECTOR_OPS}}
BANDWIDTH_PROBES = [("add", {"B": 4096, "H": 4096}), ("add", {"B": 8192, "H": 4096}), ("add", {"B": 16384, "H": 4096})]
COMPUTE_PROBES = {"linear": [{"B": 1, "M": s, "N": s, "K": s} for s in (512, 1024, 2048)],
                  "bmm": [{"B": 64, "M": s, "N": s, "K": s} for s in (128, 256, 512)]}
PROBES: list[tuple[str, dict]] = ([(op, dict(d)) for op, d in FLOOR_SHAPES.items()] + BANDWIDTH_PROBES
                                  + [(op, dict(d)) for op, ds in COMPUTE_PROBES.items() for d in ds])
"""(op, dims) of every probe: 11 floors + 3 bandwidth + 6 compute = 20 measurements."""
PROBE_KINDS: list[str] = (["floor"] * len(FLOOR_SHAPES) + ["bandwidth"] * len(BANDWIDTH_PROBES)
                          + ["compute"] * sum(len(ds) for ds in COMPUTE_PROBES.values()))
"""What each entry of :data:`PROBES` measures, by position."""

MAX_SHAPE_DISTANCE = 1.0  # log2 units per dim: a record more than 2x off on average is not a probe
FLOOR_SHAPE_DISTANCE = 3.0


@dataclasses.dataclass(frozen=True)
class DeviceCalibration:
    """What the probes say about one device for one dtype."""

    floors: dict            # op -> seconds (measured launch floor)
    bandwidth_scale: float  # multiplies the datasheet memory bandwidth
    compute_scale: dict     # GEMM op -> multiplies the datasheet matrix peak
    n_probes: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def probe_rows(records, dtype: str = "fp32") -> dict[tuple[str, int], int]:
    """Index of the record nearest to each probe shape ((op, probe number) -> row), for the rows of
    ``dtype``; probes without a record within :data:`MAX_SHAPE_DISTANCE` are left out."""
    rec = as_records(records)
    out = {}
    for i, (op, target) in enumerate(PROBES):
        idx = np.flatnonzero((rec.op == op) & (rec.dtype == dtype) & (rec.latency_ms > 0))
        if len(idx) == 0:
            continue
        dist = np.zeros(len(idx))
        for k, v in target.items():
            col = np.nan_to_num(rec.dims[k][idx], nan=1.0)
            dist += np.abs(np.log2(np.maximum(col, 1.0) / v))
        j = int(np.argmin(dist))
        # a size probe must be within 2x per dim on average, a floor probe within 8x (any tiny shape)
        limit = (FLOOR_SHAPE_DISTANCE if PROBE_KINDS[i] == "floor" else MAX_SHAPE_DISTANCE) * len(target)
        if dist[j] <= limit:
            out[(op, i)] = int(idx[j])
    return out


def scaled_device(device, compute: float = 1.0, bandwidth: float = 1.0):
    """``device`` with its matrix peaks times ``compute`` and its memory bandwidth times ``bandwidth``."""
    return dataclasses.replace(device, peak_flops={k: v * compute for k, v in device.peak_flops.items()},
                               memory_bandwidth=device.memory_bandwidth * bandwidth)


SCALE_BOUNDS = (1 / 64, 8.0)
"""Where a probe scale is searched. A scale found at a bound is not pinned by its probes (they take
about as long whatever the peak: launch-bound shapes), so the compute scale is then left at 1."""


def _solve_scale(predict, measured: np.ndarray, lo: float = SCALE_BOUNDS[0], hi: float = SCALE_BOUNDS[1],
                 steps: int = 40) -> float:
    """The scale s in [lo, hi] where median(log(predict(s) / measured)) = 0 (bisection in log s;
    predictions fall as s grows). Clamped to the interval when no root lies inside it."""
    def err(s):
        return float(np.median(np.log(predict(s) / measured)))
    a, b = math.log(lo), math.log(hi)
    if err(lo) <= 0:
        return lo
    if err(hi) >= 0:
        return hi
    for _ in range(steps):
        mid = 0.5 * (a + b)
        if err(math.exp(mid)) > 0:
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


def calibrate(model: OpModel, device, records, dtype: str = "fp32") -> DeviceCalibration | None:
    """Fit a :class:`DeviceCalibration` of ``model`` to ``device`` from its probe records (profile
    records measured on the device; the nearest record to each probe shape is used). Returns None
    when the records hold no floor probe of ``dtype``."""
    rec = as_records(records)
    rows = probe_rows(rec, dtype)
    lat = rec.latency_ms * 1e-3
    floors = {op: float(lat[r]) for (op, i), r in rows.items() if PROBE_KINDS[i] == "floor"}
    if not floors:
        return None

    def subset(kind, only_op=None):
        idx = [r for (op, i), r in rows.items() if PROBE_KINDS[i] == kind and only_op in (None, op)]
        return rec.subset(np.array(idx, dtype=np.int64)) if idx else None

    def probed(bandwidth, compute):
        return ProbedOpModel(model, device, DeviceCalibration(floors, bandwidth, compute, len(rows)))

    sm = 1.0
    bw = subset("bandwidth")
    if bw is not None:
        sm = _solve_scale(lambda s: probed(s, {}).predict_records(bw), bw.latency_ms * 1e-3)
    sc = {}
    for gemm in COMPUTE_PROBES:
        g = subset("compute", gemm)
        if g is not None:
            scale = _solve_scale(lambda s, gemm=gemm: probed(sm, {gemm: s}).predict_records(g),
                                 g.latency_ms * 1e-3)
            if SCALE_BOUNDS[0] < scale < SCALE_BOUNDS[1]:
                sc[gemm] = scale
    return DeviceCalibration(floors, sm, sc, len(rows))


class ProbedOpModel:
    """The learned model pinned to one device by a :class:`DeviceCalibration`: the device's
    measured floors, its bandwidth times ``bandwidth_scale`` and its matrix peak times the GEMM
    op's ``compute_scale``. Same ``predict`` signature as :class:`OpModel` (``device`` ignored:
    this model answers for the one device it was calibrated on)."""

    kind = "probes"

    def __init__(self, model: OpModel, device, calibration: DeviceCalibration):
        self.device, self.calibration = device, calibration
        cal = calibration
        self._devices = {op: scaled_device(device, cal.compute_scale.get(op, 1.0), cal.bandwidth_scale)
                         for op in F.OPS}
        # every scaled variant shares the bandwidth scale, hence one floor key
        self._model = model.with_device_floors(self._devices[F.OPS[0]], cal.floors)

    def predict(self, op: str, dims: Mapping[str, float], dtype: str, device=None) -> float:
        return self._model.predict(op, dims, dtype, self._devices[op])

    def host_overhead(self, op: str, dtype: str, device=None) -> float:
        """Host dispatch inside :meth:`predict`'s latency (the measured floor minus a kernel's
        minimum; see :meth:`OpModel.host_overhead`)."""
        return self._model.host_overhead(op, dtype, self._devices[op])

    def roofline_device(self, op: str, dtype: str, device=None):
        """The device whose peak and bandwidth :meth:`predict` prices ``op`` with (the probed scales)."""
        return self._devices[op]

    def predict_records(self, records) -> np.ndarray:
        """Seconds for each row of ``records`` (their device column is ignored)."""
        rec = as_records(records)
        out = np.empty(len(rec))
        for op in np.unique(rec.op):
            m = rec.op == op
            sub = rec.subset(m)
            out[m] = self._model.predict_many(str(op), sub.dims, list(sub.dtype), self._devices[str(op)])
        return out


class ProbedDevice:
    """One device's probed models, per dtype, from its profile records (what the predictor uses for
    an accelerator that ``hetero profile`` measured). A dtype with its own probes gets its own
    calibration; a dtype without probes takes the calibration of a probed dtype of the same element
    size and the same datasheet peaks (bf16 and fp16 on tensor cores that run both at one rate),
    else the measured launch floors of the fp32 (else first) calibration with the datasheet peaks,
    since floors are host-side and peaks are per dtype."""

    kind = "probes"

    def __init__(self, model: OpModel, device, records):
        rec = as_records(records)
        self.calibrations = {}
        for dt in sorted(set(rec.dtype.tolist())):
            cal = calibrate(model, device, rec, dt)
            if cal is not None:
                self.calibrations[dt] = cal
        if not self.calibrations:
            raise ValueError("the records hold no probe shape (run `hetero profile` on the device)")
        self._device = device
        first = self.calibrations.get("fp32") or next(iter(self.calibrations.values()))
        self._fallback = ProbedOpModel(model, device, DeviceCalibration(first.floors, 1.0, {}, 0))
        self._models = {dt: ProbedOpModel(model, device, c) for dt, c in self.calibrations.items()}

    def _model_for(self, dtype: str) -> ProbedOpModel:
        hit = self._models.get(dtype)
        if hit is None:
            twin = self._twin(dtype)
            hit = self._models[dtype] = self._models[twin] if twin else self._fallback
        return hit

    def _twin(self, dtype: str) -> str | None:
        """A probed dtype of the same element size and the same matrix and vector peaks (fp16 and bf16
        on tensor cores that run both at one rate): the same units, so the same calibration."""
        peaks, vec = self._device.peak_flops, self._device.peak_flops_vector
        for dt in self.calibrations:
            try:
                same_size = F.dtype_bytes(dt) == F.dtype_bytes(dtype)
            except ValueError:
                continue
            # the datasheet's own entries, not the fp32 fallbacks of matrix_flops / vector_flops
            if (same_size and dt in peaks and dtype in peaks and peaks[dt] == peaks[dtype]
                    and vec.get(dt) == vec.get(dtype)):
                return dt
        return None

    def predict(self, op: str, dims: Mapping[str, float], dtype: str, device=None) -> float:
        return self._model_for(dtype).predict(op, dims, dtype)

    def host_overhead(self, op: str, dtype: str, device=None) -> float:
        return self._model_for(dtype).host_overhead(op, dtype)

    def roofline_device(self, op: str, dtype: str, device=None):
        return self._model_for(dtype).roofline_device(op, dtype)

    def accuracy_note(self, device=None) -> str:
        """For the predictor's provenance: which dtypes the profile's probes pinned."""
        return (f"learned model pinned by this GPU's profile probes ({', '.join(self.calibrations)}; a dtype "
                f"with the same datasheet peak as one of these shares its calibration, others keep the measured "
                f"launch floors and the datasheet peaks)")


__all__ = ["BANDWIDTH_PROBES", "COMPUTE_PROBES", "DeviceCalibration", "FLOOR_SHAPES", "PROBES", "PROBE_KINDS", "ProbedDevice",
           "ProbedOpModel", "calibrate", "probe_rows", "scaled_device"]
