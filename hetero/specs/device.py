"""Device types: the numbers the predictor needs about one accelerator, and the catalog of them.

A device type is defined in the built-in catalog (``configs/devices.yaml``) or under a cluster
file's ``devices:``. An entry may inherit another with ``base:`` and override some fields; the
emulation idiom is ``{base: cpu, vendor: emu-b, slowdown: 2.0}``: a CPU device with its own vendor
tag (so it gets its own process group) that computes ``slowdown`` times slower.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources

import yaml

from .errors import Problems, SpecError, did_you_mean, join_path
from .schema import is_missing, load_dataclass, quantity

# Vendor families with a real backend. Other tags are allowed only for CPU-emulated devices.
VENDORS = ("nvidia", "amd", "ascend", "intel", "cpu", "other")
DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")


MAX_SLOWDOWN = 1000.0
"""Largest emulation slowdown a device may declare."""


@dataclass(frozen=True)
class DeviceType:
    """One accelerator type: compute, memory and link figures, each traceable to a source."""

    vendor: str
    """nvidia | amd | ascend | intel | cpu | other, or an emulation tag for ``base: cpu`` devices."""
    memory: float = quantity("bytes")
    """Device memory (bytes)."""
    memory_bandwidth: float = quantity("bandwidth")
    """Peak device-memory bandwidth (bytes/s)."""
    peak_flops: dict[str, float] = field(default_factory=dict, metadata={"kind": "flops"})
    """Dense matrix-unit peak per dtype (FLOP/s), e.g. {bf16: 312 TFLOPS}; inherited entries merge per dtype."""
    peak_flops_vector: dict[str, float] = field(default_factory=dict, metadata={"kind": "flops"})
    """Non-matrix (elementwise) peak per dtype (FLOP/s); defaults to the matrix peak's fp32 value."""
    compute_units: int | None = None
    """Streaming multiprocessors / compute units / AI cores (used for wave quantisation)."""
    l2_cache: float | None = quantity("bytes", None)
    """Last-level on-chip cache (bytes)."""
    clock: float | None = quantity("frequency", None)
    """Boost clock (Hz)."""
    link_bandwidth: float | None = quantity("bandwidth", None)
    """Typical scale-up link bandwidth per direction (NVLink, Infinity Fabric, HCCS), bytes/s."""
    tdp: float | None = quantity("power", None)
    """Board power (W)."""
    price_per_hour: float | None = None
    """Indicative cloud price in USD per device-hour (for cost objectives; not a quote)."""
    base: str | None = None
    """Inherit every field of this device type, then apply the ones given here."""
    slowdown: float = 1.0
    """Emulation: the device computes for real, then waits (slowdown - 1) x the compute time."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each figure comes from: field name -> datasheet or paper."""
    notes: str = ""

    def _check(self, path: str, problems: Problems) -> None:
        if self.memory <= 0:
            problems.add(join_path(path, "memory"), "must be positive", "give the device memory, e.g. '80 GiB'")
        if self.memory_bandwidth <= 0:
            problems.add(join_path(path, "memory_bandwidth"), "must be positive", "e.g. '2 TB/s'")
        if not self.peak_flops:
            problems.add(join_path(path, "peak_flops"), "needs at least one dtype", "e.g. {fp32: 19.5 TFLOPS}")
        for table in ("peak_flops", "peak_flops_vector"):
            for dtype, value in getattr(self, table).items():
                where = join_path(join_path(path, table), dtype)
                if dtype not in DTYPES:
                    problems.add(where, f"unknown dtype '{dtype}'", did_you_mean(dtype, DTYPES))
                elif not value >= 1e6:  # also catches a unit left out: '19.5' instead of '19.5 TFLOPS'
                    problems.add(where, f"must be at least 1 MFLOP/s, got {value:g} FLOP/s",
                                 "give the peak with its unit, e.g. 19.5 TFLOPS")
        if self.slowdown < 1.0:
            problems.add(join_path(path, "slowdown"), f"must be >= 1, got {self.slowdown}",
                         "a slowdown of k makes the device k times slower")
        elif self.slowdown > MAX_SLOWDOWN:
            # the emulated device really waits (k - 1) x its compute time: beyond this a launch
            # waits for hours, and huge values overflow the predicted times
            problems.add(join_path(path, "slowdown"), f"must be at most {MAX_SLOWDOWN:g}, got {self.slowdown:g}",
                         "a slowdown of k makes the device k times slower; today's GPUs differ by under 100x")
        if self.compute_units is not None and self.compute_units <= 0:
            problems.add(join_path(path, "compute_units"), "must be positive",
                         "give the SM / CU / AI-core count from the datasheet, or leave it out")
        if self.clock is not None and self.clock <= 0:
            problems.add(join_path(path, "clock"), "must be positive", "e.g. 1.41 GHz, or leave it out")

    @property
    def is_emulated(self) -> bool:
        """True for CPU devices that stand in for an accelerator (own vendor tag or a slowdown)."""
        return self.family == "cpu" and (self.vendor != "cpu" or self.slowdown != 1.0)

    @property
    def family(self) -> str:
        """The vendor family whose backend runs this device (an emulation tag maps to ``cpu``)."""
        return self.vendor if self.vendor in VENDORS else "cpu"

    def matrix_flops(self, dtype: str) -> float:
        """Peak matrix FLOP/s for ``dtype`` (fp32 falls back to tf32; slowdown applied)."""
        table = self.peak_flops
        value = table.get(dtype) or (table.get("tf32") if dtype == "fp32" else None) or table.get("fp32")
        if value is None:
            # Conservative: the lowest listed peak, never an int8/fp8 figure for a float dtype.
            value = min(table.values())
        return value / self.slowdown

    def vector_flops(self, dtype: str) -> float:
        """Peak non-matrix FLOP/s for ``dtype`` (slowdown applied)."""
        table = self.peak_flops_vector
        value = table.get(dtype) or table.get("fp32") or self.peak_flops.get("fp32") or min(self.peak_flops.values())
        return value / self.slowdown

    @property
    def effective_memory_bandwidth(self) -> float:
        return self.memory_bandwidth / self.slowdown


