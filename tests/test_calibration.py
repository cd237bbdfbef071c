"""Calibration: recovering known factors, save/load, bad input, and accuracy on the vTrain runs."""
import csv
import dataclasses
import itertools
import json
import sys

import pytest

from conftest import REPO, run_cli
from helpers import cluster_dict, group_dict, link_dict, network_dict

import hetero
from hetero.predictor.calibration import (ALL, RUN_PLACEMENT, Calibration, CalibrationError, Run, calibrate, evaluate,
                                          load_calibration, predict_calibrated, read_runs, run_setup)
from hetero.predictor.factors import CalibrationFactors

CLUSTER = cluster_dict(group_dict("a100", "A100-SXM4-80GB", 4, 8, intra_node=link_dict("300 GB/s", "5 us")), name="lab",
                       network=network_dict(inter_node=link_dict("100 GB/s", "10 us")))
COLUMNS = ["device", "devices_per_node", "num_devices", "global_batch_size", "micro_batch_size", "hidden_size",
           "num_attention_heads", "num_layers", "seq_length", "vocab_size", "dtype", "recompute", "tp", "dp", "pp",
           "iteration_time_ms"]
TRUTH = {"compute": 1.3, "communication": 0.8, "layer_overhead_s": 3e-4, "iteration_overhead_s": 0.02,
         "op_floor_s": 5e-5, "network": 1.6, "matrix": 0.7}


def truth_calibration(device="A100-SXM4-80GB"):
    return Calibration(factors={device: CalibrationFactors(**{k: TRUTH[k] for k in ALL[:4]})},
                       extra={device: {k: TRUTH[k] for k in ALL[4:]}})


def synthetic_runs(cluster):
    """A varied set of runs (1 to 32 GPUs, tp/dp/pp mixes, small and large models), timed by the
    predictor itself with the TRUTH factors."""
    runs = []
    shapes = [(512, 8, 8, 512), (1024, 16, 12, 1024), (2048, 16, 16, 1024), (4096, 32, 24, 2048)]
    layouts = [(1, 1, 1), (2, 1, 1), (8, 1, 1), (1, 4, 1), (2, 2, 2), (4, 2, 1), (8, 4, 1), (1, 8, 4), (8, 2, 2),
               (4, 8, 1), (2, 4, 4)]
    for (h, a, L, s), (tp, dp, pp), mbs in itertools.product(shapes, layouts, (1, 4)):
        n = tp * dp * pp
        if L % pp:
            continue
        gbs = dp * mbs * 4 * pp
        runs.append(Run(device="A100-SXM4-80GB", devices_per_node=8, num_devices=n, global_batch_size=gbs,
                        micro_batch_size=mbs, hidden_size=h, num_attention_heads=a, num_layers=L, seq_length=s,
                        vocab_size=51200, dtype="fp16", recompute="full", tp=tp, dp=dp, pp=pp,
                        iteration_time_ms=1.0, row=len(runs) + 2))
    cal = truth_calibration()
    out = []
    for r in runs:
        c, m, p = run_setup(cluster, r)
        t = predict_calibrated(c, m, p, cal, placement=RUN_PLACEMENT).iteration_time_s
        out.append(dataclasses.replace(r, iteration_time_ms=t * 1e3))
    return out


def write_runs(path, runs):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for r in runs:
            w.writerow([getattr(r, c) for c in COLUMNS])
    return path


@pytest.fixture(scope="module")
def cluster():
    return hetero.load_cluster(CLUSTER)


@pytest.fixture(scope="module")
def synthetic(cluster, tmp_path_factory):
    runs = synthetic_runs(cluster)
    path = write_runs(tmp_path_factory.mktemp("cal") / "runs.csv", runs)
    return runs, path


def test_recovers_known_factors(cluster, synthetic):
    runs, path = synthetic
    assert len(runs) >= 40 and any(r.num_devices > 8 for r in runs)
    cal = hetero.calibrate(cluster, str(path))
    theta = dict(zip(ALL, cal.theta("A100-SXM4-80GB")))
    for k in ("compute", "communication", "network", "matrix"):
        assert theta[k] == pytest.approx(TRUTH[k], rel=0.05), (k, theta)
    for k in ("layer_overhead_s", "iteration_overhead_s", "op_floor_s"):
        assert theta[k] == pytest.approx(TRUTH[k], rel=0.10, abs=TRUTH[k] * 0.1), (k, theta)
    assert cal.meta["fit"]["A100-SXM4-80GB"]["mape"] < 0.01
    assert cal.meta["fit"]["A100-SXM4-80GB"]["held_out_mape"] < 0.02   # exact model: held-out ~ in-sample
    # the standard factors reach the predictor itself
    r = runs[5]
    c, m, p = run_setup(cluster, r)
    plain = hetero.predict(c, m, p).iteration_time_s
    assert hetero.predict(c, m, p, calibration=cal).iteration_time_s != pytest.approx(plain, rel=1e-3)


