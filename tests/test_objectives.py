"""Plan objectives (cost, memory headroom, energy), the plan encoding, MaOEA-CS and plan fronts
(``hetero plan --objectives``): the front is mutually non-dominated, holds the planner's best
throughput and a plan at least as cheap as the seeds, and bad input is one line with exit 1."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

import hetero
from hetero.planner.encoding import PlanEncoding
from hetero.planner.front import ObjectiveError, parse_objectives, search_front
from hetero.planner.maoea_cs import angle_select, corner_indices, maoea_cs, non_dominated
from hetero.planner.pick import PickError, pick
from hetero.predictor import cost_model_for
from hetero.predictor.objectives import MAXIMISE, busy_seconds, objectives
from hetero.specs.device import catalog_raw, load_catalog
from hetero.specs.plan import check_plan

from conftest import run_cli
from helpers import cluster_dict, group_dict

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ROOT / "configs" / "clusters"
MODELS = ROOT / "configs" / "models"
FIVE = ("throughput", "cost", "memory_headroom", "energy", "resilience")


def _dominates(a: dict, b: dict, names) -> bool:
    ge = all((a[n] >= b[n]) if n in MAXIMISE else (a[n] <= b[n]) for n in names)
    gt = any((a[n] > b[n]) if n in MAXIMISE else (a[n] < b[n]) for n in names)
    return ge and gt


# ----------------------------------------------------------------------------- catalog + objectives
@pytest.mark.parametrize("name", sorted(catalog_raw()))
def test_every_catalog_device_has_price_and_power_with_sources(name):
    dev = load_catalog()[name]
    assert dev.price_per_hour and dev.price_per_hour > 0
    assert dev.tdp and dev.idle_power and 0 < dev.idle_power < dev.tdp
    for fld in ("price_per_hour", "tdp", "idle_power"):
        assert dev.sources.get(fld, "").strip(), f"{name}: {fld} has no source"


def test_objectives_follow_their_definitions_on_a_shipped_example():
    cluster = hetero.load_cluster(CLUSTERS / "mixed-vendor.yaml")
    model = hetero.load_model(MODELS / "llama2-7b.yaml")
    plan = hetero.load_plan(ROOT / "configs" / "plans" / "mixed-vendor-llama2-7b.yaml")
    pred = hetero.predict(cluster, model, plan)
    obj = pred.objectives
    assert obj == objectives(cluster, plan, pred)
    T, tokens = pred.iteration_time_s, pred.tokens_per_s * pred.iteration_time_s
    used = plan.devices_by_group()
    usd_h = sum(n * cluster.device_types[g].price_per_hour for g, n in used.items())
    assert obj["throughput"] == pred.tokens_per_s
    assert obj["cost"] == pytest.approx(usd_h / 3600 * T / tokens * 1e6)
    frees = [1 - s.peak_memory_bytes / s.memory_capacity_bytes for p in pred.pipelines for s in p.stages]
    assert obj["memory_headroom"] == pytest.approx(min(frees))
    # energy between every used device idle the whole step and every one at board power
    idle = sum(n * cluster.device_types[g].idle_power for g, n in used.items()) * T / tokens
    full = sum(n * cluster.device_types[g].tdp for g, n in used.items()) * T / tokens
    assert idle < obj["energy"] < full
    assert sum(n for _, n, _ in busy_seconds(plan, pred)) == sum(used.values())
    assert all(0 < b <= T * 1.0001 for _, _, b in busy_seconds(plan, pred))


def test_predict_json_adds_objectives_and_keeps_the_prediction_fields(tmp_path):
    args = ["predict", "--cluster", str(CLUSTERS / "h100-a100.yaml"), "--model", str(MODELS / "llama3-8b.yaml"),
            "--plan", str(ROOT / "configs" / "plans" / "h100-a100-llama3-8b.yaml"), "--json"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert set(d) == {"iteration_time_s", "tokens_per_s", "samples_per_s", "mfu", "fits_memory",
                      "upper_bound_tokens_per_s", "pipelines", "objectives"}
    assert set(d["objectives"]) == {"throughput", "cost", "memory_headroom", "energy"}
    assert d["objectives"]["throughput"] == d["tokens_per_s"]
    assert all(v > 0 for v in d["objectives"].values())


def _priceless_cluster():
    return hetero.load_cluster(cluster_dict(
        group_dict("a", "A100-SXM4-40GB", 1, 8), group_dict("b", "mygpu", 1, 8), name="own",
        devices={"mygpu": {"vendor": "nvidia", "memory": "40 GiB", "memory_bandwidth": "1.5 TB/s",
                           "peak_flops": {"fp32": "19.5 TFLOPS", "bf16": "312 TFLOPS"},
                           "peak_flops_vector": {"fp32": "19.5 TFLOPS"}}}))


def test_objective_names_and_catalog_data_are_checked():
    cluster = _priceless_cluster()
    assert parse_objectives("throughput,memory_headroom", cluster) == ("throughput", "memory_headroom")
    with pytest.raises(ObjectiveError, match="unknown objective 'thruput'"):
        parse_objectives("thruput,cost")
    with pytest.raises(ObjectiveError, match=r"price_per_hour of device 'mygpu'.*devices\.mygpu"):
        parse_objectives("throughput,cost", cluster)
    with pytest.raises(ObjectiveError, match="tdp of device 'mygpu'"):
        parse_objectives("throughput,energy", cluster)


# ----------------------------------------------------------------------------- encoding
def test_random_vectors_decode_to_valid_plans_that_fit():
    cluster = hetero.load_cluster(CLUSTERS / "mixed-vendor.yaml")
    model = hetero.load_model(MODELS / "llama2-7b.yaml")
    cm = cost_model_for(cluster, model)
    enc = PlanEncoding(cluster, model, 256, cm)
    rng = np.random.default_rng(0)
    shapes, idle = set(), 0
    for _ in range(60):
        plan, decoded = enc.decode(rng.random(enc.n_var))
        assert plan is not None
        check_plan(plan, cluster, model)
        pred = hetero.predict(cluster, model, plan)
        if not pred.fits_memory:   # the repair the front search applies
            pred = hetero.predict(cluster, model, enc.plain(decoded))
        assert pred.fits_memory
        used = plan.devices_by_group()
        idle += sum(used.values()) < cluster.num_devices
        shapes.add(tuple(sorted(used.items())))
    assert len(shapes) >= 10 and idle >= 10   # the encoding reaches many device sets, idle devices included


def test_a_planner_plan_encodes_to_its_structure():
    cluster = hetero.load_cluster(CLUSTERS / "h100-a100.yaml")
    model = hetero.load_model(MODELS / "llama3-8b.yaml")
    best = hetero.search(cluster, model, 128, top_k=1, interleaves=())[0].plan
    enc = PlanEncoding(cluster, model, 128, cost_model_for(cluster, model))
    plan, _ = enc.decode(enc.encode(best))
    assert plan.devices_by_group() == best.devices_by_group()
    assert (plan.recompute, plan.zero_stage, plan.micro_batch_size) == (best.recompute, best.zero_stage,
                                                                        best.micro_batch_size)
    assert [(p.replicas, [(s.group, s.tp) for s in p.stages]) for p in plan.pipelines] == \
        [(p.replicas, [(s.group, s.tp) for s in p.stages]) for p in best.pipelines]


# ----------------------------------------------------------------------------- MaOEA-CS
def _dtlz2(X: np.ndarray, m: int = 3) -> np.ndarray:
    g = ((X[:, m - 1:] - 0.5) ** 2).sum(1)
    F = np.ones((len(X), m)) * (1 + g)[:, None]
    for i in range(m):
        F[:, i] *= np.prod(np.cos(X[:, : m - 1 - i] * np.pi / 2), axis=1)
        if i:
            F[:, i] *= np.sin(X[:, m - 1 - i] * np.pi / 2)
    return F


def test_maoea_cs_converges_on_dtlz2_and_finds_its_corners():
    """DTLZ2 (3 objectives): the front is the unit sphere's positive octant, corners on the axes."""
    seen = []

    def evaluate(X):
        F = _dtlz2(X)
        seen.append(F)
        return F

    phases = []
    X, F = maoea_cs(evaluate, 8, 2000, pop_size=40, seed=1, log=lambda ph, n: phases.append(ph))
    assert phases[0] == 1 and phases[-1] == 2          # both phases ran
    norms = np.linalg.norm(F, axis=1)
    assert np.median(norms) < 1.05                     # the population reached the sphere
    allF = np.vstack(seen)
    nd = allF[non_dominated(allF)]
    for i in range(3):                                  # a near-corner solution for each axis
        others = np.delete(nd, i, axis=1)
        assert np.linalg.norm(others, axis=1).min() < 0.1
    # random search with the same budget gets nowhere near as close
    R = _dtlz2(np.random.default_rng(1).random((2000, 8)))
    assert np.median(np.linalg.norm(F, axis=1)) < np.median(np.linalg.norm(R[non_dominated(R)], axis=1))


