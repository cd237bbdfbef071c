"""hetero profile: records in the docs/formats.md format, the per-device cache, the local op model."""
import csv

import pytest
import yaml

from conftest import run_cli
from helpers import ROOT, cluster_dict, emulated_device, group_dict

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

    # a full profile cached before: a smoke test (--quick) must leave it as it is
    (cache / "profiles").mkdir(parents=True)
    (cache / "profiles" / "cpu.csv").write_text("the full profile\n")
    env = {**os.environ, "HETERO_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "hetero", "profile", "--quick", "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stderr and "is left as it is" in proc.stderr, proc.stderr
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


def test_quick_profile_leaves_the_cache_alone(quick_profile, monkeypatch):
    from hetero.predictor import profiles

    out, cache = quick_profile
    monkeypatch.setenv("HETERO_CACHE_DIR", str(cache))
    assert profiles.cache_path("cpu") == cache / "profiles" / "cpu.csv"
    assert profiles.cache_path("cpu").read_text() == "the full profile\n"
    assert not (cache / "profiles" / "cpu.meta.json").exists() and out.read_text().startswith("op,device,")


def test_cache_feeds_local_op_model(quick_profile, tmp_path, monkeypatch):
    from hetero.predictor import profiles

    out, _ = quick_profile
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))   # what a full `hetero profile` would cache
    profiles.write_records(profiles.cache_path("cpu"), profiles.read_records(out))
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
    from hetero.predictor.ops import kernel_work
    from hetero.predictor.profiles import GEMM_OPS, Record
    from hetero.measure.profiling import default_grid

    recs = []
    for op, dims in default_grid():
        flops, nbytes = kernel_work(op, dims, 4)
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
    cluster = hetero.load_cluster(cluster_dict(group_dict("slow", "cpu-slow", 1, 2), name="emu",
                                               devices={"cpu-slow": emulated_device("emu-b", 2.0)}))
    dev = cluster.device_type("slow")
    model, prov = optime.op_model_for("cpu-slow", dev)
    assert prov == "profile"
    dims = {"B": 1024, "H": 1024}
    assert model.predict("add", dims, "fp32", dev) == pytest.approx(
        2.0 * profiles.local_op_model("cpu").predict("add", dims, "fp32", dev))


def test_quick_profile_records_threads_and_block_probes(quick_profile):
    from hetero.predictor import profiles

    out, cache = quick_profile
    meta = profiles.read_meta(out)
    assert meta["threads"] == 1  # hetero launch workers run 1 thread each by default
    assert meta["blocks"], "a CPU profile times the runtime's block"
    b = meta["blocks"][0]
    for key in ("forward_ms", "backward_ms", "edges_forward_ms", "edges_backward_ms", "adamw_ms", "grad_norm_ms",
                "params"):
        assert b[key] > 0, key
    # the profile timed the kernel the runtime runs on this CPU, the one the predictor reads
    assert b["adamw_kernel"] == profiles.RUNTIME_ADAMW_KERNEL == "fused"
    assert profiles.read_meta(profiles.cache_path("cpu").parent.parent.parent / "x.csv") == {}
    # ... and the runtime's mixture-of-experts layer
    assert {m["architecture"] for m in meta["moe_blocks"]} == {"gpt", "llama"}
    assert all(m["forward_ms"] > 0 and m["backward_ms"] > 0 and m["num_experts"] >= 2 for m in meta["moe_blocks"])


def _moe_law(opm, probe, fixed=(2e-3, 3e-3), per_expert=(4e-4, 7e-4), k=(1.5, 1.3)):
    """A made-up machine's MoE layer: (forward, backward) = fixed + per_expert x experts + k x op sum."""
    from hetero.predictor import moe as M
    from hetero.predictor.profiles import moe_probe_model_dict
    from hetero.specs.model import load_model

    spec = load_model(moe_probe_model_dict(probe))
    tokens = probe["micro_batch_size"] * probe["seq_length"]
    sums = M._op_sums(opm, spec, tokens, spec.moe.num_experts, tokens * spec.moe.top_k)
    return tuple(f + p * spec.moe.num_experts + kk * s for f, p, kk, s in zip(fixed, per_expert, k, sums))


