"""hetero profile: records in the SCHEMAS.md format, the per-device cache, the local op model."""
import csv

import pytest

from conftest import run_cli

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    cache = tmp / "cache"
    out = tmp / "tmp.csv"
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "HETERO_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "hetero", "profile", "--quick", "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out, cache


def test_quick_profile_writes_schema_records(quick_profile):
    out, _ = quick_profile
    with open(out, newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames[:8] == ["op", "device", "B", "M", "N", "K", "H", "latency_ms"]
        rows = list(reader)
    ops = {r["op"] for r in rows}
    assert ops == {"linear", "bmm", "ln", "softmax", "gelu", "add", "mul", "div", "pow", "tanh", "relu"}
    for r in rows:
        assert r["device"] == "cpu" and r["dtype"] == "fp32"
        assert float(r["latency_ms"]) > 0
        if r["op"] in ("linear", "bmm"):
            assert all(r[d] and int(r[d]) >= 1 for d in "BMNK") and r["H"] == ""
        else:
            assert r["B"] and r["H"] and r["M"] == r["N"] == r["K"] == ""


def test_cache_feeds_local_op_model(quick_profile, monkeypatch):
    from hetero.predictor import profiles

    out, cache = quick_profile
    monkeypatch.setenv("HETERO_CACHE_DIR", str(cache))
    assert profiles.cache_path("cpu") == cache / "profiles" / "cpu.csv"
    assert profiles.cache_path("cpu").read_text() == out.read_text()
    model = profiles.local_op_model("cpu")
    assert model is not None and model.num_records > 20
    t = model.predict("linear", {"B": 1, "M": 256, "N": 512, "K": 256}, "fp32", None)
    assert 1e-7 < t < 1.0


def test_no_cache_means_no_local_model(tmp_path, monkeypatch):
    from hetero.predictor import profiles

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path / "empty"))
    assert profiles.local_op_model("cpu") is None
    assert profiles.local_op_model("some-device") is None


def _synthetic(device="cpu"):
    """Records of a made-up machine: GEMMs at 100 GFLOP/s + 5 us, vector ops at 20 GB/s + 2 us."""
    from hetero.predictor.profiles import GEMM_OPS, Record, _work, default_grid

    recs = []
    for op, dims in default_grid():
        flops, nbytes = _work(op, dims, 4)
        t = 5e-6 + flops / 100e9 if op in GEMM_OPS else 2e-6 + nbytes / 20e9
        recs.append(Record(op, device, dict(dims), t * 1e3, "fp32"))
    return recs


def test_predictions_scale_sensibly():
    from hetero.predictor.profiles import LocalOpModel

    m = LocalOpModel(_synthetic())
    lin = lambda rows, h: m.predict("linear", {"B": 1, "M": rows, "N": 4 * h, "K": h})  # noqa: E731
    # inside the grid: close to the generating law
    assert lin(512, 1024) == pytest.approx(5e-6 + 2 * 512 * 4096 * 1024 / 100e9, rel=0.15)
    # monotone in size, and linear in work far outside the grid (efficiency held constant)
    assert lin(128, 512) < lin(512, 512) < lin(2048, 512)
    big, bigger = lin(16384, 4096), lin(32768, 4096)
    assert bigger / big == pytest.approx(2.0, rel=0.1)
    g1, g2 = m.predict("gelu", {"B": 8192, "H": 4096}), m.predict("gelu", {"B": 65536, "H": 4096})
    assert g2 / g1 == pytest.approx(8.0, rel=0.2)
    # a dtype that was not profiled falls back to fp32 measurements
    assert m.predict("add", {"B": 512, "H": 1024}, "bf16") > 0


def test_predictor_uses_the_profile_for_cpu_devices(tmp_path, monkeypatch):
    import hetero
    from hetero.predictor import optime, profiles

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    profiles.write_records(profiles.cache_path("cpu"), _synthetic())
    cpu = hetero.load_catalog()["cpu"]
    model, prov = optime.op_model_for("cpu", cpu)
    assert prov == "profile"
    dims = {"B": 1, "M": 512, "N": 4096, "K": 1024}
    assert model.predict("linear", dims, "fp32", cpu) == pytest.approx(
        profiles.local_op_model("cpu").predict("linear", dims, "fp32", cpu))


def test_bad_profile_csv_is_reported(tmp_path):
    from hetero.predictor.profiles import ProfileError, read_records

    p = tmp_path / "bad.csv"
    p.write_text("op,device,B,M,N,K,H,latency_ms\nlinear,cpu,1,x,2,2,,0.1\n")
    with pytest.raises(ProfileError, match=r"row 2, column 'M'"):
        read_records(p)


def test_emulated_cpu_devices_use_the_cpu_profile(tmp_path, monkeypatch):
    import hetero
    from hetero.predictor import optime, profiles

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    profiles.write_records(profiles.cache_path("cpu"), _synthetic())
    cluster = hetero.load_cluster({"name": "emu", "devices": {"cpu-slow": {"base": "cpu", "vendor": "emu-b", "slowdown": 2.0}},
                                   "groups": [{"name": "slow", "device": "cpu-slow", "nodes": 1, "devices_per_node": 2}]})
    dev = cluster.device_type("slow")
    model, prov = optime.op_model_for("cpu-slow", dev)
    assert prov == "profile"
    dims = {"B": 1024, "H": 1024}
    assert model.predict("add", dims, "fp32", dev) == pytest.approx(
        2.0 * profiles.local_op_model("cpu").predict("add", dims, "fp32", dev))