CATALOG_RESOURCE = ("hetero.configs", "devices.yaml")


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if key == "base":
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def resolve_devices(raw: dict[str, dict], known: dict[str, dict], path: str,
                    problems: Problems) -> dict[str, DeviceType]:
    """Resolve raw device entries (with ``base:`` inheritance) against ``known`` raw entries."""
    # name -> merged entry, or None once its problem is recorded (so it is recorded only once).
    merged_raw: dict[str, dict | None] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> dict | None:
        if name in merged_raw:
            return merged_raw[name]
        entry = raw.get(name)
        if entry is None:
            return known.get(name)
        merged_raw[name] = merge(name, entry, chain + (name,))
        return merged_raw[name]

    def merge(name: str, entry, chain: tuple[str, ...]) -> dict | None:
        """``entry`` (``raw[name]``) over its resolved base; ``chain``: the base links that led here."""
        if not isinstance(entry, dict):
            problems.add(join_path(path, name), f"expected a mapping, got {type(entry).__name__}",
                         "write the device's fields as key: value pairs")
            return None
        base = entry.get("base")
        if base is None:
            return dict(entry)
        if base in chain:
            problems.add(join_path(join_path(path, name), "base"), f"inheritance cycle {' -> '.join(chain + (base,))}",
                         "remove one of the base: links")
            return None
        parent = resolve(base, chain)
        if parent is None:
            if base not in raw:
                problems.add(join_path(join_path(path, name), "base"), f"unknown device type '{base}'",
                             did_you_mean(base, list(known) + list(raw)))
            return None
        return {**_merge(parent, entry), "base": base}

    out: dict[str, DeviceType] = {}
    for name in raw:
        merged = resolve(name, ())
        if merged is None:
            continue
        device = load_dataclass(DeviceType, merged, join_path(path, name), problems)
        if is_missing(device):
            continue
        if device.vendor not in VENDORS and _family_of(name, raw, known) != "cpu":
            problems.add(join_path(join_path(path, name), "vendor"),
                         f"unknown vendor '{device.vendor}'",
                         f"use one of {', '.join(VENDORS)}; custom vendor tags are for emulated devices "
                         f"with 'base: cpu'")
            continue
        out[name] = device
    return out


def _family_of(name: str, raw: dict, known: dict) -> str:
    """The real vendor at the root of a device's base chain (``cpu`` for emulated devices)."""
    seen = set()
    while name not in seen:
        seen.add(name)
        entry = raw.get(name) or known.get(name) or {}
        if entry.get("base"):
            name = entry["base"]
            continue
        return entry.get("vendor", "other")
    return "other"


@functools.lru_cache(maxsize=1)
def _catalog_raw() -> dict[str, dict]:
    text = resources.files(CATALOG_RESOURCE[0]).joinpath(CATALOG_RESOURCE[1]).read_text()
    data = yaml.safe_load(text) or {}
    return dict(data.get("devices", {}))


@functools.lru_cache(maxsize=1)
def load_catalog() -> dict[str, DeviceType]:
    """The built-in device catalog, validated (a broken catalog is a bug: it raises)."""
    problems = Problems(source="configs/devices.yaml")
    raw = _catalog_raw()
    devices = resolve_devices(raw, {}, "devices", problems)
    problems.raise_if_any()
    return devices


def catalog_raw() -> dict[str, dict]:
    """Raw catalog entries (for inheritance from cluster files)."""
    return _catalog_raw()


__all__ = ["DeviceType", "VENDORS", "DTYPES", "load_catalog", "catalog_raw", "resolve_devices", "SpecError"]