def test_the_moe_layer_is_predicted_as_its_probes_measured_it():
    """MoE probes that follow fixed + per-expert + k x operator sum give that law back, and the
    predictor's MoE layer at another shape (an expert count between the probes') is the law there:
    what the operator sum misses (routing, dispatch and combine, each expert's own dispatch)."""
    import hetero
    from hetero.measure.profiling import default_moe_probes
    from hetero.predictor import moe as M
    from hetero.predictor import profiles

    plain = profiles.LocalOpModel(_synthetic())
    probes = [p for p in default_moe_probes() if p["architecture"] == "llama"]
    for p in probes:
        p["forward_ms"], p["backward_ms"] = (t * 1e3 for t in _moe_law(plain, p))
    local = profiles.LocalOpModel(_synthetic(), meta={"moe_blocks": probes})
    (f0, p0, k0), (f1, p1, k1) = M.moe_fit(local, "llama")
    assert (f0, p0, k0) == pytest.approx((2e-3, 4e-4, 1.5), rel=1e-6)
    assert (f1, p1, k1) == pytest.approx((3e-3, 7e-4, 1.3), rel=1e-6)
    assert M.moe_fit(plain, "llama") is None   # no probes: the operator sum as it is

    # the predictor's MoE layer, one device, no expert parallelism: the law at 12 experts
    model = hetero.load_model({"name": "m", "architecture": "llama", "num_layers": 1, "hidden_size": 256,
                               "num_attention_heads": 4, "vocab_size": 1024, "seq_length": 256, "dtype": "fp32",
                               "moe": {"num_experts": 12, "top_k": 2, "expert_ffn_hidden_size": 1024}})
    cluster = hetero.load_cluster(cluster_dict(group_dict("g", "cpu", 1, 1), name="one"))
    plan = hetero.load_plan({"global_batch_size": 1, "micro_batch_size": 1,
                             "pipelines": [{"micro_batches": 1, "stages": [{"group": "g", "layers": [0, 1]}]}]},
                            cluster, model)
    from hetero.predictor.costs import StageCostModel

    for opm, expected in ((local, True), (plain, False)):
        cm = StageCostModel(cluster, model)
        cm._opm["g"] = opm
        f, b = M.layer_delta(cm, plan, 0, plan.pipelines[0].stages[0], 1)
        law = _moe_law(plain, {"architecture": "llama", "hidden_size": 256, "num_attention_heads": 4,
                               "micro_batch_size": 1, "seq_length": 256, "num_experts": 12, "top_k": 2,
                               "expert_ffn_hidden_size": 1024})
        dense = [cm.kernels_time("g", o)
                 for o in M._with_backward(model, M.mlp_forward_ops(model, 256, model.ffn_hidden_size))]
        got = (f + dense[0], b + dense[1])
        assert (got == pytest.approx(law, rel=1e-6)) is expected, (got, law)