def test_angle_selection_keeps_corners_and_spreads():
    pts = np.array([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [0.69, 0.71], [0.5, 0.86], [0.86, 0.5]])
    sel = set(angle_select(pts, 4, corner_indices(pts)).tolist())
    assert {0, 1} <= sel and not {2, 3} <= sel   # both axes kept; of two near-twins at most one


# ----------------------------------------------------------------------------- pick
class _P:
    def __init__(self, **obj):
        self.objectives = obj


def test_pick_rules():
    front = [_P(throughput=100.0, cost=50.0), _P(throughput=96.0, cost=30.0), _P(throughput=90.0, cost=20.0),
             _P(throughput=60.0, cost=10.0)]
    names = ("throughput", "cost")
    assert pick(front, "fastest", names) is front[0]
    assert pick(front, "fastest under 40 USD/Mtok", names) is front[1]
    assert pick(front, "cheapest within 5% of fastest", names) is front[1]
    assert pick(front, "cheapest within 10% of fastest", names) is front[2]
    assert pick(front, "cheapest over 80 tokens/s", names) is front[2]
    with pytest.raises(PickError, match="no plan of the front meets"):
        pick(front, "fastest under 5 USD/Mtok", names)
    with pytest.raises(PickError, match="cannot read"):
        pick(front, "fastest under forty", names)
    with pytest.raises(PickError, match="not searched"):
        pick(front, "most resilient", names)


