"""The built-in device catalog (configs/devices.yaml): it loads, holds the required types, every
figure carries a source, and the figures agree with datasheets and the public NeuSight specs."""
from __future__ import annotations

import json

import pytest

from hetero.shared_data import shared_data_dir
from hetero.specs.device import DTYPES, VENDORS, catalog_raw, load_catalog

REQUIRED = [
    "A100-SXM4-40GB", "A100-SXM4-80GB", "A100-PCIE-40GB", "A100-PCIE-80GB", "H100-SXM5-80GB",
    "H100-PCIE-80GB", "H800", "H200", "L4", "V100-SXM2-32GB", "V100-PCIE-32GB", "T4",
    "P100-PCIE-16GB", "MI100", "MI210", "MI250X", "MI300X", "Ascend-910B", "Gaudi2", "cpu",
    "P4", "MI250",
]

# Fields holding a number (or a table of numbers) that must be traceable to a source.
NUMERIC_FIELDS = ("memory", "memory_bandwidth", "peak_flops", "peak_flops_vector", "compute_units",
                  "l2_cache", "clock", "link_bandwidth", "tdp", "price_per_hour", "slowdown")

# NeuSight artifact device file -> catalog name.
NEUSIGHT = {
    "Tesla_P4.json": "P4",
    "Tesla_P100-PCIE-16GB.json": "P100-PCIE-16GB",
    "Tesla_T4.json": "T4",
    "Tesla_V100-PCIE-32GB.json": "V100-PCIE-32GB",
    "NVIDIA_A100-PCIE-40GB.json": "A100-PCIE-40GB",
    "NVIDIA_A100-SXM4-40GB.json": "A100-SXM4-40GB",
    "NVIDIA_A100_80GB_PCIe.json": "A100-PCIE-80GB",
    "NVIDIA_H100_80GB_HBM3.json": "H100-SXM5-80GB",
    "NVIDIA_L4.json": "L4",
    "AMD_Instinct_MI100.json": "MI100",
    "AMD_Instinct_MI210.json": "MI210",
    "AMD_Instinct_MI250.json": "MI250",
}
# The five GPUs of the NeuSight paper's main evaluation must be present in the data.
NEUSIGHT_CORE = ["P4", "P100-PCIE-16GB", "T4", "V100-PCIE-32GB", "A100-PCIE-40GB"]

GiB = 2**30
T = 1e12


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_loads_with_every_required_name(catalog):
    missing = [name for name in REQUIRED if name not in catalog]
    assert not missing, f"catalog lacks {missing}"


@pytest.mark.parametrize("name", sorted(catalog_raw()))
def test_every_entry_is_complete_and_sourced(catalog, name):
    raw = catalog_raw()[name]
    device = catalog[name]
    assert device.vendor in VENDORS
    # Entries without a base must give every figure the predictor and the cost model use.
    if not raw.get("base"):
        for field in ("memory", "memory_bandwidth", "peak_flops", "peak_flops_vector", "compute_units",
                      "l2_cache", "clock", "link_bandwidth", "tdp", "price_per_hour"):
            assert field in raw, f"{name}: no {field}"
        assert "fp32" in device.peak_flops, f"{name}: peak_flops needs an fp32 entry"
        assert "fp32" in device.peak_flops_vector, f"{name}: peak_flops_vector needs an fp32 entry"
    # Every numeric field written in this entry (not inherited through base) names its source.
    for field in NUMERIC_FIELDS:
        if field in raw:
            assert device.sources.get(field, "").strip(), f"{name}: '{field}' has no entry under sources"
    assert "indicative" in device.notes.lower() or "price_per_hour" not in raw, \
        f"{name}: notes should say the price is indicative"
    for table in (device.peak_flops, device.peak_flops_vector):
        assert set(table) <= set(DTYPES)
        assert all(v > 0 for v in table.values())
    # Dense matrix peaks are never below the plain fp32 peak of the same device.
    assert max(device.peak_flops.values()) >= device.peak_flops_vector["fp32"]


