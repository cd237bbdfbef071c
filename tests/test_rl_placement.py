"""Generation in the predictor (decode shape, cache memory) and the RL placement search."""
from __future__ import annotations

import json

import pytest

import hetero
from hetero.cli import main
from hetero.planner import rl_placement as rp
from hetero.predictor import generation as gen
from hetero.predictor import rl as rlpred
from hetero.predictor.optime import GEMM_EFFICIENCY, MEMORY_EFFICIENCY

from conftest import CONFIGS

pytestmark = pytest.mark.timeout(60)

H100_H20 = CONFIGS / "clusters" / "h100-h20.yaml"
LOCAL = CONFIGS / "clusters" / "local-cpu.yaml"


@pytest.fixture(scope="module")
def big():
    return hetero.load_cluster(H100_H20), hetero.load_model(CONFIGS / "models" / "llama2-7b.yaml")


def test_decode_step_grows_with_context_as_the_cache_bytes_over_bandwidth(big):
    cluster, model = big
    bw = cluster.device_type("h100").effective_memory_bandwidth * MEMORY_EFFICIENCY
    rows = 32
    a, b = gen.decode_step(cluster, "h100", model, rows, 1024), gen.decode_step(cluster, "h100", model, rows, 3072)
    assert a.bound == b.bound == "memory"
    cache = rows * 2048 * gen.kv_bytes_per_token(model)          # the extra keys and values read
    assert b.seconds - a.seconds == pytest.approx(cache / bw, rel=0.05)
    # the same bytes per extra row at a fixed context: linear in the batch
    r1, r2, r3 = (gen.decode_step(cluster, "h100", model, r, 2048).device_s for r in (16, 32, 48))
    assert r3 - r2 == pytest.approx(r2 - r1, rel=0.02)
    assert r2 - r1 == pytest.approx(16 * 2048 * gen.kv_bytes_per_token(model) / bw, rel=0.15)


def test_decode_reads_the_weights_once_until_compute_takes_over(big):
    cluster, model = big
    h100 = cluster.device_type("h100")
    weights = gen.copy_weight_bytes(model) / (h100.effective_memory_bandwidth * MEMORY_EFFICIENCY)
    one, eight = (gen.decode_step(cluster, "h100", model, r, 16).device_s for r in (1, 8))
    assert one == pytest.approx(weights, rel=0.05)      # one row: the weights' bytes, nearly nothing else
    assert eight < 1.1 * one                             # eight rows cost about the same
    # past peak / bandwidth rows the GEMMs are compute-bound: time per row levels at FLOPs / peak
    big_batch = gen.decode_step(cluster, "h100", model, 4096, 16)
    assert big_batch.bound == "compute"
    flops = 2 * 4096 * (model.num_layers * model.params_per_layer() + model.vocab_size * model.hidden_size)
    gemms = flops / (h100.matrix_flops("bf16") * GEMM_EFFICIENCY)
    assert gemms < big_batch.device_s < 1.5 * gemms      # the GEMMs' FLOPs, and the rows' elementwise passes
    double = gen.decode_step(cluster, "h100", model, 8192, 16)
    assert double.device_s == pytest.approx(2 * big_batch.device_s, rel=0.02)   # linear in the rows now
    # bandwidth-bound, the H20 (4.0 TB/s) decodes faster than the H100 (3.35); compute-bound, slower
    assert gen.decode_step(cluster, "h20", model, 16, 2048).seconds < gen.decode_step(cluster, "h100", model, 16, 2048).seconds
    assert gen.decode_step(cluster, "h20", model, 4096, 16).seconds > 3 * big_batch.seconds


def test_small_models_are_dispatch_bound(big):
    cluster, _ = big
    tiny = hetero.load_model(CONFIGS / "models" / "tiny.yaml")
    step = gen.decode_step(cluster, "h100", tiny, 8, 16)
    assert step.bound == "host" and step.seconds == step.host_s