def _probe(arch, h, b, s, model):
    """A probe whose measured times are exactly 1.5x (forward) / 1.25x (backward) the op-sum, and
    edges 2x / 3x; AdamW 3 ns and the gradient-norm pass 1 ns per parameter."""
    import hetero
    from hetero.predictor import ops as O
    from hetero.predictor.profiles import probe_model_dict

    pb = {"architecture": arch, "hidden_size": h, "num_attention_heads": h // 64, "micro_batch_size": b,
          "seq_length": s, "num_layers": 4, "vocab_size": 4096}
    spec = hetero.load_model(probe_model_dict(pb))
    t = lambda ops: sum(model.predict(o.op, o.dims_dict()) for o in ops) * 1e3  # noqa: E731
    return {**pb, "forward_ms": 1.5 * t(O.layer_forward_ops(spec, b, s, 1)),
            "backward_ms": 1.25 * t(O.layer_backward_ops(spec, b, s, 1)),
            "edges_forward_ms": 2 * t(O.embedding_forward_ops(spec, b, s, 1) + O.head_forward_ops(spec, b, s, 1)),
            "edges_backward_ms": 3 * t(O.embedding_backward_ops(spec, b, s, 1) + O.head_backward_ops(spec, b, s, 1)),
            "params": 1_000_000 * h // 256, "adamw_ms": 3e-6 * 1_000_000 * h // 256,
            "grad_norm_ms": 1e-6 * 1_000_000 * h // 256, "adamw_kernel": "fused"}


def test_a_block_is_a_fixed_dispatch_part_plus_a_multiple_of_its_operators():
    """Probes measured as fixed + k x operator sum (0.5 ms forward, 0.8 ms backward of dispatch):
    a model at a probe's own point but with narrower operators (more heads, a smaller MLP) keeps the
    fixed part, where a plain ratio would shrink it with the operators."""
    import hetero
    from hetero.predictor import ops as O
    from hetero.predictor import profiles
    from hetero.predictor.profiles import probe_model_dict

    plain = profiles.LocalOpModel(_synthetic())
    shapes = ((128, 1, 128), (256, 2, 128), (512, 2, 256))
    probes = []
    for h, b, s in shapes:
        pb = {"architecture": "llama", "hidden_size": h, "num_attention_heads": h // 64, "micro_batch_size": b,
              "seq_length": s, "num_layers": 4, "vocab_size": 4096}
        spec = hetero.load_model(probe_model_dict(pb))
        t = lambda ops: sum(plain.predict(o.op, o.dims_dict()) for o in ops) * 1e3  # noqa: E731
        probes.append({**pb, "forward_ms": 0.5 + 1.4 * t(O.layer_forward_ops(spec, b, s, 1)),
                       "backward_ms": 0.8 + 1.2 * t(O.layer_backward_ops(spec, b, s, 1))})
    local = profiles.LocalOpModel(_synthetic(), meta={"blocks": probes})
    narrow = hetero.load_model({"name": "n", "architecture": "llama", "num_layers": 2, "hidden_size": 128,
                                "num_attention_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 256,
                                "vocab_size": 512, "seq_length": 64})
    fwd = sum(plain.predict(o.op, o.dims_dict()) for o in O.layer_forward_ops(narrow, 2, 64, 1)) * 1e3
    bwd = sum(plain.predict(o.op, o.dims_dict()) for o in O.layer_backward_ops(narrow, 2, 64, 1)) * 1e3
    rf, rb = local.layer_ratio(narrow, 2, 64)
    assert rf * fwd == pytest.approx(0.5 + 1.4 * fwd, rel=1e-6)
    assert rb * bwd == pytest.approx(0.8 + 1.2 * bwd, rel=1e-6)
    # one probe alone says nothing of a fixed part: its plain ratio
    one = profiles.LocalOpModel(_synthetic(), meta={"blocks": probes[:1]})
    assert one.layer_ratio(narrow, 2, 64)[0] == pytest.approx(probes[0]["forward_ms"] / (
        (probes[0]["forward_ms"] - 0.5) / 1.4))


def test_block_probes_correct_layer_edge_and_optimizer_times(tmp_path, monkeypatch):
    import hetero
    from hetero.predictor import optime, profiles
    from hetero.predictor.costs import StageCostModel

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    path = profiles.cache_path("cpu")
    profiles.write_records(path, _synthetic())
    plain = profiles.local_op_model("cpu")
    assert plain.layer_ratio(hetero.load_model({"name": "m", "architecture": "gpt", "num_layers": 2, "hidden_size": 256,
                                                "num_attention_heads": 4, "vocab_size": 1000,
                                                "seq_length": 128}), 2, 128) == (1.0, 1.0)
    assert plain.optimizer_time(1e6) is None
    probes = [_probe("gpt", h, b, s, plain) for h, b, s in ((128, 1, 128), (256, 2, 128), (512, 2, 256))]
    profiles.write_meta(path, {"threads": 1, "blocks": probes})
    local = profiles.local_op_model("cpu")  # reloaded: the sidecar changed
    assert local is not plain and local.threads == 1
    model = hetero.load_model({"name": "m", "architecture": "gpt", "num_layers": 2, "hidden_size": 384,
                               "num_attention_heads": 6, "vocab_size": 1000, "seq_length": 128})
    assert local.layer_ratio(model, 2, 128) == pytest.approx((1.5, 1.25))
    assert local.edge_ratio(model, 2, 128) == pytest.approx((2.0, 3.0))
    # a model with fused attention at a probe's own shape predicts that probe's measured block:
    # its ratio is taken against the fused operator sum, not the unfused one the probe was timed as
    import dataclasses

    from hetero.predictor import ops as O
    from hetero.predictor.profiles import probe_model_dict
    fused = dataclasses.replace(hetero.load_model(probe_model_dict(probes[1])), attention="fused")
    rf, rb = local.layer_ratio(fused, 2, 128)
    assert rf * sum(plain.predict(o.op, o.dims_dict()) for o in O.layer_forward_ops(fused, 2, 128, 1)) == \
        pytest.approx(probes[1]["forward_ms"] * 1e-3)
    assert rb * sum(plain.predict(o.op, o.dims_dict()) for o in O.layer_backward_ops(fused, 2, 128, 1)) == \
        pytest.approx(probes[1]["backward_ms"] * 1e-3)
    assert local.optimizer_time(2e6) == pytest.approx((3e-9 + 1e-9) * 2e6)   # the norm pass and AdamW
    # probes written before profiles timed the norm pass: estimated from AdamW by bytes read (4 of 28)
    older = profiles.LocalOpModel(_synthetic(), meta={"blocks": [{k: v for k, v in p.items() if k != "grad_norm_ms"}
                                                       for p in probes]})
    assert older.optimizer_time(2e6) == pytest.approx(3e-9 * (1 + 4 / 28) * 2e6)
    # probes that timed another AdamW kernel (a profile older than the runtime's fused one) are not
    # the runtime's optimizer: ignored, the cost model falls back to its bandwidth formula
    stale = profiles.LocalOpModel(_synthetic(), meta={"blocks": [{k: v for k, v in p.items() if k != "adamw_kernel"}
                                                       for p in probes]})
    assert stale.optimizer_time(2e6) is None
    assert stale.layer_ratio(model, 2, 128) == pytest.approx((1.5, 1.25))  # the block times still count
    # the cost model applies them; an emulated 2x device pays the slowdown on the optimizer too
    cluster = hetero.load_cluster(cluster_dict(group_dict("g", "slow"), name="emu",
                                               devices={"slow": emulated_device("emu-b", 2.0)}))
    cm = StageCostModel(cluster, model)
    f, b = cm.layer_compute_times("g", 1, 2, "none")
    from hetero.predictor import ops as O
    opsum = lambda ops: sum(2.0 * plain.predict(o.op, o.dims_dict()) for o in ops)  # noqa: E731
    assert f == pytest.approx(1.5 * opsum(O.layer_forward_ops(model, 2, 128, 1)))
    assert b == pytest.approx(1.25 * opsum(O.layer_backward_ops(model, 2, 128, 1)))
    from hetero.predictor import memory as mem
    params = mem.stage_params(model, 2, 1, True, True)
    assert cm.optimizer_time("g", 1, (0, 2), True, True) == pytest.approx(2.0 * 4e-9 * params)
    assert optime.op_model_for("slow", cluster.device_type("g"))[1] == "profile"


def test_predict_sees_a_profile_cached_after_its_first_call(tmp_path, monkeypatch):
    """hetero.predict memoises its cost model per (cluster, model); a profile written meanwhile
    (``hetero profile`` in the same process or beside it) must switch the source, not be ignored."""
    import hetero
    from hetero.predictor import profiles

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    cluster = hetero.load_cluster(cluster_dict(group_dict("c", "cpu"), name="one-cpu"))
    model = hetero.load_model({"name": "t", "architecture": "gpt", "num_layers": 2, "hidden_size": 64,
                               "num_attention_heads": 4, "vocab_size": 512, "seq_length": 32, "dtype": "fp32"})
    plan = hetero.load_plan({"global_batch_size": 4, "micro_batch_size": 2, "pipelines": [
        {"replicas": 1, "micro_batches": 2, "stages": [{"group": "c", "layers": [0, 2]}]}]}, cluster, model)
    before = hetero.predict(cluster, model, plan)
    assert before.provenance["cpu"]["source"] == "catalog"
    profiles.write_records(profiles.cache_path("cpu"), _synthetic())
    after = hetero.predict(cluster, model, plan)
    assert after.provenance["cpu"]["source"] == "profile"
    assert after.iteration_time_s != before.iteration_time_s


def test_isolated_call_timing_brackets_each_call():
    """On an asynchronous device each call is timed alone: event, call, event, wait; the result is
    the mean of the fastest 5 of 25 (the protocol of the data the learned model was fitted on)."""
    from hetero.measure.profiling import isolated_call_ms

    log, durations = [], iter([9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 8.0] + [7.0] * 18)

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self):
            log.append(f"record {self.name}")

        def elapsed_time(self, other):
            return next(durations)

    names = iter(["start", "end"])
    ms = isolated_call_ms(lambda: log.append("call"), lambda: Event(next(names)), lambda: log.append("sync"))
    assert ms == (1.0 + 2.0 + 3.0 + 4.0 + 5.0) / 5
    assert log[:4] == ["record start", "call", "record end", "sync"] and len(log) == 4 * 25