def test_predict_applies_the_full_fit(cluster, synthetic):
    """hetero.predict with the calibration reproduces the synthetic measurements (extras included),
    and the four-factor fit is never better than the full one."""
    runs, _ = synthetic
    cal = calibrate(cluster, runs[:24])
    name = "A100-SXM4-80GB"
    assert set(cal.standard) == {name}
    f = cal.factors_for(name, None)
    assert f.op_floor_s == cal.extra[name]["op_floor_s"] and f.network == cal.extra[name]["network"]
    assert f.matrix == cal.extra[name]["matrix"]
    assert f.op_model == cal.op_model.get(name)
    # the runs were generated with a kernel floor: hetero.predict itself must reproduce them
    for r in runs[:8]:
        c, m, p = run_setup(cluster, r)
        assert hetero.predict(c, m, p, calibration=cal).iteration_time_s == pytest.approx(r.iteration_time_s, rel=0.02)
    assert cal.meta["fit"][name]["mape_standard_factors"] >= cal.meta["fit"][name]["mape"] - 1e-6


def test_save_load_round_trip(cluster, synthetic, tmp_path):
    runs, _ = synthetic
    cal = calibrate(cluster, runs[:20])
    path = cal.save(tmp_path / "sub" / "cal.json")
    assert not list((tmp_path / "sub").glob(".*tmp"))   # atomic write leaves no temporary file
    back = hetero.load_calibration(path)
    name = "A100-SXM4-80GB"
    assert back.theta(name) == pytest.approx(cal.theta(name))
    assert back.factors_for(name, None) == cal.factors_for(name, None)
    assert back.standard == cal.standard and back.op_model == cal.op_model
    assert back.factors_for("H100-SXM5-80GB", None) is None
    assert evaluate(cluster, runs[:3], back) == pytest.approx(evaluate(cluster, runs[:3], cal))


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d.update(format="pickle"), "field 'format'"),
    (lambda d: d["factors"]["A100-SXM4-80GB"].update(compute="fast"), "factors.A100-SXM4-80GB.compute"),
    (lambda d: d["factors"]["A100-SXM4-80GB"].update(compute=-1.0), "factors.A100-SXM4-80GB.compute"),
    (lambda d: d["factors"]["A100-SXM4-80GB"].update(speed=2.0), "factors.A100-SXM4-80GB.speed"),
    # beyond the range calibrate fits in: 1e308 s per layer made predict --json print Infinity
    (lambda d: d["factors"]["A100-SXM4-80GB"].update(layer_overhead_s=1e308),
     "factors.A100-SXM4-80GB.layer_overhead_s': must be at most 0.1"),
    (lambda d: d["standard_factors"].update({"A100-SXM4-80GB": {"compute": 1e300}}),
     "standard_factors.A100-SXM4-80GB.compute': must be at most 50"),
])
def test_load_rejects_bad_files(tmp_path, mutate, fragment):
    data = truth_calibration().to_dict()
    mutate(data)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=fragment.replace(".", r"\.")) as e:
        load_calibration(path)
    assert str(path) in str(e.value)
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_calibration(path)


def _cluster_file(tmp_path):
    import yaml

    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(CLUSTER))
    return str(p)


