"""Tests of the learned operator-latency model (hetero.predictor.opmodel)."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetero.predictor.opmodel import OpModel, Records, default_model, device_from_neusight, roofline_latency
from hetero.predictor.opmodel.specs import shared_data_dir
from hetero.specs.device import DeviceType

from helpers import cluster_dict, group_dict

V100_SPEC = {"Device": "Tesla V100-PCIE-32GB", "Dev_Mem": 32, "Mem_Bw": 900, "Num_Sm": 80,
             "Core_Per_SM": 64, "Freq": 1370, "SingleFLOPs": 14029, "L2Cache": 6}
MI100_SPEC = {"Device": "AMD Instinct MI100", "Dev_Mem": 32, "Mem_Bw": 1230, "Num_Sm": 120, "Core_Per_SM": 4,
              "Freq": 1502, "SingleFLOPsMM": 46100, "SingleFLOPsVEC": 23100, "L2Cache": 8}
DATA = shared_data_dir()
HAVE_DATA = (DATA / "neusight" / "ops").is_dir()


def _benchmark(name: str):
    """A script of benchmarks/ imported as a module (its functions are what the test checks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def v100():
    return device_from_neusight(V100_SPEC)


def test_converter():
    d = device_from_neusight(MI100_SPEC)
    assert d.vendor == "amd"
    assert d.matrix_flops("fp32") == pytest.approx(46.1e12)
    assert d.vector_flops("fp32") == pytest.approx(23.1e12)
    assert d.effective_memory_bandwidth == pytest.approx(1.23e12)
    assert d.compute_units == 120 and d.l2_cache == 8 * 2**20


def test_roofline_math(v100):
    P, BW = 14029e9, 900e9
    # compute-bound GEMM
    t = roofline_latency("linear", {"B": 1, "M": 4096, "N": 4096, "K": 4096}, "fp32", v100)
    assert t == pytest.approx(2 * 4096**3 / P)
    # linear with B > 1 flattens rows; the weight is read once
    t = roofline_latency("linear", {"B": 8, "M": 1, "N": 4096, "K": 4096}, "fp32", v100)
    assert t == pytest.approx(max(2 * 8 * 4096 * 4096 / P, 4 * (8 * 4096 + 4096 * 4096 + 8 * 4096) / BW))
    # bmm: every batch has its own right operand
    t = roofline_latency("bmm", {"B": 16, "M": 8, "N": 8, "K": 8}, "fp32", v100)
    assert t == pytest.approx(4 * 16 * 3 * 64 / BW)
    # elementwise: memory-bound, add reads two tensors, relu one
    assert roofline_latency("add", {"B": 1024, "H": 1024}, "fp32", v100) == pytest.approx(12 * 2**20 / BW)
    assert roofline_latency("relu", {"B": 1024, "H": 1024}, "fp32", v100) == pytest.approx(8 * 2**20 / BW)
    # fp16 halves the bytes; slowdown scales everything
    assert roofline_latency("relu", {"B": 1024, "H": 1024}, "fp16", v100) == pytest.approx(4 * 2**20 / BW)
    slow = DeviceType(**{**v100.__dict__, "slowdown": 2.0})
    assert roofline_latency("relu", {"B": 1024, "H": 1024}, "fp32", slow) == pytest.approx(16 * 2**20 / BW)
    with pytest.raises(ValueError):
        roofline_latency("conv", {}, "fp32", v100)


def test_no_torch_import():
    code = "import hetero.predictor.opmodel, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_model_works(v100):
    m = default_model()
    t = m.predict("linear", {"B": 1, "M": 2048, "N": 2048, "K": 2048}, "fp32", v100)
    assert 1e-5 < t < 1.0
    r = roofline_latency("linear", {"B": 1, "M": 2048, "N": 2048, "K": 2048}, "fp32", v100)
    assert 0.7 * r < t < 5 * r
    for op in ("ln", "softmax", "add", "mul", "div", "pow", "tanh", "relu", "gelu"):
        assert 1e-6 < m.predict(op, {"B": 512, "H": 1024}, "fp32", v100) < 1e-2
    # a catalog-style device with fp16 tensor-core peak
    h100ish = DeviceType(vendor="nvidia", memory=80e9, memory_bandwidth=3.35e12,
                         peak_flops={"fp32": 67e12, "bf16": 989e12}, compute_units=132, l2_cache=50 * 2**20)
    assert m.predict("bmm", {"B": 32, "M": 1024, "N": 1024, "K": 128}, "bf16", h100ish) > 0
    with pytest.raises(ValueError):
        m.predict("conv", {}, "fp32", v100)


def test_no_v100_variant(v100):
    m = default_model(without="Tesla V100-PCIE-32GB")
    assert "Tesla V100-PCIE-32GB" not in m.meta["trained_devices"]
    assert len(m.meta["trained_devices"]) == 4
    assert m.predict("gelu", {"B": 4096, "H": 4096}, "fp32", v100) > 0
    with pytest.raises(ValueError):
        default_model(without="Tesla P4")


def test_save_load_roundtrip(tmp_path, v100):
    m = default_model()
    path = tmp_path / "m.json"
    m.save(path)
    assert path.read_text().lstrip().startswith("{")
    m2 = OpModel.load(path)
    rng = np.random.default_rng(0)
    dims = {k: rng.integers(1, 4096, 200).astype(float) for k in "BMNK"}
    dims["B"] = rng.integers(1, 64, 200).astype(float)
    a = m.predict_many("bmm", dims, "fp32", v100)
    b = m2.predict_many("bmm", dims, "fp32", v100)
    assert np.array_equal(a, b)
    for i in range(20):
        d = {k: float(v[i]) for k, v in dims.items()}
        s1, s2 = m.predict("bmm", d, "fp32", v100), m2.predict("bmm", d, "fp32", v100)
        assert s1 == s2
        assert s1 == pytest.approx(a[i], rel=1e-9)  # scalar path == vectorised path


@pytest.mark.slow
def test_matches_sklearn(v100):
    """The exported trees reproduce scikit-learn's own predictions."""
    pytest.importorskip("sklearn")
    from sklearn.ensemble import HistGradientBoostingRegressor

    from hetero.predictor.opmodel.trees import PackedTrees, compile_scalar, export_hgb, validate
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2000, 5))
    y = np.sin(X[:, 0]) + X[:, 1] * X[:, 2] + rng.normal(scale=0.1, size=2000)
    skm = HistGradientBoostingRegressor(max_iter=30, random_state=0).fit(X, y)
    ens = validate(export_hgb(skm, precision=17))
    Xt = rng.normal(size=(300, 5))
    ref = skm.predict(Xt)
    assert np.allclose(PackedTrees(ens).predict(Xt), ref, rtol=1e-9, atol=1e-9)
    f = compile_scalar(ens)
    assert np.allclose([f(list(r)) for r in Xt], ref, rtol=1e-9, atol=1e-9)