def test_a_dtype_list_naming_no_dtype_is_refused_before_the_cache_is_touched(tmp_path):
    """`--dtype ,` (or ` , `) would profile nothing and replace the device's cached profile with an
    empty one: an error instead, the cache and -o left as they were."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    cache = tmp_path / "cache"
    (cache / "profiles").mkdir(parents=True)
    cached = cache / "profiles" / "cpu.csv"
    cached.write_text("kept\n")
    out = tmp_path / "p.csv"
    for dtypes in (",", " , "):
        proc = subprocess.run([sys.executable, "-m", "hetero", "profile", "--device", "cpu", "--quick", "--no-blocks",
                               "--dtype", dtypes, "-o", str(out)], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "HETERO_CACHE_DIR": str(cache)}, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "--dtype" in proc.stderr and "no dtype" in proc.stderr and "fp32" in proc.stderr, proc.stderr
    assert cached.read_text() == "kept\n" and not out.exists()


def test_the_decode_floor_fit_recovers_its_coefficients_and_refuses_a_damaged_sidecar():
    """measure_decode_dispatch's fit, on cases made from known figures, gives them back; a sidecar
    whose table misses a figure or holds a negative one is not used."""
    from hetero.measure.decode_floor import dispatch_table
    from hetero.predictor.profiles import _dispatch_table

    per_layer = {"gpt": 250e-6, "llama": 400e-6}
    rows = [{"arch": a, "layers": n, "rows": r,
             "decode_step_s": 60e-6 + per_layer[a] * n + 30e-6 * r,
             "first_call_s": 350e-6 * n * (1.5 if a == "llama" else 1.0) + 90e-6 * r}
            for a in ("gpt", "llama") for n in (1, 4) for r in (1, 8)]
    table = dispatch_table(rows)
    assert table["decode_per_step_s"] == pytest.approx(60e-6)
    assert table["decode_per_layer_s"] == pytest.approx(per_layer)
    assert table["per_row_s"] == pytest.approx(30e-6)
    assert table["prefill_per_layer_s"] == pytest.approx({"gpt": 350e-6, "llama": 525e-6})
    assert table["prefill_per_row_s"] == pytest.approx(90e-6)
    assert _dispatch_table(table) is not None
    assert _dispatch_table({**table, "per_row_s": -1.0}) is None
    assert _dispatch_table({k: v for k, v in table.items() if k != "decode_per_layer_s"}) is None
    assert _dispatch_table("junk") is None


def test_generation_on_a_cpu_takes_the_host_floor_measured_with_the_profile(tmp_path, monkeypatch):
    """A CPU profile whose sidecar holds `decode_dispatch` sets generation's host time (decode and
    prefill); without it the shipped figures stand. The emulated slowdown multiplies either."""
    import hetero
    from hetero.predictor import generation as gen
    from hetero.predictor import profiles

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    cluster = hetero.load_cluster(cluster_dict(group_dict("fast", "cpu", 1, 1), name="one-cpu"))
    model = hetero.load_model({"name": "m", "architecture": "llama", "num_layers": 3, "hidden_size": 64,
                               "num_attention_heads": 4, "vocab_size": 256, "seq_length": 64})
    shipped = gen.decode_step(cluster, "fast", model, 4, 16).host_s
    floor = gen.CPU_DISPATCH
    assert shipped == pytest.approx(floor["decode_per_step_s"] + 3 * floor["decode_per_layer_s"]["llama"]
                                    + 4 * floor["per_row_s"])
    path = profiles.cache_path("cpu")
    profiles.write_records(path, _synthetic())
    measured = {"decode_per_step_s": 1e-4, "decode_per_layer_s": {"gpt": 5e-4, "llama": 7e-4}, "per_row_s": 4e-5,
                "prefill_per_layer_s": {"gpt": 6e-4, "llama": 9e-4}, "prefill_per_row_s": 8e-5}
    profiles.write_meta(path, {"threads": 1, "decode_dispatch": measured})
    assert gen.decode_step(cluster, "fast", model, 4, 16).host_s == pytest.approx(1e-4 + 3 * 7e-4 + 4 * 4e-5)
    assert gen.prefill(cluster, "fast", model, 4, 8).host_s == pytest.approx(3 * 9e-4 + 4 * 8e-5)


def test_the_decode_floor_is_timed_on_the_runtime_generate():
    """measure_cases runs generation for real: the first call and a decode step of each case, > 0.
    A decode step is a difference of two timed calls, so it takes medians of three and 8 new tokens:
    with one call each and 3 tokens the difference is at the mercy of a busy machine's noise."""
    from hetero.measure.decode_floor import measure_cases

    rows = measure_cases((1,), (1, 2), repeats=3, new=8)
    assert [(r["arch"], r["rows"]) for r in rows] == [("gpt", 1), ("gpt", 2), ("llama", 1), ("llama", 2)]
    assert all(r["first_call_s"] > 0 and r["decode_step_s"] > 0 for r in rows)