# ----------------------------------------------------------------------------- fronts
def test_five_objective_front_of_a_three_group_cluster():
    """local-cpu-3vendor (three groups, three vendors), five objectives, a small budget."""
    cluster = hetero.load_cluster(CLUSTERS / "local-cpu-3vendor.yaml")
    model = hetero.load_model(MODELS / "tiny-llama.yaml")
    res = search_front(cluster, model, 16, FIVE, budget=160, seed=0)
    front = [p.objectives for p in res.front]
    assert len(front) >= 5
    assert res.evaluations == 160
    for i, a in enumerate(front):
        assert set(a) == set(FIVE)
        for j, b in enumerate(front):
            assert i == j or not _dominates(a, b, FIVE), (a, b)
    for p in res.front:
        check_plan(p.plan, cluster, model)
        assert p.prediction.fits_memory
        assert 0 < p.objectives["resilience"] <= 1
    best = hetero.search(cluster, model, 16, top_k=1)[0].prediction.tokens_per_s
    assert max(f["throughput"] for f in front) >= 0.99 * best
    cheapest_seed = min(v["cost"] for k, v in res.seeds.items() if k == "fastest" or k.startswith("alone:"))
    assert {k for k in res.seeds if k.startswith("alone:")} == {f"alone:{g.name}" for g in cluster.groups}
    assert min(f["cost"] for f in front) <= cheapest_seed * (1 + 1e-12)


