"""Device types: the numbers the predictor needs about one accelerator, and the catalog of them.

A device type is defined in the built-in catalog (``configs/devices.yaml``) or under a cluster
file's ``devices:``. An entry may inherit another with ``base:`` and override some fields; a cluster
entry named like a catalog device overrides that device (it inherits the catalog entry, so
``A100-SXM4-80GB: {memory: 40 GiB}`` changes the memory alone). The emulation idiom is ``{base: cpu, vendor: emu-b, slowdown: 2.0}``: a CPU device with its own vendor
tag (so it gets its own process group) that computes ``slowdown`` times slower.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources

from hetero.backends import registry

from .errors import Problem, Problems, SpecError, did_you_mean, join_path
from .io import load_yaml
from .schema import is_missing, load_dataclass, quantity

# The vendor families (hetero.backends.registry). Other tags are allowed only for CPU-emulated devices.
VENDORS = registry.family_names()
DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")
HALF_DTYPES = ("fp16", "bf16")


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
    """Non-matrix (elementwise) peak per dtype (FLOP/s); a dtype not listed takes this table's fp32,
    then ``peak_flops``' fp32 entry, never a tf32 or half-precision matrix figure (:meth:`vector_peak`)."""
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
    idle_power: float | None = quantity("power", None)
    """Draw of a powered but idle device (W), for the energy objective; an estimate."""
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

    def matrix_peak(self, dtype: str) -> float | None:
        """The listed matrix peak (FLOP/s, slowdown not applied) that a ``dtype`` model runs at, or
        None when the device lists none that fits: the dtype's own entry; fp32 takes tf32 when fp32
        is not listed, and never a half-precision or integer figure; any other dtype falls back to
        fp32, and fp16 / bf16 then to each other's (the same half-precision matrix units)."""
        table = self.peak_flops
        if table.get(dtype):
            return table[dtype]
        if dtype == "fp32":
            return table.get("tf32")
        if table.get("fp32"):
            return table["fp32"]
        if dtype in HALF_DTYPES:
            return table.get(HALF_DTYPES[1 - HALF_DTYPES.index(dtype)])
        return None

    def peak_problem(self, dtype: str) -> tuple[str, str] | None:
        """``(message, fix)`` when a ``dtype`` model has no usable matrix peak on this device
        (see :meth:`matrix_peak`), else None."""
        if self.matrix_peak(dtype) is not None:
            return None
        listed = ", ".join(sorted(self.peak_flops)) or "nothing"
        usable = [d for d in ("fp32", "bf16", "fp16") if self.matrix_peak(d) is not None]
        need = "fp32 (or tf32)" if dtype == "fp32" else dtype
        fix = f"add '{dtype}: <peak> TFLOPS' to peak_flops from the datasheet"
        if usable:
            fix += f", or use a model with dtype {' or '.join(usable)}"
        why = " (an fp32 model never runs at a half-precision or integer peak)" if dtype == "fp32" else ""
        article = _article(dtype)
        return f"no matrix peak for {article} {dtype} model: needs {need}, lists {listed}{why}", fix

    def matrix_flops(self, dtype: str) -> float:
        """Peak matrix FLOP/s for ``dtype`` (fallbacks of :meth:`matrix_peak`; slowdown applied).
        Raises SpecError when none fits (validation reports it first, naming the device)."""
        value = self.matrix_peak(dtype)
        if value is None:
            message, fix = self.peak_problem(dtype)
            raise SpecError([Problem("peak_flops", message, fix, "<device type>")])
        return value / self.slowdown

    def vector_peak(self, dtype: str) -> float | None:
        """The listed non-matrix (elementwise) peak that ``dtype`` kernels run at (FLOP/s, slowdown
        not applied), or None when the device lists none: the dtype's own ``peak_flops_vector``
        entry, else that table's fp32, else the fp32 entry of ``peak_flops`` (the CUDA-core figure on
        NVIDIA, where tensor cores are listed as tf32; an upper bound where fp32 has matrix units of
        its own). Never a tf32, half-precision or integer matrix peak: those units run matrix
        products only, at 8-16x the elementwise rate, and would make every norm, activation and
        softmax look almost free."""
        vector = self.peak_flops_vector
        return vector.get(dtype) or vector.get("fp32") or self.peak_flops.get("fp32") or None

    def vector_problem(self, dtype: str) -> tuple[str, str] | None:
        """``(message, fix)`` when a ``dtype`` model has no elementwise peak on this device (see
        :meth:`vector_peak`), else None. fp32 is needed whatever the model's dtype: its loss (the
        softmax over the vocabulary) runs in fp32, in the runtime and in the predictor alike."""
        if all(self.vector_peak(d) is not None for d in (dtype, "fp32")):
            return None
        listed = ", ".join(sorted(self.peak_flops_vector)) or "nothing"
        article = _article(dtype)
        matrix = ", ".join(sorted(self.peak_flops)) or "nothing"
        return (f"no elementwise (non-matrix) fp32 peak for {article} {dtype} model: peak_flops_vector lists "
                f"{listed}, peak_flops no fp32 entry ({matrix} there: matrix-unit peaks, not elementwise ones)",
                "add 'fp32: <peak> TFLOPS' to peak_flops_vector, the datasheet's non-tensor-core figure: the "
                "loss runs in fp32 whatever the model's dtype")

    def vector_flops(self, dtype: str) -> float:
        """Peak non-matrix FLOP/s for ``dtype`` (fallbacks of :meth:`vector_peak`; slowdown applied).
        Raises SpecError when none is listed (validation reports it first, naming the device)."""
        value = self.vector_peak(dtype)
        if value is None:
            message, fix = self.vector_problem(dtype)
            raise SpecError([Problem("peak_flops_vector", message, fix, "<device type>")])
        return value / self.slowdown

    @property
    def effective_memory_bandwidth(self) -> float:
        return self.memory_bandwidth / self.slowdown