def test_cache_memory_bounds_the_sequences_and_splits_the_rows_in_waves(big):
    cluster, model = big
    fits = [gen.sequences_fit(cluster, "h100", model, n) for n in (1024, 2048, 4096)]
    assert fits[0] > fits[1] > fits[2] > 0
    free = cluster.device_type("h100").memory * (1 - gen.WORKSPACE_FRACTION) - gen.copy_weight_bytes(model)
    assert fits[2] * 4096 * gen.kv_bytes_per_token(model) <= free < (fits[2] + 1) * 4096 * gen.kv_bytes_per_token(model)
    assert gen.sequences_fit(cluster, "h100", model, 4096, tp=2) > 2 * fits[2]   # tp halves weights and cache
    rows = fits[2] * 2 + 1
    assert gen.generation_time(cluster, "h100", model, rows, 2048, 2048).waves == 3


def test_the_catalog_case_generation_on_h20_training_on_h100(big):
    """Llama 2 7B, the generation-heavy job: a prompt group is generated faster on an H20 copy."""
    cluster, model = big
    job = _job(cluster)
    sizes = rp.job_sizes(job)
    _, per = rlpred.rollout_time(cluster, model, sizes, [("h100", 1), ("h20", 1)])
    assert per["h20"] < per["h100"]


def test_the_catalog_case_trains_at_least_4x_faster_on_h100(big):
    """The actor as `hetero rl` prices it: the job's model, with the runtime's fused attention."""
    cluster, _ = big
    job = _job(cluster)
    assert job.model_spec.attention == "fused"
    plans = rp._Plans(cluster, job.model_spec, job.samples_per_step)
    h100 = plans({"h100": 8})[1].iteration_time_s
    h20 = plans({"h20": 8})[1].iteration_time_s
    assert h20 >= 4 * h100


def test_a_copy_too_large_for_one_device_generates_tensor_parallel(big):
    cluster, model = big
    assert rp.copy_tp(cluster, model, "h100", 2048, 16) == 1
    seventy = hetero.load_model(CONFIGS / "models" / "llama2-70b.yaml")   # 140 GB of bf16 weights
    tp = rp.copy_tp(cluster, seventy, "h100", 2048, 16)
    assert tp == 2 and gen.sequences_fit(cluster, "h100", seventy, 2048, 1) < 16 <= gen.sequences_fit(
        cluster, "h100", seventy, 2048, 2)
    one, four = (gen.decode_step(cluster, "h100", seventy, 16, 1024, t) for t in (1, 4))
    assert four.comm_s > 0 and four.device_s == pytest.approx(one.device_s / 4, rel=0.05)


def _job(cluster):
    from hetero.rl.job import load_rl_job

    return load_rl_job(CONFIGS / "rl" / "llama2-7b-h100-h20.yaml", cluster)


def _auto_job(tmp_path, cluster):
    from hetero.rl.job import load_rl_job

    text = (CONFIGS / "rl" / "grpo-disaggregated.yaml").read_text().replace("mode: disaggregated", "mode: auto")
    text = text.replace("actor: {plan: actor-plan.yaml}", "actor: {groups: [fast]}")
    path = CONFIGS / "rl" / "grpo-disaggregated.yaml"
    return load_rl_job({**_yaml(text)}, cluster, source=str(tmp_path / "job.yaml"), base_dir=str(path.parent))


def _yaml(text):
    import yaml

    return yaml.safe_load(text)


def test_auto_weighs_collocated_and_disaggregated_splits(tmp_path):
    cluster = hetero.load_cluster(LOCAL)
    job = _auto_job(tmp_path, cluster)
    labels = [c.label() for c in rp.candidates(job, cluster)]
    assert labels == ["collocated on fast:2", "collocated on slow:2", "collocated on fast:2+slow:2",
                      "actor fast:2 | rollout slow:2", "actor slow:2 | rollout fast:2",
                      "actor fast:1 | rollout fast:1", "actor slow:1 | rollout slow:1"]