def test_monotone_sanity(v100):
    m = default_model()
    for op, base in (("linear", {"B": 1, "M": 1024, "N": 1024, "K": 1024}),
                     ("bmm", {"B": 16, "M": 512, "N": 512, "K": 64})):
        for dim in ("M", "N", "K"):
            prev = 0.0
            for scale in (1, 2, 4, 8):
                d = dict(base, **{dim: base[dim] * scale})
                t = m.predict(op, d, "fp32", v100)
                assert t >= prev * 0.98, (op, dim, scale, t, prev)
                prev = t
    prev = 0.0
    for rows in (1024, 4096, 16384, 65536):
        t = m.predict("gelu", {"B": rows, "H": 4096}, "fp32", v100)
        assert t >= prev * 0.98
        prev = t


def test_predict_speed(v100):
    m = OpModel.load(__import__("hetero.predictor.opmodel.model", fromlist=["DEFAULT_PATH"]).DEFAULT_PATH)
    rng = np.random.default_rng(2)
    shapes = [{"B": 1.0, "M": float(a), "N": float(b), "K": float(c)} for a, b, c in rng.integers(1, 8192, (300, 3))]
    t0 = time.perf_counter()
    for d in shapes:
        m.predict("linear", d, "fp32", v100)
    uncached = (time.perf_counter() - t0) / len(shapes)
    t0 = time.perf_counter()
    for d in shapes:
        m.predict("linear", d, "fp32", v100)
    cached = (time.perf_counter() - t0) / len(shapes)
    assert uncached < 200e-6, uncached  # target < 50 us; loose bound for slow CI machines
    assert cached < uncached


