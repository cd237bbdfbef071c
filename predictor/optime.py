"""Latency of one operator on one device: the learned model when it is there, else a roofline.

:func:`op_time` is the one place the predictor asks "how long does this kernel take". It uses
``hetero.predictor.opmodel.default_model()`` (a learned efficiency over the roofline, fitted on
measured GPU kernels) when that package and its shipped data import; otherwise
:func:`roofline_time`: max(FLOPs / (peak x 0.70), bytes / (bandwidth x 0.80)) plus a kernel launch
overhead of 5 us (accelerators) or 1 us (CPU) -- efficiencies typical of large cuBLAS GEMMs and
streaming kernels (a documented assumption, used only until the learned model is present).

For CPU-family devices (including emulated ``base: cpu`` devices) a model fitted on this
machine's ``hetero profile`` records, from ``hetero.predictor.profiles.local_op_model``, is used
when present (times the device's slowdown): see :func:`op_model_for`. It also carries the profile's
block probes: the ratio of the runtime's measured transformer block to the operator sum (framework
overhead and fused kernels on a CPU) and the measured AdamW step, which the cost model applies.
"""
from __future__ import annotations

import functools

from .ops import DTYPE_BYTES, GEMM_OPS, kernel_work

GEMM_EFFICIENCY = 0.70
MEMORY_EFFICIENCY = 0.80
LAUNCH_OVERHEAD = {"cpu": 1e-6}
DEFAULT_LAUNCH_OVERHEAD = 5e-6


def roofline_time(op: str, dims: dict, dtype: str, device) -> float:
    """Roofline with fixed efficiencies plus a launch overhead (seconds)."""
    flops, nbytes = kernel_work(op, dims, DTYPE_BYTES.get(dtype, 4))
    peak = device.matrix_flops(dtype) if op in GEMM_OPS else device.vector_flops(dtype)
    t = max(flops / (peak * GEMM_EFFICIENCY), nbytes / (device.effective_memory_bandwidth * MEMORY_EFFICIENCY))
    return t + LAUNCH_OVERHEAD.get(device.family, DEFAULT_LAUNCH_OVERHEAD)


class _Roofline:
    kind = "roofline"

    def predict(self, op, dims, dtype, device) -> float:
        return roofline_time(op, dims, dtype, device)


ROOFLINE = _Roofline()


@functools.lru_cache(maxsize=1)
def learned_model():
    """The shipped learned operator model, or None when it is not importable / has no data."""
    try:
        from .opmodel import default_model

        model = default_model()
        model.predict("linear", {"B": 1, "M": 64, "N": 64, "K": 64}, "fp32", _probe_device())
        return model
    except Exception:  # noqa: BLE001 - any failure means: use the roofline
        return None


def _probe_device():
    from hetero.specs.device import DeviceType

    return DeviceType(vendor="nvidia", memory=1e9, memory_bandwidth=1e12, peak_flops={"fp32": 1e13})


def catalog_model():
    """(model, kind) for devices described by their catalog numbers: learned if present, else roofline."""
    m = learned_model()
    return (m, "learned") if m is not None else (ROOFLINE, "roofline")


def op_time(op: str, dims: dict, dtype: str, device) -> float:
    """Seconds of one kernel ``op`` with ``dims`` on ``device`` (learned model, else roofline)."""
    return catalog_model()[0].predict(op, dims, dtype, device)


def op_cost(opm, op: str, dims: dict, dtype: str, device) -> tuple[float, float]:
    """(latency, host share) seconds of one kernel under op model ``opm``: the latency an isolated
    call measures, and how much of it is host dispatch (``opm.host_overhead``). The share is 0 for
    models whose latencies hold none (the roofline) and on CPU-family devices, where an op runs on
    the host itself, synchronously, whatever model predicts it."""
    t = opm.predict(op, dims, dtype, device)
    fn = getattr(opm, "host_overhead", None)
    if fn is None or device.family == "cpu":
        return t, 0.0
    return t, min(fn(op, dtype, device), t)


def kernel_cost(opm, o, dtype: str, device) -> tuple[float, float]:
    """:func:`op_cost` of the kernel :class:`~.ops.Op` ``o`` (``dtype``: the model's, unless ``o``
    names its own). A GEMM of a fused attention kernel (``o.fused``) moves only ``o.nbytes`` (its
    s x s operand stays on chip), where the operator model, which knows GEMMs whose operands all
    reach device memory, would charge that operand too: on an accelerator its device share is
    scaled by the roofline at ``o.nbytes`` over the roofline at the whole traffic. The scale is 1
    where the GEMM is compute-bound either way; it matters where bandwidth is scarce beside
    compute (bf16 tensor cores; docs/predictor.md). A CPU's profile
    model is left as it is: its block probes measure the runtime's own attention kernel."""
    op, dims = o.op, o.dims_dict()
    t, host = op_cost(opm, op, dims, o.dtype or dtype, device)   # the whole traffic
    if not o.fused or device.family == "cpu":
        return t, host
    dtype = o.dtype or dtype
    flops, full = kernel_work(op, dims, DTYPE_BYTES.get(dtype, 4))
    priced = getattr(opm, "roofline_device", None)   # a probed model prices with its measured scales
    priced = priced(op, dtype, device) if priced else device
    peak, bw = priced.matrix_flops(dtype), priced.effective_memory_bandwidth
    scale = max(flops / peak, o.nbytes / bw) / max(flops / peak, full / bw)
    return host + (t - host) * scale, host