def test_the_placement_rated_fastest_is_chosen(tmp_path, monkeypatch):
    cluster = hetero.load_cluster(LOCAL)
    job = _auto_job(tmp_path, cluster)
    real = rlpred.rl_step
    for favourite in ("actor slow:2 | rollout fast:2", "collocated on slow:2"):
        def rated(cluster_, model, plan, sizes, mode, rollout=None, rollout_tp=1, train=None, _f=favourite):
            p = real(cluster_, model, plan, sizes, mode, rollout, rollout_tp, train)
            label = rp.Candidate(mode, plan.devices_by_group(), rollout or plan.devices_by_group()).label()
            p.step_s = 0.5 if label == _f else 1.0 + len(label) / 100
            return p
        monkeypatch.setattr(rlpred, "rl_step", rated)
        report = rp.predict_placements(job, cluster)
        assert report.placements[report.chosen].label() == favourite
    monkeypatch.setattr(rlpred, "rl_step", real)
    report = rp.predict_placements(job, cluster)
    steps = [c.prediction.step_s for c in report.placements]
    assert report.chosen == steps.index(min(steps))
    assert report.reasons and "shortest step" in report.reasons[0]


def test_a_placement_that_does_not_fit_is_never_chosen(tmp_path, monkeypatch):
    cluster = hetero.load_cluster(LOCAL)
    job = _auto_job(tmp_path, cluster)
    real = rlpred.rl_step

    def rated(*args, **kw):
        p = real(*args, **kw)
        if args[4] == "collocated":   # the shortest step, but it does not fit
            p.step_s, p.fits = 1e-6, False
        return p
    monkeypatch.setattr(rlpred, "rl_step", rated)
    report = rp.predict_placements(job, cluster)
    assert report.placements[report.chosen].mode == "disaggregated"
    assert all(c.problem for c in report.placements if c.mode == "collocated")


def test_staleness_overlaps_rollout_with_training(tmp_path):
    cluster = hetero.load_cluster(LOCAL)
    job = _auto_job(tmp_path, cluster)
    plan = hetero.load_plan(CONFIGS / "rl" / "actor-plan.yaml", cluster, job.model_spec)
    sizes = rp.job_sizes(job)
    serial = rlpred.rl_step(cluster, job.model_spec, plan, sizes, "disaggregated", {"slow": 2})
    ahead = rlpred.rl_step(cluster, job.model_spec, plan, rlpred.RLSizes(**{**sizes.__dict__, "staleness": 1}),
                           "disaggregated", {"slow": 2})
    assert serial.step_s == pytest.approx(serial.sync_s + serial.rollout_s + serial.train_s)
    send = ahead.sync_send_s   # the actor checksums its share before it trains; the rollout the rest
    assert 0 < send < ahead.sync_s
    assert ahead.step_s == pytest.approx(max(send + ahead.train_s, ahead.sync_s - send + ahead.rollout_s))
    assert ahead.step_s < serial.step_s


def test_predict_prints_the_placements_and_json(tmp_path, capsys):
    job = CONFIGS / "rl" / "grpo-disaggregated.yaml"
    assert main(["rl", str(job), "--cluster", str(LOCAL), "--predict", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == 0 and len(out["placements"]) == 1
    p = out["placements"][0]
    assert p["mode"] == "disaggregated" and p["actor"]["groups"] == ["fast"] and p["rollout"] == {"groups": ["slow"]}
    assert set(p["predicted"]) == {"step_s", "rollout_s", "train_s", "sync_s", "samples_per_s"}
    assert p["actor"]["plan"]["global_batch_size"] == 64
    assert main(["rl", str(job), "--cluster", str(LOCAL), "--predict"]) == 0
    text = capsys.readouterr().out
    assert "chosen: 0 (disaggregated" in text and "rollout s" in text


def test_predict_rl_step_is_the_summary_prediction():
    from hetero.rl.job import load_rl_job

    cluster = hetero.load_cluster(LOCAL)
    job = load_rl_job(CONFIGS / "rl" / "grpo-disaggregated.yaml", cluster)
    got = rp.predict_rl_step(job, cluster, job.placement_dict())
    assert set(got) == {"step_s", "rollout_s", "train_s", "sync_s"}
    assert got == rp.predict_rl_step(job, cluster)
    assert got["step_s"] == pytest.approx(got["sync_s"] + got["rollout_s"] + got["train_s"])