def test_records_and_exclude():
    rows = [{"op": "add", "device": "X", "B": "4", "H": "8", "latency_ms": "0.03"},
            {"op": "linear", "device": "X", "dtype": "fp32", "B": "1", "M": "4", "N": "4", "K": "4", "H": "",
             "latency_ms": "0.05"}]
    r = Records.from_rows(rows)
    assert len(r) == 2 and list(r.dtype) == ["fp32", "fp32"] and math.isnan(r.dims["H"][1])


# Test-config LODO results (400 training rows per (op, device), 80 boosting rounds, <= 200 test rows
# per op) measured when the model was last changed: (overall MAPE, overall medAPE). GPUs that meet
# the issue target must keep meeting it; the others may not regress by more than LODO_MARGIN. The
# design of each outer fold is the one the benchmark's nested selection chose for it (inner LODO
# over the four other GPUs, benchmarks/results/opmodel_lodo.json "selection"); the test does not
# rerun that selection. The full-size numbers are in benchmarks/results/opmodel_lodo.json.
LODO_TARGET = (0.15, 0.10)
LODO_DESIGNS = dict.fromkeys(("NVIDIA A100-PCIE-40GB", "Tesla P100-PCIE-16GB", "Tesla P4", "Tesla T4",
                              "Tesla V100-PCIE-32GB"), "floor_min")
LODO_DOCUMENTED = {"NVIDIA A100-PCIE-40GB": (0.079, 0.053), "Tesla P100-PCIE-16GB": (0.275, 0.272),
                   "Tesla P4": (0.092, 0.082), "Tesla T4": (0.087, 0.064),
                   "Tesla V100-PCIE-32GB": (0.195, 0.189)}