def test_cli_calibrate(tmp_path, synthetic):
    runs, _ = synthetic
    path = write_runs(tmp_path / "runs.csv", runs[:12])
    out = tmp_path / "cal.json"
    proc = run_cli("calibrate", "--cluster", _cluster_file(tmp_path), "--runs", str(path), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "compute" in proc.stdout and "measured ms" in proc.stdout
    assert load_calibration(out).factors_for("A100-SXM4-80GB") is not None


@pytest.mark.parametrize("edit,fragments", [
    (lambda rows: [r.pop("hidden_size") for r in rows], ["missing column", "'hidden_size'"]),
    (lambda rows: rows[1].update(iteration_time_ms="fast"), ["row 3", "'iteration_time_ms'", "not a number"]),
    (lambda rows: rows[0].update(tp="two"), ["row 2", "'tp'", "not a number"]),
    (lambda rows: rows[0].update(device="B200"), ["row 2", "'device'", "B200"]),
    # 64 devices of a group of 32 (tp x dp x pp and the batch agree, the cluster does not)
    (lambda rows: rows[1].update(num_devices=64, tp=1, pp=1, dp=64, global_batch_size=64 * rows[1]["micro_batch_size"]),
     ["row 3", "'num_devices'", "uses 64 A100-SXM4-80GB devices", "group 'a100' has 32 (4 nodes x 8)"]),
    # nodes wider than the group's: the run cannot have been laid out on these nodes
    (lambda rows: rows[1].update(devices_per_node=16),
     ["row 3", "'devices_per_node'", "the run has 16 devices per node but group 'a100' has 8 per node"]),
    # narrower nodes are a real layout, but 8 devices at 1 per node need 8 nodes, not the group's 4
    (lambda rows: rows[2].update(devices_per_node=1, num_devices=8, tp=1, dp=8, pp=1,
                                 global_batch_size=8 * rows[2]["micro_batch_size"]),
     ["row 4", "'devices_per_node'", "8 devices at 1 per node take 8 nodes but group 'a100' has 4 nodes"]),
])
def test_cli_bad_csv(tmp_path, synthetic, edit, fragments):
    runs, _ = synthetic
    rows = [{c: getattr(r, c) for c in COLUMNS} for r in runs[:4]]
    edit(rows)
    path = tmp_path / "bad.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    proc = run_cli("calibrate", "--cluster", _cluster_file(tmp_path), "--runs", str(path), "-o", str(tmp_path / "c.json"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for f in fragments + [str(path)]:
        assert f in proc.stderr, (f, proc.stderr)


HEADER = ",".join(COLUMNS)
ROW = "A100-SXM4-80GB,8,8,32,4,2048,16,16,1024,51200,fp16,full,4,2,1,356.2"


@pytest.mark.parametrize("text,fragments", [
    # a row cut short or with cells beyond the header: the cells no longer line up with their columns
    (f"{HEADER}\n{ROW}\nA100-SXM4-80GB,8,8\n", ["row 3", "has 3 cells but the header has 16 columns"]),
    (f"{HEADER}\n{ROW},7,8\n", ["row 2", "has 18 cells but the header has 16 columns"]),
    # a misspelt optional column would be ignored (the runs fitted without it): named, with the fix
    (f"{HEADER},dropuot\n{ROW},0.1\n", ["column 'dropuot'", "unknown column", "did you mean 'dropout'?"]),
    (f"{HEADER},dtype\n{ROW},fp32\n", ["column 'dtype'", "appears twice"]),
])
def test_run_log_rows_and_columns_must_line_up(tmp_path, text, fragments):
    path = tmp_path / "runs.csv"
    path.write_text(text)
    with pytest.raises(CalibrationError) as e:
        read_runs(path)
    for f in fragments + [str(path)]:
        assert f in str(e.value), (f, str(e.value))


def test_run_layout_is_checked_against_the_group_nodes():
    """A row's devices_per_node is the run's layout: it picks the group whose nodes can hold it, a
    narrower one is modelled as such, a wider one than every group's nodes is an error naming the
    row, the column and the group's value."""
    two = hetero.load_cluster({**CLUSTER, "groups": [
        group_dict("narrow", "A100-SXM4-80GB", 4, 4), group_dict("wide", "A100-SXM4-80GB", 2, 8)]})
    run = Run(device="A100-SXM4-80GB", devices_per_node=8, num_devices=16, global_batch_size=16, micro_batch_size=1,
              hidden_size=512, num_attention_heads=8, num_layers=8, seq_length=512, vocab_size=51200, dtype="fp16",
              recompute="full", tp=8, dp=2, pp=1, iteration_time_ms=1.0, row=7, source="runs.csv")
    c, _, _ = run_setup(two, run)
    assert [(g.name, g.nodes, g.devices_per_node) for g in c.groups] == [("wide", 2, 8)]
    c, _, _ = run_setup(two, dataclasses.replace(run, devices_per_node=4, tp=4, dp=4))
    assert [(g.name, g.nodes, g.devices_per_node) for g in c.groups] == [("narrow", 4, 4)]
    c, _, _ = run_setup(two, dataclasses.replace(run, devices_per_node=2, num_devices=8, tp=2, dp=4))
    assert [(g.name, g.nodes, g.devices_per_node) for g in c.groups] == [("narrow", 4, 2)]
    with pytest.raises(CalibrationError) as e:
        run_setup(two, dataclasses.replace(run, devices_per_node=16))
    assert str(e.value).startswith("runs.csv, row 7, column 'devices_per_node': the run has 16 devices per node but "
                                   "group 'narrow' has 4 per node / the run has 16 devices per node but group 'wide' "
                                   "has 8 per node in cluster 'lab' (fix: "), str(e.value)
    with pytest.raises(CalibrationError, match="row 7, column 'devices_per_node'"):
        calibrate(two, [dataclasses.replace(run, devices_per_node=16)])


@pytest.fixture(scope="module")
def vtrain_cv():
    """5-fold CV over whole runs on vTrain's A100 runs: (single-node MAPE, multi-node MAPE, uncalibrated MAPE)."""
    from conftest import shared_data_dir

    base = shared_data_dir() / "vtrain"
    if not (base / "calibration_runs.csv").is_file():
        pytest.skip(f"vTrain data not found at {base} (set HETERO_SHARED_DATA)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_vtrain as B

    cluster, mismatch = B.load_cluster(base / "cluster.yaml")
    assert mismatch is None, mismatch
    runs = read_runs(base / "calibration_runs.csv")
    pred = B.cross_validate(cluster, runs, k=5, seed=0)["predicted_s"]
    return (B.mape(pred, runs, lambda r: r.num_devices <= 8), B.mape(pred, runs, lambda r: r.num_devices > 8),
            B.mape(evaluate(cluster, runs, None), runs, lambda r: True), B.mape(pred, runs, lambda r: True))


@pytest.mark.slow
def test_vtrain_cross_validation_targets(vtrain_cv):
    """Issue targets on the benchmark's protocol (5-fold CV over whole runs, fold seed 0): <= 8%
    single-node, <= 12% multi-node (vTrain's simulator: 8.4% / 14.7%); now 7.7% / 11.6%
    (benchmarks/results/vtrain_cv.json). Fold seeds 1 and 2 give 7.6% / 13.5% and 7.8% / 12.0%:
    the multi-node figure is 22 runs, five of them 24-44% off, so it moves by points with the folds."""
    single, multi, uncal, overall = vtrain_cv
    assert overall < 0.6 * uncal
    assert single <= 0.08, single
    assert multi <= 0.12, multi


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_more_factors_never_fit_worse_in_sample():
    """The fit is damped Gauss-Newton: every accepted step lowers the real objective. The seven
    factors include the four standard ones, so on the same runs they must fit at least as well.
    Undamped, a full step overshot where the predictor's pieces change and the seven-factor fit on
    vTrain's runs ended at compute 1.74 x matrix 0.20: 12.5% / 32% in-sample vs 7.6% / 10%."""
    from conftest import shared_data_dir

    from hetero.predictor.calibration import PARAMS, fit_factors

    base = shared_data_dir() / "vtrain"
    if not (base / "calibration_runs.csv").is_file():
        pytest.skip(f"vTrain data not found at {base} (set HETERO_SHARED_DATA)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_vtrain as B

    cluster, _ = B.load_cluster(base / "cluster.yaml")
    runs = read_runs(base / "calibration_runs.csv")
    _, standard = fit_factors(cluster, runs, fit=PARAMS, held_out=False)
    theta, every = fit_factors(cluster, runs, fit=ALL, held_out=False)
    assert every["rmsle"] <= standard["rmsle"] + 1e-3, (every["rmsle"], standard["rmsle"], theta)
    assert every["mape"] <= standard["mape"] + 2e-3, (every["mape"], standard["mape"], theta)


def test_held_out_error_needs_enough_runs(cluster, synthetic):
    """Fewer than two runs per fold: no held-out error (None, shown as '-'), and the operator-model
    choice falls back to the in-sample error instead of failing."""
    runs, _ = synthetic
    cal = calibrate(cluster, runs[:6], standard=False, op_models=True)
    fit = cal.meta["fit"]["A100-SXM4-80GB"]
    assert fit["held_out_mape"] is None
    assert fit["op_model"] in ("predictor default", "roofline") and fit["mape"] < 0.05