def test_spot_checks_in_base_units(catalog):
    a100 = catalog["A100-SXM4-80GB"]
    assert a100.vendor == "nvidia"
    assert a100.memory == 80 * GiB
    assert a100.memory_bandwidth == pytest.approx(2039e9)
    assert a100.peak_flops["bf16"] == pytest.approx(312 * T)
    assert a100.peak_flops["fp16"] == pytest.approx(312 * T)
    assert a100.peak_flops["fp32"] == pytest.approx(19.5 * T)    # plain FP32, not TF32
    assert a100.peak_flops["tf32"] == pytest.approx(156 * T)
    assert a100.compute_units == 108
    assert a100.l2_cache == 40 * 2**20
    assert a100.clock == pytest.approx(1.41e9)
    assert a100.link_bandwidth == pytest.approx(300e9)
    assert a100.tdp == pytest.approx(400)

    assert catalog["A100-SXM4-40GB"].memory_bandwidth == pytest.approx(1555e9)
    h100 = catalog["H100-SXM5-80GB"]
    assert h100.peak_flops["bf16"] == pytest.approx(989.4 * T)   # dense, not the 1979 sparse figure
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    assert catalog["H200"].memory_bandwidth == pytest.approx(4.8e12)

    mi250x = catalog["MI250X"]
    assert mi250x.vendor == "amd"
    assert mi250x.memory == 128 * GiB
    assert mi250x.compute_units == 220
    assert mi250x.peak_flops["fp16"] == pytest.approx(383 * T)
    assert mi250x.peak_flops["fp32"] == pytest.approx(95.7 * T)
    assert mi250x.peak_flops_vector["fp32"] == pytest.approx(47.9 * T)

    assert catalog["MI300X"].memory == 192 * GiB
    assert catalog["Ascend-910B"].vendor == "ascend"
    assert catalog["Ascend-910B"].memory == 64 * GiB
    assert catalog["Gaudi2"].vendor == "intel"
    assert catalog["cpu"].vendor == "cpu"
    assert not catalog["cpu"].is_emulated


def test_fp32_matmul_does_not_fall_back_to_a_low_precision_peak(catalog):
    # matrix_flops("fp32") must never pick an fp16/int8 figure.
    for name, device in catalog.items():
        assert device.matrix_flops("fp32") <= max(device.peak_flops.get("fp32", 0),
                                                  device.peak_flops.get("tf32", 0)), name


def test_neusight_devices_agree_with_the_public_specs(catalog):
    devices_dir = shared_data_dir() / "neusight" / "devices"
    if not devices_dir.is_dir():
        pytest.skip(f"NeuSight device specs not found at {devices_dir} (set HETERO_SHARED_DATA)")
    seen = set()
    for filename, name in NEUSIGHT.items():
        path = devices_dir / filename
        if not path.is_file():
            continue
        spec = json.loads(path.read_text())
        device = catalog[name]
        seen.add(name)
        bw = spec["Mem_Bw"] * 1e9
        assert device.memory_bandwidth == pytest.approx(bw, rel=0.10), f"{name}: memory bandwidth"
        fp32 = (spec.get("SingleFLOPsVEC") or spec["SingleFLOPs"]) * 1e9
        assert device.peak_flops_vector["fp32"] == pytest.approx(fp32, rel=0.10), f"{name}: fp32 peak"
        if "SingleFLOPsMM" in spec:
            assert device.peak_flops["fp32"] == pytest.approx(spec["SingleFLOPsMM"] * 1e9, rel=0.10), \
                f"{name}: fp32 matrix peak"
        else:
            assert device.peak_flops["fp32"] == pytest.approx(fp32, rel=0.10), f"{name}: fp32 peak"
        assert device.compute_units == spec["Num_Sm"], f"{name}: compute units"
        assert device.clock == pytest.approx(spec["Freq"] * 1e6, rel=0.10), f"{name}: clock"
        assert device.memory == pytest.approx(spec["Dev_Mem"] * GiB, rel=0.10), f"{name}: memory"
    missing = [n for n in NEUSIGHT_CORE if n not in seen]
    assert not missing, f"NeuSight spec files for {missing} not found in {devices_dir}"