LODO_MARGIN = 0.02


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DATA, reason=f"NeuSight data not found under {DATA} (set HETERO_SHARED_DATA)")
def test_lodo_accuracy():
    """Leave-one-device-out on a fixed subsample (about 15 s): every held-out GPU meets the issue
    target (MAPE <= 15%, medAPE <= 10%) where it did when documented, is no worse than documented
    (+ LODO_MARGIN) elsewhere, and the learned model beats both baselines everywhere. The probed
    protocol (the same fold's model pinned to the held-out GPU by its 20 probe records, which are
    kept out of the test rows) meets the target on every GPU, and beats the specs-only model by
    5 points wherever that misses.

    Fit on <= 400 rows per (op, device) of four GPUs with 80 boosting rounds (the shipped model
    and the benchmark use 4000 rows and 200 rounds), evaluate <= 200 rows per op of the fifth.
    """
    from hetero.predictor.opmodel import load_neusight
    from hetero.predictor.opmodel.lodo import run_lodo

    rec, devices = load_neusight(DATA)
    res = run_lodo(rec, devices, train_rows_per_group=400, test_rows_per_group=200, log=None,
                   model_kwargs={"hgb_params": {"max_iter": 80}}, designs=LODO_DESIGNS, probes=True)
    summary = {d: (round(r["learned"]["overall"]["mape"], 3), round(r["learned"]["overall"]["medape"], 3),
                   round(r["roofline"]["overall"]["mape"], 3), round(r["linreg"]["overall"]["mape"], 3))
               for d, r in res.items()}
    assert set(res) == set(LODO_DOCUMENTED), summary
    for dev, r in res.items():
        mape, med = r["learned"]["overall"]["mape"], r["learned"]["overall"]["medape"]
        assert mape < r["roofline"]["overall"]["mape"], (dev, summary)
        assert mape < r["linreg"]["overall"]["mape"], (dev, summary)
        doc_mape, doc_med = LODO_DOCUMENTED[dev]
        if doc_mape <= LODO_TARGET[0] and doc_med <= LODO_TARGET[1]:
            assert mape <= LODO_TARGET[0] and med <= LODO_TARGET[1], (dev, summary)
        assert mape <= doc_mape + LODO_MARGIN and med <= doc_med + LODO_MARGIN, (dev, summary)
        probed = r["probed"]["overall"]
        assert probed["mape"] <= LODO_TARGET[0] and probed["medape"] <= LODO_TARGET[1], (dev, probed)
        if not (mape <= LODO_TARGET[0] and med <= LODO_TARGET[1]):
            # where the specs-only prior misses, the probes must be what closes the gap (where the
            # prior floor is already that GPU's own, one tiny-shape probe per op is no better)
            assert probed["mape"] < mape - 0.05, (dev, probed, mape)
        # the attribution: the specs-only model given one kind of probe measurement at a time; each
        # kind changes what is predicted (none is dropped on the way to the model)
        parts = r["attribution"]
        assert set(parts) == {"+ measured floors", "+ bandwidth scale", "+ GEMM peak scales", "+ floors and bandwidth"}
        assert all(p["mape"] != mape for p in parts.values()), (dev, parts, mape)


def test_floor_design(v100, tmp_path):
    """The shipped model adds a per-op launch floor; a trained GPU uses its own measured floors, an
    unseen one the minimum over the training GPUs; the floors survive a save/load round trip."""
    from hetero.specs.device import load_catalog

    m = default_model()
    assert m.design == "floor_min" and set(m.floors["global"]) == set(__import__(
        "hetero.predictor.opmodel.features", fromlist=["OPS"]).OPS)
    cat = load_catalog()
    assert m._floor_index(cat["V100-PCIE-32GB"]) > 0          # trained on: own floors
    m_no = default_model(without="Tesla V100-PCIE-32GB")
    assert m_no._floor_index(cat["V100-PCIE-32GB"]) == 0      # not trained on: global floors
    tiny = {"B": 1, "H": 1}
    t = m_no.predict("add", tiny, "fp32", cat["V100-PCIE-32GB"])
    assert t == pytest.approx(m_no.floors["global"]["add"], rel=0.3)
    own = {e["name"]: e["floors"]["add"] for e in m_no.floors["devices"]}
    assert m_no.floors["global"]["add"] == pytest.approx(min(own.values()))
    note = m_no.accuracy_note(cat["V100-PCIE-32GB"])   # the provenance says which floor it assumed
    assert f"quickest ({m_no.floors['global']['add'] * 1e6:.0f} us per elementwise call)" in note, note
    assert "launch floor" not in m.accuracy_note(cat["V100-PCIE-32GB"])
    path = tmp_path / "m.json"
    m.save(path)
    m2 = OpModel.load(path)
    assert m2.floors == m.floors
    assert m2.predict("add", tiny, "fp32", v100) == m.predict("add", tiny, "fp32", v100)


# GPT-2-large training step on the V100 (NeuSight e2e label) from the model fitted without V100:
# figures when documented (benchmarks/bench_e2e_v100.py). The target is 10%; neither
# protocol meets it yet, so the test keeps both from getting worse and the probed one ahead.
E2E_DOCUMENTED = {"specs": 0.130, "probed": 0.012}
E2E_MARGIN = 0.02


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "neusight" / "e2e_labels.json").is_file(),
                    reason=f"NeuSight data not found under {DATA} (set HETERO_SHARED_DATA)")
