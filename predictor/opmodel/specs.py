"""Input data for the operator model: NeuSight device specs -> ``DeviceType``, profile-record CSVs.

Only fields that our device catalog carries are used (memory, memory_bandwidth, peak_flops,
peak_flops_vector, compute_units, l2_cache, clock), so a model fitted on NeuSight devices can be
applied to any catalog device.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from hetero.shared_data import shared_data_dir
from hetero.specs.device import DeviceType

DIM_COLUMNS = ("B", "M", "N", "K", "H")


def device_from_neusight(spec: Mapping) -> DeviceType:
    """Convert one NeuSight device JSON (Dev_Mem GB, Mem_Bw GB/s, Num_Sm, Freq MHz, SingleFLOPs
    GFLOP/s or AMD SingleFLOPsMM/SingleFLOPsVEC, L2Cache MB) into a ``DeviceType`` (fp32 only).

    Units follow the vendors' datasheets: GB = 1e9 bytes for memory size and bandwidth, L2 in MiB.
    """
    name = str(spec.get("Device", ""))
    vendor = "amd" if ("AMD" in name or "Instinct" in name or "SingleFLOPsMM" in spec) else "nvidia"
    mm = float(spec.get("SingleFLOPsMM", spec.get("SingleFLOPs", 0.0))) * 1e9
    vec = float(spec.get("SingleFLOPsVEC", spec.get("SingleFLOPs", 0.0))) * 1e9
    return DeviceType(
        vendor=vendor,
        memory=float(spec["Dev_Mem"]) * 1e9,
        memory_bandwidth=float(spec["Mem_Bw"]) * 1e9,
        peak_flops={"fp32": mm},
        peak_flops_vector={"fp32": vec},
        compute_units=int(spec["Num_Sm"]),
        l2_cache=float(spec["L2Cache"]) * 2**20,
        clock=float(spec["Freq"]) * 1e6,
        sources={"*": "NeuSight artifact (sitar-lab/NeuSight), data/device_configs"},
        notes=f"converted from NeuSight spec '{name}'",
    )


def load_neusight_devices(directory: str | os.PathLike) -> dict[str, DeviceType]:
    """All ``*.json`` specs of a NeuSight ``devices/`` folder, keyed by their ``Device`` name."""
    out = {}
    for path in sorted(Path(directory).glob("*.json")):
        spec = json.loads(path.read_text())
        out[str(spec["Device"])] = device_from_neusight(spec)
    return out


class Records:
    """Profile records in columnar form: ``op``, ``device``, ``dtype`` (str arrays), dims (float
    arrays, NaN where a dimension does not apply) and ``latency_ms``."""

    def __init__(self, columns: Mapping[str, np.ndarray]):
        self.op = np.asarray(columns["op"]).astype(str)
        n = len(self.op)
        self.device = np.asarray(columns["device"]).astype(str)
        dt = columns.get("dtype")
        self.dtype = np.asarray(dt).astype(str) if dt is not None else np.full(n, "fp32")
        self.dtype = np.where(self.dtype == "", "fp32", self.dtype)
        self.dims = {c: np.asarray(columns.get(c, np.full(n, np.nan)), dtype=float) for c in DIM_COLUMNS}
        lat = columns.get("latency_ms")
        self.latency_ms = np.asarray(lat, dtype=float) if lat is not None else np.full(n, np.nan)

    def __len__(self) -> int:
        return len(self.op)

    def subset(self, mask_or_index) -> "Records":
        cols = {"op": self.op[mask_or_index], "device": self.device[mask_or_index],
                "dtype": self.dtype[mask_or_index], "latency_ms": self.latency_ms[mask_or_index]}
        cols.update({c: v[mask_or_index] for c, v in self.dims.items()})
        return Records(cols)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping]) -> "Records":
        rows = list(rows)

        def num(v):
            if v is None or v == "":
                return np.nan
            return float(v)

        cols = {"op": [r["op"] for r in rows], "device": [r["device"] for r in rows],
                "dtype": [r.get("dtype") or "fp32" for r in rows],
                "latency_ms": [num(r.get("latency_ms")) for r in rows]}
        for c in DIM_COLUMNS:
            cols[c] = [num(r.get(c)) for r in rows]
        return cls(cols)

    @classmethod
    def from_csv(cls, paths: Iterable[str | os.PathLike] | str | os.PathLike) -> "Records":
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        rows = []
        for p in paths:
            with open(p, newline="") as fh:
                rows.extend(csv.DictReader(fh))
        return cls.from_rows(rows)

    @classmethod
    def concat(cls, parts: list["Records"]) -> "Records":
        cols = {"op": np.concatenate([p.op for p in parts]),
                "device": np.concatenate([p.device for p in parts]),
                "dtype": np.concatenate([p.dtype for p in parts]),
                "latency_ms": np.concatenate([p.latency_ms for p in parts])}
        for c in DIM_COLUMNS:
            cols[c] = np.concatenate([p.dims[c] for p in parts])
        return cls(cols)


def as_records(records) -> Records:
    if isinstance(records, Records):
        return records
    if isinstance(records, Mapping):
        return Records(records)
    return Records.from_rows(records)


def catalog_name(neusight_name: str) -> str:
    """The catalog (configs/devices.yaml) name of a NeuSight device: 'Tesla V100-PCIE-32GB' ->
    'V100-PCIE-32GB', 'NVIDIA A100-PCIE-40GB' -> 'A100-PCIE-40GB'."""
    for prefix in ("Tesla ", "NVIDIA ", "AMD Instinct "):
        if neusight_name.startswith(prefix):
            return neusight_name[len(prefix):]
    return neusight_name


def with_catalog_devices(devices: Mapping[str, DeviceType]) -> dict[str, DeviceType]:
    """Replace each NeuSight device spec by the catalog's ``DeviceType`` of the same name where the
    catalog has one, so a model is trained on the same kind of numbers (datasheet peaks, tdp, ...)
    that it is given at prediction time."""
    from hetero.specs.device import load_catalog

    cat = load_catalog()
    return {name: cat.get(catalog_name(name), dev) for name, dev in devices.items()}


def load_neusight(data_dir: str | os.PathLike | None = None,
                  catalog: bool = True) -> tuple[Records, dict[str, DeviceType]]:
    """Load ``neusight/ops/*.csv`` and ``neusight/devices/*.json`` from the shared data folder.

    ``catalog``: use the device catalog's ``DeviceType`` where it has the device (the five measured
    GPUs are all there), the converted NeuSight spec otherwise."""
    base = Path(data_dir) if data_dir else shared_data_dir()
    if (base / "neusight").is_dir():
        base = base / "neusight"
    files = sorted((base / "ops").glob("*.csv"))
    if not files:
        raise FileNotFoundError(f"no profile CSVs under {base / 'ops'}")
    devices = load_neusight_devices(base / "devices")
    return Records.from_csv(files), (with_catalog_devices(devices) if catalog else devices)