CATALOG_RESOURCE = ("hetero.configs", "devices.yaml")


def _article(dtype: str) -> str:
    """'an' or 'a' before a dtype's name as read aloud ("an fp32", "a bf16")."""
    return "an" if dtype[0] in "aefhilmnorsx" else "a"


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
    """Resolve raw device entries (with ``base:`` inheritance) against ``known`` raw entries.

    An entry named like a ``known`` one (a cluster's ``A100-SXM4-80GB:`` over the catalog) overrides
    it: the known entry is its base, so the fields given replace those of the catalog and the rest
    are kept (``base:`` naming itself says the same)."""
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
        if name in known and base in (None, name):   # an override of a known (catalog) entry
            return {**_merge(known[name], entry), "base": name}
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
        root = _family_of(name, raw, known)
        where = join_path(join_path(path, name), "vendor")
        if device.vendor not in VENDORS and root != "cpu":
            problems.add(where, f"unknown vendor '{device.vendor}'",
                         f"use one of {', '.join(VENDORS)}; custom vendor tags are for emulated devices "
                         f"with 'base: cpu'")
            continue
        if root == "cpu" and device.vendor in VENDORS and device.vendor != "cpu":
            # a CPU that says it is an nvidia device: neither a real one (launch would want CUDA)
            # nor an emulated one (that takes a tag of its own): refuse it here, not at launch
            problems.add(where, f"vendor '{device.vendor}' on a device inherited from 'cpu' is ambiguous: it runs "
                                f"on the CPU, but '{device.vendor}' is a real vendor family (its own backend)",
                         f"to emulate a vendor on the CPU give it a tag of its own (e.g. 'vendor: emu-a'; each tag "
                         f"gets its own process group); for a real {device.vendor} device drop the 'base: cpu' "
                         f"link and give its memory, memory_bandwidth and peak_flops")
            continue
        out[name] = device
    return out


def _family_of(name: str, raw: dict, known: dict) -> str:
    """The real vendor at the root of a device's base chain (``cpu`` for emulated devices); an
    entry of ``raw`` that overrides a ``known`` one continues at the known entry."""
    seen = set()
    key = ("raw", name)
    while key not in seen:
        seen.add(key)
        table = raw if key[0] == "raw" else known
        entry = table.get(key[1])
        if table is raw and entry is None:
            key = ("known", key[1])
            continue
        entry = entry if isinstance(entry, dict) else {}
        base = entry.get("base")
        if table is raw and key[1] in known and base in (None, key[1]):
            key = ("known", key[1])
        elif base:
            key = ("raw", base)
        else:
            return entry.get("vendor", "other")
    return "other"


@functools.lru_cache(maxsize=1)
def _catalog_raw() -> dict[str, dict]:
    text = resources.files(CATALOG_RESOURCE[0]).joinpath(CATALOG_RESOURCE[1]).read_text()
    data = load_yaml(text) or {}
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