def stream_split(costs, compute: float = 1.0, host_floor: float = 0.0) -> tuple[float, float]:
    """(host dispatch, device work) seconds of kernels given as ``(latency, host share)`` pairs:
    the sum of host shares (each at least ``host_floor``, the calibration's per-kernel dispatch
    time) and ``compute`` (the calibration's compute factor) x the sum of the device shares."""
    host = device = 0.0
    for t, d in costs:
        host += d if d > host_floor else host_floor
        device += t - d
    return host, device * compute


def stream_time(costs, compute: float = 1.0, host_floor: float = 0.0) -> float:
    """Seconds to run kernels in order on one stream, from their ``(latency, host share)`` pairs.

    The host dispatches kernels into the stream queue while the device runs earlier ones, so in a
    step (many repetitions of the same layer) the two overlap and the slower side sets the pace:
    ``max(host dispatch, device work)`` of :func:`stream_split` -- the throughput of a two-stage
    line with a deep queue (CUDA queues about a thousand launches). A sum of isolated latencies
    would count every launch's dispatch once more; that sum is what this returns when no host share
    is known."""
    host, device = stream_split(costs, compute, host_floor)
    return host if host > device else device


class _Scaled:
    """A local (profile) model on an emulated device that runs ``factor`` times slower. It has no
    host share: a CPU op runs on the host itself, synchronously."""

    kind = "profile"

    def __init__(self, model, factor: float):
        self.model, self.factor = model, factor

    @property
    def source_model(self):
        """The cached profile model wrapped (a new wrapper is made on each lookup)."""
        return self.model

    def predict(self, op, dims, dtype, device) -> float:
        return self.model.predict(op, dims, dtype, device) * self.factor

    def layer_ratio(self, model, mbs: int, seq: int) -> tuple[float, float]:
        """Measured block time / operator sum on this machine (dimensionless: the slowdown is in
        :meth:`predict` already); see :meth:`hetero.predictor.profiles.LocalOpModel.layer_ratio`."""
        fn = getattr(self.model, "layer_ratio", None)
        return fn(model, mbs, seq) if fn else (1.0, 1.0)

    def edge_ratio(self, model, mbs: int, seq: int) -> tuple[float, float]:
        fn = getattr(self.model, "edge_ratio", None)
        return fn(model, mbs, seq) if fn else (1.0, 1.0)

    def optimizer_time(self, params: float, hidden: int | None = None) -> float | None:
        """The measured optimizer step (gradient-norm pass + AdamW) over ``params`` parameters, times
        the slowdown (the runtime sleeps (k-1) x the measured optimizer step on an emulated device);
        None without probes."""
        fn = getattr(self.model, "optimizer_time", None)
        t = fn(params, hidden) if fn else None
        return None if t is None else t * self.factor


def op_model_for(device_name: str, device) -> tuple[object, str]:
    """(model with .predict(op, dims, dtype, device), provenance) for one device type.

    CPU-family devices use this machine's profile when ``hetero.predictor.profiles`` has one
    (their own, else the ``cpu`` one; times the device's slowdown; provenance ``profile``); an
    accelerator with a cached profile of its own (``hetero profile`` on it) uses the learned model
    pinned to it by that profile's probe shapes (``profile``); everything else uses the catalog
    numbers (``catalog``).
    """
    if device.family == "cpu":
        local = None
        try:
            from .profiles import local_op_model

            # an emulated device runs on this machine's CPU: its own profile if one was cached,
            # else the plain "cpu" one (the hardware it runs on); the slowdown is applied here
            for name in dict.fromkeys((device_name, "cpu")):
                local = local_op_model(name)
                if local is not None:
                    break
        except Exception:  # noqa: BLE001 - module not there yet, or no profile on this machine
            local = None
        if local is not None:
            return _Scaled(local, device.slowdown), "profile"
    else:
        probed = probed_model(device_name, device)
        if probed is not None:
            return probed, "profile"
    return catalog_model()[0], "catalog"


_PROBED: dict = {}


def probed_model(device_name: str, device):
    """The learned model pinned to an accelerator by the probe shapes of its cached profile
    (``hetero profile`` run on that device; :mod:`hetero.predictor.opmodel.probes`), or None when
    there is no such profile or it holds no probe. Reloaded when the file changes."""
    try:
        from .opmodel.probes import ProbedDevice
        from .opmodel.specs import Records
        from .profiles import ProfileError, cache_path, read_records

        path = cache_path(device_name)
        stamp = path.stat().st_mtime_ns
    except (ImportError, OSError):
        return None
    key = (str(path), id(device))
    hit = _PROBED.get(key)
    if hit and hit[0] == stamp:
        return hit[1]
    model = learned_model()
    if model is None:
        return None
    try:
        rows = [{"op": r.op, "device": r.device, "dtype": r.dtype, "latency_ms": r.latency_ms, **r.dims}
                for r in read_records(path)]  # the parsed values, not their 6-digit CSV text
        probed = ProbedDevice(model, device, Records.from_rows(rows))
    except (OSError, ProfileError, ValueError, KeyError):
        probed = None
    _PROBED[key] = (stamp, probed)
    return probed


__all__ = ["op_time", "op_cost", "kernel_cost", "stream_split", "stream_time", "roofline_time", "learned_model", "catalog_model", "op_model_for", "probed_model",
           "GEMM_EFFICIENCY", "MEMORY_EFFICIENCY"]