def test_plan_objectives_cli_json_pick_and_plot(tmp_path):
    out, png = tmp_path / "plan.yaml", tmp_path / "front.png"
    proc = run_cli("plan", "--cluster", str(CLUSTERS / "h100-a100.yaml"), "--model", str(MODELS / "llama3-8b.yaml"),
                   "--global-batch-size", "128", "--objectives", "throughput,cost,memory_headroom,energy",
                   "--budget", "120", "--pick", "cheapest within 5% of fastest", "-o", str(out), "--plot", str(png),
                   "--json", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert set(d) == {"front", "evaluations", "seconds"} and d["evaluations"] == 120
    objs = [f["objectives"] for f in d["front"]]
    fastest = max(o["throughput"] for o in objs)
    near = [o for o in objs if o["throughput"] >= 0.95 * fastest]
    written = hetero.load_plan(yaml.safe_load(out.read_text()))
    chosen = next(f for f in d["front"] if hetero.load_plan(f["plan"]).to_dict() == written.to_dict())
    assert chosen["objectives"]["cost"] == min(o["cost"] for o in near)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra, message", [
    (["--objectives", "throughput,speed"], "unknown objective 'speed'"),
    (["--objectives", "throughput,cost", "--pick", "fastest under 0.000001 USD/Mtok"], "no plan of the front meets"),
    (["--pick", "fastest"], "--pick needs --objectives"),
])
def test_plan_objectives_bad_input_is_one_line(tmp_path, extra, message):
    out = tmp_path / "plan.yaml"
    proc = run_cli("plan", "--cluster", str(CLUSTERS / "local-cpu-3vendor.yaml"), "--model",
                   str(MODELS / "tiny-llama.yaml"), "--global-batch-size", "16", "--budget", "40", "-o", str(out),
                   "--no-progress", *extra)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_plan_objectives_names_a_device_without_price(tmp_path):
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(_priceless_cluster().to_dict()))
    proc = run_cli("plan", "--cluster", str(path), "--model", str(MODELS / "llama2-7b.yaml"),
                   "--global-batch-size", "64", "--objectives", "throughput,cost", "--no-progress")
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "mygpu" in proc.stderr and "price_per_hour" in proc.stderr and "fix" in proc.stderr
    assert math.isfinite(1.0)


def test_a_cluster_file_sets_its_own_price_and_power():
    base = cluster_dict(group_dict("a", "A100-SXM4-40GB", 1, 8), name="own")
    own = dict(base, devices={"A100-SXM4-40GB": {"price_per_hour": 1.0, "tdp": "200 W", "idle_power": "20 W"}})
    model = hetero.load_model(MODELS / "gpt3-1.3b.yaml")
    plan = hetero.search(hetero.load_cluster(base), model, 64, top_k=1, upper_bound=False)[0].plan
    a = hetero.predict(hetero.load_cluster(base), model, plan).objectives
    b = hetero.predict(hetero.load_cluster(own), model, plan).objectives
    assert b["throughput"] == a["throughput"]
    assert b["cost"] == pytest.approx(a["cost"] * 1.0 / load_catalog()["A100-SXM4-40GB"].price_per_hour)
    assert b["energy"] < a["energy"]


def test_resilience_is_what_the_elastic_replanner_keeps_after_the_worst_node():
    import types

    from hetero.planner.front import Resilience
    from hetero.runtime.elastic.policy import replan
    from hetero.specs.cluster import without_devices

    cluster = hetero.load_cluster(CLUSTERS / "local-cpu-3vendor.yaml")
    model = hetero.load_model(MODELS / "tiny-llama.yaml")
    res = hetero.search(cluster, model, 16, top_k=1)
    best, alone = res[0], res.best_alone["vendor-a"]
    r = Resilience(cluster, model, 16)
    kept = {}
    for g in best.plan.devices_by_group():
        lost = [types.SimpleNamespace(group=g, node=0)] * cluster.group(g).devices_per_node
        kept[g] = replan(without_devices(cluster, lost), model, best.plan).prediction.tokens_per_s
    assert r(best.plan, best.tokens_per_s) == pytest.approx(min(1.0, min(kept.values()) / best.tokens_per_s))
    assert r(best.plan, best.tokens_per_s) < 1.0        # the fastest plan loses speed with any node
    # a plan of vendor-a alone: after vendor-a's node goes, the other groups carry on
    t_alone = hetero.predict(cluster, model, alone).tokens_per_s
    assert r(alone, t_alone) == pytest.approx(min(1.0, r.replanned("vendor-a", bool(alone.zero_stage)) / t_alone))
    assert len(r.cache) <= 2 * len(cluster.groups)      # one replanner search per group (and ZeRO or not)