def test_the_block_probes_reach_down_to_the_shipped_tiny_models():
    """The fixed dispatch fitted over the probes is no guide below the smallest one: the probes
    include the tiny models' own shape (hidden 64, 4 heads, 32 positions) at 32 and 128 rows."""
    from hetero.measure.profiling import default_block_probes

    shapes = {(p["architecture"], p["hidden_size"], p["num_attention_heads"], p["micro_batch_size"] * p["seq_length"])
              for p in default_block_probes()}
    assert {(a, 64, 4, rows) for a in ("gpt", "llama") for rows in (32, 128)} <= shapes


def test_an_emulated_cluster_is_predicted_with_the_loopback_costs_measured_with_the_profile(tmp_path, monkeypatch):
    """A CPU profile whose sidecar holds ``loopback`` floors every hand-over between stages at its
    point-to-point figure, every gradient sum at its all-reduce, and adds the step's two world
    all-reduces (the norm's, the results'); the cluster file's links alone without it, and on a
    cluster whose groups are not all on this machine."""
    import hetero
    from hetero.predictor import profiles

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    profiles.write_records(profiles.cache_path("cpu"), _synthetic())
    model = hetero.load_model(ROOT / "configs" / "models" / "tiny.yaml")
    plan_file = ROOT / "configs" / "plans" / "tiny-local-cpu-pp.yaml"
    here = hetero.load_cluster(ROOT / "configs" / "clusters" / "local-cpu.yaml")
    plan = hetero.load_plan(plan_file, here, model)
    before = hetero.predict(here, model, plan)
    p2p, allreduce = 2e-3, 3e-3   # far above the links' 50 us, so each floor shows
    profiles.write_meta(profiles.cache_path("cpu"), {"threads": 1, "loopback": {"p2p_s": p2p, "allreduce_s": allreduce}})
    after = hetero.predict(here, model, plan)
    first, last = after.pipelines[0].stages
    assert before.pipelines[0].stages[0].p2p_time_s < p2p == pytest.approx(first.p2p_time_s)
    assert first.dp_sync_time_s == pytest.approx(allreduce)   # the tied embedding's sum, ranks 0 and 1
    assert after.overhead_time_s == pytest.approx(before.overhead_time_s + 2 * allreduce)
    assert after.iteration_time_s > before.iteration_time_s + 2 * allreduce + p2p
    elsewhere = hetero.load_cluster({**yaml.safe_load((ROOT / "configs" / "clusters" / "local-cpu.yaml").read_text()),
                                     "groups": [{**g, "hosts": ["node7"]} for g in yaml.safe_load(
                                         (ROOT / "configs" / "clusters" / "local-cpu.yaml").read_text())["groups"]]})
    assert hetero.predict(elsewhere, model, hetero.load_plan(plan_file, elsewhere, model)).iteration_time_s == \
        pytest.approx(before.iteration_time_s)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_loopback_costs_are_measured_through_the_runtime_between_two_vendors():
    """Two spawned ranks over the emulated bridge: a one-way hand-over and a small all-reduce, each
    more than nothing and less than a second, and both kept by the sidecar's reader. (Their order
    is not checked: beside another test on 2 cores a round trip waits for both ranks to be
    scheduled, and the one-way figure measured 0.96 ms against the all-reduce's 0.45.)"""
    from hetero.measure.loopback import measure_loopback
    from hetero.predictor.profiles import loopback_table

    got = measure_loopback()
    assert got is not None and got["vendors"] == "emu-a/emu-b" and got["rounds"] > 0
    assert 0 < got["p2p_s"] < 1.0 and 0 < got["allreduce_s"] < 1.0, got
    assert loopback_table(got) == {"p2p_s": got["p2p_s"], "allreduce_s": got["allreduce_s"]}
    assert loopback_table({"p2p_s": 0.0, "allreduce_s": 1e-4}) is None and loopback_table(None) is None
