"""This machine's operator profile: the record format, the per-device cache, and the latency model fitted on it.

``hetero profile`` (:mod:`hetero.measure.profiling`) times the operators of a transformer layer on
the local device and writes profile records (docs/formats.md: ``op,device,B,M,N,K,H,latency_ms,dtype``).
The records are cached per device at ``$HETERO_CACHE_DIR/profiles/<device>.csv`` (default
``~/.cache/hetero/profiles/<device>.csv``); :func:`local_op_model` fits a small latency model on that
cache, which the predictor uses for cpu-family devices (emulated ``base: cpu`` devices included;
their ``slowdown`` is the predictor's business, this model answers for the real local hardware).

The model (:class:`LocalOpModel`) is deliberately simple and robust, because a CPU profile holds a
few hundred rows, not the tens of thousands a learned cross-device model needs. Per (op, dtype) it
stores ``r = log(measured / reference roofline)`` (the log inefficiency against fixed reference
rates) together with a point in a small log feature space (GEMMs: work and arithmetic intensity;
vector ops: element count and row length), and predicts by inverse-distance weighting of the
nearest measured points. Inside the grid this interpolates; outside it holds the efficiency of the
nearest measured shapes constant, i.e. time scales with the work, which is the right asymptote for
large operators and never produces the wild values a polynomial fit extrapolates to.

Block probes (CPU). The operator sum misses what a real training step on a CPU spends around and
between the kernels (dispatch, fused kernels, gradient accumulation), so a CPU profile also holds
timings of the runtime's own transformer block and AdamW step at a few shapes, stored next to the
records in ``<device>.meta.json`` (with the thread count and the load average during the profile).
:meth:`LocalOpModel.layer_ratio` (and :meth:`~LocalOpModel.edge_ratio`
for the embedding and head) is the measured block time over the operator-sum prediction at the nearest probes (interpolated in log hidden size and log rows), which
the predictor multiplies into its per-layer times; :meth:`LocalOpModel.optimizer_time` is the
measured gradient-norm pass + AdamW seconds per parameter, interpolated in log(parameters). Both come from the machine, never from a
particular benchmark.

No torch import here (measuring lives in :mod:`hetero.measure.profiling`): loading the model only
reads the CSV (and its JSON sidecar), so predicting stays fast and works on a login node.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from hetero.errors import HeteroError

from .ops import DTYPE_BYTES, GEMM_OPS, VECTOR_OPS, kernel_work

COLUMNS = ("op", "device", "B", "M", "N", "K", "H", "latency_ms", "dtype")
DIMS = ("B", "M", "N", "K", "H")
OPS = GEMM_OPS + VECTOR_OPS
"""Profiled operators, in the order ``hetero profile`` measures them (the vocabulary of ``ops``)."""

# Fixed reference rates: only a normaliser for the stored inefficiency, not a claim about the device.
REF_FLOPS = 1e12
REF_BANDWIDTH = 50e9
RUNTIME_ADAMW_KERNEL = "fused"
"""The AdamW kernel the runtime runs on a CPU (hetero.runtime.grads.optimizer_kernel; named here so
the predict path needs no torch). Block probes record the kernel they timed; others are ignored."""


def times_runtime_adamw(block: Mapping) -> bool:
    """Whether a block probe timed the AdamW kernel the runtime runs (:data:`RUNTIME_ADAMW_KERNEL`)."""
    return block.get("adamw_kernel") == RUNTIME_ADAMW_KERNEL


# --------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    """``$HETERO_CACHE_DIR/profiles`` (default ``~/.cache/hetero/profiles``)."""
    return Path(cache_dir_str())


def cache_dir_str() -> str:
    """:func:`cache_dir` as a string, memoised on the environment it reads (the predictor asks on
    every cost model it builds whether a profile was written meanwhile)."""
    return _cache_dir_for(os.environ.get("HETERO_CACHE_DIR"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=16)
def _cache_dir_for(root: str | None, home: str | None) -> str:
    # ``home`` only keys the memo: expanduser reads $HOME itself
    base = os.path.expanduser(root) if root else os.path.join(os.path.expanduser("~"), ".cache", "hetero")
    return os.path.join(base, "profiles")


def safe_name(device_name: str) -> str:
    """A device name usable as a file name (``NVIDIA A100-SXM4-80GB`` -> ``NVIDIA_A100-SXM4-80GB``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name).strip("_") or "device"