def test_v100_gpt2_step_without_v100():
    import dataclasses
    import json
    from pathlib import Path

    from hetero.predictor.opmodel import load_neusight
    from hetero.predictor.opmodel.probes import ProbedOpModel, calibrate
    from hetero.specs.device import load_catalog

    bench = _benchmark("bench_e2e_v100")
    device = load_catalog()[bench.CATALOG_DEVICE]
    opm = default_model(without=bench.HELD_OUT)
    rec, _ = load_neusight(DATA)
    probed = ProbedOpModel(opm, device, calibrate(opm, device, rec.subset(rec.device == bench.HELD_OUT)))
    labels = json.loads((DATA / "neusight" / "e2e_labels.json").read_text())
    gpt2 = bench.models()["gpt2_large"]
    checked = 0
    for key, lab in labels.items():
        _, rest = key.split("/", 1)
        name, _, seq, batch = rest.split("-")
        if name != "gpt2_large":
            continue
        model = dataclasses.replace(gpt2, seq_length=int(seq))
        errors = {}
        for label, m in (("specs", opm), ("probed", probed)):
            f, b = bench.step_ms(m, model, int(batch), int(seq), device)
            errors[label] = (f + b) / lab["e2e_latency"] - 1
        for label, err in errors.items():
            assert abs(err) <= E2E_DOCUMENTED[label] + E2E_MARGIN, errors
        assert abs(errors["probed"]) < abs(errors["specs"]), errors
        checked += 1
    assert checked >= 1