def cache_path(device_name: str = "cpu") -> Path:
    """The cached profile CSV of ``device_name`` (see :func:`cache_dir`)."""
    return cache_dir() / f"{safe_name(device_name)}.csv"


def meta_path(records_path) -> Path:
    """The JSON sidecar of a profile CSV (thread count, load, block probes): ``<name>.meta.json``."""
    p = Path(records_path)
    return p.with_name(p.stem + ".meta.json")


def read_meta(records_path) -> dict:
    """The sidecar of ``records_path`` ({} when there is none or it is unreadable)."""
    try:
        data = json.loads(meta_path(records_path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_meta(records_path, meta: dict) -> Path:
    """Write the JSON sidecar of ``records_path`` atomically."""
    from hetero.specs.io import write_text_atomic

    path = meta_path(records_path)
    write_text_atomic(path, json.dumps(meta, indent=1))
    return path


# --------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Record:
    """One measured operator: ``dims`` holds only the dimensions that apply to ``op``."""

    op: str
    device: str
    dims: dict = field(hash=False)
    latency_ms: float
    dtype: str = "fp32"

    def row(self) -> dict:
        """The CSV row of this record (empty cells for dimensions that do not apply)."""
        out = {"op": self.op, "device": self.device, "latency_ms": f"{self.latency_ms:.6g}", "dtype": self.dtype}
        for d in DIMS:
            v = self.dims.get(d)
            out[d] = "" if v is None else str(int(v))
        return out


class ProfileError(HeteroError, ValueError):
    """A profile CSV that does not follow the record format (names the file, row and column)."""


def records_to_csv(records: Iterable[Record]) -> str:
    """Records as CSV text (header ``COLUMNS``)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow(r.row())
    return buf.getvalue()


def write_records(path, records: Iterable[Record]) -> Path:
    """Write records as CSV atomically (temporary file + rename)."""
    from hetero.specs.io import write_text_atomic

    path = Path(path)
    write_text_atomic(path, records_to_csv(records))
    return path


def read_records(path) -> list[Record]:
    """Read a profile CSV; raises :class:`ProfileError` naming the file, row and column."""
    path = Path(path)
    out: list[Record] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        for col in ("op", "device", "latency_ms"):
            if col not in header:
                raise ProfileError(f"{path}: missing column '{col}' (columns: {', '.join(COLUMNS)})")
        for i, row in enumerate(reader, start=2):
            op = (row.get("op") or "").strip()
            if op not in OPS:
                raise ProfileError(f"{path}, row {i}, column 'op': unknown op '{op}' (known: {', '.join(OPS)})")
            dims = {}
            for d in DIMS:
                text = (row.get(d) or "").strip()
                if text:
                    try:
                        dims[d] = float(text)
                    except ValueError:
                        raise ProfileError(f"{path}, row {i}, column '{d}': '{text}' is not a number") from None
            try:
                lat = float(row["latency_ms"])
            except (TypeError, ValueError):
                raise ProfileError(f"{path}, row {i}, column 'latency_ms': '{row.get('latency_ms')}' is not a number") from None
            dtype = (row.get("dtype") or "fp32").strip() or "fp32"
            out.append(Record(op, (row.get("device") or "").strip(), dims, lat, dtype))
    return out


# --------------------------------------------------------------------------------------- block probes
def probe_model_dict(probe: Mapping, attention: str = "unfused") -> dict:
    """The model file of a block probe, its attention costed as ``attention`` says."""
    return {"name": f"probe-{probe['architecture']}-{probe['hidden_size']}", "architecture": probe["architecture"],
            "num_layers": int(probe.get("num_layers") or 1), "hidden_size": int(probe["hidden_size"]),
            "num_attention_heads": int(probe["num_attention_heads"]),
            "vocab_size": int(probe.get("vocab_size") or 1024), "seq_length": int(probe["seq_length"]),
            "dtype": "fp32", "attention": attention}


def moe_probe_model_dict(probe: Mapping) -> dict:
    """The model file of an MoE probe: one MoE layer of ``num_experts`` routed experts, top-``top_k``."""
    return {**probe_model_dict({**probe, "num_layers": 1}), "name": f"probe-moe-{probe['architecture']}",
            "moe": {"num_experts": int(probe["num_experts"]), "top_k": int(probe["top_k"]),
                    "expert_ffn_hidden_size": int(probe["expert_ffn_hidden_size"])}}


# --------------------------------------------------------------------------------------- the model
def _features(op: str, dims: Mapping, elem_bytes: int) -> tuple[tuple[float, ...], float]:
    """(point in feature space, log reference roofline seconds)."""
    flops, nbytes = kernel_work(op, dims, elem_bytes)
    log_roof = math.log(max(flops / REF_FLOPS, nbytes / REF_BANDWIDTH))
    if op in GEMM_OPS:
        # size and arithmetic intensity; log2 so one grid step ~ 1 unit
        return (math.log2(flops), math.log2(flops / nbytes)), log_roof
    n, h = float(dims.get("B") or 1) * float(dims.get("H") or 1), float(dims.get("H") or 1)
    return (math.log2(n), 0.5 * math.log2(h)), log_roof


class LocalOpModel:
    """Operator latency on this machine, from its profile records (see the module docstring)."""

    def __init__(self, records: Iterable[Record], source: str = "<records>", k: int = 4,
                 meta: Mapping | None = None):
        self.source = source
        self.k = k
        self.meta = dict(meta or {})
        self.threads = self.meta.get("threads")
        self.blocks = [b for b in self.meta.get("blocks") or []
                       if all(float(b.get(key) or 0) > 0 for key in ("forward_ms", "backward_ms", "hidden_size",
                                                                    "micro_batch_size", "seq_length"))]
        self.moe_blocks = [b for b in self.meta.get("moe_blocks") or []
                           if all(float(b.get(key) or 0) > 0 for key in ("forward_ms", "backward_ms", "hidden_size",
                                                                        "seq_length", "num_experts"))]
        """The MoE layer probes (``hetero profile``; :func:`hetero.predictor.moe.moe_ratio` fits them)."""
        self.decode_dispatch = _dispatch_table(self.meta.get("decode_dispatch"))
        """Generation's host figures measured with the profile (:mod:`hetero.measure.decode_floor`), or None."""
        self.loopback = loopback_table(self.meta.get("loopback"))
        """The runtime's small-message costs between two processes of this machine, measured with the
        profile (:mod:`hetero.measure.loopback`): ``{"p2p_s", "allreduce_s"}``, or None."""
        self._ratios: dict[str, list] = {}
        self.points: dict[tuple[str, str], list[tuple[tuple[float, ...], float]]] = {}
        self.devices: set[str] = set()
        n = 0
        for r in records:
            if r.op not in OPS or not (r.latency_ms > 0):
                continue
            e = DTYPE_BYTES.get(r.dtype, 4)
            x, log_roof = _features(r.op, r.dims, e)
            self.points.setdefault((r.op, r.dtype), []).append((x, math.log(r.latency_ms * 1e-3) - log_roof))
            self.devices.add(r.device)
            n += 1
        self.num_records = n
        if not n:
            raise ProfileError(f"{source}: no usable profile records")
        self._memo: dict = {}

    def __repr__(self) -> str:
        return f"LocalOpModel({self.num_records} records from {self.source})"

    def _pool(self, op: str, dtype: str):
        """The measured points for (op, dtype), with documented fallbacks when they are missing:
        another dtype of the same op (CPUs rarely run half precision faster), then the op's family."""
        for key in ((op, dtype), (op, "fp32")):
            if key in self.points:
                return self.points[key], key[1]
        for (o, dt), pts in self.points.items():
            if o == op:
                return pts, dt
        family = GEMM_OPS if op in GEMM_OPS else VECTOR_OPS
        pool = [p for (o, dt), pts in self.points.items() if o in family for p in pts]
        if pool:
            return pool, dtype
        pool = [p for pts in self.points.values() for p in pts]
        return pool, dtype

    def predict(self, op: str, dims: Mapping, dtype: str = "fp32", device=None) -> float:
        """Seconds for one ``op`` with ``dims`` on the profiled hardware. ``device`` is accepted for
        the op-model interface and ignored: emulation slowdowns are applied by the predictor."""
        if op not in OPS:
            raise ValueError(f"unknown op '{op}' (known: {', '.join(OPS)})")
        key = (op, dtype, *(float(dims.get(d) or 0.0) for d in DIMS))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pts, used_dtype = self._pool(op, dtype)
        x, log_roof = _features(op, dims, DTYPE_BYTES.get(used_dtype, 4))
        ds = sorted((math.dist(x, p), r) for p, r in pts)[: self.k]
        if ds[0][0] < 1e-9:
            r = ds[0][1]
        else:
            w = [1.0 / (d * d) for d, _ in ds]
            r = sum(wi * ri for wi, (_, ri) in zip(w, ds)) / sum(w)
        out = math.exp(log_roof + r)
        if len(self._memo) > 100_000:
            self._memo.clear()
        self._memo[key] = out
        return out


    # ---------------------------------------------------------------- block probes
    def _block_sums(self, model, b: int, s: int) -> tuple[float, float, float, float]:
        """This model's operator-sum predictions (seconds) of one layer's forward and backward and of
        the edges' (embedding + final norm + head + loss) forward and backward, at ``b`` x ``s`` rows."""
        from .ops import (embedding_backward_ops, embedding_forward_ops, head_backward_ops, head_forward_ops,
                          layer_backward_ops, layer_forward_ops)

        key = ("sums", model, b, s)
        hit = self._memo.get(key)
        if hit is None:
            t = lambda ops: sum(self.predict(o.op, o.dims_dict()) for o in ops)  # noqa: E731
            hit = self._memo[key] = (
                t(layer_forward_ops(model, b, s, 1, "fp32")), t(layer_backward_ops(model, b, s, 1, "none", "fp32")),
                t(embedding_forward_ops(model, b, s, 1, "fp32") + head_forward_ops(model, b, s, 1, "fp32")),
                t(embedding_backward_ops(model, b, s, 1, "fp32") + head_backward_ops(model, b, s, 1, "fp32")))
        return hit

    def _probe_ratios(self, attention: str = "unfused") -> list:
        """Per probe: (architecture, point, forward, backward, edge pairs or None), each a pair
        (measured seconds, this model's operator-sum prediction at the probe's shape; edges: embedding
        + final norm + head + loss), the operators decomposed with ``attention`` as the model the
        correction is applied to is, so the corrected sum is the measured block either way."""
        if attention not in self._ratios:
            from hetero.specs.model import load_model

            out = []
            for pb in self.blocks:
                try:
                    spec = load_model(probe_model_dict(pb, attention))
                except Exception:  # noqa: BLE001 - a probe we cannot rebuild is skipped
                    continue
                b, s = int(pb["micro_batch_size"]), int(pb["seq_length"])
                of, ob, ef, eb = self._block_sums(spec, b, s)
                if of > 0 and ob > 0:
                    edges = None
                    if float(pb.get("edges_forward_ms") or 0) > 0 and float(pb.get("edges_backward_ms") or 0) > 0:
                        edges = ((pb["edges_forward_ms"] * 1e-3, ef), (pb["edges_backward_ms"] * 1e-3, eb))
                    out.append((pb["architecture"], self._probe_point(spec.hidden_size, b * s),
                                (pb["forward_ms"] * 1e-3, of), (pb["backward_ms"] * 1e-3, ob), edges))
            self._ratios[attention] = out
        return self._ratios[attention]

    @staticmethod
    def _probe_point(hidden: float, rows: float) -> tuple[float, float]:
        return (math.log2(max(hidden, 1.0)), math.log2(max(rows, 1.0)))

    @staticmethod
    def _fixed_part(pairs: list[tuple[float, float]]) -> float:
        """Seconds a block spends whatever its operators' sizes (Python, module and autograd dispatch
        around a fixed number of kernels): the intercept of measured = fixed + k x operator sum over
        the probes, fitted in relative error, at least 0 and at most 0.9 of the smallest measured
        block (0 with fewer than two probes: then the correction is a ratio alone)."""
        if len(pairs) < 2:
            return 0.0
        # least squares of (c + k x_i) / y_i = 1: the normal equations of the 2 x 2 system
        a11 = sum(1 / (y * y) for y, _ in pairs)
        a12 = sum(x / (y * y) for y, x in pairs)
        a22 = sum(x * x / (y * y) for y, x in pairs)
        b1 = sum(1 / y for y, _ in pairs)
        b2 = sum(x / y for y, x in pairs)
        det = a11 * a22 - a12 * a12
        if det <= 0:
            return 0.0
        c = (b1 * a22 - b2 * a12) / det
        return min(max(c, 0.0), 0.9 * min(y for y, _ in pairs))

    def _ratio(self, which: str, model, mbs: int, seq: int) -> tuple[float, float]:
        key = (which, model, mbs, seq)   # every field can move the model's operator sum
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pts = self._probe_ratios(model.attention)
        if which == "edges":
            pts = [(a, x, e[0], e[1]) for a, x, _, _, e in pts if e is not None]
        else:
            pts = [(a, x, f, b) for a, x, f, b, _ in pts]
        same = [p for p in pts if p[0] == model.architecture] or pts
        if not same:
            out = (1.0, 1.0)
        else:
            sums = self._block_sums(model, mbs, seq)
            sums = sums[2:] if which == "edges" else sums[:2]
            x = self._probe_point(model.hidden_size, mbs * seq)
            ds = sorted((math.dist(x, p[1]), i) for i, p in enumerate(same))[:3]
            out = []
            for d in (2, 3):   # forward, backward
                fixed = self._fixed_part([p[d] for p in same])
                r = [(same[i][d][0] - fixed) / same[i][d][1] for _, i in ds]
                if ds[0][0] < 1e-9:
                    ratio = r[0]
                else:
                    w = [1.0 / (dist * dist) for dist, _ in ds]
                    ratio = sum(wi * ri for wi, ri in zip(w, r)) / sum(w)
                own = sums[d - 2]
                out.append((fixed + ratio * own) / own if own > 0 else ratio)
            out = tuple(out)
        self._memo[key] = out
        return out

    def layer_ratio(self, model, mbs: int, seq: int) -> tuple[float, float]:
        """(forward, backward) multipliers from the operator sum of one layer of ``model`` to the
        runtime's measured block time. The block probes of the same architecture (any architecture
        when none) say it as fixed + k x operator sum: the fixed seconds fitted over all of them
        (:meth:`_fixed_part`: dispatch that does not shrink with the operators, which matters for
        small models), k by inverse-distance weighting of the nearest probes in (log2 hidden, log2
        rows); returned as one multiplier of ``model``'s own operator sum. (1, 1) without probes."""
        return self._ratio("layer", model, mbs, seq)

    def edge_ratio(self, model, mbs: int, seq: int) -> tuple[float, float]:
        """The same for the stage edges (embedding; final norm + head + loss)."""
        return self._ratio("edges", model, mbs, seq)

    def optimizer_time(self, params: float, hidden: int | None = None) -> float | None:
        """Seconds of the runtime's optimizer step over ``params`` parameters, the gradient-norm pass
        and AdamW: the block probes' measured seconds per parameter, interpolated in log(parameters)
        (the rate grows once the optimizer state leaves the caches), held constant beyond the probes;
        None without probes, or when they timed another AdamW kernel than the runtime's (a profile
        written before the runtime took the fused kernel: ``hetero profile`` again). A probe written
        before profiles timed the norm pass has it estimated from its AdamW time by bytes read
        (GRAD_NORM_BYTES_PER_PARAM of the step's OPTIMIZER_BYTES_PER_PARAM). ``hidden`` is accepted
        for the interface and unused."""
        from .ops import GRAD_NORM_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM

        def seconds(b):
            adamw = float(b["adamw_ms"]) * 1e-3
            norm = b.get("grad_norm_ms")
            norm = float(norm) * 1e-3 if norm is not None else adamw * GRAD_NORM_BYTES_PER_PARAM / OPTIMIZER_BYTES_PER_PARAM
            return adamw + norm

        pts = sorted((float(b["params"]), seconds(b) / float(b["params"]))
                     for b in self.blocks if float(b.get("adamw_ms") or 0) > 0 and float(b.get("params") or 0) > 0
                     and times_runtime_adamw(b))
        if not pts or params <= 0:
            return None
        # one rate per distinct size (probes of the same size: their mean)
        merged: dict[float, list[float]] = {}
        for n, r in pts:
            merged.setdefault(n, []).append(r)
        xs = sorted(merged)
        rates = [sum(merged[n]) / len(merged[n]) for n in xs]
        if params <= xs[0]:
            rate = rates[0]
        elif params >= xs[-1]:
            rate = rates[-1]
        else:
            i = next(k for k in range(1, len(xs)) if xs[k] >= params)
            t = (math.log(params) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
            rate = rates[i - 1] + t * (rates[i] - rates[i - 1])
        return float(params) * rate


def loopback_table(raw) -> dict | None:
    """A sidecar's ``loopback`` when it holds both figures as positive numbers under a second, else
    None (an older or damaged sidecar)."""
    try:
        out = {k: float(raw[k]) for k in ("p2p_s", "allreduce_s")}
    except (TypeError, KeyError, ValueError):
        return None
    return out if all(0 < v < 1.0 for v in out.values()) else None


def _dispatch_table(raw) -> dict | None:
    """A sidecar's ``decode_dispatch`` when it holds every figure generation reads (non-negative
    numbers, per architecture where per layer), else None (an older or damaged sidecar)."""
    try:
        flat = ("decode_per_step_s", "per_row_s", "prefill_per_row_s")
        per_layer = ("decode_per_layer_s", "prefill_per_layer_s")
        out = {k: float(raw[k]) for k in flat}
        out.update({k: {a: float(v) for a, v in raw[k].items()} for k in per_layer})
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    values = [*(out[k] for k in flat), *(v for k in per_layer for v in out[k].values())]
    if not all(v >= 0 and v == v for v in values) or not all(out[k] for k in per_layer):
        return None
    return out


_LOADED: dict[str, tuple[float, LocalOpModel]] = {}


def load_local_model(path) -> LocalOpModel:
    """A :class:`LocalOpModel` on the records at ``path`` and their sidecar."""
    return LocalOpModel(read_records(path), source=str(path), meta=read_meta(path))


def local_op_model(device_name: str = "cpu", fallback: str | None = "cpu") -> LocalOpModel | None:
    """The latency model fitted on this machine's cached profile of ``device_name``, or None when no
    profile was cached (run ``hetero profile``) or the cache is unreadable. Reloaded when the file
    changes. A device type without its own profile uses ``fallback``'s: emulated ``base: cpu``
    devices (``cpu-slow``, ...) run on this CPU, so its ``cpu`` profile describes them (the
    predictor applies their slowdown)."""
    path = cache_path(device_name)
    try:
        mtime = path.stat().st_mtime_ns
        try:
            mtime = (mtime, meta_path(path).stat().st_mtime_ns)
        except OSError:
            mtime = (mtime, None)
    except OSError:
        if fallback and fallback != device_name:
            return local_op_model(fallback, None)
        return None
    hit = _LOADED.get(str(path))
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        model = load_local_model(path)
    except (OSError, ProfileError):
        return None
    _LOADED[str(path)] = (mtime, model)
    return model


__all__ = ["COLUMNS", "LocalOpModel", "ProfileError", "Record", "cache_dir", "cache_path", "local_op_model", "loopback_table",
           "meta_path", "probe_model_dict", "read_meta", "read_records", "records_to_csv", "times_runtime_adamw",
           "write_meta", "write_records"]