def test_provenance_says_what_the_model_knows_of_each_gpu():
    """`hetero predict` tells, per device, whether the learned model saw a GPU with its specs or
    extrapolates from specs (with the leave-one-GPU-out error stored beside the model)."""
    import hetero

    cluster = hetero.load_cluster(cluster_dict(group_dict("a", "A100-SXM4-40GB"), group_dict("h", "H100-SXM5-80GB"),
                                               name="two"))
    from pathlib import Path

    model = hetero.load_model(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny.yaml")
    plan = hetero.load_plan({"global_batch_size": 2, "micro_batch_size": 1, "pipelines": [
        {"replicas": 1, "micro_batches": 2, "stages": [{"group": "a", "layers": [0, 2]},
                                                        {"group": "h", "layers": [2, 4]}]}]}, cluster, model)
    prov = hetero.predict(cluster, model, plan).provenance
    assert prov["A100-SXM4-40GB"]["note"].startswith("fitted on measurements of NVIDIA A100-PCIE-40GB")
    lodo = default_model().meta["design_selection"]["inner_mean_mape"][default_model().design]
    assert 0.05 < lodo < 0.5
    assert f"leave-one-GPU-out operator MAPE {lodo:.0%}" in prov["H100-SXM5-80GB"]["note"]
    assert prov["H100-SXM5-80GB"]["note"].startswith("a GPU it was not fitted on")
    catalog = hetero.load_cluster(cluster_dict(group_dict("n", "Ascend-910B"), name="npu")).device_type("n")
    assert default_model().accuracy_note(catalog).startswith("a device it was not fitted on")   # an NPU


def test_h100_operators_measured_with_hetero_profile():
    """An H100 (no NeuSight GPU) profiled with `hetero profile` on CUDA (benchmarks/data/h100): the
    model pinned by the profile's probes meets the operator target on fp32 (MAPE <= 15%, medAPE <=
    10%) and beats the specs-only model in every dtype, which beats the plain roofline
    (benchmarks/bench_h100.py prints the figures)."""

    bench = _benchmark("bench_h100")
    ops = bench.operators()
    assert ops["n_probe_rows"] >= 30
    fp32 = ops["fp32"]["probed"]["overall"]
    assert fp32["mape"] <= 0.15 and fp32["medape"] <= 0.10, fp32
    for dt in ("fp32", "fp16"):
        r = {m: ops[dt][m]["overall"]["mape"] for m in ("specs", "probed", "roofline")}
        assert r["probed"] < r["specs"] < r["roofline"], (dt, r)


def test_h100_step_memory_with_fused_attention():
    """The runtime's attention is fused (SDPA): predicted with `attention: fused`, the peak memory of
    the 13 one-GPU steps measured on the H100 (benchmarks/data/h100/steps.json) is within 5% on
    every step (measured +0.7% .. +2.1%, the framework overhead included; it was -11% .. +25% before
    the engine's autocast copies and the gradient-free forward peak of one micro-batch were counted)
    and closer than the unfused prediction (which counts a s^2 b of attention scores per layer that
    the kernel never keeps)."""
    import json

    import hetero

    bench = _benchmark("bench_h100")
    runs = [r for r in json.loads((bench.DATA / "steps.json").read_text())["runs"] if "error" not in r]
    assert len(runs) >= 10
    for r in runs:
        err = {}
        for attention in ("fused", "unfused"):
            cluster, model, plan = bench.step_inputs(r, attention)
            pred = hetero.predict(hetero.load_cluster(cluster), hetero.load_model(model), hetero.load_plan(plan))
            peak = pred.to_dict()["pipelines"][0]["stages"][0]["peak_memory_bytes"]
            err[attention] = peak / r["peak_allocated_bytes"] - 1
        assert abs(err["fused"]) < abs(err["unfused"]) and err["unfused"] > 0.2, (r, err)
        assert abs(err["fused"]) <= 0.05, (r, err)


@pytest.mark.slow
def test_h100_steps_launched_with_the_native_engine_on_the_gpu():
    """`hetero launch` on one H100 (benchmarks/data/h100/launch.json, the native engine placing the
    stage on the GPU): every run computed on CUDA; the runtime adds at most 12% to the same
    micro-batches measured alone (schedule, norm, metrics); fp32 is predicted within 10% from specs
    and from the profile, bf16 within the documented 35% (the fp32-fitted model's tensor-core
    extrapolation; benchmarks/bench_h100.py part 3 prints the figures)."""
    bench = _benchmark("bench_h100")
    import json

    runs = json.loads((bench.DATA / "launch.json").read_text())["runs"]
    assert len(runs) == 4 and all(r.get("device") == "cuda" for r in runs), runs
    rows = bench.launches()
    assert len(rows) == 4
    for r in rows:
        assert 0 <= r["measured_ms"] / r["bare_step_ms"] - 1 <= 0.12, r
        bound = 0.10 if r["dtype"] == "fp32" else 0.35
        assert abs(r["error"]["specs"]) <= bound and abs(r["error"]["probed"]) <= bound, r


def test_a_profile_probed_in_fp16_pins_bf16_where_the_units_are_the_same():
    """`hetero profile` probes fp32 and fp16; bf16 runs on the same tensor cores at the same peak on
    an H100, so it takes the fp16 calibration (not the fp32 floors with datasheet peaks). A device
    whose bf16 peak differs from its fp16 peak keeps the fallback."""
    import dataclasses

    from hetero.predictor.opmodel.probes import ProbedDevice
    from hetero.specs.device import load_catalog

    bench = _benchmark("bench_h100")
    rec = bench._records()
    h100 = load_catalog()[bench.DEVICE]
    dims = {"B": 1, "M": 8192, "N": 4096, "K": 4096}
    probed = ProbedDevice(default_model(), h100, rec)
    assert set(probed.calibrations) == {"fp32", "fp16"}
    assert probed.predict("linear", dims, "bf16") == probed.predict("linear", dims, "fp16")
    odd = dataclasses.replace(h100, peak_flops={**h100.peak_flops, "bf16": h100.peak_flops["bf16"] / 2})
    probed_odd = ProbedDevice(default_model(), odd, rec)
    assert probed_odd.predict("linear", dims, "bf16") != pytest.approx(probed_odd.predict("linear", dims, "fp16"), rel=0.05)
